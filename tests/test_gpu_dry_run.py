"""GpuModel's steps planned end to end on a made-up GPU, without one: every op wrapper's argument checks and launch
shapes run for the real models' shapes, and the launches are recorded instead of enqueued.

A dry run cannot check results (nothing computes); it checks what reaches the driver: which entry points a step
launches, how many times, and the copies a rewind makes. It catches a wrong argument before a device call would
(a launch on bad pointers costs the CUDA context, and every later test of that run).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ninfer_rt.errors import NinferError
from ninfer_rt.gpu.engine import Step
from test_gpu_plans import fake_kernels


class FakeGpu:
    """The driver surface GpuModel uses: allocations are addresses from a counter, copies, launches and downloads
    are recorded, uploads and memsets do nothing, downloads are zeros, graphs replay nothing."""

    def __init__(self, info):
        self.info, self.launches, self.copies, self.downloads, self.next = info, [], [], [], 1 << 20
        self.pdl = self.pdl_capable = True
        self.stream = SimpleNamespace(handle="s0", wait=lambda e: None, synchronize=lambda: None)

    def alloc(self, nbytes):
        p = self.next
        self.next += (int(nbytes) + 511) // 256 * 256
        return p

    def free(self, p):
        pass

    def upload(self, dst, array, stream=None):
        pass

    def download(self, src, shape, dtype):
        self.downloads.append((src, tuple(shape)))
        return np.zeros(shape, dtype)

    def copy(self, dst, src, nbytes, stream=None):
        self.copies.append((dst, src, nbytes))

    def memset(self, dst, byte, nbytes, stream=None):
        pass

    def new_stream(self, high_priority=False):
        return SimpleNamespace(handle="s1", wait=lambda e: None, synchronize=lambda: None)

    def begin_capture(self):
        pass

    def end_capture(self, node_priority=False):
        return SimpleNamespace(launch=lambda stream: None, destroy=lambda: None)

    def synchronize(self):
        pass

    def launch(self, fn, grid, block, args, smem, stream, cluster):
        self.launches.append(fn)

    def set_max_dynamic_smem(self, fn, nbytes):
        pass

    def set_smem_carveout(self, fn, percent):
        pass

    def static_smem(self, fn):
        return 1280

    def max_active_blocks(self, fn, threads, smem):
        return 2

    def max_active_clusters(self, fn, grid, block, smem, cluster):
        return 64


def dry_model(monkeypatch, name: str, groups=("text",), slots: int = 1):
    """GpuModel of the built-in shapes `name` (its recipe's formats) on an H100-like FakeGpu: weights at made-up
    addresses, the mma.sync prefill GEMMs (the wgmma ones build TMA descriptors through the driver)."""
    from ninfer_rt.formats import get_format
    from ninfer_rt.gpu import engine, loader
    from ninfer_rt.gpu.bench import builtin_spec
    from ninfer_rt.gpu.weights import DeviceWeight
    from ninfer_rt.recipe import load_recipe

    k = fake_kernels(9, 0, smem_optin=227 * 1024)
    gpu = k.gpu = FakeGpu(k.gpu.info)
    spec = builtin_spec(name)
    w = loader.DeviceWeights()
    for n, shape, fmt in loader.synthetic_table(spec, load_recipe(name), groups):
        if loader.is_small_param(n, shape):
            w.params[n] = gpu.alloc(4 * int(np.prod(shape)))
        else:
            w.matrices[n] = DeviceWeight(n, fmt, shape, gpu.alloc(get_format(fmt).nbytes(shape)))
    monkeypatch.setattr(engine, "Event", lambda timing=False: SimpleNamespace(record=lambda stream: None))
    model = engine.GpuModel(gpu, k, spec, w, slots=slots, max_ctx=4096, prefill_chunk=512, gemm_kernel="mma")
    return model, gpu


def count(launches, prefix):
    return sum(1 for n in launches if n.startswith(prefix))


@pytest.mark.parametrize("name", ["qwen3.6-35b-a3b", "qwen3.6-27b"])
def test_a_verification_keeps_each_tokens_state_and_rewinds_by_copies(monkeypatch, name):
    """verify(trail=True): every DeltaNet layer's step is the trail kernel (one sequence: a cluster of 4 on sm_90),
    and only then; rewind(keep) copies trail row keep - 1 into the slot's state, one copy a DeltaNet layer of
    nv·dk·dv fp32 (in a graph captured once per slot and keep), and nothing when every token is kept."""
    m, gpu = dry_model(monkeypatch, name, slots=2)
    L = len(m.ssm_state)
    m.verify(np.arange(3, dtype=np.int32), 10, 1)
    assert count(gpu.launches, "deltanet_step_trail") == 0 and count(gpu.launches, "deltanet_step_dk128_c4") == L
    gpu.launches.clear()
    m.verify(np.arange(3, dtype=np.int32), 10, 1, trail=True)
    assert count(gpu.launches, "deltanet_step_trail_dk128_c4") == L and count(gpu.launches, "deltanet_step_dk") == 0
    m.rewind(1, 3, 3)
    assert gpu.copies == [] and not any(k[0] == "rewind" for k in m.graphs)
    nbytes = m.spec.linear_num_value_heads * m.spec.linear_key_head_dim * m.spec.linear_value_head_dim * 4
    want = sorted((m.ssm_state[i] + nbytes, m._trails[i] + nbytes, nbytes) for i in m._trails)
    m.rewind(1, 2, 3, graph=False)
    assert sorted(gpu.copies) == want
    gpu.copies.clear()
    m.rewind(1, 2, 3)  # captured once (the copies recorded as they are captured), then replayed
    m.rewind(1, 2, 3)
    assert sorted(gpu.copies) == want and ("rewind", 1, 2) in m.graphs
    for keep, T in [(0, 3), (4, 3), (1, 9)]:
        with pytest.raises(NinferError, match="rewind keeps"):
            m.rewind(1, keep, T)


def test_rewind_before_a_trail_is_refused(monkeypatch):
    m, _ = dry_model(monkeypatch, "qwen3.6-35b-a3b")
    with pytest.raises(NinferError, match="trail=True first"):
        m.rewind(0, 1, 2)


def test_a_verifications_rows_as_ids_or_distributions(monkeypatch):
    """What speculative decoding reads of a verification of 3 tokens: top1 launches one arg-max over the 3 rows and
    downloads 3 ids; dist rows (GpuBackend._probs_of) launch the sampler's three kernels over them (the buffers
    allocated once), and a probability or a row is read at its place in the [rows, vocab] buffer (row stride
    vocab, as sample_probs writes it), and a row's kept tokens from its support row; rows past a step's or ids past the
    logits are refused in one line."""
    from ninfer_rt.gpu import misc
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.sampling import SamplingParams

    m, gpu = dry_model(monkeypatch, "qwen3.6-35b-a3b")
    be = GpuBackend.of_model(m)
    m.verify(np.arange(3, dtype=np.int32), 10, 0)
    gpu.launches.clear()
    V = m.V - 7
    assert m.top1(3, V).shape == (3,)
    assert gpu.launches == ["argmax_rows", "argmax_finish"] and gpu.downloads[-1] == (m.buf.argmax, (3,))
    gpu.launches.clear()
    params = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    rows = be._probs_of(3, params, V)
    first = be._probs
    be._probs_of(2, params, V)
    assert be._probs == first and gpu.launches == ["sample_hist", "sample_compact", "sample_rows"] * 2
    rows[1][5]
    assert gpu.downloads[-1] == (first[0] + 4 * (V + 5), (1,))
    np.asarray(rows[-2])
    assert gpu.downloads[-1] == (first[0] + 4 * V, (V,)) and len(rows) == 3
    ids, probs = rows[-2].support()  # the made-up GPU's zeros: a count of 0, read in one 8 KB download
    assert gpu.downloads[-1] == (first[3] + 4 * misc.SUPPORT_INTS, (misc.SUPPORT_INTS,)) and ids.size == probs.size == 0
    n = len(gpu.downloads)
    assert rows[1][V] == 0.0 and len(gpu.downloads) == n  # an id past the vocabulary: nothing read
    for n, vocab in [(0, V), (9, V), (3, m.V + 1)]:
        with pytest.raises(NinferError, match="probs"):
            be._probs_of(n, params, vocab)
        with pytest.raises(NinferError, match="top1"):
            m.top1(n, vocab)
    with pytest.raises(IndexError):
        rows[3]


def test_a_verifications_arg_maxes_come_from_its_own_graph(monkeypatch):
    """GpuBackend.verify(top1=V) on T > 1 tokens: the step's graph (keyed by V) ends with the rows' arg-max over ids
    < V, nothing is launched after it, and the host reads the ids, then the hidden rows (one wait on the step);
    another V captures another graph, and a V past the logits is refused in one line."""
    from ninfer_rt.gpu import misc
    from ninfer_rt.gpu.backend import GpuBackend

    m, gpu = dry_model(monkeypatch, "qwen3.6-35b-a3b")
    be = GpuBackend.of_model(m)
    vocabs, argmax = [], misc.argmax
    monkeypatch.setattr(misc, "argmax", lambda k, **kw: (vocabs.append((kw["M"], kw["V"])), argmax(k, **kw))[1])
    cache = be.new_cache(0)
    cache.pos = 10
    V = m.V - 7
    # the first call also plans the shared carveout (a recorded dry run of the step); the second replays the graph
    for vocab, launched in [(V, [(3, V)] * 2), (V, []), (V - 1, [(3, V - 1)])]:
        gpu.launches.clear()
        vocabs.clear()
        n = len(gpu.downloads)
        ids, hidden, undo = be.verify(np.arange(3), cache, top1=vocab)
        cache.pos = 10
        assert ids.dtype == np.int64 and ids.shape == (3,) and hidden.shape == (3, m.H) and undo == 3
        assert gpu.downloads[n:] == [(m.buf.argmax, (3,)), (m.buf.h, (3, m.H))]
        assert vocabs == launched
        assert gpu.launches[-2:] == (["argmax_rows", "argmax_finish"] if launched else [])
    assert {k.vocab for k in m.graphs if k[:2] == (1, 3)} == {V, V - 1}
    with pytest.raises(NinferError, match="verify: arg-maxes over ids"):
        m.verify(np.arange(3, dtype=np.int32), 20, 0, vocab=m.V + 1)


def test_a_batched_step_may_keep_its_rows_hidden_states(monkeypatch):
    """decode_batch(hidden=True) at B = 2 (Batch's step where a sequence's MTP head waits for the rows): the step's
    graph normalises every row into buf.h and the lm_head reads those rows, then the host reads both sequences'
    logits and hidden rows; without hidden, the lm_head normalises x itself and only the logits come back."""
    from ninfer_rt.gpu.backend import GpuBackend

    m, gpu = dry_model(monkeypatch, "qwen3.6-35b-a3b", slots=2)
    be = GpuBackend.of_model(m)
    caches = [be.new_cache(0), be.new_cache(1)]
    for c in caches:
        c.pos = 10
    for hidden in (True, False):
        gpu.launches.clear()
        n = len(gpu.downloads)
        out = be.decode_batch([3, 4], caches, hidden=hidden)
        logits, rows = out if hidden else (out, None)
        assert logits.shape == (2, m.V) and (rows is None or rows.shape == (2, m.H))
        want = [(m.buf.logits, (2, m.V))] + ([(m.buf.h, (2, m.H))] if hidden else [])
        assert gpu.downloads[n:] == want
        assert count(gpu.launches, "rms_norm") == (1 if hidden else 0)
    assert Step(2, 1, m.bucket(11), "hidden") in m.graphs and Step(2, 1, m.bucket(12), "last") in m.graphs


def test_the_speculative_loop_plans_through_the_gpu_backend(monkeypatch):
    """ninfer_rt.speculative.decode, greedy, over GpuBackend.of_model at the 35B's shapes with its MTP head: a
    600-token prompt (two prefill chunks), then steps of 3 drafts (fixed). The made-up GPU's ids are all 0, so every
    draft is kept: each step is the head over the real rows since it last ran (the prompt's last, then the 4 kept
    ones) and 2 rows chained on the device, then a verification of 4 with the trail kernels (captured once, then
    replayed); no rewind copies."""
    from ninfer_rt import speculative
    from ninfer_rt.generation import GenerationStats
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.sampling import Sampler, SamplingParams

    m, gpu = dry_model(monkeypatch, "qwen3.6-35b-a3b", groups=("text", "mtp"))
    be = GpuBackend.of_model(m)
    stats = GenerationStats(prompt_tokens=600)
    out = list(speculative.decode(be, be.new_cache(0), list(range(600)), 9, Sampler(SamplingParams(greedy=True)),
                                  stats, draft_tokens=3, real_vocab=m.spec.vocab_size, is_stop=lambda t: False,
                                  planner=speculative.DraftPlanner(3, fixed=True)))
    assert out == [0] * 9 and stats.draft_tokens == stats.accepted_tokens == 6
    b, row = m.buf, 4 * m.H  # no rewind copies; the chains' pick and hidden copies, the first from the last real row
    want = [c for rows in (1, 4) for i in range(2)
            for c in [(b.tokens, b.picks + 4 * i, 4), (b.hin, b.h + (rows - 1 if i == 0 else 0) * row, row)]]
    assert gpu.copies == want
    L = len(m.ssm_state)
    assert count(gpu.launches, "deltanet_step_trail_dk128_c4") == L  # the second verification replays its graph
    assert Step(1, 4, m.bucket(604), "all", vocab=m.spec.vocab_size, trail=True) in m.graphs
    assert ("mtp", 4, m.bucket(608)) in m.graphs


def test_the_mtp_head_drafts_with_its_own_layer(monkeypatch):
    """With the mtp group loaded: prefill(hidden=True) gives every row's hidden state; draft runs the head over a
    prompt in prefill chunks and over a few rows as one step: the embedding, the two norms, fc, one attention layer
    (prepare, decode, combine) and its MoE block, mtp.norm and the lm_head, whose one-row launch takes the arg-max
    (engine.ARGMAX_IN_LM_HEAD: no argmax launch after it). Without the group, draft is
    refused in one line; and the bench's bytes a decode step reads are the same with the head loaded."""
    m, gpu = dry_model(monkeypatch, "qwen3.6-35b-a3b", groups=("text", "mtp"))
    assert m.has_mtp and m.spec.num_hidden_layers in m.kv
    hidden = m.prefill(np.arange(600, dtype=np.int32), 0, hidden=True)
    assert hidden.shape == (600, m.H)
    assert m.draft(hidden, np.arange(600), 0, 0) == 600 - 512  # the last prefill chunk's rows
    gpu.launches.clear()
    m.draft(np.zeros((3, m.H), np.float32), np.arange(3), 600, 0)
    steps = gpu.launches
    assert steps[:3] == [steps[0], "rms_norm", "rms_norm"] and steps[0].startswith("embed_")
    assert [count(steps, p) for p in ("attn_prepare", "attn_decode", "attn_combine", "deltanet")] == [1, 1, 1, 0]
    assert steps[-1] == "gemv_q6_m1" and count(steps, "argmax_") == 0 and ("mtp", 3, m.bucket(603)) in m.graphs
    with pytest.raises(NinferError, match=r"must be \[T, 2048\]"):
        m.draft(np.zeros((2, m.H), np.float32), np.arange(3), 0, 0)
    plain, _ = dry_model(monkeypatch, "qwen3.6-35b-a3b")
    with pytest.raises(NinferError, match="without its MTP head"):
        plain.draft(np.zeros((1, plain.H), np.float32), np.arange(1), 0, 0)
    from ninfer_rt.gpu.bench import decode_bytes  # a decode step reads no MTP weight: the bench's bytes agree
    assert decode_bytes(m.spec, m.w, 8192, "int8") == decode_bytes(plain.spec, plain.w, 8192, "int8")


