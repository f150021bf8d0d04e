"""`ninfer-rt serve` on the GPU, as a user runs it: the CLI in a process of its own (the CUDA context on its main
thread, HTTP handlers on theirs), requests over loopback HTTP.

Oracle: the library on the same GPU and artifact. Each reply's text is what Model.generate gives the same prompt
alone, for prompts whose greedy paths meet no near-tie (test_mtp.clear_prompt: top-2 gaps >= 1e-2, far above the
~1e-4 by which a batched step's rounding moves a logit) and no stop id, so that batched and speculative steps must
pick the same tokens.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_client import http_request, sse_data

from .test_mtp import clear_prompt

pytestmark = pytest.mark.gpu

TOKENS = 16
TIMEOUT_S = 120  # start-up (kernels are cached by the earlier tests' build) and each request


class ServeProcess:
    """`python -m ninfer_rt.cli serve ARTIFACT --device cuda --port 0 ...`, its stderr drained on a thread; the
    bound address read from its 'serving ... on http://HOST:PORT' line."""

    def __init__(self, artifact, *options: str, device: str = "cuda"):
        self.proc = subprocess.Popen([sys.executable, "-m", "ninfer_rt.cli", "serve", str(artifact), "--device",
                                      device, "--port", "0", "--max-context", "512", "--kv-cache", "bf16", *options],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, errors="replace")
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not (m := next(filter(None, (re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+) \((\w+)", line)
                                           for line in list(self.lines))), None)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail("serve did not start:\n" + "".join(self.lines[-20:]))
            time.sleep(0.1)
        self.port, self.device = int(m.group(1)), m.group(2)

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        """(status, bytes) of one request, body sent as JSON."""
        data = None if body is None else json.dumps(body).encode()
        status, _, reply = http_request("127.0.0.1", self.port, method, path, data,
                                        {"Content-Type": "application/json"} if data else None, timeout=TIMEOUT_S)
        return status, reply

    def post(self, path: str, body: dict) -> tuple[int, bytes]:
        return self.request("POST", path, body)

    def get(self, path: str) -> tuple[int, bytes]:
        return self.request("GET", path)

    def stop(self) -> int:
        """Ctrl-C, as a user stops it (exit 130 after the cleanups, console.py); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(TIMEOUT_S)
        finally:
            self._reader.join(TIMEOUT_S)


def completion(ids: list[int], **extra) -> dict:
    return {"prompt": ids, "max_tokens": TOKENS, "temperature": 0, **extra}


def streamed_text(data: bytes) -> str:
    """The text of an OpenAI completions event stream (its chunks' choices, in order), checked to end in [DONE]."""
    frames = sse_data(data)
    assert frames and frames[-1] == "[DONE]"
    return "".join(c["text"] for f in frames[:-1] for c in f["choices"])


@pytest.fixture(scope="module")
def greedy_texts(gpu, artifact):  # gpu: skipped without one
    """(prompts, the library's greedy text for each alone): the first 3 prompt seeds whose greedy paths are clear
    (test_mtp.clear_prompt: no top-2 gap under MARGIN, no stop id)."""
    from ninfer_rt.api import load
    from ninfer_rt.sampling import SamplingParams

    with load(artifact, "cuda", max_ctx=512, kv_dtype="bf16") as plain:
        seeds = iter(range(1000, 1400))  # shared: three distinct prompts
        prompts = [clear_prompt(plain._backend, TOKENS, plain.real_vocab_size, seeds, length=12 + 5 * i,
                                is_stop=plain.tokenizer.is_stop)[0] for i in range(3)]
        texts = ["".join(plain.generate(p, max_new_tokens=TOKENS, sampling=SamplingParams(greedy=True),
                                        skip_special_tokens=True))  # serve's default, as vLLM's
                 for p in prompts]
    return prompts, texts


