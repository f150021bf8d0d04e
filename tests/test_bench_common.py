"""bench/gpu_common.replay_ms (the graph-replay timer every GPU micro-benchmark uses) and ninfer-rt bench's decode
timer, on a scripted fake GPU:
what it captures, how many replays it runs untimed and timed, what it divides by, and that the graph is freed.
Oracle: a fake clock that advances a known time per replay."""

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

    class FakeModel:
        max_ctx, sample_vocab = 1 << 20, 1000

        def __init__(self):
            self.gpu, self.keys, self.draws = gpu, [], []

        def decode(self, tok, pos, slots, draw=None):
            gpu.log.append("decode")
            self.draws.append(draw)

        def step_graph(self, B, T, bucket, logit_rows="last", draw=None):
            self.keys.append((B, T, bucket, logit_rows, draw))
            return FakeGraph(gpu)

    m = FakeModel()
    assert _time_decode(m, 8192, rounds=3, reps=7) == pytest.approx(REPLAY_MS / 1e3)
    assert m.keys == [(1, 1, 16384, "last", None)] and m.draws == [None]
    assert gpu.log[0] == "decode" and gpu.log.count("replay") == 3 * 7
    assert _time_decode(m, 8192, rounds=3, reps=7, sampled=True) == pytest.approx(REPLAY_MS / 1e3)
    assert m.keys[-1] == (1, 1, 16384, "last", ("sample", 1000))
    vocab, rec = m.draws[-1]
    assert vocab == 1000 and (rec["temperature"][0], rec["top_k"][0]) == pytest.approx(
        (SAMPLED["temperature"], SAMPLED["top_k"]))
