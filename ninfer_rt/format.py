"""The .ninfer artifact: the one module that knows the file's bytes (docs/format.md says the same in prose).

    offset 0   prefix, 64 bytes:
               magic "NINFER\\x1a\\n" (8) | version u32 LE | flags u32 LE (0) | header length u64 LE |
               SHA-256 of the header (32) | 8 zero bytes
    offset 64  header: UTF-8 JSON (model config and spec, tensor table, resources, recipe, provenance)
    ...        zero padding up to payload_offset, a multiple of 4096
    payload    tensors and resources at absolute offsets, each a multiple of 256; bytes are the kernels' layout

The writer is atomic: everything goes to a hidden temporary file beside the output, which is fsynced and
renamed into place only when complete, so an interrupted run never leaves a file at the output path.
The reader maps the file (mmap) and validates the prefix, header checksum, schema, bounds and alignment
before anything is used; tensor checksums are checked on demand (`verify_checksums`).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import mmap
import os
import socket
import stat
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Iterator
from typing import Callable

import numpy as np

from ninfer_rt.errors import FormatError, NinferError, json_reason
from ninfer_rt.formats import round_up

MAGIC = b"NINFER\x1a\n"  # \x1a and \n catch text-mode transfers, as PNG's signature does
VERSION = 1
PREFIX = struct.Struct("<8sIIQ32s8x")  # 64 bytes
PAYLOAD_ALIGN = 4096
TENSOR_ALIGN = 256
CHECKSUM = "sha256"
_HEX_ZERO = "0" * 64  # placeholder of the final checksum's exact width, so the header length is known early


@dataclass
class TensorEntry:
    """One row of the tensor table.

    name: the artifact tensor's name (a checkpoint name, or brace form for fused tensors);
    parts: the checkpoint tensors it was made from, [{"name", "shape"}], in order;
    transform/params: the named layout transform (ninfer_rt.layout) that produced `shape` from the parts;
    format: the weight format (ninfer_rt.formats) of the bytes; offset/nbytes/sha256: where and what.
    """

    name: str
    shape: list[int]
    format: str
    parts: list[dict]
    transform: str = "identity"
    params: dict = field(default_factory=dict)
    group: str = "text"
    offset: int = 0
    nbytes: int = 0
    sha256: str = _HEX_ZERO

    @classmethod
    def from_dict(cls, d: dict) -> "TensorEntry":
        try:
            return cls(**d)
        except TypeError as e:
            raise FormatError(f"malformed tensor entry {d.get('name', '?')!r}: {e}") from None

    @classmethod
    def from_plan(cls, plan, format: str, group: str, nbytes: int) -> "TensorEntry":
        """The table row for a layout plan (ninfer_rt.layout.TensorPlan); offset and checksum come at write."""
        return cls(name=plan.name, shape=list(plan.shape), format=format,
                   parts=[{"name": n, "shape": list(s)} for n, s in zip(plan.parts, plan.part_shapes)],
                   transform=plan.transform, params=dict(plan.params), group=group, nbytes=nbytes)

    def plan(self):
        """The layout plan (ninfer_rt.layout.TensorPlan) this entry records (inverse of from_plan)."""
        from ninfer_rt.layout import TensorPlan

        return TensorPlan(name=self.name, parts=tuple(p["name"] for p in self.parts),
                          part_shapes=tuple(tuple(p["shape"]) for p in self.parts), transform=self.transform,
                          params=dict(self.params), shape=tuple(self.shape))


@dataclass
class ResourceEntry:
    """A file copied byte for byte from the checkpoint (tokenizer.json, chat template, ...)."""

    name: str
    offset: int = 0
    nbytes: int = 0
    sha256: str = _HEX_ZERO


def _sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def _serialize(header: dict) -> bytes:
    # sort_keys + fixed separators: the same content always gives the same bytes and the same length
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def layout_objects(meta: dict, tensors: list[TensorEntry], resources: list[ResourceEntry]) -> tuple[dict, int]:
    """Assign offsets to every object and return (header dict, payload_offset).

    The header's length depends on the offsets it records, which depend on its length; a fixed point is
    reached in a step or two because only the digit counts can change.
    """
    payload = PAYLOAD_ALIGN
    while True:
        pos = payload
        for obj in [*tensors, *resources]:
            pos = round_up(pos, TENSOR_ALIGN)
            obj.offset = pos
            pos += obj.nbytes
        header = dict(meta, format="ninfer", version=VERSION, checksum=CHECKSUM, payload_offset=payload,
                      file_size=pos, tensors=[asdict(t) for t in tensors],
                      resources=[asdict(r) for r in resources])
        need = round_up(PREFIX.size + len(_serialize(header)), PAYLOAD_ALIGN)
        if need == payload:
            return header, payload
        payload = need


def temp_path(path: Path) -> Path:
    """Where an output is written before its rename over `path`: hidden beside it, named by host and process, so
    that remove_stale_temps can tell one whose writer is gone."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete the temporary files of earlier writes of `path` from this host whose process no longer runs (one
    killed with SIGKILL, or a machine that lost power, leaves its ~20 GB behind); returns them. A live process's,
    another host's (a shared file system) or an unparsable name is left alone."""
    prefix, host, gone = f".{path.name}.tmp-", socket.gethostname(), []
    for f in path.parent.glob(glob.escape(prefix) + "*"):
        who, _, pid = f.name[len(prefix):].rpartition("-")
        if who != host or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or PID reused: leave it)
        except PermissionError:
            continue  # alive, another user's
        except ProcessLookupError:
            pass
        try:
            f.unlink()
            gone.append(f)
        except OSError:
            pass
    return gone


