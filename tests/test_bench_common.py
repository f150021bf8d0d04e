"""bench/gpu_common.replay_ms (the graph-replay timer every GPU micro-benchmark uses) and ninfer-rt bench's decode
timer, on a scripted fake GPU:
what it captures, how many replays it runs untimed and timed, what it divides by, and that the graph is freed.
Oracle: a fake clock that advances a known time per replay. Then the decode-step benches' other helpers in
gpu_common (table and JSON, synthetic model, patched planner constants, a step timed on a fresh graph) on fakes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu_common import replay_ms  # noqa: E402

REPLAY_MS = 2.5  # fake time one replay takes


class FakeGpu:
    def __init__(self):
        self.clock, self.log, self.stream = 0.0, [], object()

    def synchronize(self):
        self.log.append("sync")

    def begin_capture(self, stream=None):
        self.log.append("begin")

    def end_capture(self, stream=None):
        self.log.append("end")
        return FakeGraph(self)


class FakeGraph:
    def __init__(self, gpu):
        self.gpu = gpu

    def launch(self, stream):
        self.gpu.clock += REPLAY_MS
        self.gpu.log.append("replay")

    def destroy(self):
        self.gpu.log.append("destroy")


@pytest.fixture
def gpu(monkeypatch):
    from ninfer_rt.gpu import driver
    g = FakeGpu()

    class FakeEvent:
        def record(self, stream):
            self.t = g.clock

        def synchronize(self):
            pass

        def elapsed_ms(self, other):
            return other.t - self.t

    monkeypatch.setattr(driver, "Event", FakeEvent)
    return g


@pytest.mark.parametrize("eager", [True, False])
def test_replay_ms_times_rounds_of_replays(gpu, eager):
    captured = []
    times = replay_ms(gpu, lambda: captured.append(gpu.log.count("begin") - gpu.log.count("end")), rounds=3,
                      replays=4, warmup=2, eager=eager)
    assert times == [REPLAY_MS] * 3  # per replay, one value per round
    assert captured == ([0] if eager else []) + [1]  # eagerly outside a capture, then inside one
    assert gpu.log.count("replay") == 2 + 3 * 4 and gpu.log[-1] == "destroy"


def test_replay_ms_frees_the_graph_when_a_replay_fails(gpu, monkeypatch):
    def broken(self, stream):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(FakeGraph, "launch", broken)
    with pytest.raises(RuntimeError, match="launch failed"):
        replay_ms(gpu, lambda: None, rounds=1, replays=1)
    assert gpu.log[-1] == "destroy"


def test_time_decode_is_the_median_seconds_per_replay_of_the_step_graph(gpu):
    """ninfer-rt bench's decode timer: one decode (it captures the bucket's graph), then rounds of replays of
    that graph through the same eager_ms timer as the micro-benchmarks, per step, in seconds. sampled: the
    decode draws under SAMPLED's record and the graph replayed is the drawing one."""
    from ninfer_rt.gpu.bench import SAMPLED, _time_decode
    from ninfer_rt.gpu.engine import GpuModel, Step

    class FakeModel:
        max_ctx, sample_vocab = 1 << 20, 1000
        bucket = GpuModel.bucket  # the engine's own bucket rule, on this max_ctx

        def __init__(self):
            self.gpu, self.keys, self.draws = gpu, [], []

        def decode(self, tok, pos, slots, draw=None):
            gpu.log.append("decode")
            self.draws.append(draw)

        def step_graph(self, step):
            self.keys.append(step)
            return FakeGraph(gpu)

    m = FakeModel()
    assert _time_decode(m, 8192, rounds=3, reps=7) == pytest.approx(REPLAY_MS / 1e3)
    assert m.keys == [Step(1, 1, 16384, "last")] and m.draws == [None]
    assert gpu.log[0] == "decode" and gpu.log.count("replay") == 3 * 7
    assert _time_decode(m, 8192, rounds=3, reps=7, sampled=True) == pytest.approx(REPLAY_MS / 1e3)
    assert m.keys[-1] == Step(1, 1, 16384, "last", draw=("sample", 1000))
    vocab, rec = m.draws[-1]
    assert vocab == 1000 and (rec["temperature"][0], rec["top_k"][0]) == pytest.approx(
        (SAMPLED["temperature"], SAMPLED["top_k"]))
    _time_decode(m, 8192, rounds=1, reps=1, sampled=True, batch=3)  # a sampled batched step: a record a row
    assert m.keys[-1] == Step(3, 1, 16384, "last", draw=("sample", 1000)) and len(m.draws[-1][1]) == 3


