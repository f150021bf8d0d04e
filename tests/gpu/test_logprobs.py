"""Logprobs on the device (kernels/logprobs.cu): misc.logprob_rows + logprob_finish against the host's
ninfer_rt.logprobs.token_logprob, then a Batch whose rows ask for logprobs drawing on the device as the host path
reports them.

Tolerance of a logprob, LOGPROB_TOL = 4e-6: the listed ids and their logits are exact (the same fp32 values,
ordered by the same rule), only lse differs. Each side sums fp32 exponentials in fp64: the host numpy's exp of
x - m (<= 1 ulp), the device exp_accurate of x - m_b (~2 ulp), each of a difference rounded to fp32 (half an ulp
of |x - m|: <= 2^-21 relative for the terms within ln V ~ 12.4 of the max that can outweigh it). So each side's
sum is within ~7e-7 relative of the exact one and the two lse within ~1.4e-6; 4e-6 leaves a factor of ~3.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_engine import prompt
from .test_penalties import switched_runs

pytestmark = pytest.mark.gpu

LOGPROB_TOL = 4e-6


def _records(kernels, dev, logits, tokens, tops, V, *, penalize=None):
    """The device's records of logits [M, ld] (with penalize: (slots, params, counts, seen), the rows penalized
    between the two kernels, as a draw with penalties does) -> (int32 [M, LP_INTS], the rows after)."""
    from ninfer_rt.gpu import misc

    M, ld = logits.shape
    d_logits, d_tops, d_tokens = dev.put(logits), dev.put(np.asarray(tops, np.int32)), dev.put(tokens)
    scratch = dev.put(np.zeros(misc.logprob_scratch_bytes(M, V), np.uint8))
    out = dev.put(np.full((M, misc.LP_INTS), 0x7EADBEEF, np.int32))
    raw = dev.put(np.zeros((M, ld), np.float32)) if penalize else 0
    misc.logprob_rows(kernels, logits=d_logits, ld=ld, M=M, V=V, tops=d_tops, scratch=scratch, raw=raw)
    if penalize:
        slots, params, counts, seen = (dev.put(a) for a in penalize)
        misc.penalize(kernels, logits=d_logits, ld=ld, M=M, V=V, slots=slots, params=params, counts=counts,
                      seen=seen)
    misc.logprob_finish(kernels, tokens=d_tokens, src=raw or d_logits, ld=ld, M=M, V=V, tops=d_tops,
                        scratch=scratch, out=out)
    return dev.get(out, (M, misc.LP_INTS), np.int32), dev.get(d_logits, (M, ld), np.float32)


def _assert_matches(rec, token, want, row):
    """A device record against token_logprob's TokenLogprob: the same ids, their logits (and the token's) the
    row's own fp32 values bit for bit, the logprobs within LOGPROB_TOL."""
    from ninfer_rt.gpu import misc

    got = misc.logprob_record(rec, token)
    assert got.id == want.id and [i for i, _ in got.top] == [i for i, _ in want.top]
    ids = [i for i, _ in got.top]
    assert rec[5:5 + 2 * len(ids):2].view(np.float32).tobytes() == row[ids].astype(np.float32).tobytes()
    assert rec[2:3].view(np.float32).tobytes() == row[token:token + 1].astype(np.float32).tobytes()
    assert abs(got.logprob - want.logprob) <= LOGPROB_TOL
    assert all(abs(a - b) <= LOGPROB_TOL for (_, a), (_, b) in zip(got.top, want.top))