def check_output_path(path: str | os.PathLike, overwrite: bool = True, example: str = "model.ninfer",
                      option: str = "--out") -> None:
    """Fail early, with one line, when `path` cannot become an artifact (or, for other outputs, a file like
    `example`, given by `option`) before hours of work are spent, or already exists and overwrite is False (the
    CLIs' default without --overwrite). Pass the path as the user wrote it: a trailing / (a folder meant) is gone
    once it is a Path."""
    takes = f"{option} takes a file path such as {example}"
    if isinstance(path, str) and path.endswith(("/", os.sep)):
        raise FormatError(f"{path} ends in a folder separator; {takes}")
    path = Path(path)
    if path.is_dir():
        raise FormatError(f"{path} is a directory; {takes}")
    if path.exists() and not path.is_file():  # a device, FIFO or socket: the final rename would replace it
        raise FormatError(f"{path} exists and is not a regular file; {takes}")
    if not path.parent.is_dir():
        raise FormatError(f"output directory does not exist: {path.parent}")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise FormatError(f"output directory is not writable: {path.parent}")
    if path.exists() and not overwrite:
        raise FormatError(f"{path} exists; pass --overwrite to replace it")
    longest = os.pathconf(path.parent, "PC_NAME_MAX")
    if len(os.fsencode(temp_path(path).name)) > longest:  # the hidden temporary name beside it must fit too
        raise FormatError(f"{path.name[:40]}...: a file name of {len(os.fsencode(path.name))} bytes leaves no room for "
                          f"the temporary name written first (at most {longest} bytes in all); use a shorter name")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` for the caller to write: renamed over `path` when the block ends normally,
    removed when it raises, so `path` is the old file or the whole new one (a killed run's temporaries of the same
    output are removed first). ArtifactWriter does the same for an artifact, writing it piece by piece."""
    path = Path(path)
    remove_stale_temps(path)
    tmp = temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class ArtifactWriter:
    """Writes one artifact atomically.

    Usage: construct with the tensor table (nbytes known from the size formulas) and the resources, then
    `with writer: writer.write_tensor(name, buf) ...`; leaving the block normally publishes the file,
    leaving it by an exception (or never calling every write_tensor) removes the temporary file.
    """

    def __init__(self, path: str | os.PathLike, meta: dict, tensors: list[TensorEntry],
                 resources: dict[str, bytes]):
        self.path = Path(path)
        self.tensors = {t.name: t for t in tensors}
        if len(self.tensors) != len(tensors):
            raise ValueError("duplicate tensor names in the artifact plan")
        self._resources = resources
        self._res_entries = [ResourceEntry(name=n, nbytes=len(b)) for n, b in resources.items()]
        self.meta = meta
        self.header, self.payload_offset = layout_objects(meta, tensors, self._res_entries)
        self.file_size = self.header["file_size"]
        self._written: set[str] = set()
        self._tmp = temp_path(self.path)
        self._fd: int | None = None

    def __enter__(self) -> "ArtifactWriter":
        check_output_path(self.path)
        remove_stale_temps(self.path)  # a killed run's half-written file, before this one needs the room
        try:
            self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(self._fd, self.file_size)  # sparse until written; reserves the full length
        except OSError as e:
            raise FormatError(f"cannot write {self.path}: {e.strerror}") from None
        return self

    def write_tensor(self, name: str, data) -> None:
        """Write one tensor's bytes (exactly its planned nbytes) and record their checksum."""
        entry = self.tensors[name]
        view = memoryview(data).cast("B")
        if view.nbytes != entry.nbytes:
            raise ValueError(f"{name}: got {view.nbytes} bytes, the size formula says {entry.nbytes}")
        self._pwrite_all(view, entry.offset)
        entry.sha256 = _sha256(view)
        self._written.add(name)

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < view.nbytes:
                done += os.pwrite(self._fd, view[done:done + (1 << 30)], offset + done)
        except OSError as e:  # disk full, quota: the caller's exit removes the temporary file
            raise FormatError(f"cannot write {self.path}: {e.strerror}") from None

    def _finish(self) -> None:
        missing = [n for n in self.tensors if n not in self._written]
        if missing:
            raise ValueError(f"artifact incomplete: {len(missing)} tensors never written, first {missing[0]}")
        for entry in self._res_entries:
            data = self._resources[entry.name]
            self._pwrite_all(memoryview(data), entry.offset)
            entry.sha256 = _sha256(data)
        header, payload = layout_objects(self.meta, list(self.tensors.values()), self._res_entries)
        assert payload == self.payload_offset and header["file_size"] == self.file_size
        raw = _serialize(header)
        prefix = PREFIX.pack(MAGIC, VERSION, 0, len(raw), hashlib.sha256(raw).digest())
        head = prefix + raw
        self._pwrite_all(memoryview(head + bytes(payload - len(head))), 0)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self._tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
        self.header = header

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._finish()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._tmp.exists():
                self._tmp.unlink()


_REQUIRED = {"format": str, "version": int, "checksum": str, "payload_offset": int, "file_size": int,
             "tensors": list, "resources": list, "model": dict, "recipe": dict, "provenance": dict}
# what info, bench and publish show as text (each may be absent; importance may be null)
_HEADER_TEXT = {"recipe": ("name", "description", "importance"),
                "provenance": ("source", "revision", "path", "ninfer_version")}


class Artifact:
    """A validated, memory-mapped .ninfer file. Use `Artifact.open(path)`; close() or a with block."""

    def __init__(self, path: Path, header: dict, mm: mmap.mmap | None, size: int, header_sha256: str = ""):
        self.path, self.header, self._mm, self.size = path, header, mm, size
        # the header names every tensor's and resource's SHA-256, so its own names the artifact's content
        self.header_sha256 = header_sha256
        self.tensors = {t["name"]: TensorEntry.from_dict(t) for t in header["tensors"]}
        self.resources = {r["name"]: ResourceEntry(**{k: r[k] for k in ("name", "offset", "nbytes", "sha256")})
                          for r in header["resources"]}

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Artifact":
        """Open and validate: magic, version, header checksum and schema, object bounds and alignment."""
        if not os.fspath(path):  # Path("") is "." (a directory): say what was given
            raise FormatError("the artifact path is empty")
        path = Path(path)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise FormatError(f"no such file: {path}") from None
        except OSError as e:  # a symlink loop, a folder we may not enter
            raise FormatError(f"{path}: {e.strerror or e}") from None
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"not a file: {path}")
        size = st.st_size
        with open(path, "rb") as f:
            prefix = f.read(PREFIX.size)
            if len(prefix) < PREFIX.size:
                raise FormatError(f"{path} is not a ninfer artifact (only {size} bytes)")
            magic, version, flags, hlen, hsum = PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise FormatError(f"{path} is not a ninfer artifact (bad magic {magic[:8]!r})")
            if version != VERSION:
                raise FormatError(f"{path} is format version {version}; this ninfer reads version {VERSION}")
            if flags or prefix[56:64] != bytes(8):
                raise FormatError(f"{path}: reserved prefix bytes are not zero (corrupted or a newer writer)")
            if PREFIX.size + hlen > size:
                raise FormatError(f"{path} is truncated: the header needs {PREFIX.size + hlen} bytes, "
                                  f"the file has {size}")
            raw = f.read(hlen)
        if hashlib.sha256(raw).digest() != hsum:
            raise FormatError(f"{path}: header checksum mismatch (the header is corrupted)")
        try:
            header = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{path}: header is not valid UTF-8 JSON ({json_reason(e)})") from None
        _validate_header(path, header, size, PREFIX.size + hlen)
        mm = None
        if size > 0:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return cls(path, header, mm, size, hsum.hex())

    def close(self) -> None:
        """Unmap now, or, while decoded arrays still view the mapping, when the last of them goes."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # numpy views are still alive; dropping our reference lets the GC unmap later
            self._mm = None

    def __enter__(self) -> "Artifact":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def spec(self):
        """The ModelSpec the artifact was made for."""
        from ninfer_rt.config import ModelSpec

        return ModelSpec.from_dict(self.header["model"]["spec"])

    @property
    def groups(self) -> set[str]:
        """The tensor groups the artifact holds ("text", and "mtp" where it kept the MTP head, ...)."""
        return {e.group for e in self.tensors.values()}

    def plan_problems(self) -> list[str]:
        """What is wrong with the tensor table for the model the header describes (layout.check_plans over every
        entry's plan and group); empty when sound."""
        from ninfer_rt.layout import check_plans

        return check_plans(self.spec, [e.plan() for e in self.tensors.values()],
                           {e.name: e.group for e in self.tensors.values()})

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes, zero-copy from the mapping."""
        e = self.tensors[name]
        return memoryview(self._mm)[e.offset:e.offset + e.nbytes]

    def resource(self, name: str) -> bytes:
        r = self.resources[name]
        return bytes(memoryview(self._mm)[r.offset:r.offset + r.nbytes])

    def decode(self, name: str) -> np.ndarray:
        """The tensor decoded to float32 in its artifact layout (after the layout transform)."""
        from ninfer_rt.formats import get_format

        e = self.tensors[name]
        return get_format(e.format).decode(self.raw(name), tuple(e.shape))

    def checkpoint_tensors(self, name: str) -> dict[str, np.ndarray]:
        """Decode one artifact tensor and invert its layout transform: {checkpoint name: float32 array}."""
        from ninfer_rt.layout import apply_inverse

        plan = self.tensors[name].plan()
        try:
            parts = apply_inverse(plan, self.decode(name))
        except (NinferError, ValueError, TypeError, KeyError, ZeroDivisionError) as err:
            # types were checked at open; what remains is a table whose parts, transform and params disagree
            raise FormatError(f"{self.path}: {name}: its layout record cannot be inverted ({err})") from None
        for part, shape in zip(plan.parts, plan.part_shapes):
            if tuple(parts[part].shape) != shape:
                raise FormatError(f"{self.path}: {name}: part {part} comes out {list(parts[part].shape)}, "
                                  f"the table says {list(shape)}")
        return parts

    @property
    def payload_bytes(self) -> int:
        """Bytes of every tensor and resource: what verify_checksums hashes (the file less its header and padding)."""
        return sum(o.nbytes for o in [*self.tensors.values(), *self.resources.values()])

    def verify_checksums(self, on_bytes: Callable[[int], None] | None = None) -> list[str]:
        """SHA-256 of every tensor and resource against the table; returns the names that differ."""
        bad = []
        for obj in [*self.tensors.values(), *self.resources.values()]:
            h = hashlib.sha256()
            view = memoryview(self._mm)[obj.offset:obj.offset + obj.nbytes]
            for i in range(0, obj.nbytes, 64 << 20):
                h.update(view[i:i + (64 << 20)])
            if on_bytes:
                on_bytes(obj.nbytes)
            if h.hexdigest() != obj.sha256:
                bad.append(obj.name)
        return bad

    def nonzero_gaps(self) -> list[str]:
        """The stretches outside every table entry (after the header, between objects) holding a byte that is not
        zero: the writer leaves every gap zero, so one that is not is damage no checksum covers (or bytes whose
        entry was dropped from the table)."""
        hlen = PREFIX.unpack(self._mm[:PREFIX.size])[3]
        spans = sorted((o.offset, o.offset + o.nbytes, o.name) for o in [*self.tensors.values(),
                                                                         *self.resources.values()])
        bad, at, after = [], PREFIX.size + hlen, "the header"
        for start, end, name in [*spans, (self.size, self.size, "the end of the file")]:
            if start > at and np.frombuffer(self._mm, np.uint8, start - at, at).any():
                bad.append(f"bytes [{at}, {start}) between {after} and {name} are in no table entry and not zero "
                           "(padding is zero)")
            if end > at:
                at, after = end, name
        return bad


def _is_int(x) -> bool:
    return type(x) is int  # JSON true/false must not pass as 1/0


def _validate_header(path: Path, h: dict, size: int, header_end: int) -> None:
    """Schema, bounds, alignment and non-overlap; every failure names what is wrong."""
    if not isinstance(h, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    for key, typ in _REQUIRED.items():
        ok = _is_int(h.get(key)) if typ is int else isinstance(h.get(key), typ)
        if not ok:
            raise FormatError(f"{path}: header field '{key}' is missing or not a {typ.__name__}")
    for section, keys in _HEADER_TEXT.items():
        for key in keys:
            if not isinstance(h[section].get(key, ""), (str, type(None))):
                raise FormatError(f"{path}: header field '{section}.{key}' is not a string")
    if h["format"] != "ninfer" or h["version"] != VERSION:
        raise FormatError(f"{path}: header says format {h['format']!r} version {h['version']}")
    if h["file_size"] != size:
        what = "truncated" if size < h["file_size"] else "longer than its header says"
        raise FormatError(f"{path} is {what}: {size} bytes, the header says {h['file_size']}")
    if h["payload_offset"] % PAYLOAD_ALIGN or h["payload_offset"] < header_end:
        raise FormatError(f"{path}: payload offset {h['payload_offset']} is misaligned or inside the header")
    spans = []
    for kind in ("tensors", "resources"):
        for obj in h[kind]:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise FormatError(f"{path}: malformed entry in '{kind}'")
            name, off, n = obj["name"], obj.get("offset"), obj.get("nbytes")
            if not (_is_int(off) and _is_int(n)) or n < 0:
                raise FormatError(f"{path}: {name}: offset/nbytes missing or invalid")
            if off % TENSOR_ALIGN or off < h["payload_offset"] or off + n > size:
                raise FormatError(f"{path}: {name}: bytes [{off}, {off + n}) are misaligned or out of bounds")
            sha = obj.get("sha256")
            if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
                raise FormatError(f"{path}: {name}: missing or malformed checksum")
            spans.append((off, off + n, name))
    for t in h["tensors"]:
        _validate_tensor(path, t)
    spans.sort()
    for (a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise FormatError(f"{path}: {an} and {bn} overlap")
    names = [t["name"] for t in h["tensors"]]
    if len(set(names)) != len(names):
        raise FormatError(f"{path}: duplicate tensor names in the table")
    from ninfer_rt.config import ModelSpec

    try:
        ModelSpec.from_dict(h["model"].get("spec"))
    except (NinferError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as e:
        raise FormatError(f"{path}: model description in the header is invalid ({e})") from None


def _validate_tensor(path: Path, t: dict) -> None:
    """Types of one tensor row, its size formula, and a known layout transform with a params dict."""
    from ninfer_rt.formats import get_format
    from ninfer_rt.layout import TRANSFORMS

    name, shape = t["name"], t.get("shape")
    if not (isinstance(shape, list) and shape and all(_is_int(d) and d > 0 for d in shape)):
        raise FormatError(f"{path}: {name}: invalid shape {shape!r}")
    try:
        fmt = get_format(t.get("format"))
        fmt.check_shape(tuple(shape))
    except NinferError as e:
        raise FormatError(f"{path}: {name}: {e}") from None
    if fmt.nbytes(tuple(shape)) != t["nbytes"]:
        raise FormatError(f"{path}: {name}: {t['nbytes']} bytes, but {fmt.name} {shape} needs "
                          f"{fmt.nbytes(tuple(shape))}")
    parts = t.get("parts")
    if not (isinstance(parts, list) and parts and all(
            isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("shape"), list)
            and p["shape"] and all(_is_int(d) and d > 0 for d in p["shape"]) for p in parts)):
        raise FormatError(f"{path}: {name}: parts must be a list of {{name, shape}}")
    if not isinstance(t.get("transform"), str) or t["transform"] not in TRANSFORMS:
        raise FormatError(f"{path}: {name}: unknown layout transform {t.get('transform')!r}")
    if not isinstance(t.get("params"), dict):
        raise FormatError(f"{path}: {name}: transform params must be an object")
    try:
        TensorEntry.from_dict(t)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None
