"""Stop strings over streamed text: what may be shown now, and where a stop string ends the text.

Text arrives in pieces (detokenized tokens). A piece's tail that could still grow into a stop string is held back
until the next piece settles it, so no client ever sees the beginning of a stop string that then completes.
"""

from __future__ import annotations

from ninfer_rt.errors import NinferError


def overlap(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with (0 when none)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def stop_strings(stop) -> list[str]:
    """A `stop` argument as a list: one string, or a list or tuple of non-empty strings (NinferError otherwise; a
    string is one stop, never its characters)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, (list, tuple)) else None
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise NinferError(f"stop must be a non-empty string or a list of them, got {stop!r}"[:200])
    return stops


class StopScanner:
    """Feed text pieces with push(); each returns what can be shown now. Once a stop string appears, `stop` names
    it, push returns the text before it and ignores everything after; finish() returns the held tail otherwise.

    Only the held tail is kept: a stop string, or a prefix of one, never starts in text already returned (that
    text was released only once no stop string could begin there), so each push scans the tail alone."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""      # text not returned yet
        self.stop: str | None = None

    def push(self, piece: str) -> str:
        """The text that can be shown after piece: all of it, less a tail that may begin a stop string."""
        if self.stop is not None:
            return ""
        self.held += piece
        hit, stop = min(((j, s) for s, j in ((s, self.held.find(s)) for s in self.stops) if j >= 0),
                        default=(-1, None))
        if hit >= 0:
            self.stop = stop
            out, self.held = self.held[:hit], ""
            return out
        keep = max((overlap(self.held, s) for s in self.stops), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> str:
        """The held tail, once no more text comes (empty after a stop string)."""
        out, self.held = self.held, ""
        return out