def test_time_decode_of_several_tokens_replays_the_verify_graph(gpu):
    """--decode-tokens: one GpuModel.verify of T tokens at ctx (slot 0), then the replays of its graph: one
    sequence, T rows, the bucket of ctx + T, every row's logits."""
    from ninfer_rt.gpu.bench import _time_decode
    from ninfer_rt.gpu.engine import GpuModel, Step

    class FakeModel:
        max_ctx, sample_vocab = 1 << 20, 1000
        bucket = GpuModel.bucket  # the engine's own bucket rule, on this max_ctx

        def __init__(self):
            self.gpu, self.keys, self.verified = gpu, [], []

        def verify(self, tok, pos, slot, trail=False):
            self.verified.append((len(tok), pos, slot, len(set(tok.tolist())), trail))

        def step_graph(self, step):
            self.keys.append(step)
            return FakeGraph(gpu)

    m = FakeModel()
    assert _time_decode(m, 16383, rounds=2, reps=3, tokens=4) == pytest.approx(REPLAY_MS / 1e3)
    assert m.verified == [(4, 16383, 0, 4, False)] and m.keys == [Step(1, 4, 32768, "all")]
    assert gpu.log.count("replay") == 2 * 3
    _time_decode(m, 100, rounds=1, reps=1, tokens=2, trail=True)  # keeping each token's DeltaNet state
    assert m.verified[-1] == (2, 100, 0, 2, True) and m.keys[-1] == Step(1, 2, 1024, "all", trail=True)


def test_time_draft_replays_the_heads_one_row_graph(gpu):
    """The bench's draft row: one GpuModel.draft of one row at ctx (slot 0, the head's positions from ctx), then the
    replays of that row count's graph in the bucket of ctx + 1."""
    from ninfer_rt.gpu.bench import _time_draft
    from ninfer_rt.gpu.engine import GpuModel

    class FakeModel:
        max_ctx, H = 1 << 20, 8
        bucket = GpuModel.bucket

        def __init__(self):
            self.gpu, self.drafts, self.keys = gpu, [], []

        def draft(self, hidden, ids, pos, slot):
            self.drafts.append((hidden.shape, ids.tolist(), pos, slot))

        def draft_graph(self, T, bucket):
            self.keys.append((T, bucket))
            return FakeGraph(gpu)

    m = FakeModel()
    assert _time_draft(m, 8192, rounds=2, reps=3) == pytest.approx(REPLAY_MS / 1e3)
    assert m.drafts == [((1, 8), [17], 8192, 0)] and m.keys == [(1, 16384)]
    assert gpu.log.count("replay") == 2 * 3


def test_step_rows_out_prints_the_table_and_writes_the_rows(tmp_path):
    """The decode-step benches' table and JSON: every row printed, the JSON exactly the rows and the device."""
    import json
    from types import SimpleNamespace

    from rich.console import Console

    from gpu_common import step_rows_out
    console = Console(record=True, width=200)
    gpu = SimpleNamespace(info=SimpleNamespace(name="Fake GPU", arch="sm_90a"))
    rows = [{"model": "a", "ms": 1.25}, {"model": "b", "ms": 2.5}]
    path = tmp_path / "sub" / "rows.json"
    step_rows_out(console, gpu, "title", [("model", True), ("ms", False)], lambda r: (r["model"], f"{r['ms']:.2f}"),
                  rows, path)
    assert json.loads(path.read_text()) == {"device": "Fake GPU", "arch": "sm_90a", "timing": "cuda-graph replay",
                                            "rows": rows}
    text = console.export_text()
    assert all(s in text for s in ("title", "1.25", "2.50", f"wrote {path}"))


def test_synthetic_model_frees_its_buffers_and_weights_even_on_error(monkeypatch):
    """synthetic_model builds the named config's weights and a one-slot INT8 model, and frees both on the way out,
    also when the body raises."""
    from ninfer_rt import recipe
    from ninfer_rt.gpu import bench, engine, loader

    from gpu_common import synthetic_model
    log = []

    class FakeModel:
        def __init__(self, gpu, k, spec, weights, **kw):
            log.append(("model", spec, kw))

        def free(self):
            log.append("model freed")

    class FakeWeights:
        def free(self, gpu):
            log.append("weights freed")

    monkeypatch.setattr(bench, "builtin_spec", lambda name: f"spec of {name}")
    monkeypatch.setattr(recipe, "load_recipe", lambda name: f"recipe {name}")
    monkeypatch.setattr(loader, "synthetic_weights", lambda gpu, spec, rec, groups: FakeWeights())
    monkeypatch.setattr(engine, "GpuModel", FakeModel)
    with pytest.raises(RuntimeError):
        with synthetic_model("gpu", "k", "qwen3.6-27b", 4096):
            raise RuntimeError("inside")
    assert log == [("model", "spec of qwen3.6-27b", {"slots": 1, "max_ctx": 4096, "kv_dtype": "int8"}),
                   "model freed", "weights freed"]


