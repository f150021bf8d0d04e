"""Token windows from text files: what calibrate measures on and verify --numerics scores."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ninfer_rt.errors import NinferError, SourceError


def check_window(window: int, max_tokens: int, min_len: int = 2) -> None:
    """NinferError unless a window and the token budget each hold at least min_len tokens."""
    if window < min_len or max_tokens < min_len:
        raise NinferError(f"window {window} and max tokens {max_tokens} must be at least {min_len} tokens")


def token_windows(ids: Sequence[int], window: int, max_tokens: int, min_len: int = 2) -> list[list[int]]:
    """The first max_tokens ids cut into windows of `window` (a last shorter one kept if it has min_len or more)."""
    check_window(window, max_tokens, min_len)
    ids = list(ids[:max_tokens])
    out = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in out if len(w) >= min_len]


def read_texts(paths: Sequence[str | Path]) -> list[tuple[Path, str]]:
    """(path, contents) of UTF-8 text files; SourceError naming one that is missing, a directory or not UTF-8.
    Needs no tokenizer, so it runs before the checkpoint that has one is opened (a Hub repo: downloaded)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            raise SourceError(f"{p} is a directory; --text takes UTF-8 text files")
        if not p.is_file():
            raise SourceError(f"no such text file: {p}")
        try:
            out.append((p, p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError) as e:
            raise SourceError(f"{p}: cannot read it as UTF-8 text ({e})") from None
    return out


def text_windows(tok, texts: Sequence[tuple[Path, str]], window: int, max_tokens: int, min_len: int = 2
                 ) -> list[list[int]]:
    """read_texts' texts, each encoded with `tok` (a ninfer_rt Tokenizer) and joined in order, as `token_windows`;
    SourceError naming a file that gives no tokens."""
    ids: list[int] = []
    for p, text in texts:
        got = tok.encode(text)
        if not got:
            raise SourceError(f"{p}: no tokens in it")
        ids += got
        if len(ids) >= max_tokens:
            break
    return token_windows(ids, window, max_tokens, min_len)
