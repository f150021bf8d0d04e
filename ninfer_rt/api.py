"""The runtime's Python API: `load` an artifact, then `logits` or streaming `generate`.

    model = load("model.ninfer")                       # device "cpu": the PyTorch reference, fp32
    for piece in model.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=64):
        print(piece, end="", flush=True)
    model.last_stats                                   # prompt/generated tokens, prefill s, decode tok/s

Generation prefills the prompt once, then decodes token by token against the cache. It stops on the tokenizer's
stop ids (<|im_end|>, <|endoftext|>, generation_config's eos), on a stop string, or after max_new_tokens.
Vocabulary rows past the tokenizer's last id (the embedding is padded, e.g. 248,320 rows for 248,077 ids) are
masked so they are never sampled. This module stays numpy-only: torch lives behind the reference backend.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Iterator, Mapping, Sequence, Set
from os import PathLike

import numpy as np

from ninfer_rt import speculative
from ninfer_rt.errors import FormatError, NinferError
from ninfer_rt.format import Artifact
from ninfer_rt.generation import GenerationStats, emit
from ninfer_rt.hostmem import available_memory, check_fits
from ninfer_rt.sampling import Sampler, SamplingParams
from ninfer_rt.stops import StopScanner, stop_strings

DEVICES = ("cpu", "cuda", "auto")
MAX_CACHE_SLOTS = 64  # sequences a model keeps at once (each a KV cache and DeltaNet state on the GPU)


class _KeptCaches:
    """What reuse_cache generations leave for the next: the last run's cache with the ids fed into it (resident)
    and a copy of a prompt's first tokens (snapshot), each an entry (cache, ids, slot, ticket) in its own backend
    slot. The recurrent state cannot rewind, so an entry serves only a prompt that extends its ids.

    Every run and copy claims its slot with a new ticket; an entry is valid while its slot's owner is still its
    ticket. On a backend whose slots are device memory (exclusive_slots, the GPU) a run whose slot was claimed
    by a later one (an interleaved generation, logits()) stops with an error instead of decoding another state."""

    def __init__(self, model: Model):
        self.model = model  # its backend may be swapped (tests wrap it): read it at each use
        self.resident = self.snapshot = None
        self.owner: dict[int, int] = {}  # per slot: the ticket that last wrote it (none yet: absent)
        self._tickets = itertools.count(1)

    @property
    def backend(self):
        return self.model._backend

    def claim(self, slot: int) -> int:
        """A new ticket for slot: whatever held the slot before is no longer valid."""
        self.owner[slot] = ticket = next(self._tickets)
        return ticket

    def _valid(self, entry) -> bool:
        return entry is not None and self.owns(entry[2], entry[3])

    def owns(self, slot: int, ticket: int) -> bool:
        """Whether the run holding ticket still owns slot."""
        return self.owner.get(slot, 0) == ticket

    def fresh(self) -> tuple[object, int, int, int]:
        """(an empty cache, 0, its slot, the run's ticket); everything kept is dropped."""
        self.resident = self.snapshot = None
        return self.backend.new_cache(0), 0, 0, self.claim(0)

    def take(self, ids: list[int]) -> tuple[object, int, int, int]:
        """(cache, tokens of ids already in it, slot, the run's ticket): the longest kept entry that ids extend,
        else an empty cache in a slot the snapshot does not hold. The resident is handed over either way."""
        fits = [e for e in (self.resident, self.snapshot) if self._valid(e) and len(e[1]) < len(ids)
                and ids[:len(e[1])] == e[1]]
        best = max(fits, key=lambda e: len(e[1]), default=None)
        if best is self.snapshot or not self._valid(self.snapshot):
            self.snapshot = None  # taken (its slot is the working one now), or overwritten
        self.resident = None
        if best is not None:
            return best[0], len(best[1]), best[2], self.claim(best[2])
        slot = 1 if self.snapshot is not None and self.snapshot[2] == 0 else 0
        return self.backend.new_cache(slot), 0, slot, self.claim(slot)

    def keep_snapshot(self, cache, ids: list[int], slot: int) -> None:
        """Copy cache (in slot, holding ids) into the other slot as the snapshot (the backend has two)."""
        other = 1 - slot
        copy = self.backend.copy_cache(cache, other)
        self.snapshot = (copy, list(ids), other, self.claim(other))

    def leave(self, cache, ids: list[int], slot: int, ticket: int) -> None:
        """The run holding ticket ended with ids in its slot: the resident for the next, if the slot is still
        its own."""
        if self.owns(slot, ticket):
            self.resident = (cache, ids, slot, ticket)


class Model:
    """A loaded artifact ready to run. Attributes: `spec` (ModelSpec), `artifact`, `device`, `tokenizer`,
    `chat_template`, `generation_config`, and `last_stats` (GenerationStats of the latest generate call)."""

    def __init__(self, artifact: Artifact, backend, device: str, speculative_tokens: int = 0):
        """Wrap an opened artifact and its backend; use `load` instead."""
        self.artifact, self.device = artifact, device
        self.speculative_tokens = speculative_tokens
        self.spec = artifact.spec
        self._backend = backend
        self._resources = {name: artifact.resource(name) for name in artifact.resources}
        self._tokenizer = None
        self._chat = None
        self.last_stats: GenerationStats | None = None
        self._kept = _KeptCaches(self)  # what reuse_cache generations leave for the next one

    # ------------------------------------------------------------------------------------------- text side

    @property
    def tokenizer(self):
        """The artifact's Tokenizer (built on first use; NinferError when the artifact carries none)."""
        if self._tokenizer is None:
            from ninfer_rt.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_resources(self._resources)
        return self._tokenizer

    @property
    def chat_template(self):
        """The artifact's sandboxed ChatTemplate (built on first use)."""
        if self._chat is None:
            from ninfer_rt.chat import ChatTemplate

            self._chat = ChatTemplate.from_resources(self._resources)
        return self._chat

    @property
    def generation_config(self) -> dict:
        """generation_config.json of the checkpoint ({} when absent)."""
        return self.tokenizer.generation_config

    @property
    def sampling_defaults(self) -> SamplingParams:
        """SamplingParams from generation_config.json (greedy when it is absent or says do_sample false)."""
        return SamplingParams.defaults_from_generation_config(self.generation_config)

    @property
    def context_length(self) -> int:
        """Positions a sequence may hold here, prompt and output together: the model's context, or on the GPU
        the KV cache allocated at load (load's max_ctx)."""
        return self._backend.max_ctx

    @property
    def can_snapshot(self) -> bool:
        """Whether generate(snapshot_at=...) keeps a copy (load's cache_slots=2); else snapshot_at is ignored."""
        return getattr(self._backend, "cache_slots", 1) >= 2

    @property
    def real_vocab_size(self) -> int:
        """Ids the tokenizer can produce; rows from here up to spec.vocab_size are padding."""
        return min(self.tokenizer.vocab_size, self.spec.vocab_size)

    def prompt_ids(self, prompt: str | Sequence[int] | None = None, *, messages: list[dict] | None = None,
                   enable_thinking: bool | None = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt: text is encoded as is (no BOS); messages are rendered with the chat template
        and add_generation_prompt (enable_thinking and tools reach the template; None keeps its default); a
        list of ids is checked and used unchanged."""
        if (prompt is None) == (messages is None):
            raise NinferError("generate: give exactly one of prompt (text or token ids) or messages")
        if messages is None and (tools is not None or enable_thinking is not None):
            raise NinferError("generate: tools and enable_thinking reach the chat template: pass messages")
        if isinstance(prompt, (bytes, bytearray)):
            raise NinferError("generate: prompt is bytes; decode it to str (or pass token ids as a list of ints)")
        if messages is not None:
            text = self.chat_template.render(messages, add_generation_prompt=True, enable_thinking=enable_thinking,
                                             tools=tools)
            ids = self._encoded(text)
        elif isinstance(prompt, str):
            ids = self._encoded(prompt)
        else:
            ids = self.check_ids(prompt)
        if not ids:
            raise NinferError("prompt is empty: there is nothing to continue from")
        return ids

    def _encoded(self, text: str) -> list[int]:
        """text's token ids; NinferError where the tokenizer gives an id the model has no row for (an artifact
        packed before quantize checked that the two agree)."""
        ids = self.tokenizer.encode(text)
        if ids and max(ids) >= self.real_vocab_size:
            raise NinferError(f"the prompt encodes to token id {max(ids)}, past the model's vocabulary of "
                              f"{self.real_vocab_size}: its tokenizer and weights disagree")
        return ids

    def check_ids(self, token_ids: Sequence[int]) -> list[int]:
        """Token ids (a list, tuple, range, deque, array.array or 1-D integer array: an ordered collection of ints)
        as a list of ints the tokenizer knows, [0, real_vocab_size) (the embedding's padding rows beyond are no
        token: vLLM refuses them too), at most the model's context; NinferError naming the first bad one.
        Nothing is coerced: 1.5, True and "1" are refused."""
        if isinstance(token_ids, np.ndarray):
            if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
                raise NinferError(f"token ids: expected a 1-D integer array, got {token_ids.dtype} of shape "
                                  f"{list(token_ids.shape)}")
        elif isinstance(token_ids, (str, bytes, bytearray, Mapping, Set)) or not isinstance(token_ids, Collection):
            raise NinferError(f"token ids: expected a list of integers, got {type(token_ids).__name__} (text goes "
                              "in as a str prompt)")
        ids, vocab = [], self.real_vocab_size
        for pos, i in enumerate(token_ids):
            if not is_int_arg(i):
                raise NinferError(f"token id {i!r} at position {pos} is not an integer")
            if not 0 <= i < vocab:
                raise NinferError(f"token id {i} at position {pos} is outside the vocabulary [0, {vocab})")
            ids.append(int(i))
        if len(ids) > self.context_length:
            raise NinferError(f"{len(ids)} token ids; the context holds {self.context_length}")
        return ids

    # ------------------------------------------------------------------------------------------- model side

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits float32 [T, vocab_size] of one sequence run from an empty cache (padded rows included)."""
        ids = self.check_ids(token_ids)
        if not ids:
            raise NinferError("logits: token_ids is empty")
        return self._backend.forward(np.asarray(ids, dtype=np.int64), self._new_cache())

    def _new_cache(self):
        """An empty cache; whatever reuse_cache kept is dropped (on the GPU this reuses its slots)."""
        return self._kept.fresh()[0]

    def generate_ids(self, prompt: str | Sequence[int] | None = None, *, messages: list[dict] | None = None,
                     max_new_tokens: int = 256, sampling: SamplingParams | None = None,
                     enable_thinking: bool | None = None, tools: list[dict] | None = None,
                     reuse_cache: bool = False, snapshot_at: int | None = None) -> Iterator[int]:
        """Stream the generated token ids (the stop id is not yielded); arguments as `generate`.

        The prompt is checked when this is called, not on the first `next`, so bad input fails early.
        """
        return self._generate_ids(prompt, messages, max_new_tokens, sampling, enable_thinking, tools, reuse_cache,
                                  snapshot_at)[0]

    def _generate_ids(self, prompt, messages, max_new_tokens, sampling, enable_thinking, tools, reuse_cache=False,
                      snapshot_at=None):
        """generate_ids, and the GenerationStats its iterator fills (last_stats once it starts)."""
        ids = self.prompt_ids(prompt, messages=messages, enable_thinking=enable_thinking, tools=tools)
        params, budget = self._check_request(ids, max_new_tokens, sampling, reuse_cache, snapshot_at)
        if reuse_cache and self.speculative_tokens:
            raise NinferError("reuse_cache: not in generate with speculative decoding (its loop starts from an empty "
                              "cache); a Batch (serve) keeps prefixes with the MTP head's cache")
        stats = GenerationStats(prompt_tokens=len(ids))
        if self.speculative_tokens:
            loop = self._speculative_loop(ids, budget, Sampler(params), stats)
        else:
            loop = self._decode_loop(ids, budget, Sampler(params), stats, reuse_cache, snapshot_at)
        return loop, stats

    def _speculative_loop(self, ids: list[int], budget: int, sampler: Sampler, stats: GenerationStats
                          ) -> Iterator[int]:
        """`_decode_loop` by drafts of the MTP head verified together (ninfer_rt.speculative), from an empty cache."""
        self.last_stats = stats
        yield from speculative.decode(self._backend, self._kept.fresh()[0], ids, budget, sampler, stats,
                                      draft_tokens=self.speculative_tokens, real_vocab=self.real_vocab_size,
                                      is_stop=self.tokenizer.is_stop)

    def batch(self, parallel: int | None = None, prefill_chunk: int | None = None):
        """A ninfer_rt.batching.Batch over this model's cache slots: up to parallel (default: all of them)
        generations at once, each prompt prefilled prefill_chunk tokens a step (default batching.PREFILL_CHUNK)."""
        from ninfer_rt.batching import Batch

        return Batch(self, parallel, prefill_chunk)

    def _check_request(self, ids: list[int], max_new_tokens, sampling, reuse_cache, snapshot_at
                       ) -> tuple[SamplingParams, int]:
        """(the sampling to use, the tokens that may be generated) for a generation of prompt ids; NinferError
        naming what is wrong."""
        if not (is_int_arg(max_new_tokens) and max_new_tokens >= 1):
            raise NinferError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise NinferError(f"sampling: expected a SamplingParams, got {type(sampling).__name__}")
        context = self.context_length
        if len(ids) >= context:
            raise NinferError(f"prompt has {len(ids)} tokens; the context holds {context} (prompt and output "
                              "together)")
        if not isinstance(reuse_cache, bool):
            raise NinferError(f"reuse_cache must be True or False, got {reuse_cache!r}")
        if snapshot_at is not None and not (reuse_cache and is_int_arg(snapshot_at) and 1 <= snapshot_at < len(ids)):
            raise NinferError(f"snapshot_at={snapshot_at!r}: must be a prompt position in [1, {len(ids)})"
                              + ("" if reuse_cache else " and needs reuse_cache"))
        params = sampling if sampling is not None else self.sampling_defaults
        return params, min(int(max_new_tokens), context - len(ids))

    def _draws_on_device(self, params: SamplingParams) -> bool:
        """Whether the backend draws tokens itself under params (the GPU: greedy, or top-k sampling; penalties
        where it applies them: GpuBackend.can_draw), so that only the id comes back."""
        can = getattr(self._backend, "can_draw", None) or getattr(self._backend, "can_sample", None)
        return can is not None and can(params)

    def _pick(self, logits: np.ndarray, sampler: Sampler, history: Sequence[int], prompt_len: int) -> int:
        """The next token from one row of logits [V] on the host; padded vocabulary rows are never drawn (they are
        set to -inf in place)."""
        logits[self.real_vocab_size:] = -np.inf
        return sampler.sample(logits, history, prompt_len)

    def _decode_loop(self, ids: list[int], budget: int, sampler: Sampler, stats: GenerationStats,
                     reuse: bool = False, snapshot_at: int | None = None) -> Iterator[int]:
        """Prefill once, then one forward per token; fills stats (self.last_stats from the first step) as it goes.

        reuse: start from what an earlier reuse generation kept (_KeptCaches) when the prompt extends it (only
        the rest is prefilled), keep a copy of the cache after the prompt's first snapshot_at tokens, and leave
        this run's cache behind, however the run ends.

        A backend that can draw the token itself (the GPU, for greedy or top-k sampling without penalties) does
        so, and only the id comes back; otherwise the last row's logits are sampled here. The two draw from the
        same distribution with different random streams, so a seed reproduces a run on the same device.
        """
        self.last_stats = stats
        history, real, is_stop = list(ids), self.real_vocab_size, self.tokenizer.is_stop
        kept = self._kept
        cache, start, slot, ticket = kept.take(ids) if reuse else kept.fresh()
        exclusive = getattr(self._backend, "exclusive_slots", False)
        stats.cached_tokens = start
        fed = list(ids[:start])  # what the cache holds, kept exact however the run ends
        clean = [True]           # False while a forward runs: if it raises, the cache's contents are unknown
        params = sampler.params
        on_device = self._draws_on_device(params)
        ahead = on_device and hasattr(self._backend, "sample_ahead")

        def owned() -> None:
            if exclusive and not kept.owns(slot, ticket):
                raise NinferError("a later generation (or logits) took this generation's sequence slot on the GPU: "
                                  "finish or close one generation before starting the next")

        def step(new_ids: list[int], pick: bool = True) -> int | None:
            """Forward new_ids through the cache and pick the next token from the last row (pick False: only
            feed them)."""
            arr = np.asarray(new_ids, dtype=np.int64)
            owned()
            clean[0], token = False, None
            if on_device and pick:
                token = self._backend.sample_next(arr, cache, params, vocab=real, seed=sampler.seed,
                                                  step=len(stats.token_ids))
            else:
                logits = self._backend.forward(arr, cache, last_only=True)[-1]  # [V]
                if pick:
                    token = self._pick(logits, sampler, history, len(ids))
            fed.extend(new_ids)
            clean[0] = True
            return token

        try:
            t0 = time.perf_counter()
            if snapshot_at is not None and start <= snapshot_at and self.can_snapshot:
                if start < snapshot_at:  # the prompt up to the snapshot (its last logits are not needed)
                    step(ids[start:snapshot_at], pick=False)
                    start = snapshot_at
                kept.keep_snapshot(cache, fed, slot)  # (again, when this run began from the snapshot itself)
            if on_device and params.penalised:  # the device keeps the sequence's penalty state from here
                self._backend.set_penalties(cache, ids, len(ids), params)
            token = step(ids[start:])
            stats.prefill_s = time.perf_counter() - t0
            if ahead:
                yield from self._run_ahead(token, cache, budget, sampler, stats, history, fed, clean, owned)
                return
            while not (yield from emit([token], stats, history, budget, is_stop)):
                t0 = time.perf_counter()
                token = step([token])
                stats.decode_s += time.perf_counter() - t0
        finally:  # however it ended (a stop, the caller closing it), its cache is there for the next one
            if reuse and clean[0]:
                kept.leave(cache, fed, slot, ticket)

    def _run_ahead(self, token: int, cache, budget: int, sampler: Sampler, stats: GenerationStats,
                   history: list[int], fed: list[int], clean: list[bool], owned) -> Iterator[int]:
        """_decode_loop's decode on a backend that feeds each drawn token to the next step on the device
        (GpuBackend.sample_ahead): the step after a token is enqueued before the host reads that token, so the
        host's wait, the consumer's work and the next launch overlap the GPU's step instead of following it.

        token: the prompt's draw (on the host). At most two steps are in flight: `nxt`, drawing the token after
        `token`, and one fed by nxt's draw, enqueued while the budget leaves a token after it. If nxt's draw is a
        stop id that second step was spent for nothing (the cache then holds the stop id too: `fed` says so).
        decode_s is the wall time from the first decode step's enqueue to the last token's arrival."""
        is_stop, real, params = self.tokenizer.is_stop, self.real_vocab_size, sampler.params
        drawn = 1  # tokens drawn so far: the next draw's index in the seed's stream (as _decode_loop's `step`)

        def feed():
            nonlocal drawn
            owned()
            clean[0] = False
            pending = self._backend.sample_ahead(cache, params, vocab=real, seed=sampler.seed, step=drawn)
            clean[0] = True  # enqueued: the cache holds one more token, which `fed` gets once it is read
            drawn += 1
            return pending

        def read(pending) -> int:
            clean[0] = False
            tok = pending.result()
            clean[0] = True
            return tok

        t0 = time.perf_counter()
        nxt = after = None  # after: the step fed by nxt's draw, while the host has not read it
        try:
            if not is_stop(token) and budget > 1:
                nxt = feed()
                fed.append(token)
            while True:
                if nxt is not None and not is_stop(token) and len(stats.token_ids) + 2 < budget:
                    after = feed()  # fed by nxt's draw, before the host has it
                if (yield from emit([token], stats, history, budget, is_stop)):
                    return
                token = read(nxt)
                stats.decode_s = time.perf_counter() - t0
                if after is not None:
                    fed.append(token)
                nxt, after = after, None
        finally:
            if after is not None and clean[0]:  # stopped with nxt's draw fed but unread: `fed` must name it
                fed.append(read(nxt))

    def generate(self, prompt: str | Sequence[int] | None = None, *, messages: list[dict] | None = None,
                 max_new_tokens: int = 256, sampling: SamplingParams | None = None,
                 enable_thinking: bool | None = None, stop: str | list[str] | None = None,
                 tools: list[dict] | None = None, reuse_cache: bool = False,
                 snapshot_at: int | None = None, skip_special_tokens: bool = False) -> Iterator[str]:
        """Stream the continuation as text pieces (each complete UTF-8).

        prompt: text or token ids, or messages: a chat rendered with the artifact's template (enable_thinking
        False asks for the no-thinking prompt; tools, JSON-schema dicts, are offered to the model).
        sampling defaults to the artifact's generation_config.json. Stops on a stop id, on the `stop` string
        or any of the `stop` strings (text from the stop string on is not yielded), or after max_new_tokens.
        Timings land in `last_stats` (the stats of the generation started last) as the iterator runs.
        reuse_cache: when the prompt's tokens extend exactly what the previous reuse_cache generation fed into its
        cache (its prompt and output, as an agent's next turn does after a tool call), only the rest is prefilled
        (last_stats.cached_tokens says how many were not). snapshot_at (with reuse_cache) keeps a copy of the
        cache after the prompt's first snapshot_at tokens, from which a later prompt that shares them continues
        (a chat's next turn, whose template re-renders this turn's reply; needs load(..., cache_slots=2),
        else it is ignored). The result equals a fresh run's up to the rounding of a prefill split in two.
        skip_special_tokens: special tokens (<|im_start|>, <|image_pad|>, ...; not <think> or <tool_call>, which the
        tokenizer marks as text) stay out of the text, as vLLM does by default and HF's decode does when asked.
        """
        stops, detok = stop_strings(stop), self.tokenizer.detokenizer(skip_special_tokens)  # checked before any work
        token_stream, stats = self._generate_ids(prompt, messages, max_new_tokens, sampling, enable_thinking, tools,
                                                 reuse_cache, snapshot_at)
        return self._text_stream(token_stream, stops, stats, detok)

    def _text_stream(self, token_stream: Iterator[int], stops: list[str], stats: GenerationStats,
                     detok) -> Iterator[str]:
        """Detokenize the ids with detok, holding back any tail that could still grow into a stop string."""
        scan = StopScanner(stops)
        for piece in _chain_tail((detok.push(i) for i in token_stream), detok.finish):
            out = scan.push(piece)
            if scan.stop is not None:  # the run ends (and leaves its cache) before the last text goes out
                token_stream.close()
                stats.finish_reason, stats.stop_string = "stop", scan.stop
            if out:
                yield out
            if scan.stop is not None:
                return
        tail = scan.finish()
        if tail:
            yield tail

    # ------------------------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Release the artifact's mapping and, on the GPU, the device memory."""
        if hasattr(self._backend, "close"):
            self._backend.close()
        self.artifact.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chain_tail(pieces: Iterator[str], tail) -> Iterator[str]:
    """Yield the pieces, then tail() once the stream is exhausted (the detokenizer's held bytes)."""
    yield from pieces
    yield tail()


def check_kv_dtype(kv_dtype: str) -> None:
    """The KV cache dtypes the GPU path has (load's check; bench, which builds its model without load, asks too)."""
    if kv_dtype not in ("int8", "bf16"):
        raise NinferError(f"kv cache dtype {kv_dtype!r}: choose int8 or bf16")


def is_int_arg(v) -> bool:
    """An integer argument: Python or numpy, not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def gpu_available() -> bool:
    """True when cuda-python imports and the driver reports at least one GPU."""
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, n = driver.cuDeviceGetCount()
        return err == driver.CUresult.CUDA_SUCCESS and n > 0
    except (ImportError, RuntimeError):
        return False


def load(path: str | PathLike, device: str = "cpu", *, max_ctx: int = 32768, kv_dtype: str = "int8",
         prefill_chunk: int | None = None, progress=None, check_checksums: bool = False,
         cache_slots: int = 1, speculative_tokens: int = 0) -> Model:
    """Open and validate the artifact at `path` and build a Model on `device`.

    max_ctx: positions a sequence may hold, prompt and output together (a longer prompt is refused, output stops
    there). "cpu": the fp32 PyTorch reference; "cuda": our kernels on GPU 0 (max_ctx positions of KV cache in
    kv_dtype int8 or bf16; prompts in steps of prefill_chunk tokens, default ninfer_rt.gpu.PREFILL_CHUNK; progress(done,
    total) while weights load); "auto": cuda when a GPU is present. check_checksums: hash every tensor against
    the header first (SHA-256, ~1-2 GB/s a core: as `ninfer-pack verify` does) and refuse a corrupted file.
    cache_slots: sequences kept at once (1 to MAX_CACHE_SLOTS; on the GPU each has its own KV cache of max_ctx
    positions and DeltaNet state): 2 lets generate(reuse_cache=True, snapshot_at=...) keep a prompt's prefix beside
    the last run, and a ninfer_rt.batching.Batch runs up to that many sequences at once.
    speculative_tokens: k > 0 makes generate draft up to k tokens a step with the checkpoint's MTP head and verify
    them in one forward (ninfer_rt.speculative; a Batch does so for a sequence while it decodes alone).
    """
    if not isinstance(path, (str, PathLike)):
        raise NinferError(f"load: path must be a str or os.PathLike, got {type(path).__name__}")
    if device not in DEVICES:
        raise NinferError(f"device {device!r}: choose cpu, cuda or auto")
    if progress is not None and not callable(progress):
        raise NinferError(f"load: progress must be a callable(done, total) or None, got {type(progress).__name__}")
    if not isinstance(check_checksums, bool):
        raise NinferError(f"load: check_checksums must be True or False, got {check_checksums!r}")
    if prefill_chunk is not None and not (is_int_arg(prefill_chunk) and prefill_chunk >= 1):
        raise NinferError(f"prefill chunk {prefill_chunk!r}: must be a number of tokens >= 1")
    check_kv_dtype(kv_dtype)  # on every device and before any weight loads, though only cuda allocates a cache
    if not (is_int_arg(max_ctx) and max_ctx >= 1):
        raise NinferError(f"max context {max_ctx!r}: must be a number of positions >= 1")
    if not (is_int_arg(cache_slots) and 1 <= cache_slots <= MAX_CACHE_SLOTS):
        raise NinferError(f"cache_slots={cache_slots!r}: must be an integer in [1, {MAX_CACHE_SLOTS}]")
    most = speculative.MAX_DRAFT_TOKENS
    if not (is_int_arg(speculative_tokens) and 0 <= speculative_tokens <= most):
        raise NinferError(f"speculative_tokens={speculative_tokens!r}: must be an integer in [0, {most}]")
    if device == "auto":
        device = "cuda" if gpu_available() else "cpu"
    artifact = Artifact.open(path)
    try:
        problems = artifact.plan_problems()
        if problems:  # a header edited, or written for another model: refuse before any weight is read
            raise FormatError(f"{artifact.path}: {problems[0]}")
        if check_checksums:  # a progress phase of its own: done reaches total, then the weights' bar starts
            total = artifact.payload_bytes
            done = 0

            def hashed(n: int) -> None:
                nonlocal done
                done += n
                if progress:
                    progress(done, total)

            bad = artifact.verify_checksums(hashed if progress else None)
            if bad:
                raise FormatError(f"{artifact.path}: checksum mismatch in {bad[0]} ({len(bad)} in all): the file "
                                  "is corrupted; download or pack it again")
        if speculative_tokens and "mtp" not in artifact.groups:
            raise NinferError(f"{artifact.path}: speculative decoding drafts with the MTP head, and this "
                              "artifact has no MTP head (no mtp.* tensors)")
        groups = ("text", "mtp") if speculative_tokens else ("text",)
        if device == "cuda":
            from ninfer_rt.gpu.backend import GpuBackend
            backend = GpuBackend(artifact, max_ctx=int(max_ctx), kv_dtype=kv_dtype, progress=progress,
                                 prefill_chunk=None if prefill_chunk is None else int(prefill_chunk),
                                 cache_slots=int(cache_slots), groups=groups)
        else:
            # the reference holds every weight in fp32: a model far larger than RAM gets a line, not the OOM killer
            check_fits(4 * artifact.spec.num_parameters(groups), "the CPU reference holds the model in fp32 "
                       "(run it on a GPU: --device cuda)", available_memory())
            from ninfer_rt.reference.backend import ReferenceBackend
            backend = ReferenceBackend(artifact, cache_slots=int(cache_slots), groups=groups, max_ctx=int(max_ctx))
        return Model(artifact, backend, device, int(speculative_tokens))
    except BaseException:
        artifact.close()
        raise
