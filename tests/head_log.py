"""HeadLog: a speculative backend wrapper that records the MTP head's calls (tests of what the head is fed)."""


class HeadLog:
    """A backend that records each MTP head call: (the head cache's position, the ids fed, the picks, chain)."""

    def __init__(self, backend):
        self.inner, self.calls = backend, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, hidden, next_ids, draft_cache, top1=None, chain=0):
        start = draft_cache.pos
        picks, out = self.inner.draft(hidden, next_ids, draft_cache, top1=top1, chain=chain)
        self.calls.append((start, [int(t) for t in next_ids], [int(t) for t in picks], chain))
        return picks, out
