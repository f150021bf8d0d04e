"""Speculative steps inside a Batch (serve's decoding): a sequence that decodes alone drafts with the MTP head, and
its slot keeps the head's state for a prompt that extends it.

Oracles: plain greedy decoding of each prompt alone (Model.generate on a model without drafts: the ids must be the
same whatever the drafts were), and the reference head run over a whole real sequence in one call (a head state
carried across generations must draft what the head drafts from scratch).
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt import load
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SteeredDrafts
from head_log import HeadLog
from test_speculative import GREEDY, PROMPT, _plain



@pytest.fixture(scope="module")
def model(packed, one_thread):
    m = load(packed, "cpu", cache_slots=3, speculative_tokens=3)
    yield m
    m.close()


def drain(batch) -> None:
    while batch.busy:
        batch.step()


@pytest.fixture
def wrap(model):
    """wrap(backend_factory) puts a wrapper around the model's backend for one test."""
    inner = model._backend

    def put(make):
        model._backend = make(inner)
        return model._backend
    yield put
    model._backend = inner


def test_a_lone_sequence_drafts_and_keeps_plain_output(model, packed_model, wrap):
    """Drafts steered to plain greedy's text are all kept (steps of up to 4 tokens), and with the head's own drafts
    (none right) the output is plain greedy's all the same."""
    want = _plain(packed_model, n=24)
    steered = wrap(lambda b: SteeredDrafts(b, PROMPT + want))
    batch = model.batch(parallel=2)
    g = batch.add(PROMPT, max_new_tokens=24, sampling=GREEDY)
    drain(batch)
    s = g.stats
    assert s.token_ids == want and s.finish_reason == "length"
    assert s.accepted_tokens == s.draft_tokens > 0 and steered.verifies < 1 + 23 / 2
    model._backend = steered.inner
    g = batch.add(PROMPT, max_new_tokens=24, sampling=GREEDY)
    drain(batch)
    assert g.stats.token_ids == want and g.stats.draft_tokens > 0


def test_a_prompt_that_extends_a_slot_drafts_from_the_heads_whole_history(model, packed_model, wrap):
    """A second request whose prompt extends the first one's slot prefills only its new tokens, and its head feeds
    on from where the first one's pairs ended: its first head call starts there with the tokens that follow, and
    drafts what the head run over the whole real sequence at once drafts (oracle: the backend's forward and head,
    one call each). Both outputs are plain greedy's."""
    log = wrap(HeadLog)
    batch = model.batch(parallel=2)
    a = batch.add(PROMPT, max_new_tokens=10, sampling=GREEDY)
    drain(batch)
    first = list(a.stats.token_ids)
    assert first == _plain(packed_model, n=10)
    calls_a = len(log.calls)
    second = PROMPT + first + [7, 300, 21]
    b = batch.add(second, max_new_tokens=6, sampling=GREEDY)
    fed = b.stats.cached_tokens
    assert fed == len(PROMPT) + len(first) - 1  # every id but the last output token was fed
    drain(batch)
    assert b.stats.token_ids == _plain(packed_model, n=6, prompt=second) and b.stats.draft_tokens > 0
    start, ids, picks, _ = log.calls[calls_a]
    seq = second + b.stats.token_ids
    assert start + len(ids) > fed and ids == seq[start + 1:start + 1 + len(ids)]
    head_a = max(c[0] + len(c[1]) for c in log.calls[:calls_a])  # real pairs the first request fed
    assert start == head_a  # none skipped, none again: the second request's head feeds on from the first one's
    ref = log.inner
    _, hidden, _ = ref.verify(np.asarray(seq, np.int64), ref.new_cache(), undoable=False)
    end = start + len(ids)
    want, _ = ref.draft(hidden[:end], np.asarray(seq[1:end + 1], np.int64), ref.new_draft_cache(),
                        top1=model.real_vocab_size)
    assert picks[-1 - log.calls[calls_a][3]] == want[-1]


@pytest.mark.parametrize("limit", [1024, 4], ids=["rows-wait", "head-keeps-up"])
def test_batched_steps_keep_the_heads_rows(model, packed_model, wrap, monkeypatch, limit):
    """Two sequences share batched steps, each row's post-norm hidden state kept for its head (fed once more than
    BATCHED_HEAD_ROWS wait: 4 here feeds both heads during the batched steps); once the other has finished, the
    first decodes alone and drafts again. Each head is fed its sequence's real pairs once and in order from position
    0 (none lost to the batched steps), and the first head call's draft is what the head run over the whole real
    sequence at once drafts (oracle: the reference's forward and head, one call each). Both outputs are plain
    greedy's, and a prompt extending the first one's slot drafts on from its head's state."""
    from ninfer_rt import batching

    monkeypatch.setattr(batching, "BATCHED_HEAD_ROWS", limit)
    log = wrap(HeadLog)
    other = [9, 8, 7, 6]
    batch = model.batch(parallel=2)
    a = batch.add(PROMPT, max_new_tokens=16, sampling=GREEDY)
    b = batch.add(other, max_new_tokens=4, sampling=GREEDY)
    drain(batch)
    assert a.stats.token_ids == _plain(packed_model, n=16)
    assert b.stats.token_ids == _plain(packed_model, n=4, prompt=other)
    assert a.stats.draft_tokens > 0 and b.stats.draft_tokens == 0  # b never decoded alone
    seqs = {"a": PROMPT + a.stats.token_ids, "b": other + b.stats.token_ids}
    fed, first = {"a": 0, "b": 0}, {}
    for call in log.calls:
        start, ids, _, _ = call
        owner = next(k for k, seq in seqs.items() if start == fed[k] and ids == seq[start + 1:start + 1 + len(ids)])
        fed[owner] = start + len(ids)  # contiguous: none skipped, none again
        first.setdefault(owner, call)
    assert (fed["b"] > 0) == (limit == 4)  # b's head was fed only where the batched steps' rows were capped
    _, ids, picks, chain = first["a"]
    # the prompt's pairs, and where rows wait the batched steps' too; else the prompt's at the first batched step
    assert len(ids) > len(PROMPT) + 1 if limit == 1024 else len(ids) == len(PROMPT)
    seq, ref = seqs["a"], log.inner
    _, hidden, _ = ref.verify(np.asarray(seq, np.int64), ref.new_cache(), undoable=False)
    want, _ = ref.draft(hidden[:len(ids)], np.asarray(seq[1:len(ids) + 1], np.int64), ref.new_draft_cache(),
                        top1=model.real_vocab_size)
    assert picks[-1 - chain] == want[-1]
    c = batch.add(seq + [4], max_new_tokens=4, sampling=GREEDY)
    assert c.stats.cached_tokens == len(seq) - 1 and c.spec is not None
    drain(batch)
    assert c.stats.token_ids == _plain(packed_model, n=4, prompt=seq + [4])


