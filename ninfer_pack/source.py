"""Reading Qwen3.5/3.6 checkpoints: a local directory, a Hub repo or a built-in tiny model.

`Checkpoint.open(source)` reads config.json and every safetensors header, maps each stored tensor to its
canonical name (docs/architecture.md) and checks the set against `ModelSpec.tensor_shapes()`. Tensors are
then read one at a time, straight from the shard files with positioned reads into the output tensor's own
memory: no mmap and no whole-shard load, so host memory stays about one canonical tensor whatever the model.

On-disk forms accepted (facts §4): `model.language_model.*` (VLM) or `model.*` (text-only) prefixes; fused
expert banks or per-expert tensors (stacked here, possibly spread over shards); fp32 tensors among bf16; FP8
e4m3 weights with block `weight_scale_inv` (bf16 or fp32), dequantized to float32; `mtp.*`; `model.visual.*`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
from collections import OrderedDict
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ninfer_rt.config import ModelSpec
from ninfer_rt.errors import ConfigError, SourceError, json_reason

# safetensors dtype -> (torch dtype, bytes per element); FP8 only as a weight with block scales.
_DTYPES = {"BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2), "F32": (torch.float32, 4),
           "F8_E4M3": (torch.float8_e4m3fn, 1)}
_FP8 = "F8_E4M3"
_SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` scales `X.weight`; `Y_scale_inv` scales a fused `Y`
_DEFAULT_BLOCK = (128, 128)

RESOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                  "generation_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                  "preprocessor_config.json", "video_preprocessor_config.json")
HUB_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "*.txt", "tokenizer*"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_EXPERT_PART = re.compile(r"^(?P<stem>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_KEPT_PREFIXES = ("model.language_model.", "model.visual.", "mtp.", "lm_head.")
_OPEN_FILES = 4  # file handles kept open (LRU); per-expert banks hop between a few shards
_TRUE = {"1", "ON", "YES", "TRUE"}
_MAX_HEADER = 100_000_000  # bytes; the safetensors library's own cap, so a corrupt length cannot fill RAM


@dataclass(frozen=True)
class _Stored:
    """One tensor as a safetensors file stores it."""

    name: str
    file: Path
    shard: int  # position of `file` in read order
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in `file`
    nbytes: int


@dataclass(frozen=True)
class _Piece:
    """A stored weight and, for FP8, its block scales."""

    data: _Stored
    scale: _Stored | None = None


@dataclass(frozen=True)
class _Entry:
    """How to build one canonical tensor: "plain" (one piece), "gate_up" or "down" (per-expert pieces)."""

    kind: str
    pieces: tuple[_Piece, ...]
    shape: tuple[int, ...]
    dtype: str

    @property
    def first(self) -> tuple[int, int]:
        """(shard, offset) where reading this tensor starts: the sort key of the read order."""
        return min((p.data.shard, p.data.start) for p in self.pieces)


def _canonical(name: str) -> str:
    """Canonical spelling of a stored (non-expert-part) name; `model.*` of *ForCausalLM moves under language_model."""
    if name.startswith(_KEPT_PREFIXES) or not name.startswith("model."):
        return name
    return "model.language_model." + name[len("model."):]


def _read_header(path: Path, shard: int) -> dict[str, _Stored]:
    """Parse and validate one safetensors header: 8-byte LE length, JSON, offsets relative to the data start."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SourceError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise SourceError(f"{path}: safetensors header length {n} bytes exceeds the {_MAX_HEADER}-byte limit "
                              f"(corrupted length prefix?)")
        if n > size - 8:
            raise SourceError(f"{path}: truncated safetensors header ({n} bytes announced, {size - 8} present)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise SourceError(f"{path}: malformed safetensors header ({json_reason(e)})") from None
    if not isinstance(header, dict):
        raise SourceError(f"{path}: malformed safetensors header (not a JSON object)")
    data_start, data_size = 8 + n, size - 8 - n
    out, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:  # dtype a string, shape a list of ints, data_offsets two ints; all ints >= 0 and not bools
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not (isinstance(dtype, str) and isinstance(shape, list) and isinstance(offsets, list)):
                raise TypeError
            shape, (begin, end) = tuple(shape), offsets
            if not all(type(v) is int and v >= 0 for v in (*shape, begin, end)):
                raise TypeError
        except (TypeError, KeyError, ValueError):
            raise SourceError(f"{path}: malformed safetensors header entry for tensor {name} (expected a string "
                              f"dtype, a shape of non-negative integers and two integer data_offsets)") from None
        if dtype not in _DTYPES:
            raise SourceError(f"tensor {name} in {path} has unsupported dtype {dtype} "
                              f"(supported: {', '.join(_DTYPES)})")
        nbytes = math.prod(shape) * _DTYPES[dtype][1]
        if end < begin or end - begin != nbytes:
            raise SourceError(f"{path}: tensor {name} has data offsets [{begin}, {end}], which do not hold "
                              f"its {dtype} shape {list(shape)} ({nbytes} bytes)")
        if end > data_size:
            raise SourceError(f"{path}: tensor {name} has data offsets [{begin}, {end}] beyond the end of the "
                              f"file ({data_size} data bytes): the file is truncated")
        out[name] = _Stored(name, path, shard, dtype, shape, data_start + begin, nbytes)
        spans.append((begin, end, name))
    _check_tiling(path, spans, data_size)
    return out


def _check_tiling(path: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """The tensors' byte ranges must cover the data area end to end, without overlap or gap, as the safetensors
    library requires (it refuses such a file); an overlap would read one tensor's bytes as another's."""
    at, last = 0, None
    for begin, end, name in sorted(spans):
        if begin != at:
            what = f"overlaps {last}" if begin < at else f"leaves bytes [{at}, {begin}) unused before it"
            raise SourceError(f"{path}: malformed safetensors file: tensor {name} at [{begin}, {end}] {what}")
        at, last = end, name
    if at != data_size:
        raise SourceError(f"{path}: malformed safetensors file: {data_size - at} bytes after the last tensor")


def _shard_files(path: Path, label: str) -> tuple[list[Path], Path | None, dict | None]:
    """The shard files in read order, and the index file and its weight_map when there is one."""
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1 and (path / "model.safetensors.index.json").is_file():
        indexes = [path / "model.safetensors.index.json"]
    if len(indexes) > 1:
        raise SourceError(f"{label} has several safetensors index files: {', '.join(p.name for p in indexes)}")
    if not indexes:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SourceError(f"{label} has no *.safetensors files")
        return files, None, None
    index = indexes[0]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (ValueError, RecursionError, KeyError, TypeError):
        raise SourceError(f"{index}: malformed index (expected a JSON object with a weight_map)") from None
    for name, fname in weight_map.items():  # an untrusted index must not point outside the checkpoint
        if fname in ("", ".", "..") or "\0" in fname or Path(fname).name != fname:
            raise SourceError(f"{index.name} maps tensor {name!r} to {fname!r}, which is not a plain file name "
                              f"(shards must lie in {label} itself)")
    files = []
    for fname in sorted(set(weight_map.values())):
        if not (path / fname).is_file():
            raise SourceError(f"{index.name} names shard {fname}, which is missing from {label}")
        files.append(path / fname)
    return files, index, weight_map


class Checkpoint:
    """A checkpoint opened for streaming: canonical names, shapes, dtypes, sizes, and `read(name)`.

    Attributes: `path`, `config` (config.json as a dict), `spec` (ModelSpec), `resources` (tokenizer and
    template files, byte for byte), `provenance` (source, and Hub commit or local path), `missing_groups`
    (optional groups, "mtp" / "vision", absent as a whole), `names` (canonical names in read order).
    """

    def __init__(self, path: Path, label: str, provenance: dict):
        """Scan a checkpoint directory; `label` names it in errors (the source string as the user gave it)."""
        self.path, self.provenance = path, provenance
        self._files: OrderedDict[Path, int] = OrderedDict()
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise SourceError(f"{label} has no config.json")
        self.spec = ModelSpec.from_file(cfg_path)
        self.config = self.spec.raw
        self.resources = {n: (path / n).read_bytes() for n in RESOURCE_FILES if (path / n).is_file()}

        stored = self._scan(path, label)
        entries = self._assemble(stored)
        if self.spec.tie_word_embeddings and "lm_head.weight" in entries:
            # a stored head is the model's head even where the config ties it, as transformers 5 loads it
            self.spec = dataclasses.replace(self.spec, tie_word_embeddings=False)
        self._validate(entries)
        self._entries = dict(sorted(entries.items(), key=lambda kv: kv[1].first))
        self.names: list[str] = list(self._entries)

    # ---- opening ----
    @classmethod
    def open(cls, source: str | os.PathLike, revision: str | None = None, progress: bool = True) -> Checkpoint:
        """Open "builtin:<name>", a local checkpoint directory, or a Hub repo id "owner/name" (downloaded)."""
        source = os.fspath(source)
        if not source.strip():  # Path("") is the working directory: an empty argument is a mistake, not "."
            raise SourceError("SOURCE is empty: give a checkpoint directory, a Hub repo id or builtin:tiny-moe")
        if source.startswith("builtin:"):
            from ninfer_pack.tiny import BUILTIN_SOURCES, materialize_builtin

            if source not in BUILTIN_SOURCES:
                raise SourceError(f"unknown built-in checkpoint {source!r}; choose from {', '.join(BUILTIN_SOURCES)}")
            if revision is not None:
                raise SourceError(f"--revision {revision} applies to Hub repos, but {source} is built in")
            return cls(Path(materialize_builtin(source)), source, {"source": source})
        local = Path(source).expanduser()
        if local.is_dir():
            if revision is not None:
                raise SourceError(f"--revision {revision} applies to Hub repos, but {source} is a local directory")
            local = local.resolve()
            return cls(local, source, {"source": source, "path": str(local)})
        if local.exists():
            raise SourceError(f"not a directory: {source}")
        if not _REPO_ID.match(source):
            raise SourceError(f"no such directory: {source}")
        with _maybe_a_path(source):
            folder, commit = _download(source, revision, progress)
        return cls(folder, source, {"source": source, "revision": commit})

    def _scan(self, path: Path, label: str) -> dict[str, _Stored]:
        """Every stored tensor of every shard, checked against the index when there is one."""
        files, index, weight_map = _shard_files(path, label)
        stored: dict[str, _Stored] = {}
        for shard, f in enumerate(files):
            for name, st in _read_header(f, shard).items():
                if name in stored:
                    raise SourceError(f"tensor {name} is stored twice: in {stored[name].file.name} and {f.name}")
                stored[name] = st
        for name, fname in (weight_map or {}).items():
            if name not in stored or stored[name].file.name != fname:
                raise SourceError(f"{index.name} places tensor {name} in {fname}, but that shard does not hold it")
        return stored

    def _assemble(self, stored: dict[str, _Stored]) -> dict[str, _Entry]:
        """Pair FP8 weights with their scales, canonicalise names, stack per-expert tensors into banks."""
        scales = {n[: -len(_SCALE_SUFFIX)]: st for n, st in stored.items() if n.endswith(_SCALE_SUFFIX)}
        entries: dict[str, _Entry] = {}
        where: dict[str, str] = {}  # canonical name -> the stored name it came from (for messages)
        parts: dict[str, dict[tuple[int, str], _Piece]] = {}
        stems: dict[str, str] = {}
        for name, st in stored.items():
            if name.endswith(_SCALE_SUFFIX):
                continue
            piece = _Piece(st, self._scale_for(st, scales.pop(name, None)))
            m = _EXPERT_PART.match(name)
            if m:
                bank = _canonical(m["stem"]) + (".down_proj" if m["proj"] == "down_proj" else ".gate_up_proj")
                parts.setdefault(bank, {})[(int(m["e"]), m["proj"])] = piece
                stems[bank] = m["stem"]
                continue
            canon = _canonical(name)
            if canon in where:
                raise SourceError(f"tensor {canon} is stored twice, as {where[canon]} and {name}")
            where[canon] = name
            entries[canon] = _Entry("plain", (piece,), st.shape, st.dtype)
        if scales:
            base = min(scales)
            raise SourceError(f"unexpected tensor {base}{_SCALE_SUFFIX}: there is no {base} for it to scale")
        shapes = self.spec.tensor_shapes()
        for bank, got in parts.items():
            if bank in entries:
                raise SourceError(f"{bank} is stored both fused ({where[bank]}) and per expert ({stems[bank]}.*)")
            entries[bank] = _stack(bank, stems[bank], got, shapes.get(bank))
        return entries

    def _scale_for(self, st: _Stored, scale: _Stored | None) -> _Stored | None:
        """Check an FP8 weight's block scales: present, a float dtype, [..., ceil(N/bn), ceil(K/bk)]."""
        if st.dtype != _FP8:
            if scale is not None:
                raise SourceError(f"tensor {scale.name} scales {st.name}, which is {st.dtype}, not {_FP8}")
            return None
        if scale is None:
            raise SourceError(f"FP8 tensor {st.name} has no {st.name}{_SCALE_SUFFIX} block scales")
        if len(st.shape) < 2:
            raise SourceError(f"FP8 tensor {st.name} has shape {list(st.shape)}; block scales need 2-D or more")
        if scale.dtype == _FP8:
            raise SourceError(f"tensor {scale.name} has dtype {scale.dtype}; block scales must be BF16, F16 or F32")
        bn, bk = self.block_size
        *lead, n, k = st.shape
        want = (*lead, -(-n // bn), -(-k // bk))
        if scale.shape != want:
            raise ConfigError(f"tensor {scale.name} has shape {list(scale.shape)}, but {list(st.shape)} in "
                              f"{bn}x{bk} blocks (quantization_config.weight_block_size) needs {list(want)}")
        return scale

    @property
    def block_size(self) -> tuple[int, int]:
        """FP8 block (rows, columns) from quantization_config.weight_block_size, default 128 x 128."""
        q = self.spec.quantization or {}
        b = q.get("weight_block_size") or _DEFAULT_BLOCK
        if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(isinstance(v, int) and v > 0 for v in b)):
            raise ConfigError(f"quantization_config.weight_block_size must be two positive integers, got {b!r}")
        return int(b[0]), int(b[1])

    def _validate(self, entries: dict[str, _Entry]) -> None:
        """Names and shapes against config.json: nothing unexpected, all text, mtp/vision all or nothing."""
        shapes = self.spec.tensor_shapes()
        for name in sorted(entries, key=lambda n: entries[n].first):
            if name not in shapes:
                raise SourceError(f"unexpected tensor {name}: config.json implies no such tensor")
        missing = [n for n in shapes if n not in entries]
        for n in missing:
            if shapes[n].group == "text":
                raise SourceError(f"checkpoint lacks tensor {n}")
        absent = set()
        for group in ("mtp", "vision"):
            names = [n for n, t in shapes.items() if t.group == group]
            lacking = [n for n in names if n not in entries]
            if names and len(lacking) == len(names):
                absent.add(group)
            elif lacking:
                raise SourceError(f"checkpoint has part of the {group} tensors but lacks {lacking[0]}")
        self.missing_groups = frozenset(absent)
        for name, e in entries.items():
            if tuple(e.shape) != tuple(shapes[name].shape):
                raise ConfigError(f"tensor {name} has shape {list(e.shape)} in the checkpoint, but config.json "
                                  f"implies {list(shapes[name].shape)}")

    # ---- queries ----
    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{name} is not a tensor of {self.provenance['source']}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Canonical shape."""
        return tuple(self._entry(name).shape)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{canonical name: shape} for every tensor, in read order: what planning needs."""
        return {n: self.shape(n) for n in self.names}

    def source_dtype(self, name: str) -> str:
        """safetensors dtype as stored ("BF16", "F32", "F8_E4M3", ...)."""
        return self._entry(name).dtype

    def source_nbytes(self, name: str) -> int:
        """Bytes on disk: the tensor, its FP8 scales and all its per-expert parts."""
        return sum(p.data.nbytes + (p.scale.nbytes if p.scale else 0) for p in self._entry(name).pieces)

    @property
    def total_source_bytes(self) -> int:
        """Bytes on disk of every tensor read."""
        return sum(self.source_nbytes(n) for n in self.names)

    # ---- reading ----
    def read(self, name: str) -> torch.Tensor:
        """The canonical tensor: stored dtype (bf16/f16/fp32), or float32 for FP8-dequantized weights."""
        e = self._entry(name)
        out = torch.empty(e.shape, dtype=torch.float32 if e.dtype == _FP8 else _DTYPES[e.dtype][0])
        if e.kind == "plain":
            self._read_piece(e.pieces[0], out)
        elif e.kind == "gate_up":  # out: [E, 2I, H]; pieces: gate_0, up_0, gate_1, up_1, ...
            rows = e.shape[1] // 2
            for i, p in enumerate(e.pieces):
                self._read_piece(p, out[i // 2, (i % 2) * rows:(i % 2 + 1) * rows])
        else:  # "down": out [E, H, I]; one piece per expert
            for i, p in enumerate(e.pieces):
                self._read_piece(p, out[i])
        return out

    def _read_piece(self, p: _Piece, dest: torch.Tensor) -> None:
        """Fill a contiguous slice of the output: directly for float data, via an FP8 buffer plus scales."""
        if p.scale is None:
            self._read_into(p.data, dest)
            return
        w8 = torch.empty(p.data.shape, dtype=torch.float8_e4m3fn)
        self._read_into(p.data, w8)
        scale = torch.empty(p.scale.shape, dtype=_DTYPES[p.scale.dtype][0])
        self._read_into(p.scale, scale)
        dest.copy_(w8)
        del w8
        _dequantize_(dest, scale.float(), self.block_size)

    def _read_into(self, st: _Stored, dest: torch.Tensor) -> None:
        """Positioned reads of one stored tensor into `dest` (contiguous, same dtype and numel)."""
        if st.nbytes == 0:
            return
        buf = memoryview(dest.view(-1).view(torch.uint8).numpy())  # writable bytes of dest's storage
        fd, done = self._fd(st.file), 0
        while done < st.nbytes:
            got = os.preadv(fd, [buf[done:]], st.start + done)
            if got <= 0:
                raise SourceError(f"{st.file}: file ended while reading tensor {st.name} (truncated since opened?)")
            done += got

    def _fd(self, path: Path) -> int:
        """An open descriptor for a shard, from a small LRU."""
        fd = self._files.pop(path, None)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            while len(self._files) >= _OPEN_FILES:
                os.close(self._files.popitem(last=False)[1])
        self._files[path] = fd
        return fd

    def close(self) -> None:
        """Close the shard files (reading again reopens them)."""
        while self._files:
            os.close(self._files.popitem()[1])

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_files", None):
            self.close()


def _stack(bank: str, stem: str, got: dict[tuple[int, str], _Piece], want: object) -> _Entry:
    """Order per-expert pieces into a fused bank: gate_up [E, 2I, H] (gate rows first) or down [E, H, I]."""
    projs = ("down_proj",) if bank.endswith(".down_proj") else ("gate_proj", "up_proj")
    n_experts = want.shape[0] if want is not None else 1 + max(e for e, _ in got)
    for e, proj in sorted(got):
        if e >= n_experts:
            raise SourceError(f"unexpected tensor {stem}.{e}.{proj}.weight: config.json has {n_experts} experts")
    pieces = []
    for e in range(n_experts):
        for proj in projs:
            if (e, proj) not in got:
                raise SourceError(f"checkpoint lacks tensor {stem}.{e}.{proj}.weight (expert {e} of {bank})")
            pieces.append(got[(e, proj)])
    first = pieces[0].data
    for p in pieces:
        if p.data.dtype != first.dtype:
            raise SourceError(f"tensor {p.data.name} is {p.data.dtype} but {first.name} is {first.dtype}; "
                              f"the experts of {bank} must share one dtype")
        if p.data.shape != first.shape or len(first.shape) != 2:
            raise ConfigError(f"tensor {p.data.name} has shape {list(p.data.shape)}, but {first.name} has "
                              f"{list(first.shape)}; expert tensors must be equal 2-D matrices")
    rows, cols = first.shape
    shape = (n_experts, len(projs) * rows, cols)
    return _Entry("down" if len(projs) == 1 else "gate_up", tuple(pieces), shape, first.dtype)


def _dequantize_(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """In place: W[..., i, j] *= scale[..., i // bn, j // bk] (float32; partial edge blocks included)."""
    bn, bk = block
    k = w.shape[-1]
    cols = scale.repeat_interleave(bk, dim=-1)[..., :k]  # [..., ceil(N/bn), K]
    for i in range(scale.shape[-2]):
        w[..., i * bn:(i + 1) * bn, :].mul_(cols[..., i:i + 1, :])


def _hub(repo: str, revision: str | None, progress: bool, call):
    """Run `call(offline)` against the Hub; every failure becomes a one-line SourceError naming `repo`."""
    from huggingface_hub import errors as hfe
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    # huggingface_hub reads HF_HUB_OFFLINE once at import; honour it as set now, too.
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE
    quiet_before = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        return call(offline)
    except Exception as e:
        reason = _hub_reason(e, hfe, revision, offline)
        if reason is None:
            raise
        raise SourceError(f"cannot download {repo!r} from the Hugging Face Hub: {reason}") from None
    finally:
        if not progress and not quiet_before:
            enable_progress_bars()


@contextlib.contextmanager
def _maybe_a_path(source: str):
    """A repo-id-shaped source whose first part is a local folder (ck/typo beside ck/) was most likely a mistyped
    path: a Hub failure then says that first."""
    try:
        yield
    except SourceError as e:
        if Path(source).expanduser().parent.is_dir():
            raise SourceError(f"no such directory: {source} (as a Hub repo id: {e})") from None
        raise


def _download(repo: str, revision: str | None, progress: bool) -> tuple[Path, str | None]:
    """snapshot_download the files ninfer needs; returns the folder and the resolved commit."""
    import huggingface_hub

    folder = Path(_hub(repo, revision, progress, lambda offline: huggingface_hub.snapshot_download(
        repo, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=offline)))
    commit = folder.name if re.fullmatch(r"[0-9a-f]{40}", folder.name) else None
    return folder, commit


def fetch_config(source: str, revision: str | None = None) -> dict:
    """config.json alone, from a local directory or a Hub repo id (for plans that need no weights).

    The file is checked as a ModelSpec on the way; the parsed JSON object is returned."""
    import huggingface_hub

    if not source.strip():
        raise SourceError("SOURCE is empty: give a checkpoint directory, a config.json or a Hub repo id")
    local = Path(source).expanduser()
    if local.is_dir():
        path = local / "config.json"
        if not path.is_file():
            raise SourceError(f"{source} has no config.json")
    elif local.suffix == ".json" and not local.exists():
        raise SourceError(f"no such file: {source}")
    elif _REPO_ID.match(source) and not local.exists():
        # snapshot_download, as quantize does: one attempt (hf_hub_download retries an unreachable Hub for ~25 s)
        with _maybe_a_path(source):
            path = Path(_hub(source, revision, False, lambda offline: huggingface_hub.snapshot_download(
                source, revision=revision, allow_patterns=["config.json"], local_files_only=offline)))
        path = path / "config.json"
        if not path.is_file():
            raise SourceError(f"{source} has no config.json on the Hub")
    elif local.exists():
        raise SourceError(f"{source} is not a checkpoint directory, config.json or Hub repo id")
    else:
        from ninfer_pack.plan import builtin_configs  # plan mode's other sources (no cycle: plan imports no source)
        raise SourceError(f"no such directory: {source} (nor a built-in config: {', '.join(builtin_configs())})")
    return ModelSpec.from_file(path).raw


def _hub_reason(e: Exception, hfe, revision: str | None, offline: bool) -> str | None:
    """A short reason for a Hub failure, or None for an exception that is a bug rather than a user error."""
    if isinstance(e, hfe.GatedRepoError):
        return "the repository is gated; request access on its page, then log in (hf auth login)"
    if isinstance(e, hfe.RepositoryNotFoundError):
        return "repository not found (a private one needs a token: hf auth login)"
    if isinstance(e, hfe.RevisionNotFoundError):
        return f"revision {revision!r} not found"
    if isinstance(e, (hfe.LocalEntryNotFoundError, hfe.OfflineModeIsEnabled)):
        if offline or isinstance(e.__cause__, hfe.OfflineModeIsEnabled) or isinstance(e, hfe.OfflineModeIsEnabled):
            return "offline mode (HF_HUB_OFFLINE) is on and it is not (completely) in the local cache"
        return "the Hub is unreachable and it is not (completely) in the local cache"
    if isinstance(e, hfe.RemoteEntryNotFoundError):
        return "the repository has no such file"
    if isinstance(e, hfe.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return f"not authorised (HTTP {status}); log in with hf auth login"
        return f"HTTP error {status}" if status else _first_line(e)
    if isinstance(e, (hfe.HFValidationError, OSError, hfe.HTTPError)):
        return _first_line(e)
    return None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(e).__name__}: {line[:160]}"