@pytest.mark.parametrize("name", ["qwen3.6-35b-a3b", "qwen3.6-27b"])
def test_every_step_launches_each_layers_ops(monkeypatch, name):
    """Decode at B = 1, 2, 4 and a 600-token prompt (two chunks of 512): per the spec's layer kinds, each DeltaNet
    layer one step launch a decode step and the chunked delta rule a prompt chunk; each attention layer prepare,
    decode and combine (prefill attention for a chunk); each MoE block its fused launch at one sequence and the
    routed gate/up and down at several; one embedding a step, and its arg-max: in the lm_head's launch where that
    is one block-kernel launch (one row of the 248,320-row lm_head: engine.ARGMAX_IN_LM_HEAD), else its own two."""
    m, gpu = dry_model(monkeypatch, name, slots=4)
    s = m.spec
    n_lin, n_att = s.layer_types.count("linear_attention"), s.layer_types.count("full_attention")
    n_moe = s.num_hidden_layers if s.is_moe else 0
    for B in (1, 2, 4):
        gpu.launches.clear()
        m.decode(np.arange(B, dtype=np.int32), [10] * B, list(range(B)))
        got = gpu.launches
        assert count(got, "deltanet_step_dk") == n_lin and count(got, "embed_") == 1, (B, got)
        assert [count(got, f"attn_{k}") for k in ("prepare", "decode", "combine")] == [n_att] * 3
        moe = ([count(got, "moe_fused")] if B == 1 else [count(got, "moe_gate_up_routed"), count(got, "moe_down")])
        assert moe == [n_moe] * len(moe) and count(got, "argmax_finish") == (B > 1)
        assert B > 1 or (got[-1].startswith("gemv_") and got[-1].endswith("_m1")), got[-3:]
    gpu.launches.clear()
    m.prefill(np.arange(600, dtype=np.int32), 0)
    got = gpu.launches
    assert count(got, "deltanet_chunk_prep") == 2 * n_lin and count(got, "attn_prefill") == 2 * n_att
    assert count(got, "embed_") == 2 and count(got, "argmax_") == 0 and got[-1].endswith("_m1")
    # each MoE block of a chunk sums its routed rows in slot order (ordered_moe, the default): one fp32 row a slot
    assert count(got, "moe_sum_slots") == 2 * n_moe
    if s.is_moe:
        assert m.ordered_moe and m.buf.slot_y == m.buf.mixed