@pytest.mark.parametrize("V,ld", [(248_320, 248_320), (5_003, 5_120), (17, 32)])
def test_logprob_kernels_are_token_logprob(gpu, kernels, dev, V, ld):
    """Rows of a real vocabulary's width and of odd widths: ties at the top and at the 20th place go to the lower
    id, a row asking for 0 alternatives gets its token's logprob alone, a row asking for none (-1) is not
    written, and NaN ranks as -inf."""
    from ninfer_rt.gpu import misc
    from ninfer_rt.logprobs import token_logprob

    rng = np.random.default_rng()
    M = 5
    logits = (rng.standard_normal((M, ld)) * 3).astype(np.float32)
    top = logits[0, :V].max()
    for i in (V - 1, V // 2, 3):  # a three-way tie at the top: the lower ids listed first
        logits[0, i] = top + 1
    order, r = np.argsort(-logits[1, :V], kind="stable"), min(17, V - 6)
    logits[1, order[r:r + 6]] = logits[1, order[r]]  # six tied across ranks 18-23 (12-17 of 17)
    logits[4, :V:3] = np.nan
    tokens = rng.integers(0, V, M).astype(np.int32)
    tokens[4] = 1  # a finite logit (the NaN ones read back as NaN, not -inf)
    tops = [20, min(20, V), 0, -1, 5]
    recs, _ = _records(kernels, dev, logits, tokens, tops, V)
    for m in range(M):
        if tops[m] < 0:
            assert (recs[m] == 0x7EADBEEF).all()
            continue
        row = logits[m, :V] if m != 4 else np.where(np.isnan(logits[m, :V]), -np.inf, logits[m, :V])
        _assert_matches(recs[m], int(tokens[m]), token_logprob(row, int(tokens[m]), tops[m], V), row)
    assert [i for i, _ in misc.logprob_record(recs[0], 0).top[:3]] == [3, V // 2, V - 1]


def test_the_drawn_tokens_logit_is_read_from_before_the_penalties(gpu, kernels, dev):
    """With a raw copy, a row penalized between the kernels (a draw with penalties) still reports its token's
    logprob under the raw logits, as the host does."""
    from ninfer_rt.gpu import misc
    from ninfer_rt.logprobs import token_logprob

    rng = np.random.default_rng()
    M, V = 2, 40_000
    logits = (rng.standard_normal((M, V)) * 3).astype(np.float32)
    tokens = np.argsort(-logits, axis=1)[:, 0].astype(np.int32)  # each row's top id, which the penalty lowers
    params = np.concatenate([misc.penalty_params(1.5, 2.0, 0.0)] * M)
    state = [misc.penalty_state([int(t)] * 3, 0, V) for t in tokens]
    counts, seen = np.stack([c for c, _ in state]), np.stack([s for _, s in state])
    recs, after = _records(kernels, dev, logits, tokens, [3, 0], V,
                           penalize=(np.arange(M, dtype=np.int32), params, counts, seen))
    assert all(after[m, tokens[m]] < logits[m, tokens[m]] for m in range(M))  # the penalty did lower them
    for m in range(M):
        _assert_matches(recs[m], int(tokens[m]), token_logprob(logits[m], int(tokens[m]), [3, 0][m], V), logits[m])


@pytest.mark.parametrize("sampling", [dict(greedy=True), dict(greedy=True, presence_penalty=1.5)])
def test_a_batch_reports_device_logprobs_as_the_host_path_does(gpu, artifact, monkeypatch, sampling):
    """Two sequences asking for logprobs (3 and 0 alternatives) beside one that asks for none, then one alone:
    drawn on the device (no logits row downloaded), they give the host path's tokens (draws_logprobs off: their
    rows drawn on the host from downloaded logits) and its logprobs within LOGPROB_TOL."""
    from ninfer_rt.api import load
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.sampling import SamplingParams

    params = SamplingParams(**sampling)
    m = load(artifact, device="cuda", max_ctx=256, cache_slots=3)
    try:
        monkeypatch.setattr(m.tokenizer, "is_stop", lambda token: False)
        v = m.real_vocab_size
        prompts = [prompt(30, seed=60 + i, vocab=v).tolist() for i in range(3)]

        def run():
            batch = m.batch(3)
            gens = [batch.add(p, max_new_tokens=12, sampling=params, logprobs=n)
                    for p, n in zip(prompts, (3, None, 0))]
            while batch.busy:
                batch.step()
            alone = batch.add(prompts[0], max_new_tokens=8, sampling=params, logprobs=2)
            while batch.busy:
                batch.step()
            gens.append(alone)
            return [(g.stats.token_ids, g.take_logprobs()) for g in gens]

        host, device, _, downloads = switched_runs(monkeypatch, (GpuBackend, "draws_logprobs"), run,
                                                   m._backend.model, "logits_row")
    finally:
        m.close()
    assert downloads == 0
    for (ids_d, lps_d), (ids_h, lps_h) in zip(device, host):
        assert ids_d == ids_h and len(lps_d) == len(lps_h)
        for got, want in zip(lps_d, lps_h):
            assert got.id == want.id and [i for i, _ in got.top] == [i for i, _ in want.top]
            assert abs(got.logprob - want.logprob) <= LOGPROB_TOL
            assert all(abs(a - b) <= LOGPROB_TOL for (_, a), (_, b) in zip(got.top, want.top))
    assert [len(lps) for _, lps in device] == [12, 0, 12, 8]


def test_a_json_row_drawn_on_the_device_takes_the_host_paths_tokens(gpu, artifact, monkeypatch):
    """A JSON-constrained greedy row beside a plain one: drawn on the device (draws_constrained: its logits row
    downloaded only where the constraint refuses the arg-max, so at most once a decode step) it decodes what the
    host path decodes from every step's row (the same logits: the draw reads them in the step's graph), with its
    logprobs."""
    from ninfer_rt.api import load
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.sampling import SamplingParams

    m = load(artifact, device="cuda", max_ctx=256, cache_slots=2)
    try:
        v = m.real_vocab_size
        prompts = [prompt(20, seed=80 + i, vocab=v).tolist() for i in range(2)]

        def run():
            batch = m.batch(2)
            gens = [batch.add(prompts[0], max_new_tokens=24, sampling=SamplingParams(greedy=True), json_object=True,
                              logprobs=1),
                    batch.add(prompts[1], max_new_tokens=24, sampling=SamplingParams(greedy=True))]
            text = ["", ""]
            while batch.busy:
                batch.step()
                text = [t + "".join(g.take()) for t, g in zip(text, gens)]
            return [(g.stats.token_ids, t, str(g.error), g.take_logprobs()) for g, t in zip(gens, text)]

        host, device, _, downloads = switched_runs(monkeypatch, (GpuBackend, "draws_constrained"), run,
                                                   m._backend.model, "logits_row")
    finally:
        m.close()
    assert [r[:3] for r in device] == [r[:3] for r in host] and len(host[0][0]) > 1
    assert downloads <= len(host[0][0]) - 1  # at most the refused steps' rows (the host path: every step's)
    for got, want in zip(device[0][3], host[0][3]):
        assert got.id == want.id and abs(got.logprob - want.logprob) <= LOGPROB_TOL


def test_a_lone_row_with_logprobs_runs_ahead_as_it_waits(gpu, artifact, monkeypatch):
    """A sequence alone asking for logprobs: run ahead (logprobs_ahead: each step's record comes back through the
    pinned ring with its token) it reports the tokens and logprobs of the path that waits for each step, exactly
    (both replay one graph: the step's token comes from the draw slot or from the host), and reads its tokens
    through the ring."""
    from ninfer_rt.api import load
    from ninfer_rt.gpu.backend import GpuBackend, PendingToken
    from ninfer_rt.sampling import SamplingParams

    m = load(artifact, device="cuda", max_ctx=256)
    try:
        monkeypatch.setattr(m.tokenizer, "is_stop", lambda token: False)
        ids = prompt(30, seed=90, vocab=m.real_vocab_size).tolist()

        def run():
            batch = m.batch(1)
            g = batch.add(ids, max_new_tokens=16, sampling=SamplingParams(greedy=True), logprobs=3)
            while batch.busy:
                batch.step()
            return g.stats.token_ids, g.take_logprobs()

        waiting, ahead, reads_off, reads = switched_runs(monkeypatch, (GpuBackend, "logprobs_ahead"), run,
                                                         PendingToken, "logprob")
    finally:
        m.close()
    assert reads_off == 0
    assert ahead == waiting and len(ahead[1]) == 16
    assert reads == 14  # draws 2..15: all but the host's first and the batched step that starts the chain
