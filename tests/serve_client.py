"""Test helpers for ninfer-rt serve: a Server on a background thread with a loopback client, and the parsers of
both event-stream formats."""

from __future__ import annotations

import http.client
import json
import threading
import time

from ninfer_rt.api import GenerationStats
from ninfer_rt.serve import Server

TIMEOUT_S = 60  # every request and the server's shutdown are bounded by this


class Running:
    """A Server on a background thread (the reference backend runs on any thread), stopped at exit."""

    def __init__(self, model, **kwargs):
        self.lines: list[str] = []  # the server's log
        self.server = Server(model, model_name="tiny", port=0, log=self.lines.append, **kwargs)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive()

    def request(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
        """(status, headers, bytes) of one request; body is sent as JSON."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        return http_request(*self.server.address, method, path, data, headers)

    def json(self, path: str, body=None, method="POST", headers=None):
        status, _, data = self.request(method, path, body, headers)
        return status, json.loads(data)


def http_request(host: str, port: int, method: str, path: str, data: bytes | None = None, headers=None,
                 timeout: float = TIMEOUT_S) -> tuple[int, dict, bytes]:
    """(status, headers, bytes) of one request over a connection of its own, bounded by timeout seconds."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def sse_data(data: bytes) -> list:
    """The data payloads of an OpenAI event stream, [DONE] as the string."""
    out = []
    for frame in data.decode().split("\n\n"):
        if frame.startswith("data: "):
            payload = frame[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def sse_events(data: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of an Anthropic event stream."""
    out = []
    for frame in filter(None, data.decode().split("\n\n")):
        name, payload = frame.split("\n", 1)
        assert name.startswith("event: ") and payload.startswith("data: ")
        out.append((name[len("event: "):], json.loads(payload[len("data: "):])))
    return out


class Scripted:
    """The model with generation replaced: model.batch gives a ScriptedBatch, whose generations each yield `text`
    in pieces of `step` characters (one a step; each step waits `delay` seconds), then end with finish_reason eos
    (or length at max_new_tokens); records the prompts, how many pieces were taken and the most generations a step
    ran."""

    def __init__(self, model, text: str, step: int = 3, delay: float = 0.0):
        self._model, self.text, self.step, self.delay = model, text, step, delay
        self.taken = 0
        self.most = 0  # the most generations one step ran
        self.prompts: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def batch(self, parallel: int | None = None, prefill_chunk: int | None = None):
        return ScriptedBatch(self, parallel or 1)


class _ScriptedRun:
    def __init__(self, pieces: list[str], budget: int, prompt_tokens: int):
        self.pieces, self.budget, self.done, self.error = pieces, budget, False, None
        self.stats = GenerationStats(prompt_tokens=prompt_tokens)
        self._out: list[str] = []

    def take(self) -> list[str]:
        out, self._out = self._out, []
        return out


class ScriptedBatch:
    """batching.Batch's interface (add, step, cancel, busy, free) over Scripted's text."""

    def __init__(self, scripted: Scripted, parallel: int):
        self.s, self.parallel, self.runs = scripted, parallel, []

    @property
    def busy(self) -> bool:
        return bool(self.runs)

    @property
    def free(self) -> int:
        return self.parallel - len(self.runs)

    def add(self, ids, *, max_new_tokens, sampling, stop, snapshot_at, logprobs=None, prompt_logprobs=None,
            json_object=False, json_schema=None, skip_special_tokens=False):
        self.s.prompts.append(list(ids))
        text, step = self.s.text, self.s.step
        run = _ScriptedRun([text[i:i + step] for i in range(0, len(text), step)], max_new_tokens, len(ids))
        self.runs.append(run)
        self.s.last_stats = run.stats
        return run

    def cancel(self, run) -> None:
        run.done = True
        self.runs.remove(run)

    def step(self) -> None:
        time.sleep(self.s.delay)
        self.s.most = max(self.s.most, len(self.runs))
        for run in list(self.runs):
            s = run.stats
            if s.generated_tokens < min(len(run.pieces), run.budget):
                run._out.append(run.pieces[s.generated_tokens])
                self.s.taken += 1
                s.generated_tokens += 1
                continue
            s.finish_reason = "eos" if len(run.pieces) <= run.budget else "length"
            s.generated_tokens += s.finish_reason == "eos"
            run.done = True
            self.runs.remove(run)