def test_a_prompt_chunks_moe_may_sum_by_atomics(monkeypatch):
    """ordered_moe=False: the routed down adds into x by float atomics, with no slot rows and no moe_sum_slots
    launch; otherwise the slot rows (chunk · top_k · H fp32) lie over the mixer's buffer, grown to hold them."""
    from ninfer_rt.gpu import engine
    sizes = {}
    for ordered in (True, False):
        calls = []
        real = engine.GpuModel._alloc
        monkeypatch.setattr(engine.GpuModel, "_alloc", lambda self, n: calls.append(n) or real(self, n))
        make = engine.GpuModel.__init__
        monkeypatch.setattr(engine.GpuModel, "__init__", lambda self, *a, **kw: make(self, *a, **kw,
                                                                                    ordered_moe=ordered))
        m, gpu = dry_model(monkeypatch, "qwen3.6-35b-a3b")
        monkeypatch.undo()
        sizes[ordered] = sum(calls)
        gpu.launches.clear()
        m.prefill(np.arange(600, dtype=np.int32), 0)
        assert m.ordered_moe == ordered and count(gpu.launches, "moe_sum_slots") == (2 * 40 if ordered else 0)
    s = m.spec
    grown = 512 * 4 * max(0, s.num_experts_per_tok * s.hidden_size - m.mixed_cols)
    assert sizes[True] - sizes[False] == grown > 0 and not m.buf.slot_y


