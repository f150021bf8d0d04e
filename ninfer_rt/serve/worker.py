"""The generation worker: continuous batching of the queued requests, on the thread that loaded the model.

HTTP handlers run in their own threads; they prepare a request (template, tokens: see common.prepare) and hand it
here as a Ticket. The worker runs on the thread it was started from (the GPU backend's CUDA context is current on
the loading thread only): it moves waiting tickets into the model's Batch as it has room (`parallel` sequences at
once), steps the batch, and sends each ticket its pieces through its own queue. A handler whose client went away
cancels its ticket, and the sequence leaves the batch at the next step.
"""

from __future__ import annotations

import collections
import queue
import threading
import traceback
from dataclasses import dataclass, field

from ninfer_rt.batching import check_batch
from ninfer_rt.errors import NinferError
from ninfer_rt.serve.common import Prepared, RequestError

_POLL_S = 0.2  # how often an idle worker looks at its stop flag (signals reach the main thread in between)


def _shutting_down() -> RequestError:
    return RequestError(503, "the server is shutting down", kind="overloaded_error")


@dataclass(eq=False)  # a ticket is itself: hashed by identity
class Ticket:
    """One queued generation. out receives ("admitted", cached prompt tokens) when it joins the batch, then
    ("piece", str) items (and ("logprobs", [TokenLogprob]) before the pieces of those tokens, where asked), then
    ("done", GenerationStats) or ("error", RequestError)."""

    prepared: Prepared
    out: queue.Queue | Tagged = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Tagged:
    """A ticket's out that puts (index, item) into a queue it shares with its request's other choices."""

    inbox: queue.Queue
    index: int

    def put(self, item) -> None:
        self.inbox.put((self.index, item))


