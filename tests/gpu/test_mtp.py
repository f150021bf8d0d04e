"""The MTP head and speculative decoding on the GPU (ninfer_rt/gpu/mtp.py, GpuBackend's verify / rewind / draft),
on the tiny built-in checkpoints packed with the tiny recipe, MTP head included.

Oracles: the reference backend (ReferenceModel.mtp_forward, the same artifact in fp32 on the CPU) for the draft
logits, within the engine tests' bound (mean KL <= 1e-3 nats a row), the head fed the reference's own hidden states
so that only the head is compared; and plain greedy decoding on the GPU for the speculative loop's output.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_engine import kld, prompt

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backends(gpu, artifact):  # gpu: skipped without one
    from ninfer_rt.format import Artifact
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.reference.backend import ReferenceBackend

    art = Artifact.open(artifact)
    ref = ReferenceBackend(art, groups=("text", "mtp"))
    dev = GpuBackend(art, max_ctx=512, kv_dtype="bf16", groups=("text", "mtp"), cache_slots=2)
    yield ref, dev, art
    dev.close()


def test_draft_matches_the_reference_head(backends):
    """A 24-token prompt (its rows through the head as one prefill-sized draft), a verification of 4 tokens, the
    head over those 4 rows (a decode-sized, captured draft) and one chained row: each draft's last-row logits
    against the reference head's on the same hidden states, and the verification's rows against the reference's."""
    ref, dev, _ = backends
    ids = prompt(32, 9)
    rc, gc = ref.new_cache(), dev.new_cache()
    r_logits, r_hidden, _ = ref.verify(ids[:24], rc, undoable=False)
    g_logits, g_hidden, _ = dev.verify(ids[:24], gc, undoable=False)
    assert g_logits.shape == (1, r_logits.shape[1]) and g_hidden.shape == r_hidden.shape
    assert kld(r_logits[-1:], g_logits).max() <= 1e-3
    rd, gd = ref.new_draft_cache(rc), dev.new_draft_cache(gc)
    r_dl, _ = ref.draft(r_hidden, ids[1:25], rd)  # the prompt's rows (h_p, x_{p+1})
    g_dl, _ = dev.draft(r_hidden, ids[1:25], gd)
    bounds = [kld(r_dl[-1:], g_dl).max()]
    r_l, r_h, _ = ref.verify(ids[24:28], rc)  # a verification of 4 tokens, then the head over its rows
    g_l, g_h, undo = dev.verify(ids[24:28], gc)
    assert undo == 4 and kld(r_l, g_l).max() <= 1e-3
    r_dl, r_dh = ref.draft(r_h, ids[25:29], rd)
    g_dl, g_dh = dev.draft(r_h, ids[25:29], gd)
    bounds.append(kld(r_dl[-1:], g_dl).max())
    tok = np.asarray([int(r_dl[-1].argmax())])
    r_cl, _ = ref.draft(r_dh[-1:], tok, rd)  # chained: the head's own output and its draft
    g_cl, _ = dev.draft(r_dh[-1:], tok, gd)
    bounds.append(kld(r_cl[-1:], g_cl).max())
    print("draft KLD: prompt {:.1e}, 4 rows {:.1e}, chained {:.1e}".format(*bounds))
    assert max(bounds) <= 1e-3
    assert g_dh.shape == (1, r_dh.shape[1]) and rd.pos == gd.pos == 29


@pytest.mark.parametrize("chain", [1, 3, 7])
def test_a_chain_on_the_device_is_the_chain_through_the_host(backends, chain):
    """draft(..., chain=c) (mtp.chain: picks and hidden rows moved by device copies, one download) after a prompt's
    rows and after 4 rows: the same picks, bit for bit, as c more draft calls each fed the downloaded hidden row and
    pick (the same kernels on the same inputs, in another slot), and the head cache c rows further on."""
    ref, dev, art = backends
    V = art.spec.vocab_size
    ids = prompt(32, 11)
    _, hidden, _ = ref.verify(ids[:28], ref.new_cache(), undoable=False)
    for rows in (slice(0, 24), slice(24, 28)):
        on_dev = dev.new_draft_cache(dev.new_cache(0))
        by_host = dev.new_draft_cache(dev.new_cache(1))
        for d in (on_dev, by_host):
            d.pos = rows.start  # both slots went through the same head rows before these
        picks, none = dev.draft(hidden[rows], ids[rows.start + 1:rows.stop + 1], on_dev, top1=V, chain=chain)
        want, h = dev.draft(hidden[rows], ids[rows.start + 1:rows.stop + 1], by_host, top1=V)
        want = [int(want[-1])]
        for _ in range(chain):
            p, h = dev.draft(h, np.asarray(want[-1:]), by_host, top1=V)
            want.append(int(p[-1]))
        assert none is None and picks.tolist() == want and on_dev.pos == by_host.pos == rows.stop + chain


