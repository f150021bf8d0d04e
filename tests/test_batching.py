"""ninfer_rt.batching.Batch: continuous batching over cache slots, with per-slot prefix reuse.

Oracles: Model.generate of each prompt alone (the reference backend, fp32, whose batched step is each sequence's
own forward, so greedy tokens must agree exactly), and slot_backend.SlotBackend, whose logits name a hash of the
slot's whole history: a sequence continued from a stale, shared or overwritten slot decodes something else.
"""

from __future__ import annotations

import random

import pytest

from ninfer_rt import load
from ninfer_rt.batching import Batch
from ninfer_rt.errors import NinferError
from ninfer_rt.json_schema import compile_schema
from ninfer_rt.sampling import SamplingParams
from slot_backend import DrawingSlotBackend, SlotBackend

GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module")
def model(packed):
    m = load(packed, "cpu", cache_slots=3)
    yield m
    m.close()


@pytest.fixture
def fake(model, monkeypatch):
    f = SlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids), cache_slots=4)
    monkeypatch.setattr(model, "_backend", f)
    return f


@pytest.fixture(params=["host draws", "device draws"])
def any_fake(model, monkeypatch, request):
    """SlotBackend, or the same with the GPU backend's draws (a lone sequence then runs a step ahead)."""
    cls = SlotBackend if request.param == "host draws" else DrawingSlotBackend
    f = cls(model.real_vocab_size, set(model.tokenizer.eos_ids), cache_slots=4)
    monkeypatch.setattr(model, "_backend", f)
    return f


def drain(batch: Batch, gens) -> dict:
    """Step until every generation is done; each one's text."""
    text = {id(g): "" for g in gens}
    while batch.busy:
        batch.step()
        for g in gens:
            text[id(g)] += "".join(g.take())
    return text


def test_a_batch_decodes_what_each_prompt_decodes_alone(model):
    """Three prompts of different lengths and budgets, one joining two steps late: each one's tokens, text and
    finish reason are a lone generate's."""
    prompts = [model.tokenizer.encode(t) for t in ("The garden at dawn", "Once", "A list of numbers: 1, 2, 3,")]
    budgets = [9, 5, 7]
    alone = []
    for ids, n in zip(prompts, budgets):
        text = "".join(model.generate(ids, max_new_tokens=n, sampling=GREEDY))
        alone.append((list(model.last_stats.token_ids), text, model.last_stats.finish_reason))
    batch = model.batch()
    gens = [batch.add(prompts[0], max_new_tokens=budgets[0], sampling=GREEDY),
            batch.add(prompts[1], max_new_tokens=budgets[1], sampling=GREEDY)]
    text = {id(g): "" for g in gens}
    for _ in range(2):
        batch.step()
        for g in gens:
            text[id(g)] += "".join(g.take())
    gens.append(batch.add(prompts[2], max_new_tokens=budgets[2], sampling=GREEDY))
    text.update({id(gens[2]): ""})
    for k, v in drain(batch, gens).items():
        text[k] += v
    for g, (tokens, want, reason) in zip(gens, alone):
        assert (g.stats.token_ids, text[id(g)], g.stats.finish_reason) == (tokens, want, reason)
        assert g.error is None and g.stats.cached_tokens == 0