class Worker:
    """Runs Tickets up to `parallel` at a time in one batch; at most max_queue wait behind them (more: 503,
    overloaded). model.batch(parallel, prefill_chunk) gives the Batch (ninfer_rt.batching) it steps (prefill_chunk
    None: batching.PREFILL_CHUNK)."""

    def __init__(self, model, max_queue: int, log=None, parallel: int = 1, prefill_chunk: int | None = None):
        check_batch(model, parallel, prefill_chunk)  # a server whose batch cannot be made refuses to start
        self.model, self.max_queue, self.parallel = model, max_queue, parallel
        self.prefill_chunk = prefill_chunk
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.stopping = threading.Event()
        self.log = log or (lambda line: None)
        self._lock = threading.Condition()
        self._outstanding = 0  # tickets waiting or running
        self._running: dict[Ticket, object] = {}  # ticket -> its batching.Generation
        # /metrics counters since start, under the lock: generations by how they ended, and their tokens
        self.ended = {"done": 0, "error": 0, "cancelled": 0}
        self.tokens = {"prompt": 0, "prompt_cached": 0, "generated": 0, "drafted": 0, "accepted": 0}

    def _refusal(self, n: int = 1) -> RequestError | None:
        """Why n generations cannot queue now (called with the lock held), or None."""
        if self.stopping.is_set():
            return _shutting_down()
        if self._outstanding + n > self.capacity:
            return RequestError(503, f"the server is busy: {self.parallel} requests are generating and "
                                     f"{self.max_queue} are waiting; try again later", kind="overloaded_error")
        return None

    @property
    def capacity(self) -> int:
        """Generations that may be outstanding at once: running (--parallel) and waiting (--max-queue)."""
        return self.parallel + self.max_queue

    def check_room(self) -> None:
        """RequestError 503 when a request could not queue now: asked before its body is read and prepared."""
        with self._lock:
            refusal = self._refusal()
        if refusal is not None:
            raise refusal

    def submit_all(self, prepared: list[Prepared], inbox: queue.Queue | None = None) -> list[Ticket]:
        """Queue the generations of one request together (n choices), or none of them (RequestError 503 when the
        batch is full and max_queue already wait). With inbox, ticket i's items arrive there as (i, item)
        (Tagged)."""
        with self._lock:  # the shutdown's drain cannot pass between the check and the append
            refusal = self._refusal(len(prepared))
            if refusal is not None:
                raise refusal
            self._outstanding += len(prepared)
            tickets = [Ticket(p) if inbox is None else Ticket(p, Tagged(inbox, i)) for i, p in enumerate(prepared)]
            self.waiting.extend(tickets)
            self._lock.notify()
        return tickets

    def run(self) -> None:
        """Serve tickets until stop() (or an exception such as KeyboardInterrupt, which propagates); the tickets
        still waiting or running then get a 503 each."""
        batch = self.model.batch(self.parallel, self.prefill_chunk)
        try:
            while True:
                with self._lock:
                    while not (self.stopping.is_set() or self.waiting or self._running):
                        self._lock.wait(_POLL_S)
                    if self.stopping.is_set():
                        break
                    # a queued request whose client left gives its place back now, not when it would have joined
                    gone = [t for t in self.waiting if t.cancelled.is_set()]
                    for ticket in gone:
                        self.waiting.remove(ticket)
                        self._end(ticket)
                    joining = [self.waiting.popleft() for _ in range(min(batch.free, len(self.waiting)))]
                for ticket in joining:
                    self._join(batch, ticket)
                for ticket, g in list(self._running.items()):
                    if ticket.cancelled.is_set():
                        batch.cancel(g)
                if batch.busy:
                    try:
                        batch.step()
                    except Exception as e:  # a bug outside any one forward: every running request gets a 500
                        for g in self._running.values():
                            g.done, g.error = True, e
                        # the slots' contents are unknown: start afresh
                        batch = self.model.batch(self.parallel, self.prefill_chunk)
                self._deliver()
        finally:
            with self._lock:
                self.stopping.set()
                for ticket in [*self._running, *self.waiting]:
                    ticket.out.put(("error", _shutting_down()))
                self._running.clear()
                self.waiting.clear()

    def stop(self) -> None:
        """Stop: the running generations at their next step, the waiting ones at once (each answered 503)."""
        self.stopping.set()

    def _join(self, batch, ticket: Ticket) -> None:
        """Start a ticket in the batch (a cancelled one, or one the batch refuses, ends here)."""
        p = ticket.prepared
        if ticket.cancelled.is_set():
            self._end(ticket)
            return
        try:
            # a request that extends an earlier one's prompt and reply (an agent's next turn after a tool call)
            # prefills only what is new; one that shares a chat's history (its next turn) starts from its snapshot
            g = self._running[ticket] = batch.add(p.ids, max_new_tokens=p.max_tokens, sampling=p.sampling,
                                                  stop=p.stop, snapshot_at=p.snapshot_at, logprobs=p.logprobs,
                                                  prompt_logprobs=p.prompt_logprobs, json_schema=p.json_schema,
                                                  skip_special_tokens=p.skip_special_tokens)
            ticket.out.put(("admitted", g.stats.cached_tokens))
        except NinferError as e:
            self._end(ticket, ("error", RequestError(400, str(e))))
        except Exception as e:  # a bug: the request gets a 500, the log the traceback, and the server goes on
            self._end(ticket, self._internal(e))

    def _deliver(self) -> None:
        """Send each running ticket its new pieces, and the final item of those that ended."""
        for ticket, g in list(self._running.items()):
            if ticket.prepared.logprobs is not None:
                entries = g.take_prompt_logprobs() + g.take_logprobs()  # before the text they belong with
                if entries:
                    ticket.out.put(("logprobs", entries))
            for piece in g.take():
                ticket.out.put(("piece", piece))
            if not g.done:
                continue
            del self._running[ticket]
            if ticket.cancelled.is_set():  # its client left (the batch cancelled it): no reply, no token counts
                self._end(ticket)
            elif g.error is None:
                self._end(ticket, ("done", g.stats))
            elif isinstance(g.error, NinferError):  # e.g. the sampler refused the logits it got
                self._end(ticket, ("error", RequestError(400, str(g.error))))
            else:
                self._end(ticket, self._internal(g.error))

    def _internal(self, e: BaseException) -> tuple:
        """A bug's final item: a 500 naming only the exception's type; the traceback goes to the log."""
        self.log("".join(traceback.format_exception(e)).rstrip())
        return ("error", RequestError(500, f"internal error: {type(e).__name__}", kind="api_error"))

    def _end(self, ticket: Ticket, final: tuple | None = None) -> None:
        """A ticket leaves: one fewer outstanding, its counts in the metrics, then its final item (none for a
        cancelled one, whose handler has gone): a client that has its reply finds it in /metrics."""
        with self._lock:
            self._outstanding -= 1
            self.ended["cancelled" if final is None else final[0]] += 1
            if final is not None and final[0] == "done":
                stats = final[1]
                self.tokens["prompt"] += stats.prompt_tokens
                self.tokens["prompt_cached"] += stats.cached_tokens
                self.tokens["generated"] += stats.generated_tokens
                self.tokens["drafted"] += stats.draft_tokens
                self.tokens["accepted"] += stats.accepted_tokens
        if final is not None and not ticket.cancelled.is_set():
            ticket.out.put(final)

    def metrics(self) -> str:
        """The counters and the queue as Prometheus' text exposition format (`GET /metrics`)."""
        with self._lock:
            running, waiting = len(self._running), len(self.waiting)
            ended, tokens = dict(self.ended), dict(self.tokens)
        rows = [("ninfer_requests_running", "gauge", "Generations in the batch now.", [("", running)]),
                ("ninfer_requests_waiting", "gauge", "Generations queued behind them.", [("", waiting)]),
                ("ninfer_requests_total", "counter", "Generations ended since start, by how they ended.",
                 [(f'{{outcome="{k}"}}', v) for k, v in ended.items()]),
                ("ninfer_prompt_tokens_total", "counter", "Prompt tokens of the finished generations.",
                 [("", tokens["prompt"])]),
                ("ninfer_prompt_tokens_cached_total", "counter", "Of those, tokens taken from a kept cache "
                 "instead of prefilled.", [("", tokens["prompt_cached"])]),
                ("ninfer_generation_tokens_total", "counter", "Tokens generated by the finished generations.",
                 [("", tokens["generated"])]),
                ("ninfer_draft_tokens_total", "counter", "Tokens the MTP head drafted for them (--speculative-tokens).",
                 [("", tokens["drafted"])]),
                ("ninfer_draft_tokens_accepted_total", "counter", "Of those, drafts the verifications kept.",
                 [("", tokens["accepted"])])]
        out = []
        for name, kind, help_, samples in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *(f"{name}{lab} {v}" for lab, v in samples)]
        return "\n".join(out) + "\n"

