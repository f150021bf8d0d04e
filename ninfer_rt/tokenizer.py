"""The checkpoint's tokenizer, loaded from its files with `tokenizers` (no torch, no transformers).

`Tokenizer.from_resources` takes the files by name (tokenizer.json required; tokenizer_config.json and
generation_config.json optional) and exposes encode/decode, the stop ids, and a streaming detokenizer that only
ever yields complete UTF-8 text.
"""

from __future__ import annotations

import codecs
import functools
import json
import unicodedata
from collections.abc import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.normalizers import NFC

from ninfer_rt.errors import NinferError, json_reason

# Qwen chats end on <|im_end|>; raw text ends on <|endoftext|>: stop on either (facts §7).
_QWEN_STOPS = ("<|im_end|>", "<|endoftext|>")


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode) inverted: the character that stands for each byte ->
    the byte. Printable Latin-1 bytes stand for themselves; the other 68 take U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_OF = _byte_level_chars()


def _load_json(resources: dict[str, bytes], name: str) -> dict:
    """Parse an optional JSON resource; {} when absent, NinferError naming the file when malformed."""
    raw = resources.get(name)
    if raw is None:
        return {}
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise NinferError(f"{name}: malformed JSON ({json_reason(e)})") from None
    if not isinstance(obj, dict):
        raise NinferError(f"{name}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Byte-level BPE tokenizer with the checkpoint's stop, bos and pad ids."""

    def __init__(self, backend: _HFTokenizer, tokenizer_config: dict, generation_config: dict):
        """Wrap a loaded `tokenizers.Tokenizer`; use `from_resources` to build one from files."""
        self._tok = backend
        self.tokenizer_config = tokenizer_config
        self.generation_config = generation_config
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._added = frozenset(backend.get_added_tokens_decoder())

        eos: list[int] = []
        gen_eos = generation_config.get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(i, int):
                eos.append(i)
        for text in (_token_text(tokenizer_config.get("eos_token")), *_QWEN_STOPS):
            i = backend.token_to_id(text) if text else None
            if i is not None:
                eos.append(i)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.bos_id: int | None = self._special_id("bos")
        self.pad_id: int | None = self._special_id("pad")

    def _special_id(self, kind: str) -> int | None:
        """bos/pad id: generation_config's `<kind>_token_id`, else tokenizer_config's `<kind>_token` looked up."""
        i = self.generation_config.get(f"{kind}_token_id")
        if isinstance(i, int):
            return i
        text = self.special_text(kind)
        return self._tok.token_to_id(text) if text else None

    def special_text(self, kind: str) -> str | None:
        """tokenizer_config.json's `<kind>_token` text (bos, eos, pad, unk), or None."""
        return _token_text(self.tokenizer_config.get(f"{kind}_token"))

    @classmethod
    def from_resources(cls, resources: dict[str, bytes]) -> Tokenizer:
        """Build from checkpoint files by name: tokenizer.json (required), tokenizer_config.json and
        generation_config.json (optional)."""
        raw = resources.get("tokenizer.json")
        if raw is None:
            raise NinferError("tokenizer.json: missing (the checkpoint has no tokenizer)")
        try:
            backend = _HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise NinferError(f"tokenizer.json: malformed ({first})") from e
        return cls(backend, _load_json(resources, "tokenizer_config.json"),
                   _load_json(resources, "generation_config.json"))

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special tokens written in the text (e.g. <|im_start|>) become their ids, no BOS."""
        if not isinstance(text, str):
            raise NinferError(f"encode: expected text (str), got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates: bytes that were not UTF-8 (a shell's argv, a bad file)
            raise NinferError(f"text is not valid UTF-8 (character {e.start}: {text[e.start]!r})") from None
        # encode_batch releases the GIL while it runs (encode holds it): a long prompt does not stall the server
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def id_bound(self) -> int:
        """One past the largest id (ids may skip some): what the model's embedding must cover. On first use only:
        it builds the whole vocabulary as a dict, which loading a model for a run does not need."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @functools.cached_property
    def _most_bytes(self) -> int:
        """The most bytes of text one token stands for, where that bounds a text's tokens: a byte-level vocabulary
        (each piece's characters are bytes) behind no normalizer or NFC (which only composes); else 0."""
        if self._tok.normalizer is not None and not isinstance(self._tok.normalizer, NFC):
            return 0
        pieces = self._tok.get_vocab(with_added_tokens=False)
        if not all(ch in _BYTE_OF for piece in pieces for ch in piece):
            return 0
        added = (t.content.encode("utf-8") for t in self._tok.get_added_tokens_decoder().values())
        return max(max(map(len, pieces), default=1), max(map(len, added), default=1))

    def least_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) found without tokenizing it (0 where none is known): the bytes of
        its NFC form over the most bytes one token stands for. A prompt that cannot fit is refused in
        milliseconds, not after the seconds a 30 MB text takes to tokenize."""
        most = self._most_bytes
        if not most:
            return 0
        return -(-len(unicodedata.normalize("NFC", text).encode("utf-8", "replace")) // most)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ids; incomplete UTF-8 decodes to U+FFFD. Every id must be an integer in [0, vocab_size)."""
        if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Iterable):
            raise NinferError(f"decode: expected token ids, got {type(ids).__name__}")
        ids = list(ids)
        for i in ids:
            if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.vocab_size:
                raise NinferError(f"decode: token id {i!r} is not an integer in [0, {self.vocab_size})")
        ids = [int(i) for i in ids]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary or added token, None when unknown."""
        if not isinstance(token, str):
            raise NinferError(f"token_to_id: expected a token string, got {type(token).__name__}")
        return self._tok.token_to_id(token)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for on its own (a byte-level token may hold part of a UTF-8 character): an
        added token's text (a special one's too, as vLLM's logprobs spell it), else its byte-level characters
        mapped back to bytes (its decoded text where the vocabulary is not byte-level)."""
        if i not in self._added:
            piece = self._tok.id_to_token(i)
            if piece is not None and all(ch in _BYTE_OF for ch in piece):
                return bytes(_BYTE_OF[ch] for ch in piece)
        return self.decode([i]).encode("utf-8")

    def text_bytes(self, i: int, skip_special_tokens: bool = False) -> bytes:
        """What token i adds to a text decoded with skip_special_tokens: token_bytes(i), or b"" for a special token
        such a text leaves out."""
        if skip_special_tokens and i in self._added:
            return self.decode([i], skip_special_tokens=True).encode("utf-8")
        return self.token_bytes(i)

    def is_added(self, i: int) -> bool:
        """Whether i is an added token (the specials: <|im_start|>, <think>, <tool_call>, ...), not a piece of text."""
        return i in self._added

    def is_stop(self, i: int) -> bool:
        """Whether generation ends on this id."""
        return i in self.eos_ids

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer over this tokenizer (skip_special_tokens checked here for every caller:
        Model.generate, Batch.add)."""
        if not isinstance(skip_special_tokens, bool):
            raise NinferError(f"skip_special_tokens must be True or False, got {skip_special_tokens!r}")
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of ids into text pieces; a piece is released only once its UTF-8 is complete.

    Decodes a small window (from the last released boundary) rather than the whole stream, so each step costs
    O(window), and the window keeps context for decoders whose output depends on the previous token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        """Start an empty stream."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already released as text

    def push(self, i: int) -> str:
        """Add one id; return the newly completed text ('' while a multi-byte character is still open)."""
        self._ids.append(i)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(full_text) > len(prefix_text) and not (full_text.endswith("\ufffd") and self._unfinished()):
            self._prefix, self._read = self._read, len(self._ids)
            return full_text[len(prefix_text):]
        return ""

    def _unfinished(self) -> bool:
        """Whether the unreleased ids' bytes end inside a character that a later token may finish (a U+FFFD that
        is the text's own, or stands for bytes no continuation can mend, goes out at once: holding it would
        re-decode a growing window at every step)."""
        pending = b"".join(self._tok.text_bytes(i, self._skip) for i in self._ids[self._read:])
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(pending, final=False)
        return bool(decoder.getstate()[0])

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield the non-empty pieces of ids, then whatever `finish` releases."""
        for i in ids:
            piece = self.push(i)
            if piece:
                yield piece
        tail = self.finish()
        if tail:
            yield tail

    def finish(self) -> str:
        """Release what is still held (an unfinished character comes out as U+FFFD) and reset the stream."""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._ids, self._prefix, self._read = [], 0, 0
        return full_text[len(prefix_text):]
