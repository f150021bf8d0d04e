"""ninfer-rt serve against hostile or broken clients: connections reused after an error, malformed framing,
clients that leave, foreign Host and Origin headers, http.server's own refusals, shutdown with requests waiting,
a failure after a stream began, terminal escapes in the log; and Anthropic's assistant prefill.

Every exchange is raw bytes on a loopback socket, bounded by a timeout.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from ninfer_rt import sandbox
from ninfer_rt.sandbox import TEMPLATE_HELPERS
from serve_client import TIMEOUT_S, Running, Scripted, ScriptedBatch, sse_events

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model(packed_model):
    return packed_model


def exchange(srv, data: bytes, shut: bool = True) -> bytes:
    """Send raw bytes; everything that comes back until the server closes (or the timeout). shut: close our
    sending side after them, which ends a keep-alive connection but also reads as a client gone: not for
    requests that generate (post() asks the server to close instead)."""
    with socket.create_connection(srv.server.address, timeout=TIMEOUT_S) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
            f"{extra}\r\n").encode() + body


def responses(data: bytes) -> list[int]:
    """Status codes of the HTTP responses in data, in order."""
    return [int(line.split()[1]) for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.")]


def test_an_error_closes_the_connection_so_an_unread_body_is_never_a_request(srv):
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    for path in ("/v1/nothing", "/v1/models"):  # 404, and 405 (a POST to a GET route): the body is not read
        keep_alive = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(smuggled)}\r\n\r\n"
        got = exchange(srv, keep_alive.encode() + smuggled)
        assert responses(got) == [404 if path == "/v1/nothing" else 405] and b'"object": "list"' not in got
    # a body that was read leaves the connection usable: two requests on one connection, two answers
    conn = http.client.HTTPConnection(*srv.server.address, timeout=TIMEOUT_S)
    for _ in range(2):
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 1}))
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["object"] == "text_completion"
    conn.close()


def test_a_body_no_get_reads_ends_the_connection(srv):
    """A GET may carry a body (requests sends json={} as two bytes): the reply closes the connection, so that body
    is never read as the next request, and a client's next request on a fresh connection is answered."""
    smuggled = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    head = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(smuggled)}\r\n\r\n".encode()
    got = exchange(srv, head + smuggled, shut=False)
    assert responses(got) == [200] and b"Connection: close" in got and b'"object": "list"' in got
    conn = http.client.HTTPConnection(*srv.server.address, timeout=TIMEOUT_S)
    for method, path, body in (("GET", "/v1/models", b"{}"), ("GET", "/health", b"{}"),
                               ("POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 1}')):
        conn.request(method, path, body=body)  # http.client opens a new connection after a close
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())
    conn.close()


def test_an_http_1_1_request_has_one_host(srv):
    """RFC 9112 3.2: no Host, or two, is a 400 (HTTP/1.0 may leave it out)."""
    for host in (b"", b"Host: 127.0.0.1\r\nHost: evil.example\r\n"):
        got = exchange(srv, b"GET /v1/models HTTP/1.1\r\n" + host + b"\r\n")
        assert responses(got) == [400] and b"exactly one Host header" in got
    assert responses(exchange(srv, b"GET /v1/models HTTP/1.0\r\n\r\n")) == [200]


@pytest.mark.parametrize("length", ["\xb2", "9" * 5000, "-5", "1e3", "12, 12"])
def test_content_length_must_be_one_number(srv, length):
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n\r\n"
    got = exchange(srv, head.encode("latin-1") + b"{}")
    assert responses(got) == [400] and b"Content-Length must be one number of bytes" in got
    two = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}"
    assert responses(exchange(srv, two.encode())) == [400]
    assert not any("Traceback" in line for line in srv.lines)


@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"FOO /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 501),  # a method HTTP does not define
    (b"GET /health HTTP/2.0\r\n\r\n", 505),
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET /health HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431),
])
def test_http_servers_own_refusals_are_json(srv, raw, status):
    """Refused by http.server before any route: JSON in the path's API shape (Anthropic's under /v1/messages), and
    a line in the log."""
    for path in (b"/health", b"/v1/messages"):
        got = exchange(srv, raw.replace(b"/health", path))
        head, _, body = got.partition(b"\r\n\r\n")
        assert responses(head) == [status] and b"application/json" in head
        reply = json.loads(body)
        assert reply["error"]["message"]
        assert (reply.get("type") == "error") == (path == b"/v1/messages" and b"/health" in raw)
        assert any(line.split()[1:2] == [str(status)] for line in srv.lines), srv.lines[-3:]