def test_serve_on_the_gpu_batches_requests_as_the_library_generates_alone(artifact, greedy_texts):
    """Three concurrent completions (one streamed) decode together in batched steps; each reply is the library's
    text for its prompt alone, with its usage; a malformed request between them is a 400 and the server goes on;
    Ctrl-C ends the process cleanly."""
    prompts, texts = greedy_texts
    srv = ServeProcess(artifact, "--parallel", "3", "--no-prefix-snapshot")
    try:
        assert srv.device == "cuda"
        bodies = [completion(prompts[0]), completion(prompts[1], stream=True), completion(prompts[2])]
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda b: srv.post("/v1/completions", b), bodies))
        assert [status for status, _ in replies] == [200, 200, 200], replies
        first, third = json.loads(replies[0][1]), json.loads(replies[2][1])
        got = [first["choices"][0]["text"], streamed_text(replies[1][1]), third["choices"][0]["text"]]
        assert got == texts
        assert first["usage"]["prompt_tokens"] == len(prompts[0]) and first["usage"]["completion_tokens"] == TOKENS
        assert first["choices"][0]["finish_reason"] == "length"
        status, body = srv.post("/v1/completions", {"prompt": prompts[0], "max_tokens": "many"})
        assert status == 400 and b"max_tokens" in body
        status, body = srv.post("/v1/completions", completion(prompts[2]))
        assert status == 200 and json.loads(body)["choices"][0]["text"] == texts[2]
        status, metrics = srv.get("/metrics")
        assert status == 200
    finally:
        code = srv.stop()
    assert code == 130, "".join(srv.lines[-20:])  # console.py: Ctrl-C exits 130
    assert not any("Traceback" in line for line in srv.lines), "".join(srv.lines)
    generated = re.search(rb"^ninfer_generation_tokens_total (\d+)", metrics, re.M)
    assert generated and int(generated.group(1)) == 4 * TOKENS, metrics.decode()


def test_serve_on_the_gpu_with_speculation_answers_as_plain_decoding(artifact, greedy_texts):
    """--speculative-tokens 2: a lone request drafts with the MTP head (mostly refused: the tiny head is random)
    and verifies on the GPU, and still answers the library's plain greedy text."""
    prompts, texts = greedy_texts
    srv = ServeProcess(artifact, "--parallel", "1", "--speculative-tokens", "2")
    try:
        got = []
        for p in prompts[:2]:
            status, body = srv.post("/v1/completions", completion(p))
            assert status == 200, body
            got.append(json.loads(body)["choices"][0]["text"])
        status, metrics = srv.get("/metrics")
    finally:
        code = srv.stop()
    assert got == texts[:2]
    assert code == 130, "".join(srv.lines[-20:])  # console.py: Ctrl-C exits 130
    drafted = re.search(rb"^ninfer_draft_tokens_total (\d+)", metrics, re.M)
    assert drafted and int(drafted.group(1)) > 0, metrics.decode()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_run_on_the_gpu_prints_what_the_library_generates(gpu, artifact, sampling):
    """`ninfer-rt run` (device auto: the GPU) prints exactly the library's text for the same request on the same
    GPU: greedy, and the checkpoint's sampling defaults with a seed (drawn on the device, Philox per (seed, step));
    its stats line says it ran on cuda."""
    from ninfer_rt.api import load
    from ninfer_rt.sampling import SamplingParams, requested_sampling

    text = "The GPU path of ninfer, end to end"
    args = ["--greedy"] if sampling == "greedy" else ["--seed", "5"]
    out = subprocess.run([sys.executable, "-m", "ninfer_rt.cli", "run", str(artifact), "--prompt", text,
                          "--max-new-tokens", str(TOKENS), "--max-context", "512", "--kv-cache", "bf16", *args],
                         capture_output=True, text=True, errors="replace", timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    with load(artifact, "cuda", max_ctx=512, kv_dtype="bf16") as m:
        params = SamplingParams(greedy=True) if sampling == "greedy" else requested_sampling(m.generation_config,
                                                                                               seed=5)
        want = "".join(m.generate(text, max_new_tokens=TOKENS, sampling=params, skip_special_tokens=True))
    assert out.stdout == want + "\n"  # run leaves special tokens out unless --special
    assert re.search(r"generated \d+ tokens, decode [\d.]+ tok/s.* on cuda", out.stderr), out.stderr