def test_patched_sets_module_attributes_and_restores_them_even_on_error():
    """patched sets "module.attr" names for the with-block and puts the old values back, also after a raise."""
    from types import SimpleNamespace

    from gpu_common import patched
    mod = SimpleNamespace(A=1, B="b")
    with patched({"m": mod}, {"m.A": 5}):
        assert (mod.A, mod.B) == (5, "b")
    assert (mod.A, mod.B) == (1, "b")
    with pytest.raises(RuntimeError):
        with patched({"m": mod}, {"m.A": 7, "m.B": None}):
            assert (mod.A, mod.B) == (7, None)
            raise RuntimeError("inside")
    assert (mod.A, mod.B) == (1, "b")


def test_time_fresh_step_recaptures_and_takes_the_best_of_three(monkeypatch):
    """time_fresh_step destroys and forgets the model's graphs and its shared carveout's plan first (so the next
    decode plans and recaptures), then returns the least of three runs of ninfer-rt bench's decode timer at that
    context."""
    from types import SimpleNamespace

    from ninfer_rt.gpu import bench

    from gpu_common import time_fresh_step
    log, times = [], iter([3.0, 1.0, 2.0])

    class Graph:
        def destroy(self):
            log.append("destroy")

    model = SimpleNamespace(graphs={"a": Graph(), "b": Graph()}, forget_carveout=lambda: log.append("forget"))

    def fake_time_decode(m, ctx, batch=1, tokens=1):
        log.append(("time", ctx, batch, tokens, len(m.graphs)))
        return next(times)

    monkeypatch.setattr(bench, "_time_decode", fake_time_decode)
    assert time_fresh_step(model, 8192, batch=2) == 1.0
    assert log == ["destroy", "destroy", "forget"] + [("time", 8192, 2, 1, 0)] * 3
    log.clear()
    times = iter([2.0, 3.0, 1.5])
    assert time_fresh_step(model, 8192, tokens=3) == 1.5  # a verification step's timer
    assert log == ["forget"] + [("time", 8192, 1, 3, 0)] * 3


def test_parse_settings_reads_planner_constants_and_refuses_the_rest():
    """parse_settings (decode_timeline's --set): "module.ATTR=value" with a Python literal becomes patched()'s
    {"module.ATTR": value}; an unknown module or attribute, a missing "=" or a value that is no literal is one
    ValueError line naming the item."""
    from types import SimpleNamespace

    from gpu_common import parse_settings
    mods = {"moe": SimpleNamespace(FLAG=False, ROWS=(1,)), "linear": SimpleNamespace(DEPTH={4: 1})}
    assert parse_settings(["moe.FLAG=True", "linear.DEPTH={4: 2, 8: 1}", "moe.ROWS = (1, 2)"], mods) == {
        "moe.FLAG": True, "linear.DEPTH": {4: 2, 8: 1}, "moe.ROWS": (1, 2)}
    assert parse_settings([], mods) == {}
    for bad, why in [("moe.NOPE=1", "want module.ATTR=value"), ("gemm.FLAG=1", "want module.ATTR=value"),
                     ("moe.FLAG", "want module.ATTR=value"), ("moe=1", "want module.ATTR=value"),
                     ("moe.FLAG=yes please", "is not a Python literal")]:
        with pytest.raises(ValueError, match=why) as e:
            parse_settings([bad], mods)
        assert "\n" not in str(e.value) and repr(bad) in str(e.value)


def test_planner_ab_variants_name_real_planner_constants():
    """Every planner constant planner_ab's variants set exists in gpu_common.planner_modules() (a renamed switch
    would otherwise only fail on the GPU, mid-run)."""
    import planner_ab
    from gpu_common import parse_settings, planner_modules
    mods = planner_modules()
    for label, over in planner_ab.VARIANTS:
        assert parse_settings([f"{key}={value!r}" for key, value in over.items()], mods) == dict(over), label