def plain_greedy(dev, ids: list[int], n: int) -> list[int]:
    """n tokens of plain greedy decoding on the GPU backend in slot 0 (host arg-max of each step's logits)."""
    return clear_greedy(dev, ids, n, dev.model.V)[0]


def spec_greedy(backend, art, ids: list[int], n: int, k: int, fixed: bool = False):
    """(n tokens of speculative.decode's greedy output in slot 1, its stats); fixed: k drafts every step, not the
    planner's count."""
    from ninfer_rt import speculative
    from ninfer_rt.generation import GenerationStats
    from ninfer_rt.sampling import Sampler, SamplingParams

    stats = GenerationStats(prompt_tokens=len(ids))
    out = list(speculative.decode(backend, backend.new_cache(1), ids, n, Sampler(SamplingParams(greedy=True)),
                                  stats, draft_tokens=k, real_vocab=art.spec.vocab_size, is_stop=lambda t: False,
                                  planner=speculative.DraftPlanner(k, fixed=fixed)))
    return out, stats


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_is_plain_greedy(backends, k):
    """ninfer_rt.speculative.decode on the GPU backend (drafts by the head, verifications keeping each token's
    DeltaNet state, rewinds on rejections): greedy output equals the GPU's plain greedy decoding of 24 tokens."""
    _, dev, art = backends
    ids = prompt(20, 11).tolist()
    plain = plain_greedy(dev, ids, 24)
    out, stats = spec_greedy(dev, art, ids, 24, k)
    print(f"k = {k}: {stats.accepted_tokens} of {stats.draft_tokens} drafts kept")
    assert out == plain
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens


@pytest.mark.parametrize("k", [2, 4])
def test_speculative_accepts_steered_drafts(backends, k):
    """The speculative loop on the GPU where drafts are often right (SteeredDrafts: every position but each third):
    accepted prefixes of every length run the verification's rewind to keep > 1 and the head over several real
    rows; the greedy output still equals plain greedy decoding, and some but not all drafts were kept. k drafts
    every step (fixed): 2/3 kept lies at the planner's break-even, where it may stop drafting."""
    from ninfer_rt.speculative import SteeredDrafts

    _, dev, art = backends
    ids = prompt(20, 17).tolist()
    plain = plain_greedy(dev, ids, 32)
    out, stats = spec_greedy(SteeredDrafts(dev, ids + plain, lambda p: p % 3 == 0), art, ids, 32, k, fixed=True)
    print(f"steered k = {k}: {stats.accepted_tokens} of {stats.draft_tokens} drafts kept")
    assert out == plain
    assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_load_on_cuda_drafts_and_keeps_greedy_output(gpu, artifact):  # gpu: skipped without one
    """load(..., "cuda", speculative_tokens=2): the MTP head loaded and drafting (stats count drafts), and the
    greedy output of 24 tokens equal to the same artifact's plain greedy decoding on the GPU."""
    from ninfer_rt.api import load
    from ninfer_rt.sampling import SamplingParams

    ids, greedy = prompt(20, 13).tolist(), SamplingParams(greedy=True)
    with load(artifact, "cuda", max_ctx=512, kv_dtype="bf16") as plain:
        want = list(plain.generate_ids(ids, max_new_tokens=24, sampling=greedy))
    with load(artifact, "cuda", max_ctx=512, kv_dtype="bf16", speculative_tokens=2) as spec:
        got = list(spec.generate_ids(ids, max_new_tokens=24, sampling=greedy))
        stats = spec.last_stats
    print(f"api: {stats.accepted_tokens} of {stats.draft_tokens} drafts kept")
    assert got == want and stats.draft_tokens > 0


