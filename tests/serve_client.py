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
        host, port = self.server.address
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        out = (resp.status, dict(resp.getheaders()), resp.read())
        conn.close()
        return out

    def json(self, path: str, body=None, method="POST", headers=None):
        status, _, data = self.request(method, path, body, headers)
        return status, json.loads(data)


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
    """The model with generate replaced: yields `text` in pieces of `step` characters (each one token, after
    `delay` seconds), then ends with finish_reason eos; records how many pieces were taken."""

    def __init__(self, model, text: str, step: int = 3, delay: float = 0.0):
        self._model, self.text, self.step, self.delay = model, text, step, delay
        self.taken = 0
        self.prompts: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def generate(self, ids, *, max_new_tokens, sampling, stop, reuse_cache, snapshot_at):
        self.prompts.append(list(ids))
        stats = self.last_stats = GenerationStats(prompt_tokens=len(ids))
        pieces = [self.text[i:i + self.step] for i in range(0, len(self.text), self.step)]

        def run():
            for piece in pieces[:max_new_tokens]:
                time.sleep(self.delay)
                self.taken += 1
                stats.generated_tokens += 1
                yield piece
            stats.finish_reason = "eos" if len(pieces) <= max_new_tokens else "length"
            stats.generated_tokens += stats.finish_reason == "eos"
        return run()