@pytest.mark.parametrize("ahead", [False, True])
def test_host_loop_times_chained_calls_and_drops_the_capturing_round(monkeypatch, ahead):
    """bench/host_loop.loop_s: each round draws once untimed (sample_next at ctx - steps - 1), then times `steps`
    tokens ending at position ctx, each fed the id drawn before it: by sample_next, or by sample_ahead with every
    pending token read once, in order, and at most two steps unread; the first round (which captures the graph)
    is left out of the median. Oracle: a fake clock that each timed token advances by a known time, 10x longer in
    the first round."""
    import numpy as np

    import host_loop

    now, calls, spent = [0.0], [], []  # spent: each timed token's time, in order

    def tick():
        spent.append(0.010 if len(spent) < 4 else 0.001 * (1 + len(spent) % 3))  # round 1: 4 slow tokens
        now[0] += spent[-1]

    class Pending:
        def __init__(self, token):
            self.token, self.read = token, False

        def result(self):
            assert not self.read
            self.read = True
            tick()
            return self.token

    class FakeBackend:
        def __init__(self):
            self.pending = []

        def sample_next(self, ids, cache, params, *, vocab, seed, step):
            calls.append(("next", int(ids[0]), cache.pos, step))
            if step:
                tick()
            cache.pos += 1
            return 100 + len(calls)

        def sample_ahead(self, cache, params, *, vocab, seed, step):
            assert sum(not p.read for p in self.pending) < 2  # one in flight beyond the one being read
            calls.append(("ahead", None, cache.pos, step))
            cache.pos += 1
            self.pending.append(Pending(100 + len(calls)))
            return self.pending[-1]

    monkeypatch.setattr(host_loop.time, "perf_counter", lambda: now[0])
    model = type("M", (), {"sample_vocab": 500})()
    backend = FakeBackend()
    from ninfer_rt.sampling import SamplingParams

    got = host_loop.loop_s(backend, model, ctx=40, steps=4, params=SamplingParams(greedy=True), ahead=ahead)
    assert len(calls) == 5 * host_loop.ROUNDS and len(spent) == 4 * host_loop.ROUNDS
    for n, (kind, fed, pos, step) in enumerate(calls):
        assert (pos, step) == (35 + n % 5, n % 5)
        if n % 5 == 0:
            assert (kind, fed) == ("next", 17)
        else:
            assert kind == ("ahead" if ahead else "next") and fed in (None, 100 + n)  # call n returned 100 + n
    assert all(p.read for p in backend.pending)
    means = [np.mean(spent[4 * r:4 * r + 4]) for r in range(1, host_loop.ROUNDS)]
    assert got == pytest.approx(float(np.median(means)), rel=1e-12)


@pytest.mark.parametrize("draws", ["host", "device", "ahead"])
def test_host_loop_batched_steps_feed_each_row_its_own_draw(draws):
    """bench/host_loop.batch_loop_s: B rows a step, each fed the token drawn for it the step before (by
    sample_batch; by a host Sampler over the step's logits with the padded rows masked: the fake's padded row is
    every row's largest, so an unmasked draw would pick it; or, run ahead, from the draw slots the step before
    left, after a first sample_batch), the steps ending at position ctx - 1."""
    import numpy as np

    import host_loop
    from ninfer_rt.sampling import SamplingParams

    V, pad, calls = 50, 56, []

    def step(ids, caches):
        calls.append(([int(i) for i in ids], [c.pos for c in caches], [c.slot for c in caches]))
        for c in caches:
            c.pos += 1
        return [(3 * int(i) + 1) % V for i in ids]  # each row's next token, a function of its own input

    class Pending:
        def __init__(self, token):
            self.token = token

        def result(self):
            return self.token

    class FakeBackend:
        drawn: list[int] = []  # the draw slots

        def sample_batch(self, ids, caches, params, *, vocab, seeds, steps):
            assert vocab == V and len(params) == len(seeds) == len(caches)
            self.drawn = step(ids, caches)
            return self.drawn

        def sample_batch_ahead(self, caches, params, *, vocab, seeds, steps):
            assert draws == "ahead" and vocab == V and len(params) == len(seeds) == len(caches)
            self.drawn = step(self.drawn, caches)
            return [Pending(t) for t in self.drawn]

        def decode_batch(self, ids, caches):
            nxt = step(ids, caches)
            logits = np.zeros((len(ids), pad), np.float32)
            logits[:, V:] = 100.0
            logits[np.arange(len(ids)), nxt] = 50.0
            return logits

    model = type("M", (), {"sample_vocab": V})()
    host_loop.batch_loop_s(FakeBackend(), model, ctx=30, steps=3, params=SamplingParams(greedy=True), B=2,
                           draws=draws)
    per_round = 3 + (draws == "ahead")  # (run ahead: the first draw, outside the timing, then 3)
    assert len(calls) == per_round * host_loop.ROUNDS
    for n, (ids, pos, slots) in enumerate(calls):
        assert slots == [0, 1] and pos == [30 - per_round + n % per_round] * 2
        want = [17, 1026 % V] if n % per_round == 0 else [(3 * i + 1) % V for i in calls[n - 1][0]]
        assert ids == want