MARGIN = 1e-2  # least top-2 logit gap of a greedy path whose tokens a several-row verification must reproduce


def clear_greedy(backend, ids: list[int], n: int, vocab: int) -> tuple[list[int], float]:
    """(n plain greedy tokens over ids < vocab in slot 0, stop ids included, and the least gap between a step's two
    best logits). Where the gap is below the rounding of a forward over several rows (~1e-3 here, from the verify
    KLDs of ~1e-6), a verification may pick the other token: agreement with plain decoding is only defined away
    from such ties."""
    c, feed, out, least = backend.new_cache(0), ids, [], np.inf
    for _ in range(n):
        row = backend.forward(np.asarray(feed, np.int32), c, last_only=True)[0, :vocab]
        lo, hi = np.partition(row, -2)[-2:]
        least = min(least, float(hi - lo))
        out.append(int(row.argmax()))
        feed = out[-1:]
    return out, least


def clear_paths(plain, seeds, lengths, make_prompt) -> tuple[int, list[list[int]], list[list[int]]]:
    """(seed, prompts, their greedy paths) for the first seed whose prompts, make_prompt(seed, the paths before it)
    in turn, have greedy paths of `lengths` tokens on `plain` (a loaded Model) with no stop id and no top-2 gap
    under MARGIN (clear_greedy): what a test comparing speculative or batched output with plain greedy needs."""
    V = plain.real_vocab_size
    for seed in seeds:
        prompts, paths = [], []
        for n in lengths:
            ids = make_prompt(seed, paths)
            path, gap = clear_greedy(plain._backend, ids, n, V)
            if gap < MARGIN or any(map(plain.tokenizer.is_stop, path)):
                break
            prompts.append(ids)
            paths.append(path)
        else:
            return seed, prompts, paths
    pytest.fail(f"no prompt seed gives greedy paths without a stop id and with top-2 gaps >= {MARGIN}")


def test_a_batch_on_cuda_drafts_and_keeps_the_head_for_a_longer_prompt(gpu, artifact):  # gpu: skipped without one
    """Batch (serve's decoding) on a model loaded with speculative_tokens=3: a lone request drafts (steered to the
    plain text: every draft kept), and a second request extending its slot prefills only its new tokens and drafts
    on from the head's state; both outputs equal plain greedy decoding on the GPU, for the first prompt seed whose
    two greedy paths meet no near-tie (clear_greedy) and no stop id (one among kept drafts is fed: the second prompt
    would not extend the slot)."""
    from ninfer_rt.api import load
    from ninfer_rt.sampling import SamplingParams
    from ninfer_rt.speculative import SteeredDrafts

    greedy = SamplingParams(greedy=True)
    with load(artifact, "cuda", max_ctx=512, kv_dtype="bf16") as plain:
        seed, (ids, second), (want_a, want_b) = clear_paths(
            plain, range(13, 45), (16, 12), lambda seed, wants: prompt(20, seed).tolist() + (
                wants[0] + [5, 6, 7] if wants else []))
    with load(artifact, "cuda", max_ctx=512, kv_dtype="bf16", cache_slots=2, speculative_tokens=3) as spec:
        spec._backend = SteeredDrafts(spec._backend, second + want_b)  # both requests' texts, position by position
        batch = spec.batch(parallel=1)
        runs = []
        for p, n in ((ids, 16), (second, 12)):
            g = batch.add(p, max_new_tokens=n, sampling=greedy)
            runs.append((g, g.stats.cached_tokens, g.spec is not None))
            while batch.busy:
                batch.step()
    (a, cached_a, spec_a), (b, cached_b, spec_b) = runs
    print(f"batch (prompt seed {seed}): {a.stats.accepted_tokens} of {a.stats.draft_tokens}, then "
          f"{b.stats.accepted_tokens} of {b.stats.draft_tokens} drafts kept")
    assert a.stats.token_ids == want_a and b.stats.token_ids == want_b
    assert (cached_a, cached_b, spec_a, spec_b) == (0, len(ids) + 15, True, True)
    assert a.stats.accepted_tokens == a.stats.draft_tokens > 0 and b.stats.accepted_tokens == b.stats.draft_tokens > 0