def test_a_prompt_prefilled_in_chunks_decodes_as_whole(model):
    ids = model.tokenizer.encode("Chunks of a prompt, fed a few tokens at a time between decode steps")
    want = list(model.generate_ids(ids, max_new_tokens=6, sampling=GREEDY))
    batch = model.batch(prefill_chunk=3)
    g = batch.add(ids, max_new_tokens=6, sampling=GREEDY)
    steps = 0
    while batch.busy:
        batch.step()
        steps += 1
    # a step a chunk; the last one draws token 1 and decodes token 2, then a step for each of tokens 3-6
    assert g.stats.token_ids == want and steps == -(-len(ids) // 3) + 4


def test_one_decode_step_serves_every_running_sequence(model, fake):
    """Three sequences with budgets 2, 4 and 6 join at once: the batched forward takes 3, then 2, then 1 rows as
    they finish, and each decodes what the rule gives it alone."""
    batch = model.batch(3)
    prompts = [[100 + i, 7, 8] for i in range(3)]
    gens = [batch.add(p, max_new_tokens=n, sampling=GREEDY) for p, n in zip(prompts, (2, 4, 6))]
    drain(batch, gens)
    assert fake.batches == [3, 2, 2, 1, 1]
    for g, p in zip(gens, prompts):
        assert g.stats.token_ids == fake.decode_fresh(p, g.budget) and g.stats.finish_reason == "length"


def test_random_traffic_never_serves_a_stale_slot(model, any_fake):
    """Random joins of prompts that extend a finished one's prompt and reply, share a snapshot's prefix, or are
    new, with cancels: every generation decodes what the rule gives its prompt alone, prefills only what its slot
    lacks, and slots are reused both ways; with device draws too, where a lone sequence's step runs ahead."""
    fake = any_fake
    rng = random.Random(5)
    toks = lambda n: [rng.randrange(100, model.real_vocab_size) for _ in range(n)]  # noqa: E731
    batch = model.batch(parallel=3)
    finished, snapshots, live = [], [], []
    reused = {"extend": 0, "snapshot": 0}
    for _ in range(400):
        if batch.free and rng.random() < 0.5:
            kind = rng.choice(["extend", "snapshot", "new"])
            if kind == "extend" and finished:
                g0 = rng.choice(finished[-4:])
                prompt = g0.prompt + g0.stats.token_ids + toks(rng.randrange(1, 4))
            elif kind == "snapshot" and snapshots:
                prompt = rng.choice(snapshots[-3:]) + toks(rng.randrange(2, 5))
            else:
                kind, prompt = "new", toks(rng.randrange(3, 10))
            at = rng.choice([None, rng.randrange(1, len(prompt))])
            g = batch.add(prompt, max_new_tokens=rng.randrange(1, 6), sampling=GREEDY, snapshot_at=at)
            g.kind = kind
            live.append(g)
            if at is not None:
                snapshots.append(prompt[:at])
        if live and rng.random() < 0.05:
            batch.cancel(rng.choice(live))
        batch.step()
        for g in [g for g in live if g.done]:
            live.remove(g)
            assert g.error is None
            n = len(g.stats.token_ids)
            assert g.stats.token_ids == fake.decode_fresh(g.prompt, n)
            if g.stats.finish_reason != "cancelled":
                finished.append(g)
            if g.stats.cached_tokens and g.kind != "new":
                reused[g.kind] += 1
    assert min(reused.values()) > 15 and max(fake.batches) == 3
    assert getattr(fake, "reads", 40) >= 40  # with device draws, lone sequences ran ahead (83 reads)


def test_cancel_stop_strings_and_refusals(model, fake):
    batch = model.batch(2)
    a = batch.add([5, 6, 7], max_new_tokens=50, sampling=GREEDY)
    b = batch.add([8, 9], max_new_tokens=3, sampling=GREEDY)
    with pytest.raises(NinferError, match="the batch is full: 2 generations are running"):
        batch.add([1, 2], max_new_tokens=3)
    batch.step()
    batch.cancel(a)
    assert a.done and a.stats.finish_reason == "cancelled" and batch.free == 1
    drain(batch, [b])
    # the cancelled sequence's slot kept what it fed: its continuation prefills only the rest
    turn = a.prompt + a.stats.token_ids + [42]
    c = batch.add(turn, max_new_tokens=2, sampling=GREEDY)
    drain(batch, [c])
    assert c.stats.cached_tokens == len(a.prompt) + len(a.stats.token_ids) - 1
    assert c.stats.token_ids == fake.decode_fresh(turn, 2)
    for bad, match in [(dict(max_new_tokens=-1), "max_new_tokens"),
                       (dict(max_new_tokens=False), r"max_new_tokens=False: must be an integer >= 0"),
                       (dict(max_new_tokens=0.0), r"max_new_tokens=0.0: must be an integer >= 0"),
                       (dict(logprobs=2.0), r"logprobs=2.0: must be an integer"),
                       (dict(stop=[""]), "stop must be a non-empty string"),
                       (dict(snapshot_at=9), "snapshot_at")]:
        with pytest.raises(NinferError, match=match):
            batch.add([1, 2, 3], **bad)
    with pytest.raises(NinferError, match="outside the vocabulary"):
        batch.add([model.spec.vocab_size])
    with pytest.raises(NinferError, match=r"parallel=5: must be in \[1, 4\]"):
        model.batch(5)


def test_max_new_tokens_0_prefills_the_prompt_for_a_later_request(model, fake):
    """A prefill-only request (llama.cpp's n_predict 0) draws nothing and ends "length"; its prompt stays in a
    slot, so a request extending it feeds only the rest and decodes what a fresh forward of the whole prompt
    decodes (the slot backend's logits hash the slot's whole history)."""
    batch = model.batch(2)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    g = batch.add(prompt, max_new_tokens=0, sampling=GREEDY)
    assert drain(batch, [g])[id(g)] == ""
    assert g.stats.finish_reason == "length" and g.stats.generated_tokens == 0 and g.stats.token_ids == []
    assert g.take_prompt_logprobs() == [] and g.take_logprobs() == []
    turn = prompt + [5, 3]
    c = batch.add(turn, max_new_tokens=3, sampling=GREEDY)
    drain(batch, [c])
    assert c.stats.cached_tokens == len(prompt) and c.stats.token_ids == fake.decode_fresh(turn, 3)


def test_stop_strings_end_the_text_as_generate_does(model):
    ids = model.tokenizer.encode("Counting: one, two, three,")
    full = "".join(model.generate(ids, max_new_tokens=12, sampling=GREEDY))
    stop = full[len(full) // 2:len(full) // 2 + 2]
    want = "".join(model.generate(ids, max_new_tokens=12, sampling=GREEDY, stop=[stop]))
    batch = model.batch()
    g = batch.add(ids, max_new_tokens=12, sampling=GREEDY, stop=[stop])
    assert drain(batch, [g])[id(g)] == want and g.stats.finish_reason == "stop" and g.stats.stop_string == stop


def test_a_stop_completed_by_the_last_held_bytes_is_a_stop_as_in_generate(model, fake):
    """A reply whose last token holds part of a character: at its end the held bytes go out as U+FFFD, and a stop
    string they complete ends it as "stop" (with that stop string) in the batch, as generate reports it."""
    tok = model.tokenizer

    def cut_in_a_character(ids) -> bool:
        try:
            b"".join(tok.token_bytes(i) for i in ids).decode("utf-8")
        except UnicodeDecodeError as e:
            return e.reason == "unexpected end of data"
        return False

    for first in range(5, 200):  # the first prompt whose greedy 2-token reply ends inside a character
        text = "".join(model.generate([first, 3], max_new_tokens=2, sampling=GREEDY))
        if text.count("\ufffd") == 1 and text.endswith("\ufffd") and cut_in_a_character(model.last_stats.token_ids):
            break
    else:
        pytest.fail("no prompt's reply ends inside a character")
    want = "".join(model.generate([first, 3], max_new_tokens=2, sampling=GREEDY, stop=["\ufffd"]))
    assert model.last_stats.finish_reason == "stop" and model.last_stats.stop_string == "\ufffd"
    batch = model.batch()
    g = batch.add([first, 3], max_new_tokens=2, sampling=GREEDY, stop=["\ufffd"])
    assert drain(batch, [g])[id(g)] == want == text[:-1]
    assert (g.stats.finish_reason, g.stats.stop_string) == ("stop", "\ufffd")


def test_a_failing_forward_fails_its_batch_and_the_next_starts_clean(model, fake, monkeypatch):
    batch = model.batch(2)
    a, b = (batch.add([10 + i, 11], max_new_tokens=4, sampling=GREEDY) for i in range(2))
    real = fake.decode_batch
    monkeypatch.setattr(fake, "decode_batch", lambda ids, caches: (_ for _ in ()).throw(RuntimeError("boom")))
    batch.step()
    assert a.done and b.done and isinstance(a.error, RuntimeError) and isinstance(b.error, RuntimeError)
    assert a.stats.finish_reason == b.stats.finish_reason == "error"  # not the default "cancelled"
    monkeypatch.setattr(fake, "decode_batch", real)
    c = batch.add([10, 11, 12], max_new_tokens=3, sampling=GREEDY)  # no slot's old contents are trusted
    drain(batch, [c])
    assert c.stats.cached_tokens == 0 and c.stats.token_ids == fake.decode_fresh([10, 11, 12], 3)


def test_one_sequences_dead_end_fails_it_alone(model):
    """A JSON schema the compiler cannot see is unsatisfiable (two distinct strings of length 0) ends its own
    generation with the automaton's reason at the step where no token continues it; the sequence decoding beside
    it in the same steps goes on and decodes what it decodes alone, and its slot's cache stays reusable."""
    ids = model.tokenizer.encode("A list of numbers: 1, 2, 3,")
    alone = "".join(model.generate(ids, max_new_tokens=64, sampling=GREEDY))
    batch = model.batch(2)
    dead = batch.add(ids, max_new_tokens=80, sampling=GREEDY, json_schema={
        "type": "array", "items": {"type": "string", "maxLength": 0}, "minItems": 2, "uniqueItems": True})
    other = batch.add(ids, max_new_tokens=64, sampling=GREEDY)
    text = drain(batch, [dead, other])
    assert isinstance(dead.error, NinferError) and "continues the JSON reply" in str(dead.error)
    assert len(dead.stats.token_ids) < len(other.stats.token_ids)  # it ended while the other was decoding beside it
    assert other.error is None and text[id(other)] == alone and other.stats.finish_reason == "length"
    again = batch.add(ids + other.stats.token_ids + [11], max_new_tokens=2, sampling=GREEDY)
    drain(batch, [again])
    # other's slot: its prompt and every token it fed (all it drew but the last)
    assert again.error is None and again.stats.cached_tokens == len(ids) + len(other.stats.token_ids) - 1


def test_a_generate_meanwhile_takes_slot_0_from_the_batch(model, fake):
    batch = model.batch(2)
    a = batch.add([20, 21], max_new_tokens=6, sampling=GREEDY)  # the least recently used slot: 0
    b = batch.add([30, 31], max_new_tokens=6, sampling=GREEDY)
    batch.step()
    list(model.generate_ids([40, 41], max_new_tokens=2, sampling=GREEDY))
    drain(batch, [a, b])
    assert isinstance(a.error, NinferError) and "took this generation's sequence slot" in str(a.error)
    assert b.error is None and b.stats.token_ids == fake.decode_fresh([30, 31], 6)


def test_idle_slots_are_reused_least_recently_used_first(model, fake):
    """Four slots, one sequence at a time: a fifth new prompt takes the slot whose sequence left longest ago, so
    the first conversation's continuation starts over while the second's still continues."""
    batch = model.batch(1)
    gens = []
    for i in range(5):
        g = batch.add([50 + i, 1, 2], max_new_tokens=2, sampling=GREEDY)
        drain(batch, [g])
        gens.append(g)

    def continued(g0) -> int:
        g = batch.add(g0.prompt + g0.stats.token_ids + [9], max_new_tokens=1, sampling=GREEDY)
        drain(batch, [g])
        assert g.stats.token_ids == fake.decode_fresh(g.prompt, 1)
        return g.stats.cached_tokens

    assert continued(gens[1]) == 4 and continued(gens[0]) == 0


def test_a_stop_string_is_one_stop_in_the_batch_as_in_generate(model):
    """stop="..." is one stop string in Batch.add, as in Model.generate (it once became one stop a character)."""
    ids = model.tokenizer.encode("The garden at dawn")
    alone = "".join(model.generate(ids, max_new_tokens=24, sampling=GREEDY))
    stop = alone[len(alone) // 2:len(alone) // 2 + 3]  # three characters from the middle of the greedy text
    assert len(stop) == 3 and alone.index(stop) > 0
    want = "".join(model.generate(ids, max_new_tokens=24, sampling=GREEDY, stop=stop))
    batch = model.batch()
    g = batch.add(ids, max_new_tokens=24, sampling=GREEDY, stop=stop)
    assert drain(batch, [g])[id(g)] == want == alone[:alone.index(stop)]
    assert g.stats.stop_string == stop


@pytest.mark.parametrize("stop", [5, b"x", [1], ["ok", ""], {"a": 1}])
def test_a_stop_that_is_not_strings_is_one_line(model, stop):
    ids = model.tokenizer.encode("Once")
    for call in (lambda: list(model.generate(ids, max_new_tokens=2, stop=stop)),
                 lambda: model.batch().add(ids, max_new_tokens=2, stop=stop)):
        with pytest.raises(NinferError, match=r"^stop must be a non-empty string or a list of them, got "):
            call()


def test_a_schema_dict_is_compiled_and_a_bad_one_refused(model):
    """Batch.add takes a JSON Schema as a request carries it (it once failed inside the step on a dict)."""
    ids, schema = model.tokenizer.encode("Once"), {"type": "object", "properties": {"a": {"type": "integer"}}}
    texts = []
    for given in (schema, compile_schema(schema)):  # the oracle: the compiled Node the server passes
        batch = model.batch()
        g = batch.add(ids, max_new_tokens=40, sampling=GREEDY, json_schema=given)
        texts.append(drain(batch, [g])[id(g)])
        assert g.error is None, g.error
    assert texts[0] == texts[1] and texts[0].strip()
    with pytest.raises(NinferError, match="json_schema"):
        model.batch().add(ids, max_new_tokens=2, json_schema={"type": "no-such-type"})


def test_numpy_integer_arguments_are_integers(model, fake):
    """A numpy integer is an integer for logprobs as for every other count (it was refused there alone)."""
    import numpy as np

    batch = model.batch(2)
    a = batch.add([10, 11], max_new_tokens=np.int64(3), sampling=GREEDY, logprobs=np.int64(2))
    b = batch.add([10, 11], max_new_tokens=3, sampling=GREEDY, logprobs=2)
    drain(batch, [a, b])
    assert a.stats.token_ids == b.stats.token_ids == fake.decode_fresh([10, 11], 3)
    assert [(t.id, t.top) for t in a.take_logprobs()] == [(t.id, t.top) for t in b.take_logprobs()]


@pytest.mark.parametrize("kw", [{"parallel": True}, {"prefill_chunk": True}, {"parallel": 1.0}])
def test_batch_sizes_are_integers_not_bools(model, kw):
    with pytest.raises(NinferError, match=f"{next(iter(kw))}="):
        model.batch(**kw)


def test_batched_steps_draw_on_the_device_but_rows_that_need_their_logits(model):
    """A batched step draws every sequence it can on the device (sample_batch: only the ids come back), each row
    with its own draw index; a row that needs its logits (logprobs) gets them back in the same step and is drawn
    on the host, its logprobs reported. Tokens are the rule's either way."""
    f = DrawingSlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids), cache_slots=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "_backend", f)
        batch = model.batch(3)
        a = batch.add([100, 7, 8], max_new_tokens=6, sampling=GREEDY)
        b = batch.add([101, 7], max_new_tokens=4, sampling=GREEDY)
        drain(batch, [a, b])
        assert f.batch_steps == [[1, 1], [2, 2], [3, 3]] and f.batches == [2, 2, 2]
        c = batch.add([102, 7], max_new_tokens=4, sampling=GREEDY)
        d = batch.add([103, 7], max_new_tokens=4, sampling=GREEDY, logprobs=1)
        drain(batch, [c, d])
        assert f.batch_steps[3:] == [[1, None], [2, None], [3, None]] and f.batches == [2, 2, 2] * 2
    for g in (a, b, c, d):
        assert g.stats.token_ids == f.decode_fresh(g.prompt, g.budget)
    assert [lp.id for lp in d.take_logprobs()] == d.stats.token_ids and c.take_logprobs() == []


def test_rows_with_logprobs_draw_on_the_device_where_the_backend_computes_them(model):
    """Where the backend computes logprobs with its draws (GpuBackend.draws_logprobs), a row asking for them is a
    device row of a batched step, alone too (no run-ahead: each step's record comes back with its id), and the
    logprobs it reports are the ones the host path reports for the same tokens."""
    def run(on_device: bool):
        f = DrawingSlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids), cache_slots=4)
        f.draws_logprobs = on_device
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(model, "_backend", f)
            batch = model.batch(3)
            c = batch.add([102, 7], max_new_tokens=4, sampling=GREEDY)
            d = batch.add([103, 7], max_new_tokens=4, sampling=GREEDY, logprobs=2)
            drain(batch, [c, d])
            e = batch.add([104, 9], max_new_tokens=3, sampling=GREEDY, logprobs=0)
            drain(batch, [e])
        return f, [g.stats.token_ids for g in (c, d, e)], [g.take_logprobs() for g in (c, d, e)]

    dev, host = run(True), run(False)
    assert dev[0].batch_steps == [[1, 1], [2, 2], [3, 3], [1], [2]] and dev[0].reads == 0
    assert host[0].batch_steps == [[1, None], [2, None], [3, None]]  # (e alone on the host: decode_batch)
    assert dev[1] == host[1] and dev[2] == host[2]
    assert [len(lps) for lps in dev[2]] == [0, 4, 3] and all(len(lp.top) == 2 for lp in dev[2][1])