@pytest.mark.parametrize("loop", ["host", "device", "device ahead"])
def test_host_loop_logprob_loops_feed_each_draw_and_read_its_record(loop):
    """bench/host_loop.logprob_loop_s: after a first device draw (outside the timing), each step is fed the token
    drawn before it, which comes from the host's draw over the step's logits (padded rows masked), the device's
    record (sample_batch with logprobs), or the record read through a step run ahead (sample_ahead with logprobs,
    fed from the draw slot); the steps end at position ctx - 1 and each asks for the same alternatives."""
    import numpy as np

    import host_loop
    from ninfer_rt.logprobs import TokenLogprob

    V, pad, calls = 50, 56, []

    def advance(token, cache, how):
        calls.append((how, int(token), cache.pos))
        cache.pos += 1
        return (3 * int(token) + 1) % V

    class FakeBackend:
        drawn = None  # the draw slot

        def sample_batch(self, ids, caches, params, *, vocab, seeds, steps, logprobs):
            assert vocab == V and logprobs == [4] and len(ids) == 1
            self.drawn = advance(ids[0], caches[0], "batch")
            return [TokenLogprob(self.drawn, -1.0)]

        def sample_ahead(self, cache, params, *, vocab, seed, step, logprobs):
            assert loop == "device ahead" and logprobs == 4
            self.drawn = advance(self.drawn, cache, "ahead")
            token = self.drawn
            return type("P", (), {"logprob": lambda _: TokenLogprob(token, -1.0)})()

        def forward(self, ids, cache, last_only):
            row = np.zeros((1, pad), np.float32)
            row[0, V:] = 100.0
            row[0, advance(ids[0], cache, "host")] = 50.0
            return row

    model = type("M", (), {"sample_vocab": V})()
    host_loop.logprob_loop_s(FakeBackend(), model, ctx=30, steps=3, top=4, loop=loop)
    how = {"host": "host", "device": "batch", "device ahead": "ahead"}[loop]
    assert len(calls) == 4 * host_loop.ROUNDS
    for n, (kind, token, pos) in enumerate(calls):
        assert kind == ("batch" if n % 4 == 0 else how) and pos == 26 + n % 4
        assert token == (17 if n % 4 == 0 else (3 * calls[n - 1][1] + 1) % V)


def test_host_loop_penalised_loops_set_the_state_and_draw_on_the_host_from_the_history():
    """bench/host_loop: a penalised loop_s sets the slot's penalty state from PROMPT_IDS prompt ids each round;
    host_loop_s feeds each step the token the host Sampler drew from that step's logits (padded ids masked: the
    fake makes a padded id every row's largest) over a history that grows by each token (the presence penalty
    then turns the pick)."""
    import numpy as np

    import host_loop
    from ninfer_rt.sampling import SamplingParams

    V, pad = 50, 56
    params = SamplingParams(greedy=True, presence_penalty=1.5)
    calls, states = [], []

    class FakeBackend:
        def set_penalties(self, cache, history, prompt_len, p):
            states.append((cache.pos, list(history), prompt_len, p))

        def sample_next(self, ids, cache, p, *, vocab, seed, step):
            cache.pos += 1
            return 3

        def forward(self, ids, cache, last_only=False):
            assert last_only
            calls.append((int(ids[0]), cache.pos))
            cache.pos += 1
            logits = np.zeros((1, pad), np.float32)
            logits[0, V:] = 100.0
            logits[0, 20], logits[0, 5] = 10.0, 9.9  # 20 wins until the output holds it (presence 1.5), then 5
            return logits

    model = type("M", (), {"sample_vocab": V})()
    host_loop.loop_s(FakeBackend(), model, ctx=30, steps=3, params=params, ahead=False)
    assert len(states) == host_loop.ROUNDS
    assert all(s == (26, list(range(host_loop.PROMPT_IDS)), host_loop.PROMPT_IDS, params) for s in states)
    host_loop.host_loop_s(FakeBackend(), model, ctx=30, steps=3, params=params)
    assert len(calls) == 3 * host_loop.ROUNDS
    # each round: 17, then 20 (no output yet: 20 is only in the prompt), then 5 (20 now in the output)
    assert [fed for fed, _ in calls] == [17, 20, 5] * host_loop.ROUNDS
    assert [pos for _, pos in calls] == [27, 28, 29] * host_loop.ROUNDS


