"""Weight formats: byte layout against a naive spec-following packer, round trips, sizes, bf16 vs torch."""

from __future__ import annotations

import math
import mmap
import struct

import numpy as np
import pytest
import torch

from ninfer_rt.errors import FormatError
from ninfer_rt.formats import (FORMATS, IntFormat, bf16_bits_to_f32, f32_to_bf16_bits, get_format, pack_high_bits,
                               pack_nibbles, pad_k, unpack_high_bits, unpack_nibbles, unpad_k)

INT_FORMATS = [f for f in FORMATS.values() if f.is_quantized]
SHAPES = [(3, 200), (2, 3, 130), (4, 256)]  # K not a multiple of 128 (2-D and 3-D), and one that is


def _round_up(n, a):
    return (n + a - 1) // a * a


def random_codes(fmt: IntFormat, shape, rng):
    """Codes [..., Kp] and scales [..., Kp/G] as the format expects them: extremes present, padding zero."""
    k, kp = shape[-1], _round_up(shape[-1], 128)
    q = rng.integers(fmt.qmin, fmt.qmax + 1, size=shape[:-1] + (kp,)).astype(np.int8)
    q.reshape(-1, kp)[0, :2] = (fmt.qmin, fmt.qmax)  # both ends of the code range, always
    q[..., k:] = 0
    s = (rng.standard_normal(shape[:-1] + (kp // fmt.group,)) * 0.02).astype(np.float16)
    s.reshape(-1, kp // fmt.group)[0, :2] = (np.float16(6e-8), np.float16(-65504))  # subnormal, extreme
    s[..., -(-k // fmt.group):] = 0  # groups wholly in the padding
    return q, s


def spec_pack(fmt: IntFormat, q, s, shape) -> bytes:
    """The layout written out element by element from the spec in the module docstring (naive on purpose)."""
    rows, kp, b = math.prod(shape[:-1]), _round_up(shape[-1], 128), fmt.bits
    q2, s2 = q.reshape(rows, kp), s.reshape(rows, -1)
    planes = []
    if b == 8:
        planes.append(bytes(int(v) & 0xFF for v in q2.reshape(-1)))
    else:
        qs, qh = bytearray(rows * kp // 2), bytearray(rows * kp * (b - 4) // 8)
        for r in range(rows):
            for k in range(kp):
                u = int(q2[r, k]) + 2 ** (b - 1)
                qs[(r * kp + k) // 2] |= (u & 15) << (4 * (k % 2))
                if b == 5:
                    qh[(r * kp + k) // 8] |= ((u >> 4) & 1) << (k % 8)
                elif b == 6:
                    qh[(r * kp + k) // 4] |= ((u >> 4) & 3) << (2 * (k % 4))
        planes += [bytes(qs)] + ([bytes(qh)] if b in (5, 6) else [])
    planes.append(b"".join(struct.pack("<e", float(v)) for v in s2.reshape(-1)))
    return b"".join(p + bytes(_round_up(len(p), 256) - len(p)) for p in planes)


@pytest.mark.parametrize("fmt", INT_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pack_matches_spec_and_round_trips(fmt, shape):
    rng = np.random.default_rng(fmt.bits * 1000 + fmt.group + len(shape))
    q, s = random_codes(fmt, shape, rng)
    buf = fmt.pack(q, s)
    assert buf.dtype == np.uint8 and buf.ndim == 1
    assert buf.tobytes() == spec_pack(fmt, q, s, shape)
    assert len(buf) == fmt.nbytes(shape)
    q2, s2 = fmt.unpack(buf.tobytes(), shape)
    assert q2.dtype == np.int8 and q2.shape == q.shape and np.array_equal(q2, q)
    assert s2.dtype == np.float16 and np.array_equal(s2.view(np.uint16), s.view(np.uint16))


@pytest.mark.parametrize("fmt", INT_FORMATS, ids=lambda f: f.name)
def test_decode_is_scale_times_code_exactly(fmt):
    shape = (2, 3, 200)
    q, s = random_codes(fmt, shape, np.random.default_rng(fmt.bits + fmt.group))
    # float64 product of an fp16 and an int is exact; it then fits fp32 exactly, so this is float32(s) * q
    expect = (np.repeat(s.astype(np.float64), fmt.group, axis=-1) * q).astype(np.float32)[..., :200]
    got = fmt.decode(memoryview(fmt.pack(q, s)), shape)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(got.view(np.uint32), expect.view(np.uint32))


def test_sizes_by_hand():
    # q4g64 [256, 2048]: nibbles 256*2048/2 + scales 256*(2048/64)*2, both already multiples of 256
    assert get_format("q4g64").nbytes((256, 2048)) == 262144 + 16384
    assert get_format("q4g64").bits_per_weight((256, 2048)) == 4 + 16 / 64
    # q5g32 [3, 200]: Kp 256; nibbles 384 -> 512, high bits 96 -> 256, scales 3*8*2 = 48 -> 256
    assert get_format("q5g32").nbytes((3, 200)) == 512 + 256 + 256
    # q6g128 [2, 4, 130]: R 8, Kp 256; nibbles 1024, high bits 512, scales 8*2*2 = 32 -> 256
    assert get_format("q6g128").nbytes((2, 4, 130)) == 1024 + 512 + 256
    # q8g64 [5, 128]: codes 640 -> 768, scales 5*2*2 = 20 -> 256
    assert get_format("q8g64").nbytes((5, 128)) == 768 + 256
    assert get_format("q8g32").bits_per_weight((1024, 4096)) == 8 + 16 / 32
    assert get_format("bf16").nbytes((3, 5, 7)) == 3 * 5 * 7 * 2 and get_format("fp32").nbytes((9,)) == 36


@pytest.mark.parametrize("fmt", INT_FORMATS, ids=lambda f: f.name)
def test_planes_aligned_ordered_and_sized(fmt):
    shape = (3, 7, 300)
    planes = fmt.planes(shape)
    assert [p.name for p in planes] == ["qs"] + (["qh"] if fmt.bits in (5, 6) else []) + ["scales"]
    rows, kp = 21, 384
    assert planes[0].shape == ((rows, kp) if fmt.bits == 8 else (rows, kp // 2))
    assert planes[-1].shape == (rows, kp // fmt.group) and planes[-1].dtype == np.float16
    end = 0
    for p in planes:
        assert p.offset % 256 == 0 and p.offset == _round_up(end, 256)
        end = p.offset + p.nbytes
    assert fmt.nbytes(shape) == _round_up(end, 256)


def test_inverse_pairs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 200)).astype(np.float32)
    padded = pad_k(x)
    assert padded.shape == (3, 2, 256) and not padded[..., 200:].any()
    assert np.array_equal(unpad_k(padded, 200), x)
    assert pad_k(padded) is padded
    lo = rng.integers(0, 16, size=(5, 64), dtype=np.uint8)
    assert np.array_equal(unpack_nibbles(pack_nibbles(lo)), lo)
    for width in (1, 2):
        hi = rng.integers(0, 1 << width, size=(5, 64), dtype=np.uint8)
        assert pack_high_bits(hi, width).shape == (5, 64 * width // 8)
        assert np.array_equal(unpack_high_bits(pack_high_bits(hi, width), width), hi)


def test_decode_from_mmap_without_copying(tmp_path):
    fmt = get_format("q8g32")
    q, s = random_codes(fmt, (4, 256), np.random.default_rng(1))
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * 512 + fmt.pack(q, s).tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)[512:512 + fmt.nbytes((4, 256))]
        q2, s2 = fmt.unpack(view, (4, 256))
        base = np.frombuffer(view, np.uint8)
        assert np.shares_memory(q2, base) and np.shares_memory(s2, base)  # views into the mapping
        assert np.array_equal(q2, q)
        del q2, s2, base, view
    buf = get_format("q4g64").pack(*random_codes(get_format("q4g64"), (4, 256), np.random.default_rng(2)))
    assert np.shares_memory(get_format("q4g64").unpack(buf, (4, 256))[1], buf)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    enc = get_format("fp32").encode(x)
    assert np.shares_memory(get_format("fp32").decode(enc, (3, 4)), enc)


def test_raw_formats_little_endian_and_round_trip():
    x = np.array([[1.0, -2.5, 3e-5], [65504.0, 0.1, -0.0]], dtype=np.float32)
    fp32 = get_format("fp32").encode(x)
    assert fp32.tobytes() == b"".join(struct.pack("<f", v) for v in x.reshape(-1))
    assert np.array_equal(get_format("fp32").decode(fp32.tobytes(), x.shape), x)
    f16 = get_format("f16").encode(x)
    assert f16.tobytes() == b"".join(struct.pack("<e", v) for v in x.reshape(-1))
    assert np.array_equal(get_format("f16").decode(f16, x.shape), torch.from_numpy(x).half().float().numpy())
    bf = get_format("bf16")
    want = torch.from_numpy(x).bfloat16()
    assert bf.encode(x).tobytes() == want.view(torch.int16).numpy().astype("<i2").tobytes()
    bits = want.view(torch.int16).numpy().view(np.uint16)
    assert bf.encode(bits).tobytes() == bits.astype("<u2").tobytes()  # bit patterns pass through as is
    assert np.array_equal(bf.decode(bf.encode(x), x.shape), want.float().numpy())
    assert get_format("bf16").nbytes(()) == 2 and not bf.is_quantized


def _torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_bf16_rounding_matches_torch():
    special = [
        0x3F808000, 0x3F818000,  # ties: kept lsb even stays, odd rounds up
        0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000,  # just below / above a tie, negative ties
        0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF,  # inf, and float max which rounds to inf
        0x7F7F7FFF, 0x7F7F8000,  # largest finite bf16, and the tie just above it that overflows
        0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x80008001, 0x00000000, 0x80000000,  # subnormals, zeros
    ]
    rng = np.random.default_rng(0)
    bits = np.concatenate([np.array(special, np.uint32), rng.integers(0, 2**32, 200_000, dtype=np.uint32)])
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    assert np.array_equal(f32_to_bf16_bits(x), _torch_bf16_bits(x))


def test_bf16_nan_stays_nan():
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF810000, 0x7FFFFFFF, 0x7F808000], np.uint32)
    out = f32_to_bf16_bits(nans.view(np.float32))
    assert np.isnan(bf16_bits_to_f32(out)).all()
    # torch's own NaN bits depend on its code path; ours are those of its scalar path, for every NaN
    scalar = torch.tensor(float("nan")).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF
    assert (out == scalar).all()


def test_bf16_to_f32_matches_torch_for_every_pattern():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(bf16_bits_to_f32(bits).view(np.uint32), want.view(np.uint32))


def test_errors_name_the_culprit():
    with pytest.raises(FormatError, match=r"unknown weight format 'q3g64' \(known: bf16, f16, fp32, q4g32"):
        get_format("q3g64")
    with pytest.raises(FormatError, match=r"q4g64 .*got shape \[4096\]"):
        get_format("q4g64").nbytes((4096,))
    fmt = get_format("q5g64")
    q, s = random_codes(fmt, (2, 128), np.random.default_rng(3))
    buf = fmt.pack(q, s)
    with pytest.raises(FormatError, match=r"q5g64 \[2, 128\]: buffer has 767 bytes, expected 768"):
        fmt.decode(buf[:-1], (2, 128))
    with pytest.raises(FormatError, match=r"codes span \[-16, 16\]"):
        fmt.pack(np.full((2, 128), 16, np.int8) - np.eye(2, 128, dtype=np.int8) * 32, s)
    with pytest.raises(FormatError, match="scales must be float16"):
        fmt.pack(q, s.astype(np.float32))
    with pytest.raises(FormatError, match="cannot encode a float64"):
        get_format("bf16").encode(np.zeros(3))


@pytest.mark.parametrize("fmt", ["f16", "bf16", "fp32"])
def test_the_packer_refuses_a_weight_a_raw_format_stores_as_inf(fmt):
    """encode_tensor refuses exactly the weights that the format's own rounding (numpy's for f16, torch's for bf16)
    turns into inf or NaN, naming its row and column; the values just inside are stored."""
    from ninfer_pack.pipeline import encode_tensor
    from ninfer_rt.errors import NinferError

    top = float(np.finfo(np.float32).max)
    half_past = np.float32(2.0 ** 128 * (1 - 2.0 ** -9))  # bf16's largest finite value plus half its ulp
    for x in (65504.0, np.nextafter(np.float32(65520), 0), 65520.0, np.nextafter(half_past, 0), half_past, top,
              math.inf, math.nan):
        w = np.ones((3, 4), np.float32)
        w[1, 2] = x
        if fmt == "f16":
            with np.errstate(over="ignore"):
                stored = float(np.float32(x).astype(np.float16))
        elif fmt == "bf16":
            stored = float(torch.tensor(np.float32(x)).to(torch.bfloat16).float())
        else:
            stored = float(np.float32(x))
        if math.isfinite(stored):
            assert get_format(fmt).decode(encode_tensor(w, fmt, name="t"), (3, 4))[1, 2] == stored
        else:
            with pytest.raises(NinferError, match=r"^tensor t: weight row 1, column 2: "):
                encode_tensor(w, fmt, name="t")