def test_a_lone_row_with_logprobs_runs_ahead_where_the_backend_brings_the_record_back(model):
    """Where sample_ahead also brings back a step's logprobs (GpuBackend.logprobs_ahead), a sequence alone with
    logprobs runs a step ahead after its first device draw, and reports the tokens and logprobs of the path that
    waits for each step (logprobs_ahead off) and of the host path."""
    def run(cls, **flags):
        f = cls(model.real_vocab_size, set(model.tokenizer.eos_ids), cache_slots=4)
        for k, v in flags.items():
            setattr(f, k, v)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(model, "_backend", f)
            batch = model.batch(2)
            g = batch.add([104, 9, 3], max_new_tokens=7, sampling=GREEDY, logprobs=2)
            drain(batch, [g])
        return f, (g.stats.token_ids, g.take_logprobs())

    ahead, got = run(DrawingSlotBackend, draws_logprobs=True, logprobs_ahead=True)
    waiting, want = run(DrawingSlotBackend, draws_logprobs=True)
    _, host = run(SlotBackend)
    assert got == want == host and len(got[1]) == 7
    assert ahead.batch_steps == [[1]] and ahead.steps == list(range(2, 7)) and ahead.reads == 5
    assert waiting.batch_steps == [[i] for i in range(1, 7)] and waiting.reads == 0


def test_the_devices_penalty_state_follows_tokens_drawn_elsewhere(model):
    """A sequence with penalties whose tokens were drawn on the host (its first, with prompt_logprobs) has its
    slot's penalty state set from its whole history before its first draw on the device, once; one drawn on the
    device from its prompt gets the prompt alone."""
    f = DrawingSlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids), cache_slots=4)
    f.device_penalties = True
    pen = SamplingParams(greedy=True, repetition_penalty=1.3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "_backend", f)
        batch = model.batch(3)
        a = batch.add([100, 7, 8], max_new_tokens=4, sampling=pen, prompt_logprobs=0)
        b = batch.add([101, 7], max_new_tokens=4, sampling=pen)
        drain(batch, [a, b])
    sets = {slot: (hist, n) for slot, hist, n in f.penalty_sets}
    assert len(f.penalty_sets) == 2 and len(sets) == 2
    assert sorted(sets.values()) == sorted([([100, 7, 8, a.stats.token_ids[0]], 3), ([101, 7], 2)])