@pytest.mark.parametrize("loop,B", [("host", 1), ("device", 1), ("device ahead", 1), ("device", 2),
                                    ("device ahead", 2)])
def test_host_loop_json_loops_feed_each_draw_to_the_constraint(monkeypatch, loop, B):
    """bench/host_loop.json_loop_s: each row's step is fed the token drawn for it before (on the host from the
    step's logits, padded rows masked; by sample_batch; or, after a first sample_batch, by sample_ahead /
    sample_batch_ahead from the draw slots, under each string's mask, set before and cleared after), its steps end at
    position ctx - 1, and the constraint (JsonTokens.allows) takes each drawn token in turn. The mask holds every
    id of the table (each one's letters keep the string plain) and none past it."""
    import numpy as np

    import host_loop
    from ninfer_rt.json_tokens import JsonTokens

    V, pad, calls, taken, masks = 50, 56, [], [], []
    allows = JsonTokens.allows
    monkeypatch.setattr(JsonTokens, "allows", lambda self, c, t: taken.append(int(t)) or allows(self, c, t))

    def advance(token, cache, how):
        calls.append((cache.slot, how, int(token), cache.pos))
        cache.pos += 1
        return (3 * int(token) + 1) % V

    def pending(token):
        return type("Pending", (), {"result": lambda _: token})()

    class FakeBackend:
        mask_words, slots = 2, []

        def set_mask(self, cache, bits):
            masks.append(None if bits is None else np.unpackbits(bits.view(np.uint8), bitorder="little"))

        def sample_batch(self, ids, caches, params, *, vocab, seeds, steps):
            assert loop != "host" and vocab == V and len(ids) == len(caches) == B and params[0].greedy
            self.slots = [advance(t, c, "device") for t, c in zip(ids, caches)]
            return list(self.slots)

        def sample_ahead(self, cache, params, *, vocab, seed, step):
            assert loop == "device ahead" and B == 1 and vocab == V
            self.slots = [advance(self.slots[0], cache, "ahead")]
            return pending(self.slots[0])

        def sample_batch_ahead(self, caches, params, *, vocab, seeds, steps):
            assert loop == "device ahead" and B > 1 and len(caches) == B and vocab == V
            self.slots = [advance(t, c, "ahead") for t, c in zip(self.slots, caches)]
            return [pending(t) for t in self.slots]

        def forward(self, ids, cache, last_only):
            assert loop == "host" and last_only
            row = np.zeros((1, pad), np.float32)
            row[0, V:] = 100.0
            row[0, advance(ids[0], cache, "host")] = 50.0
            return row

    model = type("M", (), {"sample_vocab": V})()
    host_loop.json_loop_s(FakeBackend(), model, ctx=30, steps=3, loop=loop, B=B)
    per = 4 if loop == "device ahead" else 3  # (the first draw of a chain run ahead is outside the timing)
    assert len(calls) == per * host_loop.ROUNDS * B
    for b in range(B):
        mine = [c[1:] for c in calls if c[0] == b]
        for n, (kind, token, pos) in enumerate(mine):
            first = n % per == 0
            assert kind == ({"host": "host", "device": "device"}.get(loop) or ("device" if first else "ahead"))
            assert pos == 30 - per + n % per
            assert token == ((17 + 1009 * b) % V if first else (3 * mine[n - 1][1] + 1) % V)
    assert taken == [(3 * t + 1) % V for _, _, t, _ in calls]
    if loop == "device ahead":
        want = np.zeros(64, np.uint8)
        want[:V] = 1
        assert len(masks) == 2 * B * host_loop.ROUNDS
        assert all(np.array_equal(m, want) for r in range(host_loop.ROUNDS) for m in masks[2 * B * r:2 * B * r + B])
        assert all(m is None for r in range(host_loop.ROUNDS) for m in masks[2 * B * r + B:2 * B * (r + 1)])
    else:
        assert masks == []
