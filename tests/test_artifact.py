"""The .ninfer container: write/read round trip, alignment, atomicity, and every way a file can be bad."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

from ninfer_rt.errors import FormatError
from ninfer_rt.format import MAGIC, PAYLOAD_ALIGN, PREFIX, TENSOR_ALIGN, Artifact, ArtifactWriter, TensorEntry
from ninfer_rt.formats import get_format

META = {"model": {"config": {}, "spec": {}}, "recipe": {"name": "test"}, "provenance": {"source": "unit"}}


def _entries(rng):
    """Three tensors of different formats with their exact bytes."""
    shapes = {"a.weight": ("bf16", (3, 5)), "b.weight": ("fp32", (7,)), "c.weight": ("q4g32", (4, 200))}
    entries, data = [], {}
    for name, (fmt, shape) in shapes.items():
        n = get_format(fmt).nbytes(shape)
        entries.append(TensorEntry(name=name, shape=list(shape), format=fmt,
                                   parts=[{"name": name, "shape": list(shape)}], nbytes=n))
        data[name] = rng.integers(0, 256, n, dtype=np.uint8)
    return entries, data


def _write(path, rng, resources=None):
    entries, data = _entries(rng)
    with ArtifactWriter(path, META, entries, resources or {"tokenizer.json": b'{"x": 1}'}) as w:
        for name in reversed(list(data)):  # any order
            w.write_tensor(name, data[name])
    return data


def test_round_trip_and_alignment(tmp_path):
    rng = np.random.default_rng()
    p = tmp_path / "m.ninfer"
    data = _write(p, rng, {"tokenizer.json": b"tok", "chat_template.jinja": "{{ x }}\u00e9".encode()})
    with Artifact.open(p) as art:
        assert art.size == p.stat().st_size == art.header["file_size"]
        assert art.header["payload_offset"] % PAYLOAD_ALIGN == 0
        for name, buf in data.items():
            e = art.tensors[name]
            assert e.offset % TENSOR_ALIGN == 0
            assert bytes(art.raw(name)) == buf.tobytes()
            assert e.sha256 == hashlib.sha256(buf.tobytes()).hexdigest()
        assert art.resource("chat_template.jinja") == "{{ x }}\u00e9".encode()
        assert art.verify_checksums() == []
    raw = p.read_bytes()
    magic, version, _f, hlen, hsum = PREFIX.unpack(raw[:PREFIX.size])
    assert magic == MAGIC and version == 1
    assert hashlib.sha256(raw[64:64 + hlen]).digest() == hsum
    assert set(raw[64 + hlen:json.loads(raw[64:64 + hlen])["payload_offset"]]) <= {0}


def test_same_content_same_bytes(tmp_path):
    rng1, rng2 = np.random.default_rng(7), np.random.default_rng(7)
    _write(tmp_path / "a.ninfer", rng1)
    _write(tmp_path / "b.ninfer", rng2)
    assert (tmp_path / "a.ninfer").read_bytes() == (tmp_path / "b.ninfer").read_bytes()


def test_interrupted_write_leaves_nothing(tmp_path):
    rng = np.random.default_rng()
    entries, data = _entries(rng)
    p = tmp_path / "m.ninfer"
    with pytest.raises(KeyboardInterrupt):
        with ArtifactWriter(p, META, entries, {}) as w:
            w.write_tensor("a.weight", data["a.weight"])
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="never written"):
        with ArtifactWriter(p, META, entries, {}) as w:
            w.write_tensor("a.weight", data["a.weight"])
    assert list(tmp_path.iterdir()) == []


def test_wrong_size_write_is_refused(tmp_path):
    rng = np.random.default_rng()
    entries, data = _entries(rng)
    with pytest.raises(ValueError, match="size formula"):
        with ArtifactWriter(tmp_path / "m.ninfer", META, entries, {}) as w:
            w.write_tensor("a.weight", data["a.weight"][:-1])
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def good(tmp_path):
    p = tmp_path / "good.ninfer"
    _write(p, np.random.default_rng())
    return p


def _rewrite_header(src, dst, mutate):
    """Copy an artifact with a mutated header, re-hashed so only the mutation is wrong."""
    raw = bytearray(src.read_bytes())
    _m, v, f, hlen, _h = PREFIX.unpack(raw[:PREFIX.size])
    h = json.loads(raw[64:64 + hlen])
    mutate(h)
    new = json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
    assert len(new) <= hlen
    new = new + b" " * (hlen - len(new))  # JSON allows trailing whitespace: same length, offsets stay valid
    raw[:PREFIX.size] = PREFIX.pack(MAGIC, v, f, hlen, hashlib.sha256(new).digest())
    raw[64:64 + hlen] = new
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"),
    ("empty", "not a ninfer artifact"),
    ("foreign", "bad magic"),
    ("version", "format version 9"),
    ("truncated_header", "truncated"),
    ("truncated_payload", "truncated"),
    ("trailing", "longer than its header says"),
    ("header_bit", "header checksum mismatch"),
    ("bad_offset", "misaligned or out of bounds"),
    ("bad_nbytes", "size formula|needs"),
    ("overlap", "overlap"),
    ("unknown_format", "unknown weight format"),
])
def test_bad_files_are_rejected_with_a_reason(good, tmp_path, case, message):
    p = tmp_path / f"{case}.ninfer"
    raw = good.read_bytes()
    hlen = PREFIX.unpack(raw[:PREFIX.size])[3]
    if case == "empty":
        p.write_bytes(b"")
    elif case == "foreign":
        p.write_bytes(b"PK\x03\x04" + raw[4:])
    elif case == "version":
        p.write_bytes(raw[:8] + struct.pack("<I", 9) + raw[12:])
    elif case == "truncated_header":
        p.write_bytes(raw[:100])
    elif case == "truncated_payload":
        p.write_bytes(raw[:-10])
    elif case == "trailing":
        p.write_bytes(raw + b"\0")
    elif case == "header_bit":
        b = bytearray(raw)
        b[64 + hlen // 2] ^= 0x01
        p.write_bytes(bytes(b))
    elif case == "bad_offset":
        _rewrite_header(good, p, lambda h: h["tensors"][0].update(offset=h["tensors"][0]["offset"] + 8))
    elif case == "bad_nbytes":
        _rewrite_header(good, p, lambda h: h["tensors"][0].update(nbytes=h["tensors"][0]["nbytes"] - 1))
    elif case == "overlap":
        _rewrite_header(good, p, lambda h: h["tensors"][1].update(offset=h["tensors"][0]["offset"]))
    elif case == "unknown_format":
        _rewrite_header(good, p, lambda h: h["tensors"][0].update(format="q3g7"))
    with pytest.raises(FormatError, match=message) as ei:
        Artifact.open(p)
    assert "\n" not in str(ei.value)


def test_payload_corruption_is_found_by_checksums(good, tmp_path):
    with Artifact.open(good) as art:
        off = art.tensors["c.weight"].offset
    b = bytearray(good.read_bytes())
    b[off + 3] ^= 0x10
    p = tmp_path / "flip.ninfer"
    p.write_bytes(bytes(b))
    with Artifact.open(p) as art:  # structure is intact...
        assert art.verify_checksums() == ["c.weight"]  # ...the payload is not
