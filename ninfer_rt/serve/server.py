"""The HTTP layer of `ninfer-rt serve`: routes, authentication, CORS, request bodies, JSON and server-sent events.

Standard library only (http.server): one thread per connection reads and checks a request, prepares it (chat
template and tokens), queues it on the Worker and writes what comes back; generation itself runs on the thread
that called serve_forever (the one that loaded the model). Bodies are bounded (MAX_BODY), sockets time out
(IO_TIMEOUT_S), every refusal is a JSON error in the API's own shape, and a client that leaves mid-stream
cancels its generation.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import queue
import re
import select
import socket
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from ninfer_rt.errors import NinferError, json_reason
from ninfer_rt.serve import anthropic, openai
from ninfer_rt.serve.common import Job, RequestError, bad, choice_prepared, each_prompt, prepare, prompt_ids
from ninfer_rt.serve.replies import ReplyParser
from ninfer_rt.serve.worker import Worker

MAX_BODY = 32 << 20  # bytes of request body: a 262,144-token conversation is a few MB of JSON
IO_TIMEOUT_S = 120   # a client that sends or reads nothing for this long is dropped
_WATCH_S = 0.25      # how often a request waiting on its generation checks that its client is still there
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

# path -> (method, what it does); the Anthropic paths answer errors in Anthropic's shape
_ROUTES = {
    "/health": ("GET", "health"), "/v1/health": ("GET", "health"), "/v1/models": ("GET", "models"),
    "/v1/chat/completions": ("POST", "chat"), "/v1/completions": ("POST", "completion"),
    "/v1/messages": ("POST", "messages"), "/v1/messages/count_tokens": ("POST", "count_tokens"),
    "/tokenize": ("POST", "tokenize"), "/detokenize": ("POST", "detokenize"),  # vLLM's
    "/tokenizer_info": ("GET", "tokenizer_info"),
    "/metrics": ("GET", "metrics"),  # Prometheus
}
_GENERATORS = {"chat": (openai.parse_chat, openai.ChatReply, openai),
               "completion": (openai.parse_completion, openai.CompletionReply, openai),
               "messages": (anthropic.parse_messages, anthropic.MessagesReply, anthropic)}
_TOKEN_ONLY = ("count_tokens", "tokenize", "detokenize")  # answered at once: no generation, no queue
_ALLOWED_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta"
_PREPARING = 4  # requests rendered and tokenized at once (under the GIL more would only wait on each other)
_COUNTING = 2  # count_tokens / tokenize / detokenize at once, apart: any length, they must not hold up generation


def _printable(text: str) -> str:
    """text for the log with control characters escaped (a request line must not drive the operator's terminal)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def check_cors_origin(origin: str) -> str:
    """--cors-origin as browsers send Origin (RFC 6454): "*", or scheme://host[:port] with http or https and no
    path, lowercased as browsers serialize it; NinferError otherwise."""
    if origin == "*" or re.fullmatch(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?", origin):
        return origin.lower()
    raise NinferError(f"--cors-origin {origin!r}: give * or an origin such as https://app.example.com "
                      "(scheme, host and port; no path)")


def is_loopback(host: str) -> bool:
    """A loopback address or name (localhost and its subdomains, RFC 6761; any case, a trailing dot)."""
    name = host.strip("[]").rstrip(".").lower()
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return name == "localhost" or name.endswith(".localhost")


def authority(host: str, port: int) -> str:
    """host:port as a URL writes it: an IPv6 address in brackets (RFC 3986), http://[::1]:8080."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _front(target: str):
    """The API module whose shapes a request target's answers take: anthropic under /v1/messages, else openai."""
    return anthropic if urlsplit(target).path.startswith("/v1/messages") else openai


def _parse_body(data: bytes) -> dict:
    """A request body as a JSON object (400 for anything else: bad UTF-8, NaN, nesting past the parser's depth)."""
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise bad(f"the body is not valid JSON: {json_reason(e)}") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


class _Handler(BaseHTTPRequestHandler):
    """One connection; `app` (the Server) is set on a subclass."""

    server_version = "ninfer"
    protocol_version = "HTTP/1.1"
    timeout = IO_TIMEOUT_S
    app: Server
    _head, _allow = False, None  # this request is a HEAD; the Allow header of a 405 (set per request)

    def _do(self) -> None:
        self._dispatch(self.command)  # the request line's method, as parse_request read it

    # GET and POST routes, CORS preflights, HEAD (a GET route's status and headers, no body: monitors probe /health
    # so), and the methods HTTP defines that no route takes (a 405 with Allow, in the route's error shape)
    do_GET = do_POST = do_OPTIONS = do_HEAD = do_PUT = do_PATCH = do_DELETE = do_TRACE = _do

    def version_string(self) -> str:
        return self.server_version  # not the Python version

    def log_message(self, fmt: str, *args) -> None:  # http.server's own lines (bad request lines) go to our log
        self.app.log(_printable(f"{self.client_address[0]} {fmt % args}"))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, an unknown method, an oversized header) as JSON
        in the shape of the route's API (OpenAI's where the path is unknown), logged, and the connection closed:
        what follows on it cannot be trusted."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # refused before its version was read: answer with a status line
            self.request_version = "HTTP/1.0"
        message = message or self.responses.get(code, ("",))[0]
        words = (getattr(self, "requestline", "") or "").split()  # self.path is unset when the line was refused
        front = _front(words[1] if len(words) >= 2 else "")
        self.app.log(_printable(f"{self.client_address[0]} {code} {message}"))
        try:
            self._send_json(code, front.error_body(RequestError(code, message)))
        except OSError:
            pass

    def log_request(self, code="-", size="-") -> None:  # _dispatch logs each request once, with its tokens
        pass

    # ------------------------------------------------------------------------------------------------ routing

    def _dispatch(self, method: str) -> None:
        t0, self._note, self._streaming = time.perf_counter(), "", False
        self._head, self._allow = method == "HEAD", None
        path = urlsplit(self.path).path.rstrip("/") or "/"
        front = _front(path)
        status = 200
        try:
            status = self._route(method, path)
        except RequestError as e:
            status = e.status
            self._refuse(front, e)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            status, self.close_connection = 499, True  # the client left (nginx's code for it, in the log only)
        except Exception as e:  # a bug: 500 to the client, the traceback to the log
            self.app.log(traceback.format_exc().rstrip())
            status = 500
            self._refuse(front, RequestError(500, f"internal error: {type(e).__name__}", kind="api_error"))
        self.app.log(_printable(f"{self.client_address[0]} {method} {path} {status}{self._note} "
                                f"{time.perf_counter() - t0:.2f}s"))

    def _refuse(self, front, e: RequestError) -> None:
        """An error as JSON, or as the API's error event once a stream has begun; the connection then closes
        (a body left unread must not be taken for the next request)."""
        self.close_connection = True
        try:
            if self._streaming:
                self._write([front.stream_error(e)])
            else:
                self._send_json(e.status, front.error_body(e))
        except OSError:
            pass

    def _route(self, method: str, path: str) -> int:
        """Handle the request; returns the status sent (RequestError for refusals)."""
        if path.startswith("/v1/models/"):
            want, action = "GET", "model"
        elif path in _ROUTES:
            want, action = _ROUTES[path]
        else:
            raise RequestError(404, f"no route for {path}", kind="not_found_error")
        self._check_host_and_origin()
        if method != "POST" and (self.headers.get("Transfer-Encoding")
                                 or (self.headers.get("Content-Length") or "0").strip() != "0"):
            self.close_connection = True  # a body no GET reads: the reply ends the connection (RFC 9112 6.3)
        if method == "OPTIONS":
            return self._preflight()
        if method == "HEAD" and want == "GET":
            method = "GET"
        if method != want:
            self._allow = f"{want}, OPTIONS" if want == "POST" else f"{want}, HEAD, OPTIONS"
            raise RequestError(405, f"{path} takes {want}, not {method}")
        if action != "health":
            self._authenticate()
        if action == "health":
            return self._send_json(200, {"status": "ok"})
        if action == "metrics":
            return self._send_bytes(200, self.app.worker.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        if action == "tokenizer_info":
            return self._send_json(200, openai.tokenizer_info(self.app.model))
        if action == "models":
            return self._send_json(200, {"object": "list", "data": [self.app.model_card()]})
        if action == "model":
            name = unquote(path[len("/v1/models/"):])
            if name != self.app.model_name:
                raise RequestError(404, f"no model {name!r} here (this server runs {self.app.model_name!r})",
                                   kind="not_found_error")
            return self._send_json(200, self.app.model_card())
        if action not in _TOKEN_ONLY:
            self.app.worker.check_room()  # a full queue refuses before the body is read and prepared
        body = self._read_body()
        if action in _TOKEN_ONLY:  # any length (whether a conversation fits is what count_tokens is asked)
            with self.app.counting:
                if action == "count_tokens":
                    _, ids = prompt_ids(self.app.model, anthropic.parse_messages(body, count_only=True))
                    reply = {"input_tokens": len(ids)}
                else:
                    reply = openai.tokens_reply(self.app.model, action, body)
            return self._send_json(200, reply)
        with self.app.preparing:  # rendering and tokenizing are CPU work: a few at a time, not one per connection
            parse, reply, front = _GENERATORS[action]
            job: Job = parse(body)
            jobs = each_prompt(job)
            self._check_capacity(job, len(jobs))  # before the preparing: a batch that could never queue
            preparations = [self._prepare(one, k if len(jobs) > 1 else None) for k, one in enumerate(jobs)]
        return self._generate(job, preparations, reply, front)

    def _prepare(self, job: Job, k: int | None):
        """prepare(job); prompt k of a batch names itself in a refusal."""
        try:
            return prepare(self.app.model, job)
        except RequestError as e:
            if k is not None:
                e.message = f"prompt {k}: {e.message}"
            raise

    def _check_capacity(self, job: Job, prompts: int) -> None:
        """n choices of each prompt past --parallel + --max-queue could never all queue: a 400, not a 503 to retry."""
        capacity = self.app.worker.capacity
        if job.n * prompts > capacity:
            asked = f"n={job.n}" if prompts == 1 else f"{prompts} prompts x n={job.n}"
            raise bad(f"{asked} exceeds the {capacity} generations this server runs or queues at once (--parallel + "
                      "--max-queue)", "n" if prompts == 1 else "prompt")

    def _check_host_and_origin(self) -> None:
        """A server on a loopback address answers only requests addressed to a loopback name (a DNS-rebinding page
        names its own host), and no server answers a browser's cross-origin request unless --cors-origin allows
        that origin (a page could otherwise start generations with a plain form post). An HTTP/1.1 request names
        exactly one Host (RFC 9112 3.2)."""
        hosts = self.headers.get_all("Host") or []
        if len(hosts) > 1 or (not hosts and self.request_version == "HTTP/1.1"):
            raise bad(f"an HTTP/1.1 request has exactly one Host header (this one has {len(hosts)})")
        if is_loopback(self.app.address[0]):
            host = hosts[0] if hosts else ""  # none at all: not a browser (HTTP/1.0 clients may omit it)
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if host and not is_loopback(name):
                raise RequestError(403, f"Host {host!r} is not this machine: the server answers loopback names "
                                        "only (run it with --host to expose it)", kind="permission_error")
        origin = self.headers.get("Origin")
        if origin is not None and self.app.cors_origin not in ("*", origin):
            raise RequestError(403, f"requests from the web origin {origin!r} are not allowed (ninfer-rt serve "
                                    "--cors-origin)", kind="permission_error")

    def _authenticate(self) -> None:
        """With an API key set: Authorization: Bearer KEY (OpenAI) or x-api-key: KEY (Anthropic)."""
        key = self.app.api_key
        if key is None:
            return
        auth = self.headers.get("Authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else self.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise RequestError(401, "missing or wrong API key", kind="authentication_error")

    def _read_body(self) -> dict:
        """The request's JSON body, bounded by MAX_BODY and by Content-Length."""
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(411, "chunked request bodies are not supported: send Content-Length")
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            raise RequestError(411, "a POST needs a Content-Length header")
        if len(lengths) > 1 or not re.fullmatch(r"[0-9]{1,15}", lengths[0].strip()):
            raise bad("Content-Length must be one number of bytes")
        n = int(lengths[0])
        if n > MAX_BODY:  # its body stays unread (the refusal closes the connection)
            raise RequestError(413, f"the body is {n:,} bytes; the limit is {MAX_BODY:,}", kind="request_too_large")
        data = self.rfile.read(n)
        if len(data) < n:
            raise bad(f"the body ended after {len(data)} of {n} bytes")
        return _parse_body(data)

    # ------------------------------------------------------------------------------------------------ generation

    def _generate(self, job: Job, preparations: list, reply_class, front) -> int:
        """Queue and answer a request's prepared prompts (one, or a batched completion's), n choices of each, each
        choice a sequence of the batch (choice i of a prompt sampling with seed + i where a seed is given): whole,
        or as server-sent events. The text is split into reasoning, text and tool calls as it comes (a raw
        completion, with no thinking prompt and no tools, passes through as text)."""
        preps = [choice_prepared(prepared, i) for prepared in preparations for i in range(job.n)]
        n = len(preps)  # the request's choices, indexed prompt by prompt as OpenAI's batched completions are
        inbox: queue.Queue = queue.Queue()
        tickets = self.app.worker.submit_all(preps, inbox)
        replies = [reply_class(self.app.model_name, p, job) for p in preps]
        if n > 1:
            replies = front.choices(replies)
        parsers = [ReplyParser(thinking=p.thinking, tools=p.tools) for p in preps]
        for parser, p in zip(parsers, preps):
            parser.push(p.reply_prefix)  # a forced call's opening: an open block, so it makes no event yet
        stats: list = [None] * n
        try:
            if job.stream:
                self._start_stream()
                self._write([frame for r in replies for frame in r.start()])
            watched = time.monotonic()
            while None in stats:
                try:
                    i, (kind, value) = inbox.get(timeout=_WATCH_S)
                except queue.Empty:
                    kind = None
                if time.monotonic() - watched >= _WATCH_S:  # also while a stream holds its text back
                    watched = time.monotonic()
                    if self._client_gone():
                        raise ConnectionResetError("the client closed the connection")
                if kind is None:
                    continue
                reply = replies[i]
                if kind == "logprobs":  # each token's own text, a special one's too (vLLM: decode([id]))
                    tok, skip = self.app.model.tokenizer, preps[i].skip_special_tokens
                    shown = functools.partial(tok.text_bytes, skip_special_tokens=skip)  # what the text holds of it
                    reply.add_logprobs(value, tok.token_bytes, shown)
                    continue
                if kind == "admitted":  # it joined the batch; value: its prompt tokens read from a cache
                    if job.stream:
                        self._write(reply.admitted(value))
                    continue
                if kind == "piece":
                    frames = reply.events(parsers[i].push(value))
                    if job.stream:
                        self._write(frames)
                    continue
                if kind == "error":
                    if not job.stream:
                        raise value
                    self._write([front.stream_error(value)])
                    self._note = f" error: {value.message}"
                    return 200
                stats[i] = value
                frames = reply.events(parsers[i].finish())
                if job.stream:
                    self._write(frames + (reply.finish(value) if n == 1 else reply.close(value)))
            s = stats[0] if n == 1 else front.combined_stats(stats, job.n)
            self._note = (f" prompt {s.prompt_tokens} + {s.generated_tokens} tokens ({s.finish_reason}"
                          f"{f', {n} choices' if n > 1 else ''}), prefill {s.prefill_tok_s:.0f} tok/s, "
                          f"decode {s.decode_tok_s:.1f} tok/s")
            if job.stream:
                if n > 1:
                    self._write(replies[0].end(s))
                return 200
            return self._send_json(200, replies[0].body(s) if n == 1 else front.choices_body(replies, stats, job.n))
        finally:
            for ticket in tickets:
                ticket.cancelled.set()  # a no-op once it is done; else the worker stops at the next token

    def _client_gone(self) -> bool:
        """Whether the client closed its end (readable with nothing to read; a pipelined request is not that). A
        client that only shuts down its sending side reads the same: it is taken as gone, as nginx does."""
        try:
            if hasattr(select, "poll"):  # select.select cannot watch descriptors past 1023
                poller = select.poll()
                poller.register(self.connection, select.POLLIN | select.POLLHUP | select.POLLERR)
                if not poller.poll(0):
                    return False
            elif not select.select([self.connection], [], [], 0)[0]:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    # ------------------------------------------------------------------------------------------------ writing

    def _cors(self) -> None:
        origin = self.app.cors_origin
        if origin:
            self.send_header("Access-Control-Allow-Origin", origin)
            if origin != "*":
                self.send_header("Vary", "Origin")

    def _preflight(self) -> int:
        if not self.app.cors_origin:
            raise RequestError(405, "cross-origin requests are not enabled (ninfer-rt serve --cors-origin)")
        self.send_response(204)
        self._cors()
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", _ALLOWED_HEADERS)
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()
        return 204

    def _send_json(self, status: int, obj: dict) -> int:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace")  # a lone surrogate: \udXXX
        return self._send_bytes(status, data, "application/json; charset=utf-8")

    def _send_bytes(self, status: int, data: bytes, content_type: str) -> int:
        self.send_response(status)
        self._cors()
        self._request_id()
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self._allow:
            self.send_header("Allow", self._allow)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not self._head:
            self.wfile.write(data)
        return status

    def _request_id(self) -> None:
        """One id a response, under both APIs' header names (the SDKs show it as _request_id; the log does not
        need it: it names each request by its line)."""
        rid = f"req_{uuid.uuid4().hex[:24]}"
        self.send_header("request-id", rid)
        self.send_header("x-request-id", rid)

    def _start_stream(self) -> None:
        self._streaming = True
        self.send_response(200)
        self._cors()
        self._request_id()
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream's end is the connection's end: no chunked framing
        self.end_headers()
        self.close_connection = True

    def _write(self, frames: list[bytes]) -> None:
        if frames:
            self.wfile.write(b"".join(frames))
            self.wfile.flush()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True      # a stuck connection never holds the process at exit
    request_queue_size = 64

    def handle_error(self, request, client_address) -> None:
        """A client that resets its connection between requests (or a TCP health probe that connects and resets)
        is no error of ours: socketserver would print a traceback for it. Anything else is still printed."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            return
        super().handle_error(request, client_address)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class Server:
    """`ninfer-rt serve`: the HTTP front ends over one loaded Model. serve_forever() blocks on the calling thread,
    which must be the one that loaded the model (it runs the generations); shutdown() may come from any thread."""

    def __init__(self, model, *, model_name: str, host: str = "127.0.0.1", port: int = 8080,
                 api_key: str | None = None, cors_origin: str | None = None, max_queue: int = 32,
                 parallel: int = 1, prefill_chunk: int | None = None, log=None):
        self.model, self.model_name, self.api_key, self.cors_origin = model, model_name, api_key, cors_origin
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.worker = Worker(model, max_queue, self.log, parallel=parallel, prefill_chunk=prefill_chunk)
        self.preparing = threading.BoundedSemaphore(_PREPARING)
        self.counting = threading.BoundedSemaphore(_COUNTING)
        handler = type("Handler", (_Handler,), {"app": self})
        try:
            self.httpd = (_HTTPServer6 if ":" in host else _HTTPServer)((host, port), handler)
        except OSError as e:
            raise NinferError(f"cannot listen on {authority(host, port)}: {e.strerror or e}") from None
        self.created = int(time.time())

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on (the port the OS chose when port was 0)."""
        return self.httpd.server_address[:2]

    def model_card(self) -> dict:
        """The /v1/models entry of the served model."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "ninfer",
                "max_model_len": self.model.context_length}

    def serve_forever(self) -> None:
        """Answer HTTP on a background thread and run generations here until shutdown() or an interrupt."""
        http = threading.Thread(target=self.httpd.serve_forever, name="ninfer-http", daemon=True)
        http.start()
        try:
            self.worker.run()
        finally:
            self.httpd.shutdown()
            self.httpd.server_close()

    def shutdown(self) -> None:
        """Stop serving (from any thread): running and waiting requests get 503, and serve_forever returns."""
        self.worker.stop()
