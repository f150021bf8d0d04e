"""What every generation loop shares: its GenerationStats, and `emit`, which hands the sampled ids out."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """Timings and counts of one generate call.

    generated_tokens counts every sampled token, the stop token included (it cost a forward like the others);
    token_ids holds the output without the stop token. finish_reason: "eos" (a stop id), "stop" (a stop
    string), "length" (max_new_tokens or the context end), "cancelled" (the caller stopped iterating), or in a
    Batch "error" (the generation failed: Generation.error).
    """

    prompt_tokens: int
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = "cancelled"
    token_ids: list[int] = field(default_factory=list)
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")
    cached_tokens: int = 0          # prompt tokens taken from the previous generation's cache (reuse_cache)
    draft_tokens: int = 0           # speculative decoding: tokens the MTP head drafted
    accepted_tokens: int = 0        # ... and how many of them verification kept

    @property
    def acceptance(self) -> float:
        """Share of the drafted tokens that were kept (0 without speculative decoding)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens per second of the prefill (which includes sampling the first token)."""
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first sampled token (one forward each; several a forward when drafted)."""
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


def emit(tokens: Iterable[int], stats: GenerationStats, history: list[int], budget: int,
         is_stop: Callable[[int], bool]) -> Generator[int, None, bool]:
    """Yield sampled ids as output, in order, counting each in stats (the stop id too) and appending it to
    history; returns True once the generation is over: a stop id (not yielded) or budget output ids."""
    for tok in tokens:
        stats.generated_tokens += 1
        if is_stop(tok):
            stats.finish_reason = "eos"
            return True
        stats.token_ids.append(tok)
        history.append(tok)
        yield tok
        if len(stats.token_ids) >= budget:
            stats.finish_reason = "length"
            return True
    return False
