"""The generation worker: one sequence at a time, on the thread that loaded the model.

HTTP handlers run in their own threads; they prepare a request (template, tokens: see common.prepare) and hand it
here as a Ticket. The worker runs tickets in arrival order on the thread it was started from: the GPU backend's
CUDA context is current on the loading thread only, and the model holds one sequence's cache. A ticket's pieces
come back through its own queue; a handler whose client went away cancels it, and the run stops at the next token.
"""

from __future__ import annotations

import queue
import threading
import traceback
from dataclasses import dataclass, field

from ninfer_rt.errors import NinferError
from ninfer_rt.serve.common import Prepared, RequestError

_POLL_S = 0.2  # how often an idle worker looks at its stop flag (signals reach the main thread in between)


def _shutting_down() -> RequestError:
    return RequestError(503, "the server is shutting down", kind="overloaded_error")


@dataclass
class Ticket:
    """One queued generation. out receives ("piece", str) items, then ("done", GenerationStats) or
    ("error", RequestError)."""

    prepared: Prepared
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker:
    """Runs Tickets one at a time; at most max_queue wait behind the running one (more: 503, overloaded)."""

    def __init__(self, model, max_queue: int, log=None):
        self.model, self.max_queue = model, max_queue
        self.tickets: queue.Queue[Ticket] = queue.Queue()
        self.stopping = threading.Event()
        self.log = log or (lambda line: None)
        self._lock = threading.Lock()
        self._outstanding = 0  # tickets queued or running

    def _refusal(self) -> RequestError | None:
        """Why a request cannot queue now (called with the lock held), or None."""
        if self.stopping.is_set():
            return _shutting_down()
        if self._outstanding > self.max_queue:
            return RequestError(503, f"the server is busy: one request is generating and {self.max_queue} are "
                                     "waiting; try again later", kind="overloaded_error")
        return None

    def check_room(self) -> None:
        """RequestError 503 when a request could not queue now: asked before its body is read and prepared."""
        with self._lock:
            refusal = self._refusal()
        if refusal is not None:
            raise refusal

    def submit(self, prepared: Prepared) -> Ticket:
        """Queue a prepared request; RequestError 503 when max_queue already wait behind a running one."""
        with self._lock:  # with the queue's put inside, so the shutdown's drain cannot pass between them
            refusal = self._refusal()
            if refusal is not None:
                raise refusal
            self._outstanding += 1
            ticket = Ticket(prepared)
            self.tickets.put(ticket)
        return ticket

    def run(self) -> None:
        """Serve tickets until stop() (or an exception such as KeyboardInterrupt, which propagates); the tickets
        still waiting then get a 503 each."""
        try:
            while not self.stopping.is_set():
                try:
                    ticket = self.tickets.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                try:
                    if not ticket.cancelled.is_set():
                        self._generate(ticket)
                finally:
                    with self._lock:
                        self._outstanding -= 1
        finally:
            with self._lock:
                self.stopping.set()
                while True:
                    try:
                        ticket = self.tickets.get_nowait()
                    except queue.Empty:
                        break
                    ticket.out.put(("error", _shutting_down()))

    def stop(self) -> None:
        """Stop: the running generation at its next token, the waiting ones at once (each answered 503)."""
        self.stopping.set()

    def _generate(self, ticket: Ticket) -> None:
        """Run one ticket, streaming its pieces; every way it ends puts exactly one final item."""
        p = ticket.prepared
        try:
            # reuse_cache: a request that extends the last one's prompt and reply (an agent's next turn after a tool
            # call) prefills only what is new; one that shares its history (a chat's next turn) starts there
            pieces = self.model.generate(p.ids, max_new_tokens=p.max_tokens, sampling=p.sampling, stop=p.stop,
                                         reuse_cache=True, snapshot_at=p.snapshot_at)
            for piece in pieces:
                if ticket.cancelled.is_set() or self.stopping.is_set():
                    pieces.close()
                    break
                ticket.out.put(("piece", piece))
            ticket.out.put(("error", _shutting_down()) if self.stopping.is_set() else ("done", self.model.last_stats))
        except NinferError as e:  # e.g. the sampler refused the logits it got
            ticket.out.put(("error", RequestError(400, str(e))))
        except Exception as e:  # a bug: the request gets a 500, the log the traceback, and the server goes on
            self.log(traceback.format_exc().rstrip())
            ticket.out.put(("error", RequestError(500, f"internal error: {type(e).__name__}", kind="api_error")))