def test_foreign_hosts_and_origins_are_refused(model, srv):
    rebind = b"GET /v1/models HTTP/1.1\r\nHost: rebind.attacker.example\r\n\r\n"
    got = exchange(srv, rebind)
    assert responses(got) == [403] and b"permission_error" in got
    for host in ("localhost", f"localhost:{srv.server.address[1]}", "127.0.0.1", "[::1]:8080", "LOCALHOST",
                 "Localhost:8080", "localhost.", "127.0.0.1.", "app.localhost", "127.0.0.2"):
        assert responses(exchange(srv, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())) == [200]
    assert responses(exchange(srv, b"GET /health HTTP/1.0\r\n\r\n")) == [200]  # no Host at all: not a browser
    form = post("/v1/completions", b'{"prompt": "Hi"}', "Origin: https://evil.example\r\nContent-Type: text/plain\r\n")
    assert responses(exchange(srv, form)) == [403]
    with Running(model, cors_origin="https://app.example") as r:
        ok = post("/v1/completions", b'{"prompt": "Hi", "max_tokens": 1}', "Origin: https://app.example\r\n")
        assert responses(exchange(r, ok, shut=False)) == [200]
        assert responses(exchange(r, form)) == [403]


def test_server_header_and_log_say_no_more_than_they_should(srv):
    got = exchange(srv, b"GET /\x1b[2J\x1b]0;TITLE\x07x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert b"\r\nServer: ninfer\r\n" in got and b"Python" not in got
    assert any("\\x1b[2J" in line for line in srv.lines) and not any("\x1b" in line for line in srv.lines)


def wait_idle(r: Running) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while r.server.worker._outstanding and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("stream, text", [(False, "x" * 600), (True, "<tool_call>\n" + "y" * 600)],
                         ids=["whole", "stream-holding-a-call"])
def test_a_client_that_leaves_stops_its_generation(model, stream, text):
    """Gone while a whole reply is generated, or while a stream holds text back (an open tool-call block): the
    generation stops within a few watch periods, and the slot serves the next request."""
    slow = Scripted(model, text, step=1, delay=0.01)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with Running(slow) as r:
        body = json.dumps({"messages": USER, "stream": stream, "max_tokens": 1000, "tools": tools,
                           "chat_template_kwargs": {"enable_thinking": False}}).encode()
        s = socket.create_connection(r.server.address, timeout=TIMEOUT_S)
        s.sendall(post("/v1/chat/completions", body))
        time.sleep(0.5)
        s.close()
        wait_idle(r)
        assert r.server.worker._outstanding == 0 and slow.taken < 300
        assert responses(exchange(r, post("/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}'), shut=False)) == [200]


def test_shutdown_answers_every_request(model):
    slow = Scripted(model, "z" * 100, step=1, delay=0.01)
    r = Running(slow).__enter__()
    results = []

    def ask():
        results.append(responses(exchange(r, post("/v1/completions", b'{"prompt": "Hi", "max_tokens": 100}'),
                                          shut=False)))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    r.__exit__(None, None, None)
    for t in threads:
        t.join(TIMEOUT_S)
    # the running generation stops at its next token, the waiting ones at once: each is answered 503
    assert results == [[503]] * 3 and 0 < slow.taken < 100


def test_a_failure_after_the_stream_began_is_an_error_event(model):
    class BrokenBatch(ScriptedBatch):
        def step(self):
            if self.s.taken:
                raise RuntimeError("a bug in a backend")
            super().step()

    class Broken(Scripted):
        def batch(self, parallel=None, prefill_chunk=None):
            return BrokenBatch(self, parallel or 1)

    with Running(Broken(model, "fine" * 3, step=4)) as r:
        body = json.dumps({"messages": USER, "max_tokens": 5, "stream": True}).encode()
        got = exchange(r, post("/v1/messages", body), shut=False)
        head, _, stream = got.partition(b"\r\n\r\n")
        assert responses(got) == [200] and b"HTTP/1.1 500" not in stream
        events = sse_events(stream)
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
        assert b"fine" in stream and any("RuntimeError: a bug in a backend" in line for line in r.lines)


def test_anthropic_prefill_is_continued(model):
    """A final assistant message is continued: the prompt ends with its text (not a closed turn and a new
    thinking one), and the reply is read as text."""
    scripted = Scripted(model, ' 42}')
    with Running(scripted) as r:
        status, body = r.json("/v1/messages", {"max_tokens": 20, "messages": [
            {"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": '{"a":'}]})
        prompt = model.tokenizer.decode(scripted.prompts[-1])
        assert status == 200 and prompt.endswith('{"a":') and "<think>\n\n</think>\n\n{\"a\":" in prompt
        assert body["content"] == [{"type": "text", "text": " 42}"}]
        # words that also stand in the template's closing tokens: the prompt still ends right after the prefill
        for prefill in ("<", "im", "end", "_end", ">", "|"):
            status, _ = r.json("/v1/messages", {"max_tokens": 5, "messages": [
                {"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": prefill}]})
            got = model.tokenizer.decode(scripted.prompts[-1])
            assert status == 200 and got.endswith("<think>\n\n</think>\n\n" + prefill), (prefill, got[-40:])
        # OpenAI: vLLM's continue_final_message
        status, body = r.json("/v1/chat/completions", {"continue_final_message": True, "messages": [
            {"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": '{"a":'}]})
        assert status == 200 and model.tokenizer.decode(scripted.prompts[-1]) == prompt
        assert body["choices"][0]["message"]["content"] == " 42}"


def test_count_tokens_counts_past_the_context(srv, model):
    long = [{"role": "user", "content": "hello " * 5000}]
    status, body = srv.json("/v1/messages/count_tokens", {"messages": long})
    assert status == 200 and body["input_tokens"] == len(model.prompt_ids(messages=long, enable_thinking=False)) > \
        model.context_length


@pytest.mark.parametrize("body, fragment", [
    ({"messages": USER, "chat_template_kwargs": {"self": 1}}, "may not set 'self'"),
    ({"messages": USER, "chat_template_kwargs": {"namespace": 1}}, "may not set 'namespace'"),
    ({"messages": USER, "chat_template_kwargs": {"raise_exception": 1}}, "may not set 'raise_exception'"),
    ({"messages": USER, "stop": ["\ud800"]}, "lone surrogate"),
    ({"messages": USER, "logit_bias": {"5": -100}}, "logit_bias is not supported"),
])
def test_more_bad_fields(srv, body, fragment):
    status, reply = srv.json("/v1/chat/completions", body)
    assert status == 400 and fragment in reply["error"]["message"]
    assert reply["error"]["param"] == next(k for k in ("stop", "logit_bias", "chat_template_kwargs") if k in body)


def test_every_response_names_a_request_id(srv):
    """request-id and x-request-id (the Anthropic and OpenAI SDKs' _request_id), one fresh id a response."""
    ids = []
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": {}}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True}),
                       ("/v1/completions", {"prompt": ""})):
        status, headers, _ = srv.request("POST", path, body)
        assert headers["request-id"] == headers["x-request-id"] and headers["request-id"].startswith("req_")
        ids.append(headers["request-id"])
    assert len(set(ids)) == 3


def test_template_helpers_are_the_sandboxs_globals():
    """The names chat_template_kwargs may not replace are exactly what every template sees besides its variables."""
    assert set(sandbox.environment().globals) == TEMPLATE_HELPERS


def test_tools_nested_past_the_template_are_one_line(srv):
    """A tool schema deeper than the renderer recurses: the template's RecursionError as our one line."""
    deep = '{"a": ' * 900 + "1" + "}" * 900  # json.loads reads it; json.dumps cannot write it
    body = ('{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "tools": [{"type": "function", '
            '"function": {"name": "f", "parameters": ' + deep + "}}]}")
    status, _, data = srv.request("POST", "/v1/chat/completions", raw=body.encode(),
                                  headers={"Content-Type": "application/json"})
    message = json.loads(data)["error"]["message"]
    assert status == 400 and "nest too deeply" in message and "Recursion" not in message, message


def test_lenient_where_clients_differ(srv):
    status, body = srv.json("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "tool_choice": None})
    assert status == 200
    assert srv.json("/v1/models/tiny%20x", method="GET")[0] == 404
    assert srv.json("/v1/models/%74iny", method="GET") == (200, srv.json("/v1/models/tiny", method="GET")[1])


DEEP = "[" * 100_000  # nesting past json's recursion limit


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/chat/completions", {"messages": USER, "temperature": 10 ** 400}, "'temperature' must be a number in"),
    ("/v1/messages", {"messages": USER, "max_tokens": 2, "top_p": -10 ** 400}, "'top_p' must be a number in"),
    ("/v1/messages", {"messages": [{"role": "user", "content": []}], "max_tokens": 2},
     "messages[0].content must not be empty"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": []}]}, "must not be empty"),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role must be one of"),
    ("/v1/chat/completions", {"messages": USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": DEEP}}]}]}, "arguments is not valid JSON"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
     "'messages[0].tool_call_id' must be a string"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": {"a": 1}, "content": "x"}]}]},
     "'messages[0].content[0].tool_use_id' must be a string"),
    ("/v1/messages", {"max_tokens": 2, "messages": USER + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": 7, "name": "f", "input": {}}]}]}, "'messages[1].content[0].id' must be a string"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": 3, "text": "x"}]}]},
     "messages[0].content[0].type must be a string"),
])
def test_fields_that_once_raised_are_a_400_naming_them(srv, path, body, fragment):
    """Each of these was a 500 (an exception past the checks: OverflowError, KeyError, IndexError, TypeError,
    RecursionError) or passed unchecked; now a 400 in the path's shape whose message names the field."""
    status, reply = srv.json(path, body)
    message = reply["error"]["message"]
    assert status == 400 and fragment in message and "\n" not in message, reply
    assert (reply.get("type") == "error") == path.startswith("/v1/messages")


