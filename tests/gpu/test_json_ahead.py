"""Masked draws (kernels/sampling.cu mask_rows, draws.py "masked") and a JSON row run ahead inside a plain string
(batch_ahead.py): mask_rows against its host twin misc.mask_reference bit for bit; a masked draw against the same
draw over the reference's masked row; then Batch's JSON row, run ahead under its masks, against the same row stepped
without running ahead and (greedy) against the path that draws unmasked and lets the host redraw refused tokens.
All comparisons are exact: the masked copy holds the row's own fp32 values or -inf, and each draw reads the same
values in the same order."""

from __future__ import annotations

import numpy as np
import pytest

from .test_engine import prompt

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("V,ld", [(248_320, 248_320), (1_001, 1_024), (5, 8)])
def test_mask_rows_is_its_host_twin(gpu, kernels, dev, V, ld):
    """Each row's copy keeps its slot's allowed ids' values bit for bit (NaN, -0 included) and -inf elsewhere;
    the rows themselves are untouched."""
    from ninfer_rt.gpu import misc

    rng = np.random.default_rng(V)
    M, S, W = 3, 4, misc.mask_words(V)
    logits = (rng.standard_normal((M, ld)) * 4).astype(np.float32)
    logits[0, :3] = [np.nan, -0.0, np.inf]
    masks = rng.integers(0, 2**32, (S, W), dtype=np.uint64).astype(np.uint32)
    masks[3] = 0xFFFFFFFF  # a slot that masks nothing
    slots = np.array([2, 3, 0], np.int32)
    d_logits, out = dev.put(logits), dev.put(np.full((M, ld), 7.0, np.float32))
    misc.mask_rows(kernels, logits=d_logits, ld=ld, M=M, V=V, slots=dev.put(slots), masks=dev.put(masks), words=W,
                   out=out, ldo=ld)
    got = dev.get(out, (M, ld), np.float32)[:, :V]
    want = misc.mask_reference(logits, V, slots, masks)
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
    assert np.array_equal(dev.get(d_logits, (M, ld), np.float32), logits, equal_nan=True)
    assert np.isneginf(got[0]).any() and not np.isneginf(got[1]).any()


def test_a_masked_draw_is_the_draw_over_the_masked_row(gpu, artifact):
    """After a decode step of a tiny model: GpuModel.draw over slot 0's mask (arg-max and a top-k draw) gives what
    the same draw gives over the row masked on the host, and the row (last_logits) stays unmasked."""
    from ninfer_rt.api import load
    from ninfer_rt.gpu import misc
    from ninfer_rt.gpu.backend import GpuCache

    m = load(artifact, device="cuda", max_ctx=64)
    try:
        be, g = m._backend, m._backend.model
        cache = GpuCache()
        be.forward(prompt(6, seed=5, vocab=m.real_vocab_size), cache)
        be.forward(np.array([3], np.int32), cache, last_only=True)
        row, V = be.last_logits(0), m.real_vocab_size
        rng = np.random.default_rng(1)
        bits = rng.integers(0, 2**32, be.mask_words, dtype=np.uint64).astype(np.uint32)
        bits[int(np.argmax(row[:V])) >> 5] = 0  # the unmasked arg-max's word is out
        masked = misc.mask_reference(row[None], V, [0], bits[None])[0]
        record = misc.sample_params(0.9, top_k=20, seed=7, step=3)
        be.set_mask(cache, bits)
        got = [g.draw(V, None, slot=0, masked=True), g.draw(V, record, slot=0, masked=True)]
        assert np.array_equal(be.last_logits(0), row, equal_nan=True)
        be.set_mask(cache, None)
        want_argmax = int(np.argmax(masked))
        g.gpu.upload(g.buf.logits, masked)  # the same draw over the host-masked row
        want = [want_argmax, g.draw(V, record)]
    finally:
        m.close()
    assert got == want and got[0] != int(np.argmax(row[:V]))


# a synthetic byte table over the tiny vocabulary: of every 16 tokens one closes the string, one closes it and opens
# the next item, one writes an escape (the state stays as it was), one opens the array, one the next item after a
# closed one; the rest are letters
def _bytes(t: int) -> bytes:
    return {0: b'"', 1: b'", "', 2: b"\\n", 3: b'["', 4: b', "'}.get(t % 16, bytes([0x61 + t % 26]) * (1 + t % 3))


