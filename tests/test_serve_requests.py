"""ninfer-rt serve: tool calls and reasoning in both APIs (scripted replies), refusals, authentication, CORS, the
queue, cancellation, and the CLI end to end.

The scripted model is the tiny artifact's Model (its template, tokenizer and context) whose generate yields a
known text in known pieces: the oracle for what the server must make of it.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from serve_client import TIMEOUT_S, Running, Scripted, ScriptedBatch, sse_data, sse_events

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>")
REPLY = "The user asks for the weather.\n</think>\n\nLet me check.\n\n" + CALL


@pytest.fixture(scope="module")
def model(packed_model):
    return packed_model


# ----------------------------------------------------------------------------------------------- tool calls


def test_openai_reasoning_text_and_tool_call(model):
    with Running(Scripted(model, REPLY)) as r:
        status, body = r.json("/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "max_tokens": 500})
        message = body["choices"][0]["message"]
        assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"
        assert message["reasoning_content"] == "The user asks for the weather."
        assert message["content"] == "Let me check."
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
        # streamed: the same pieces as deltas, the call in one delta at index 0
        status, _, data = r.request("POST", "/v1/chat/completions", {"messages": USER, "tools": [WEATHER],
                                                                      "stream": True})
        deltas = [e["choices"][0]["delta"] for e in sse_data(data)[:-1]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user asks for the weather."
        assert "".join(d.get("content", "") for d in deltas) == "Let me check."
        (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert calls[0]["index"] == 0 and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
        assert sse_data(data)[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_tools_the_call_stays_text(model):
    with Running(Scripted(model, REPLY)) as r:
        body = r.json("/v1/chat/completions", {"messages": USER, "tool_choice": "none", "tools": [WEATHER]})[1]
        message = body["choices"][0]["message"]
        assert message["content"] == "Let me check.\n\n" + CALL and "tool_calls" not in message
        assert body["choices"][0]["finish_reason"] == "stop"
        # tool_choice none: the tools are not offered either (the prompt is the chat's without them)
        assert r.server.model.prompts[-1] == model.prompt_ids(messages=USER)


def test_anthropic_thinking_text_and_tool_use(model):
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    with Running(Scripted(model, REPLY)) as r:
        status, body = r.json("/v1/messages", {"messages": USER, "tools": tools, "max_tokens": 500,
                                               "thinking": {"type": "adaptive"}})
        assert status == 200 and body["stop_reason"] == "tool_use"
        thinking, text, tool = body["content"]
        assert thinking == {"type": "thinking", "thinking": "The user asks for the weather.", "signature": ""}
        assert text == {"type": "text", "text": "Let me check."}
        assert tool["type"] == "tool_use" and tool["name"] == "get_weather"
        assert tool["input"] == {"city": "Paris", "days": 3} and tool["id"].startswith("toolu_")
        status, _, data = r.request("POST", "/v1/messages", {"messages": USER, "tools": tools, "max_tokens": 500,
                                                             "stream": True, "thinking": {"type": "enabled"}})
        events = sse_events(data)
        starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
        assert starts == ["thinking", "text", "tool_use"]
        partial = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"
                   and d["delta"]["type"] == "input_json_delta"]
        assert [json.loads(p) for p in partial] == [{"city": "Paris", "days": 3}]
        # every block that starts stops, at its own index, in order
        opened = [d["index"] for n, d in events if n == "content_block_start"]
        closed = [d["index"] for n, d in events if n == "content_block_stop"]
        assert opened == closed == [0, 1, 2]
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_max_tokens_cut_reports_length(model):
    with Running(Scripted(model, REPLY, step=1)) as r:
        body = r.json("/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "max_tokens": 10})[1]
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["message"]["reasoning_content"] == REPLY[:10]
        body = r.json("/v1/messages", {"messages": USER, "max_tokens": 10})[1]
        assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 10


# ----------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v1/chat/completions", {"messages": []}, 400, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1"),
    ("/v1/chat/completions", {"messages": USER, "temperature": 3}, 400, "'temperature' must be a number in [0, 2]"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 0}, 400, "'top_p' must be a number in (0, 1]"),
    ("/v1/chat/completions", {"messages": USER, "n": 0}, 400, "'n' must be an integer in [1, 16]"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "'n' must be an integer in [1, 16]"),
    ("/v1/chat/completions", {"messages": USER, "stream": "yes"}, 400, "'stream' must be a boolean, got string"),
    ("/v1/chat/completions", {"messages": USER, "seed": -1}, 400, "'seed' must be an integer in [0, "),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 3}, 400, "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "any", "tools": [WEATHER]}, 400,
     "tool_choice must be 'auto', 'none', 'required' or a function"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "'image_url' content is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400, "is not valid JSON"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"enable_thinking": "no"}}, 400,
     "chat_template_kwargs.enable_thinking must be true, false or null"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 20000}]}, 400,
     "prompt is too long: "),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": [1] * 5000}, 400, "prompt is too long: 5000 tokens > "),  # token ids too
    ("/v1/completions", {"prompt": [[2], [1] * 5000]}, 400, "prompt 1: prompt is too long: 5000 tokens > "),
    ("/v1/completions", {"prompt": ""}, 400, "'prompt' must be a non-empty string"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix and best_of are not supported"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens 0 generates nothing: it needs echo"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "'echo' must be a boolean, got string"),
    ("/v1/messages", {"messages": USER}, 400, "'max_tokens' is required"),
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "temperature": 1.5}, 400, "'temperature' must be a number"),
    ("/v1/messages", {"messages": [{"role": "system", "content": "x"}], "max_tokens": 5}, 400,
     "role 'user' or 'assistant'"),
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "thinking": {"type": "sometimes"}}, 400,
     "thinking.type must be"),
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "tools": [{"type": "web_search_20250305",
                                                                    "name": "web_search"}]}, 400,
     "Anthropic-defined tool 'web_search_20250305' is not supported: give a custom tool"),
])
def test_bad_requests_get_one_line_in_the_apis_shape(srv, path, body, status, fragment):
    got, reply = srv.json(path, body)
    assert got == status
    message = reply["error"]["message"]
    assert fragment in message and "\n" not in message and "Traceback" not in message
    if path.startswith("/v1/messages"):
        assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    else:  # OpenAI's code names a prompt past the context (clients trim on it), else null
        code = "context_length_exceeded" if "prompt is too long" in message else None
        assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["code"] == code


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "the body is not valid JSON"),
    (b"[1, 2]", "the body must be a JSON object"),
    (b'{"messages": NaN}', "the body is not valid JSON"),
    (b"\xff\xfe", "the body is not valid JSON"),
    (b"[" * 100000 + b"]" * 100000, "the body is not valid JSON: nested too deeply"),
    (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "the body is not valid JSON: an integer of more than 4300 digits"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": -1' + b"0" * 4299 + b"}",
     "'max_tokens' must be"),  # 4,300 digits parse: the field refuses the value
], ids=["not-json", "array", "nan", "not-utf8", "deep", "5001-digits", "4300-digits"])
def test_malformed_bodies(srv, raw, fragment):
    """The JSON parser's refusals in one line of our own words (Python's name sys.* or end mid-sentence)."""
    status, _, data = srv.request("POST", "/v1/chat/completions", raw=raw,
                                  headers={"Content-Type": "application/json"})
    message = json.loads(data)["error"]["message"]
    assert status == 400 and fragment in message and "sys." not in message and "recursion" not in message


def raw_http(srv, head: bytes, body: bytes = b"") -> bytes:
    """Send bytes on a fresh connection; what comes back before the server closes it (bounded)."""
    with socket.create_connection(srv.server.address, timeout=TIMEOUT_S) as s:
        s.sendall(head + body)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_bodies_are_bounded_and_need_a_length(srv):
    from ninfer_rt.serve.server import MAX_BODY

    big = raw_http(srv, f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n"
                   .encode())
    assert big.startswith(b"HTTP/1.1 413") and b"request_too_large" in big
    none = raw_http(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert none.startswith(b"HTTP/1.1 411")
    short = raw_http(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\n\r\n", b"{}")
    assert short.startswith(b"HTTP/1.1 400") and b"the body ended after 2 of 50 bytes" in short


def test_routes_and_methods(srv):
    assert srv.json("/v1/nothing", {})[0] == 404
    status, body = srv.json("/v1/chat/completions", method="GET")
    assert status == 405 and "takes POST, not GET" in body["error"]["message"]
    assert srv.request("OPTIONS", "/v1/models")[0] == 405  # no CORS unless asked for
    assert srv.server.address[0] == "127.0.0.1"  # localhost unless told otherwise


def test_api_key_and_cors(model):
    with Running(model, api_key="s3cret", cors_origin="https://app.example") as r:
        assert r.json("/v1/models", method="GET")[0] == 401
        status, body = r.json("/v1/messages", {"messages": USER, "max_tokens": 1})
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert r.json("/v1/models", method="GET", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert r.json("/v1/models", method="GET", headers={"Authorization": "Bearer s3cret"})[0] == 200
        assert r.json("/v1/models", method="GET", headers={"x-api-key": "s3cret"})[0] == 200
        assert r.json("/health", method="GET")[0] == 200  # health checks need no key
        status, headers, _ = r.request("OPTIONS", "/v1/chat/completions")
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "x-api-key" in headers["Access-Control-Allow-Headers"]
        status, headers, _ = r.request("GET", "/v1/models", headers={"x-api-key": "s3cret"})
        assert headers["Access-Control-Allow-Origin"] == "https://app.example"


# ----------------------------------------------------------------------------------------------- queue and cancel


class Holding(Scripted):
    """The scripted model whose tokenizing of a text holding "HOLD" waits for release (counts how many wait)."""

    def __init__(self, model):
        super().__init__(model, "ok")
        self.release, self.held, self._lock = threading.Event(), 0, threading.Lock()

    def prompt_ids(self, prompt):
        if isinstance(prompt, str) and "HOLD" in prompt:
            with self._lock:
                self.held += 1
            self.release.wait(TIMEOUT_S)
        return self._model.prompt_ids(prompt)


def test_token_counting_never_holds_up_generation(model):
    """count_tokens and tokenize take any length (an 8 MB text tokenizes for seconds): however many are being
    tokenized, a generation's request is still prepared and answered."""
    holding = Holding(model)
    big = {"messages": [{"role": "user", "content": "HOLD"}]}
    with Running(holding) as r:
        results = []
        counters = [threading.Thread(target=lambda path, body: results.append(r.json(path, body)), args=args)
                    for args in [("/v1/messages/count_tokens", big)] * 3 + [("/tokenize", {"prompt": "HOLD"})] * 3]
        for t in counters:
            t.start()
        deadline = time.monotonic() + TIMEOUT_S
        while holding.held < 2 and time.monotonic() < deadline:  # two tokenize at once; the rest wait their turn
            time.sleep(0.01)
        try:
            status, body = r.json("/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                           "chat_template_kwargs": {"enable_thinking": False}})
            assert status == 200 and body["choices"][0]["message"]["content"] == "ok"
            assert 2 <= holding.held < len(counters)  # the counters were still held while it was answered
        finally:
            holding.release.set()
            for t in counters:
                t.join(TIMEOUT_S)
        assert sorted(status for status, _ in results) == [200] * len(counters)


def test_a_full_queue_answers_503_and_a_client_that_leaves_cancels(model):
    slow = Scripted(model, "x" * 400, step=1, delay=0.01)
    with Running(slow, max_queue=0) as r:
        body = json.dumps({"messages": USER, "stream": True, "max_tokens": 1000}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        s = socket.create_connection(r.server.address, timeout=TIMEOUT_S)
        s.sendall(head + body)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")  # the stream has started: one generation running
        status, reply = r.json("/v1/chat/completions", {"messages": USER})
        assert status == 503 and reply["error"]["type"] == "overloaded_error"
        s.close()  # the client leaves mid-stream
        deadline = time.monotonic() + TIMEOUT_S
        while r.server.worker._outstanding and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.server.worker._outstanding == 0 and slow.taken < 400  # stopped early, the slot is free
        status, reply = r.json("/v1/chat/completions", {"messages": USER, "max_tokens": 3})
        assert status == 200 and reply["choices"][0]["message"]["reasoning_content"] == "xxx"
        status, _, data = r.request("GET", "/metrics")
    ended = dict(ln.rsplit(" ", 1) for ln in data.decode().splitlines() if ln.startswith("ninfer_requests_total"))
    # the client that left mid-stream is a cancelled generation, not a finished one; the 503 never started one
    assert {k: float(v) for k, v in ended.items()} == {'ninfer_requests_total{outcome="done"}': 1,
                                                       'ninfer_requests_total{outcome="error"}': 0,
                                                       'ninfer_requests_total{outcome="cancelled"}': 1}


def _open_stream(r, body: dict) -> socket.socket:
    """A streamed request on a raw socket, its 200 read (the request is queued or running)."""
    data = json.dumps({**body, "stream": True}).encode()
    s = socket.create_connection(r.server.address, timeout=TIMEOUT_S)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n".encode()
              + data)
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    return s


def test_a_queued_request_whose_client_leaves_gives_its_place_back(model):
    """--parallel 1, --max-queue 1: one request runs, one waits and its client leaves. The waiting place is free
    again while the first still runs (it was held, with 503s for everyone, until a slot freed): a third request
    queues instead of a 503, and gets its reply once the first ends."""
    slow = Scripted(model, "x" * 400, step=1, delay=0.01)
    with Running(slow, max_queue=1) as r:
        first = _open_stream(r, {"prompt": "Hi", "max_tokens": 1000})
        _open_stream(r, {"prompt": "Hi", "max_tokens": 5}).close()
        worker, deadline = r.server.worker, time.monotonic() + TIMEOUT_S
        while worker._outstanding > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker._outstanding == 1 and not worker.waiting and slow.taken < 400  # the first still runs
        got = []
        third = threading.Thread(target=lambda: got.append(r.json("/v1/completions",
                                                                   {"prompt": "Hi", "max_tokens": 3})))
        third.start()
        while worker._outstanding < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        first.close()
        third.join(TIMEOUT_S)
    assert got and got[0][0] == 200 and got[0][1]["choices"][0]["text"] == "xxx"


def test_requests_generate_together_up_to_parallel(model):
    """Three requests at once with --parallel 2: two share the batch's steps, the third waits for a free slot,
    and each gets the whole reply."""
    slow = Scripted(model, "y" * 30, step=1, delay=0.02)
    with Running(slow, parallel=2) as r:
        got = []
        threads = [threading.Thread(target=lambda: got.append(r.json("/v1/completions", {"prompt": "Hi", "max_tokens": 99})))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
    assert [(status, body["choices"][0]["text"]) for status, body in got] == [(200, "y" * 30)] * 3
    assert slow.most == 2


# ----------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                             (signal.SIGINT, 130, "interrupted")])
def test_cli_serves_until_a_signal(packed, tmp_path, sig, code, said):
    key = tmp_path / "key"
    key.write_text("k3y\n")
    proc = subprocess.Popen([sys.executable, "-m", "ninfer_rt.cli", "serve", str(packed), "--device", "cpu",
                             "--port", "0", "--api-key-file", str(key)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    try:
        line, deadline = "", time.monotonic() + TIMEOUT_S
        while "serving" not in line and time.monotonic() < deadline:
            if select.select([proc.stderr], [], [], 1.0)[0]:
                line = proc.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert m, line
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", int(m.group(1)), timeout=TIMEOUT_S)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 3}),
                     headers={"Authorization": "Bearer k3y"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["prompt_tokens"] >= 1
        proc.send_signal(sig)
        assert proc.wait(TIMEOUT_S) == code
        rest = proc.stderr.read()
        assert said in rest and "Traceback" not in rest
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("args, fragment", [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--api-key-file", "/nonexistent/key"], "No such file or directory"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--parallel", "0"], "--parallel must be in [1, 63], got 0"),
    (["--parallel", "64"], "--parallel must be in [1, 63], got 64"),
    (["--parallel", "65", "--no-prefix-snapshot"], "--parallel must be in [1, 64], got 65"),
    (["--api-key-file", "KEYFILE"], "the key must be printable ASCII"),
])
def test_cli_refuses_bad_options_in_one_line(packed, capsys, tmp_path, args, fragment):
    from cli_runner import run_main
    from ninfer_rt import cli

    key = tmp_path / "key"
    key.write_text("clé\n", encoding="utf-8")
    args = [str(key) if a == "KEYFILE" else a for a in args]
    code, out, err = run_main(cli.main, "ninfer-rt", ["serve", packed, "--device", "cpu", *args], capsys)
    assert code != 0 and fragment in err and len(err.strip().splitlines()) == 1


def test_cli_port_in_use_is_one_line(packed, capsys):
    from cli_runner import run_main
    from ninfer_rt import cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_main(cli.main, "ninfer-rt", ["serve", packed, "--device", "cpu", "--port", port], capsys)
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1


def test_serving_thread_is_the_generating_thread(model):
    """Generation runs on the thread that called serve_forever (the GPU context is current only there)."""
    seen = []

    class Recording(ScriptedBatch):
        def step(self):
            seen.append(threading.current_thread())
            return super().step()

    class Scripts(Scripted):
        def batch(self, parallel=None, prefill_chunk=None):
            return Recording(self, parallel or 1)

    with Running(Scripts(model, "ok")) as r:
        r.json("/v1/completions", {"prompt": "Hi"})
        assert seen and set(seen) == {r.thread}


def test_anthropic_thinks_only_where_asked(model):
    """As in the Messages API, a reply holds thinking blocks only where the request asked (enabled or adaptive):
    without a thinking field the prompt is the template's no-thinking one."""
    oracle = {False: model.prompt_ids(messages=USER, enable_thinking=False),
              True: model.prompt_ids(messages=USER, enable_thinking=True)}
    assert oracle[False] != oracle[True]
    with Running(Scripted(model, "Hello.")) as r:
        for thinking, think in ((None, False), ({"type": "disabled"}, False), ({"type": "enabled"}, True),
                                ({"type": "adaptive", "budget_tokens": 2048}, True)):
            body = {"messages": USER, "max_tokens": 20, **({"thinking": thinking} if thinking else {})}
            status, reply = r.json("/v1/messages", body)
            assert status == 200 and r.server.model.prompts[-1] == oracle[think], thinking
            assert [b["type"] for b in reply["content"]] == (["thinking"] if think else ["text"])


def test_anthropic_usage_counts_cached_tokens_once(model):
    """input_tokens + cache_read_input_tokens + cache_creation_input_tokens is the prompt (Anthropic's rule); the
    stream's message_delta carries the same counts as the whole reply."""
    with Running(model) as r:
        first = {"messages": USER, "max_tokens": 3, "temperature": 0}
        status, a = r.json("/v1/messages", first)
        turn = USER + [{"role": "assistant", "content": a["content"][0]["text"] if a["content"] else "ok"},
                       {"role": "user", "content": "And then?"}]
        for stream in (False, True):
            status, _, data = r.request("POST", "/v1/messages", {**first, "messages": turn, "stream": stream})
            usage = (json.loads(data) if not stream else sse_events(data)[-2][1])["usage"]
            prompt = len(model.prompt_ids(messages=turn, enable_thinking=False))
            assert status == 200 and usage["cache_creation_input_tokens"] == 0
            assert usage["cache_read_input_tokens"] > 0  # the history came from the first turn's snapshot
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt, usage


def test_serve_prefill_chunk_sets_the_batchs_step(model, monkeypatch):
    """--prefill-chunk reaches serve's batch: a joining prompt is fed that many tokens a forward (it once reached
    only load, and serve fed 2,048 a step whatever it said)."""
    sizes, real = [], model._backend.forward

    def forward(ids, cache, **kw):
        sizes.append(len(ids))
        return real(ids, cache, **kw)

    monkeypatch.setattr(model._backend, "forward", forward)
    prompt = "Numbers such as 12, 345 and 2026 are split into single digits before the merges are applied."
    n = len(model.tokenizer.encode(prompt))
    with Running(model, prefill_chunk=5) as r:
        status, body = r.json("/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert status == 200 and n - cached > 10
    assert sizes == [5] * ((n - cached) // 5) + ([(n - cached) % 5] if (n - cached) % 5 else []), sizes


@pytest.mark.parametrize("path, field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"),
                                         ("/v1/messages", "messages")])
def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(srv, monkeypatch, path, field):
    """A text whose bytes alone need more tokens than the context holds is refused by Tokenizer.least_tokens
    without tokenizing it (a 30 MB body took a preparation slot for a minute): "at least N tokens", N no more
    than /tokenize's count and at least the context; the tokenizer's encode is never called for it."""
    tokenizer, context = srv.server.model.tokenizer, srv.json("/tokenize", {"prompt": "x"})[1]["max_model_len"]
    text = "The quick brown fox. " * 64
    text *= -(-context // tokenizer.least_tokens(text))  # the least bytes that cannot fit, whatever the context
    count = srv.json("/tokenize", {"prompt": text})[1]
    monkeypatch.setattr(tokenizer, "encode", lambda _: pytest.fail("a prompt that cannot fit was tokenized"))
    body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    status, out = srv.json(path, {**body, "max_tokens": 4})
    message = out["error"]["message"]
    least = int(re.fullmatch(r"prompt is too long: at least (\d+) tokens > (\d+) maximum .*", message).group(1))
    assert status == 400 and count["max_model_len"] <= least <= count["count"], (message, count)


def test_a_server_whose_batch_cannot_be_made_refuses_to_start(model):
    """parallel past the model's cache slots (load's cache_slots): the Server refuses when made, before it binds a
    port, in Batch's words; serve_forever raised it only once clients were connecting."""
    from ninfer_rt.errors import NinferError
    from ninfer_rt.serve.server import Server

    slots = model._backend.cache_slots
    with pytest.raises(NinferError, match=rf"^parallel={slots + 1}: must be in \[1, {slots}\] \(the model's "):
        Server(model, model_name="tiny", port=0, parallel=slots + 1)