def test_a_batch_on_cuda_keeps_the_heads_rows_through_batched_steps(gpu, artifact):  # gpu: skipped without one
    """Two requests on a model loaded with speculative_tokens=3 share batched steps (each row's post-norm hidden
    state kept for its head: decode_batch(hidden=True)); once the short one ends, the long one decodes alone and
    drafts again (steered to its plain text: every draft kept, the head fed the batched steps' rows too). Both
    outputs equal plain greedy decoding on the GPU, for the first prompt seeds whose greedy paths meet no near-tie
    (clear_greedy; a batched step rounds differently from a lone one) and no stop id."""
    from ninfer_rt.api import load
    from ninfer_rt.sampling import SamplingParams
    from ninfer_rt.speculative import SteeredDrafts

    greedy = SamplingParams(greedy=True)
    with load(artifact, "cuda", max_ctx=512, kv_dtype="bf16") as plain:
        seed, (ids_a, ids_b), (want_a, want_b) = clear_paths(
            plain, range(13, 60), (16, 4), lambda seed, wants: prompt(12, seed + 100).tolist() if wants else
            prompt(20, seed).tolist())
    with load(artifact, "cuda", max_ctx=512, kv_dtype="bf16", cache_slots=2, speculative_tokens=3) as spec:
        spec._backend = SteeredDrafts(spec._backend, ids_a + want_a)
        batch = spec.batch(parallel=2)
        a = batch.add(ids_a, max_new_tokens=16, sampling=greedy)
        b = batch.add(ids_b, max_new_tokens=4, sampling=greedy)
        while batch.busy:
            batch.step()
    print(f"batched, then alone (prompt seed {seed}): {a.stats.accepted_tokens} of {a.stats.draft_tokens} kept")
    assert a.stats.token_ids == want_a and b.stats.token_ids == want_b
    assert a.stats.accepted_tokens == a.stats.draft_tokens > 0 and b.stats.draft_tokens == 0


SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.95)


def test_verify_rows_of_final_probabilities(backends):
    """verify(dist=(params, V)): each row's final probabilities computed on the device equal the host Sampler's
    distribution of the same verification's logits (padding masked), within fp32 rounding of a softmax (1e-6
    absolute); a single probability read equals the row's entry."""
    from ninfer_rt.sampling import Sampler, SamplingParams

    _, dev, art = backends
    params, V = SamplingParams(**SAMPLED), art.spec.vocab_size - 3  # a real vocabulary short of the rows
    ids = prompt(28, 19)
    got = {}
    for slot, dist in ((0, None), (1, (params, V))):
        c = dev.new_cache(slot)
        dev.verify(ids[:24], c, undoable=False)
        got[slot] = dev.verify(ids[24:], c, dist=dist)[0]
    logits, rows = got[0], got[1]
    assert len(rows) == 4
    for i in range(4):
        row = logits[i].copy()
        row[V:] = -np.inf
        want = Sampler(params).distribution(row)
        have = np.asarray(rows[i])
        assert have.shape == (V,) and np.abs(have - want[:V]).max() <= 1e-6
        top = int(want.argmax())
        assert rows[i][top] == have[top]


def test_speculative_sampling_runs_on_device_rows(backends):
    """A sampled speculative run on the GPU (dist rows, arg-max drafts steered right at most positions): it
    emits the budget of real ids, counts its drafts, and the same seed repeats it."""
    from ninfer_rt import speculative
    from ninfer_rt.generation import GenerationStats
    from ninfer_rt.sampling import Sampler, SamplingParams

    _, dev, art = backends
    ids = prompt(20, 23).tolist()
    runs = []
    for _ in range(2):
        stats = GenerationStats(prompt_tokens=len(ids))
        steered = speculative.SteeredDrafts(dev, ids + [0] * 40, lambda p: p % 3 == 0)
        out = list(speculative.decode(steered, dev.new_cache(1), ids, 24, Sampler(SamplingParams(**SAMPLED, seed=5)),
                                      stats, draft_tokens=3, real_vocab=art.spec.vocab_size, is_stop=lambda t: False))
        runs.append(out)
        assert len(out) == 24 and all(0 <= t < art.spec.vocab_size for t in out) and stats.draft_tokens > 0
    assert runs[0] == runs[1]