def _counted(monkeypatch, backend, *names: str) -> dict[str, int]:
    """Each of backend's methods `names` wrapped to count its calls: the counts, by name."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name,
                            lambda *a, _r=real, _n=name, **kw: calls.__setitem__(_n, calls[_n] + 1) or _r(*a, **kw))
    return calls


@pytest.mark.parametrize("sampling", ["greedy", "top-k"])
def test_a_json_row_runs_ahead_as_it_steps(gpu, artifact, monkeypatch, sampling):
    """A lone JSON row (an array of strings) whose tokens' bytes are _bytes: run ahead under its masks it draws
    the tokens it draws stepped one at a time with the same masks (no sample_ahead) and, greedy, those of the path
    without masks (json_ahead off: unmasked device draws, refused ones redrawn on the host); it ran ahead (and,
    sampled, drew again steps whose state a token changed); its bytes are a JSON prefix the schema accepts."""
    from ninfer_rt.api import load
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.json_automaton import SchemaPrefix
    from ninfer_rt.json_schema import compile_schema
    from ninfer_rt.sampling import SamplingParams

    schema = {"type": "array", "items": {"type": "string"}}
    params = SamplingParams(greedy=True) if sampling == "greedy" else SamplingParams(temperature=1.0, top_k=20,
                                                                                     seed=11)
    m = load(artifact, device="cuda", max_ctx=256)
    try:
        monkeypatch.setattr(m.tokenizer, "token_bytes", _bytes)
        monkeypatch.setattr(m.tokenizer, "is_stop", lambda t: False)
        monkeypatch.setattr(m.tokenizer, "is_added", lambda t: False)
        ids = prompt(12, seed=21, vocab=m.real_vocab_size).tolist()

        def run():
            batch = m.batch(1)
            g = batch.add(ids, max_new_tokens=40, sampling=params, json_schema=schema)
            while batch.busy:
                batch.step()
            return g.stats.token_ids, str(g.error)

        calls = _counted(monkeypatch, m._backend, "sample_ahead", "redraw")
        ahead = run()
        seen = dict(calls)
        monkeypatch.delattr(GpuBackend, "sample_ahead")
        monkeypatch.delattr(m._backend, "sample_ahead")
        stepped = run()
        monkeypatch.setattr(GpuBackend, "json_ahead", False)
        unmasked = run()
    finally:
        m.close()
    assert ahead == stepped and ahead[1] == "None" and len(ahead[0]) == 40
    assert seen["sample_ahead"] > 10
    if sampling == "greedy":
        assert unmasked == ahead
    else:  # (a sampled row's tokens vary enough to close a string; a tiny model's greedy ones may repeat one)
        assert seen["redraw"] > 0
    c = SchemaPrefix(compile_schema(schema))
    assert c.feed(b"".join(_bytes(t) for t in ahead[0]))


def test_two_json_rows_run_ahead_in_batched_steps_as_they_step(gpu, artifact, monkeypatch):
    """Two sampled JSON rows (arrays of strings, _bytes) in batched steps: run ahead (sample_batch_ahead, each row
    under its slot's mask, a row's stale step drawn again from its own row) they draw the tokens they draw with
    batch_ahead off (batched steps, the same masks); both ran ahead and drew steps again."""
    from ninfer_rt.api import load
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.sampling import SamplingParams

    schema = {"type": "array", "items": {"type": "string"}}
    m = load(artifact, device="cuda", max_ctx=256, cache_slots=2)
    try:
        monkeypatch.setattr(m.tokenizer, "token_bytes", _bytes)
        monkeypatch.setattr(m.tokenizer, "is_stop", lambda t: False)
        monkeypatch.setattr(m.tokenizer, "is_added", lambda t: False)
        prompts = [prompt(12, seed=31 + i, vocab=m.real_vocab_size).tolist() for i in range(2)]

        def run():
            batch = m.batch(2)
            gens = [batch.add(p, max_new_tokens=40, json_schema=schema,
                              sampling=SamplingParams(temperature=1.0, top_k=20, seed=5 + i))
                    for i, p in enumerate(prompts)]
            while batch.busy:
                batch.step()
            return [(g.stats.token_ids, str(g.error)) for g in gens]

        calls = _counted(monkeypatch, m._backend, "sample_batch_ahead", "redraw")
        ahead = run()
        seen = dict(calls)
        monkeypatch.setattr(GpuBackend, "batch_ahead", False)
        stepped = run()
    finally:
        m.close()
    assert ahead == stepped and all(e == "None" and len(t) == 40 for t, e in ahead)
    assert seen["sample_batch_ahead"] > 10 and seen["redraw"] > 0