@pytest.mark.parametrize("draw", ["argmax", "sample"])
def test_a_steps_first_run_launches_its_draws_once(monkeypatch, draw):
    """The first decode step of a shape plans the shared carveout by a dry run of the step, recorded and not
    enqueued; the draw's kernels too. Enqueued there, penalty_count counted a token drawn from the last step's
    logits into each penalized slot's state before the real draw (greedy with a presence penalty then drew another
    token on a fresh model than the host path and a warm model, perf.md v112). Each draw kernel of a penalized
    batched step reaches the driver once on the first step (captured into its graph); the second replays it."""
    from ninfer_rt.gpu import misc

    m, gpu = dry_model(monkeypatch, "qwen3.6-35b-a3b", slots=2)
    for slot in (0, 1):
        m.set_penalties(slot, misc.penalty_params(presence=1.5))
    records = None if draw == "argmax" else np.concatenate([misc.sample_params(0.7, top_k=20)] * 2)
    for once in (1, 0):
        gpu.launches.clear()
        m.decode(np.array([3, 4], np.int32), [10, 12], [0, 1], draw=(m.V, records, True))
        assert count(gpu.launches, "penalize") == once and count(gpu.launches, "penalty_count") == once
        assert count(gpu.launches, "argmax_rows" if draw == "argmax" else "sample_rows") == once