def test_a_block_without_a_type_is_text(srv):
    """As in OpenAI's parts here, a content block with no type reads as a text block (it raised a KeyError)."""
    blocks = [{"role": "user", "content": [{"text": "Hi"}]}]
    status, reply = srv.json("/v1/messages", {"messages": blocks, "max_tokens": 2})
    assert status == 200 and reply["type"] == "message"
    assert srv.json("/v1/messages/count_tokens", {"messages": blocks})[1] == \
        srv.json("/v1/messages/count_tokens", {"messages": USER})[1]


@pytest.mark.parametrize("method, path, status, allow", [
    ("HEAD", "/health", 200, None), ("HEAD", "/v1/models", 200, None),
    ("DELETE", "/v1/messages", 405, "POST, OPTIONS"), ("PUT", "/v1/chat/completions", 405, "POST, OPTIONS"),
    ("PATCH", "/health", 405, "GET, HEAD, OPTIONS"), ("HEAD", "/v1/messages", 405, "POST, OPTIONS"),
])
def test_other_methods(srv, method, path, status, allow):
    """HEAD is GET without the body; a method the path does not take is a 405 with Allow, in the path's error
    shape (http.server answered these 501 in OpenAI's shape, with a body on HEAD)."""
    c = http.client.HTTPConnection(*srv.server.address, timeout=TIMEOUT_S)
    try:
        c.request(method, path, headers={"Host": "127.0.0.1"})
        r = c.getresponse()
        body = r.read()
        assert r.status == status and r.getheader("Allow") == allow
        if method == "HEAD":
            assert body == b"" and int(r.getheader("Content-Length")) > 0
        else:
            reply = json.loads(body)
            assert (reply.get("type") == "error") == path.startswith("/v1/messages") and "takes" in body.decode()
    finally:
        c.close()


def test_a_connection_reset_between_requests_is_no_traceback(srv, capfd):
    """A keep-alive client that resets after a full reply, and a TCP health probe that connects and resets, are
    quiet: socketserver printed a 17-line traceback for each (the next request line's read was reset)."""
    import struct

    def reset(s):  # RST instead of FIN: linger on with a zero timeout
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()

    capfd.readouterr()
    s = socket.create_connection(srv.server.address, timeout=TIMEOUT_S)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    time.sleep(0.2)  # the handler is back in its read of the next request line
    reset(s)
    probe = socket.create_connection(srv.server.address, timeout=TIMEOUT_S)
    time.sleep(0.2)
    reset(probe)
    time.sleep(0.5)
    assert srv.request("GET", "/health")[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