def test_logprobs_and_json_decode_plainly(model, packed_model):
    """Requests that need every token's distribution (logprobs, a JSON constraint) take no drafts: their ids and
    log-probabilities are what a model without the head gives, bit for bit (the same reference ops)."""
    def run(m, **kw):
        batch = m.batch(parallel=2)
        g = batch.add(PROMPT, max_new_tokens=4, sampling=GREEDY, **kw)
        spec = g.spec
        drain(batch)
        return g, spec

    g, spec = run(model, logprobs=2)
    plain, _ = run(packed_model, logprobs=2)
    assert spec is None and g.stats.draft_tokens == 0
    assert g.stats.token_ids == plain.stats.token_ids
    got, want = g.take_logprobs(), plain.take_logprobs()
    assert got == want and len(want) == 4
    g, spec = run(model, json_object=True)
    plain, _ = run(packed_model, json_object=True)
    assert spec is None and g.stats.draft_tokens == 0
    assert g.stats.token_ids == plain.stats.token_ids and g.stats.finish_reason == plain.stats.finish_reason


def test_a_snapshot_keeps_the_heads_state(model, packed_model):
    """A prompt's snapshot (a chat's history) carries a copy of the head's state: a next prompt extending the
    snapshot's ids takes that slot and speculates from it, with plain greedy's output."""
    batch = model.batch(parallel=1)
    long = PROMPT + [33, 44, 55, 66]
    a = batch.add(long, max_new_tokens=3, sampling=GREEDY, snapshot_at=len(PROMPT))
    drain(batch)
    nxt = PROMPT + [2, 4, 6]
    b = batch.add(nxt, max_new_tokens=6, sampling=GREEDY)
    assert b.stats.cached_tokens == len(PROMPT) and b.spec is not None
    drain(batch)
    assert a.stats.token_ids == _plain(packed_model, n=3, prompt=long)
    assert b.stats.token_ids == _plain(packed_model, n=6, prompt=nxt)


def test_seeded_sampling_repeats_in_a_batch(model):
    """The same seed gives the same ids, another seed others (12 draws of ~20 candidates each)."""
    outs = []
    for seed in (77, 77, 78):
        batch = model.batch(parallel=1)
        g = batch.add(PROMPT, max_new_tokens=12, sampling=SamplingParams(temperature=0.9, top_k=20, seed=seed))
        drain(batch)
        outs.append(g.stats.token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 12 and outs[2] != outs[0]


def test_seeded_sampling_decodes_plainly_and_repeats_beside_others(model, packed_model):
    """A sampled request with a seed takes no drafts (a speculative step uses the seed's stream otherwise than a
    batched step, so its text would depend on the server's load): alone, beside another sequence, and on a model
    without the head, the same seed gives the same ids. Unseeded and greedy requests still draft."""
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=8)

    def run(m, others: int):
        batch = m.batch(parallel=2)
        g = batch.add(PROMPT, max_new_tokens=12, sampling=seeded)
        spec = g.spec
        for _ in range(others):
            batch.add(PROMPT[:5], max_new_tokens=12, sampling=GREEDY)
        drain(batch)
        return g.stats.token_ids, spec, g.stats.draft_tokens

    alone, spec, drafts = run(model, 0)
    assert spec is None and drafts == 0 and len(alone) == 12
    assert run(model, 1)[0] == alone == run(packed_model, 0)[0]
    batch = model.batch(parallel=2)
    assert batch.add(PROMPT, max_new_tokens=2, sampling=GREEDY).spec is not None
    assert batch.add(PROMPT, max_new_tokens=2, sampling=SamplingParams(temperature=0.9, top_k=20)).spec is not None
    drain(batch)


def test_serve_drafts_and_counts_its_drafts(model, packed_model):
    """serve over a speculative model: a greedy completion is plain greedy decoding's text, and /metrics counts the
    drafts the generation took and kept (its GenerationStats, which Batch.add made model.last_stats)."""
    from serve_client import Running

    want = "".join(packed_model.generate("Once upon a time", max_new_tokens=12, sampling=GREEDY))
    with Running(model) as r:
        status, reply = r.json("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})
        _, _, data = r.request("GET", "/metrics")
    stats = model.last_stats
    got = dict(ln.rsplit(" ", 1) for ln in data.decode().splitlines() if not ln.startswith("#"))
    assert status == 200 and reply["choices"][0]["text"] == want and stats.draft_tokens > 0
    assert int(got["ninfer_draft_tokens_total"]) == stats.draft_tokens
    assert int(got["ninfer_draft_tokens_accepted_total"]) == stats.accepted_tokens
