"""Weight formats: the exact bytes of every tensor in a .ninfer artifact (docs/format.md, "Weight formats").

Raw formats `bf16`, `f16`, `fp32` store an array of any shape row-major, little-endian. numpy has no
bfloat16, so bf16 values travel as uint16 bit patterns (`f32_to_bf16_bits`, `bf16_bits_to_f32`).

Integer formats `q{b}g{G}` (b in 4, 5, 6, 8; G in 32, 64, 128) store a 2-D [N, K] or 3-D [E, N, K]
tensor as R = prod(shape[:-1]) rows of K padded with zeros to Kp = round_up(K, 128), symmetric codes
q in [-2^(b-1), 2^(b-1) - 1] and one fp16 scale per G consecutive elements of a row:

    value = float32(scale[r, k // G]) * q[r, k]

in planes, each at a 256-byte-aligned offset from the tensor's first byte and zero-filled to the next
256-byte boundary:
    qs      b in 4, 5, 6: uint8 [R, Kp/2], low 4 bits of u = q + 2^(b-1), element 2i in the low nibble
            of byte i, 2i+1 in the high nibble;  b = 8: int8 [R, Kp], q itself
    qh      b = 5: uint8 [R, Kp/8], bit j of byte i = bit 4 of u for element 8i+j
            b = 6: uint8 [R, Kp/4], bits 2j..2j+1 of byte i = bits 4..5 of u for element 4i+j
    scales  float16 [R, Kp/G]; groups lying wholly in the K padding have scale 0
Choosing codes (the scale search) lives in ninfer_pack.quant; this module only moves bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ninfer_rt.errors import FormatError

K_ALIGN = 128  # K is padded to a multiple of this: a whole number of groups for every G, and kernel tiles
PLANE_ALIGN = 256  # every plane starts at a multiple of this from the tensor's first byte


def round_up(n: int, a: int) -> int:
    return -(-n // a) * a


# --- bf16 as uint16 bit patterns -------------------------------------------------------------------------

BF16_NAN = 0x7FC0  # canonical quiet NaN: what torch's scalar path (c10::BFloat16) produces for any NaN


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest, ties to even; any NaN -> 0x7FC0.

    Matches torch's `.to(torch.bfloat16)` bit for bit on every non-NaN input (inf, subnormals, overflow to
    inf included). NaNs stay NaN; torch itself is not consistent about their bits (contiguous CPU tensors
    give 0xFFFF, 0-d and strided ones 0x7FC0), so one canonical pattern is used.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # adding 0x7FFF + lsb carries into the kept half exactly when the dropped half is > 0.5 ulp, or = 0.5 ulp
    # and the kept lsb is odd; the carry may ripple into the exponent, which is the right overflow to inf
    lsb = (bits >> 16) & 1
    out = ((bits + (lsb + 0x7FFF)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        out[nan] = BF16_NAN
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exact: the bf16 bits are the high half of the float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# --- named inverse pairs of the integer layouts ----------------------------------------------------------

def pad_k(x: np.ndarray, multiple: int = K_ALIGN) -> np.ndarray:
    """[..., K] -> [..., Kp] with zeros appended, Kp = round_up(K, multiple); no copy when K == Kp.

    Why: kernels walk K in 128-wide tiles and groups must tile K exactly, so every stored row has the
    same padded length and no kernel needs a ragged tail. Inverse: unpad_k(pad_k(x), K) == x.
    """
    k = x.shape[-1]
    kp = round_up(k, multiple)
    if kp == k:
        return x
    out = np.zeros(x.shape[:-1] + (kp,), dtype=x.dtype)
    out[..., :k] = x
    return out


def unpad_k(x: np.ndarray, k: int) -> np.ndarray:
    """[..., Kp] -> [..., K]: a view dropping the padding columns (inverse of pad_k)."""
    return x[..., :k]


def pack_nibbles(lo: np.ndarray) -> np.ndarray:
    """uint8 [..., 2n] of 4-bit values -> uint8 [..., n]: element 2i in the low nibble of byte i, 2i+1 high.

    Why: halves the bytes of 4-bit data; adjacent elements share a byte so one byte load feeds two
    consecutive K positions. Inverse: unpack_nibbles(pack_nibbles(lo)) == lo.
    """
    # out: [..., n] = even elements | odd elements << 4
    return lo[..., 0::2] | (lo[..., 1::2] << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> uint8 [..., 2n] of 4-bit values, low nibble first (inverse of pack_nibbles)."""
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    np.bitwise_and(packed, 0x0F, out=out[..., 0::2])
    np.right_shift(packed, 4, out=out[..., 1::2])
    return out


def pack_high_bits(hi: np.ndarray, width: int) -> np.ndarray:
    """uint8 [..., n*(8/width)] of `width`-bit values -> uint8 [..., n]; element j of a byte at bits j*width.

    Why: 5- and 6-bit codes keep their low 4 bits in the nibble plane (shared with 4-bit, so one unpack
    path serves all three) and their remaining 1 or 2 bits in this dense plane; width 1 puts element 8i+j
    in bit j of byte i, width 2 puts element 4i+j in bits 2j..2j+1. Inverse: unpack_high_bits.
    """
    per = 8 // width
    # h: [..., n, per]; the bytes are disjoint bit fields OR-ed together
    h = hi.reshape(hi.shape[:-1] + (hi.shape[-1] // per, per))
    out = h[..., 0].copy()
    for j in range(1, per):  # at most 8 vectorised passes, not a loop over elements
        out |= h[..., j] << (j * width)
    return out


def unpack_high_bits(packed: np.ndarray, width: int) -> np.ndarray:
    """uint8 [..., n] -> uint8 [..., n*(8/width)] of `width`-bit values (inverse of pack_high_bits)."""
    per = 8 // width
    mask = (1 << width) - 1
    out = np.empty(packed.shape + (per,), dtype=np.uint8)
    for j in range(per):
        np.bitwise_and(packed >> (j * width), mask, out=out[..., j])
    return out.reshape(packed.shape[:-1] + (packed.shape[-1] * per,))


# --- formats ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plane:
    """One contiguous array inside a tensor's bytes: offset from the tensor's first byte, row-major."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of the array itself, without the alignment fill after it."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


class WeightFormat:
    """Base of all formats: name, size formula, plane layout, shape check, exact decode to float32."""

    name: str
    is_quantized: bool

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raise FormatError naming the shape if this format cannot store a tensor of that shape."""
        if not all(isinstance(d, (int, np.integer)) and d > 0 for d in shape):
            raise FormatError(f"{self.name}: invalid shape {tuple(shape)}: every dim must be a positive int")

    def planes(self, shape: tuple[int, ...]) -> list[Plane]:
        """The arrays that make up a tensor of this shape, in byte order."""
        raise NotImplementedError

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Exact size in bytes of a tensor of this shape."""
        raise NotImplementedError

    def bits_per_weight(self, shape: tuple[int, ...]) -> float:
        """8 * nbytes / number of logical elements (padding and alignment included in the cost)."""
        return 8 * self.nbytes(shape) / math.prod(shape)

    def decode(self, buf, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor's values as float32 of the logical shape (K padding stripped)."""
        raise NotImplementedError

    def _view(self, buf, shape: tuple[int, ...]) -> np.ndarray:
        """buf (anything with the buffer protocol) as a flat uint8 array, zero-copy, after a size check."""
        self.check_shape(shape)
        raw = np.frombuffer(buf, dtype=np.uint8)
        want = self.nbytes(shape)
        if raw.size != want:
            raise FormatError(f"{self.name} {list(shape)}: buffer has {raw.size} bytes, expected {want}")
        return raw

    def _plane(self, raw: np.ndarray, p: Plane) -> np.ndarray:
        return raw[p.offset:p.offset + p.nbytes].view(p.dtype).reshape(p.shape)

    def __repr__(self) -> str:
        return f"<weight format {self.name}>"


class RawFormat(WeightFormat):
    """An array of any shape stored as is: row-major, little-endian bf16 (uint16 bits), f16 or fp32."""

    is_quantized = False

    def __init__(self, name: str, dtype: str):
        self.name = name
        self.dtype = np.dtype(dtype)  # the stored element: '<u2' for bf16, '<f2', '<f4'

    def planes(self, shape):
        """One plane, 'data', at offset 0."""
        self.check_shape(shape)
        return [Plane("data", self.dtype, tuple(shape), 0)]

    def nbytes(self, shape):
        """prod(shape) * element size; no alignment fill (the file aligns tensors, not the format)."""
        self.check_shape(shape)
        return math.prod(shape) * self.dtype.itemsize

    def encode(self, array: np.ndarray) -> np.ndarray:
        """array -> flat uint8 buffer of nbytes(array.shape).

        bf16 takes uint16 bit patterns as is, or float16/float32 rounded (f32_to_bf16_bits); f16 takes
        float16 as is or float32 rounded to nearest even; fp32 takes float16/float32 (exact).
        """
        a = np.asarray(array)
        ok = {"bf16": ("uint16", "float16", "float32"), "f16": ("float16", "float32"),
              "fp32": ("float16", "float32")}[self.name]
        if a.dtype.name not in ok:
            raise FormatError(f"{self.name}: cannot encode a {a.dtype} array (accepts {', '.join(ok)})")
        if self.name == "bf16" and a.dtype != np.uint16:
            a = f32_to_bf16_bits(a.astype(np.float32))
        self.check_shape(a.shape)
        return np.ascontiguousarray(a, dtype=self.dtype).reshape(-1).view(np.uint8)

    def decode(self, buf, shape):
        """float32 of `shape`; fp32 is a zero-copy view of buf (read-only if buf is)."""
        data = self._plane(self._view(buf, shape), self.planes(shape)[0])
        if self.name == "bf16":
            return bf16_bits_to_f32(data)
        return data.astype(np.float32, copy=False)


class IntFormat(WeightFormat):
    """q{bits}g{group}: symmetric integer codes, one fp16 scale per group of `group` elements along K."""

    is_quantized = True

    def __init__(self, bits: int, group: int):
        self.bits, self.group = bits, group
        self.name = f"q{bits}g{group}"
        self.qmin, self.qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        self.offset = 1 << (bits - 1)  # u = q + offset is the unsigned code whose bits are stored

    def check_shape(self, shape):
        """2-D [N, K] or 3-D [E, N, K] (any number of leading dims >= 1 works the same way)."""
        if len(shape) < 2:
            raise FormatError(f"{self.name} needs a [N, K] or [E, N, K] tensor, got shape {list(shape)}")
        super().check_shape(shape)

    def planes(self, shape):
        """qs, then qh (5 and 6 bits only), then scales, each at a 256-byte-aligned offset."""
        self.check_shape(shape)
        rows, kp = math.prod(shape[:-1]), round_up(shape[-1], K_ALIGN)
        if self.bits == 8:
            arrays = [("qs", np.dtype(np.int8), (rows, kp))]
        else:
            arrays = [("qs", np.dtype(np.uint8), (rows, kp // 2))]
            if self.bits in (5, 6):
                arrays.append(("qh", np.dtype(np.uint8), (rows, kp * (self.bits - 4) // 8)))
        arrays.append(("scales", np.dtype("<f2"), (rows, kp // self.group)))
        out, off = [], 0
        for name, dtype, pshape in arrays:
            p = Plane(name, dtype, pshape, off)
            out.append(p)
            off = round_up(off + p.nbytes, PLANE_ALIGN)
        return out

    def nbytes(self, shape):
        """Sum of the planes' sizes, each rounded up to 256 bytes."""
        return sum(round_up(p.nbytes, PLANE_ALIGN) for p in self.planes(shape))

    def _check_codes(self, q: np.ndarray, scales: np.ndarray) -> None:
        if q.dtype != np.int8 or q.ndim < 2 or q.shape[-1] % K_ALIGN:
            raise FormatError(f"{self.name}: codes must be int8 [..., Kp] with Kp a multiple of {K_ALIGN}, "
                              f"got {q.dtype} {list(q.shape)}")
        want = q.shape[:-1] + (q.shape[-1] // self.group,)
        if scales.dtype != np.float16 or scales.shape != want:
            raise FormatError(f"{self.name}: scales must be float16 {list(want)}, "
                              f"got {scales.dtype} {list(scales.shape)}")
        lo, hi = int(q.min()), int(q.max())
        if lo < self.qmin or hi > self.qmax:
            raise FormatError(f"{self.name}: codes span [{lo}, {hi}], outside [{self.qmin}, {self.qmax}]")

    def pack(self, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """Codes int8 [..., Kp] and scales float16 [..., Kp/G] -> flat uint8 buffer of the planes.

        Its length is nbytes(shape) for any logical shape whose K pads to Kp (the layout depends on Kp
        only). The caller supplies zeros in the K padding (codes 0, padding-only groups scale 0).
        """
        rows, kp = math.prod(q.shape[:-1]), q.shape[-1]
        buf = np.zeros(self.nbytes((rows, kp)), dtype=np.uint8)
        self.pack_rows(buf, rows, 0, q.reshape(rows, kp), scales.reshape(rows, -1))
        return buf

    def pack_rows(self, buf: np.ndarray, total_rows: int, row0: int, q: np.ndarray, scales: np.ndarray) -> None:
        """Write rows [row0, row0 + n) of a tensor of total_rows rows into every plane of buf, in place.

        Planes are row-major, so a block of rows is one contiguous slice of each plane: a large tensor is
        packed chunk by chunk into its final buffer with no full-size temporaries.
        """
        self._check_codes(q, scales)
        n, kp = q.shape
        planes = {p.name: p for p in self.planes((total_rows, kp))}
        rows = slice(row0, row0 + n)
        if self.bits == 8:
            self._plane(buf, planes["qs"])[rows] = q
        else:
            u = (q.view(np.uint8) + np.uint8(self.offset))  # wraps mod 256 to exactly q + 2^(b-1)
            self._plane(buf, planes["qs"])[rows] = pack_nibbles(u & 0x0F)
            if self.bits > 4:
                self._plane(buf, planes["qh"])[rows] = pack_high_bits(u >> 4, self.bits - 4)
        self._plane(buf, planes["scales"])[rows] = scales

    def unpack(self, buf, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Inverse of pack: (codes int8 [..., Kp], scales float16 [..., Kp/G]) for the logical shape.

        Scales are always a zero-copy view of buf, and so are the codes for 8 bits.
        """
        raw = self._view(buf, shape)
        planes = {p.name: p for p in self.planes(shape)}
        lead = tuple(shape[:-1])
        scales = self._plane(raw, planes["scales"]).reshape(lead + (-1,))
        qs = self._plane(raw, planes["qs"])
        if self.bits == 8:
            return qs.reshape(lead + (-1,)), scales
        u = unpack_nibbles(qs)
        if self.bits > 4:
            u |= unpack_high_bits(self._plane(raw, planes["qh"]), self.bits - 4) << 4
        u -= np.uint8(self.offset)  # wraps mod 256: the int8 view is q
        return u.view(np.int8).reshape(lead + (-1,)), scales

    def decode(self, buf, shape):
        """float32(scale) * q, exact (an fp16 scale times a <= 8-bit code fits fp32's 24-bit mantissa)."""
        q, scales = self.unpack(buf, shape)
        rows, kp = math.prod(shape[:-1]), q.shape[-1]
        # w: [R, Kp/G, G] = codes * per-group scale
        w = q.reshape(rows, kp // self.group, self.group).astype(np.float32)
        w *= scales.reshape(rows, -1, 1).astype(np.float32)
        return np.ascontiguousarray(w.reshape(rows, kp)[:, :shape[-1]]).reshape(shape)


FORMATS: dict[str, WeightFormat] = {
    "bf16": RawFormat("bf16", "<u2"),
    "f16": RawFormat("f16", "<f2"),
    "fp32": RawFormat("fp32", "<f4"),
    **{f"q{b}g{g}": IntFormat(b, g) for b in (4, 5, 6, 8) for g in (32, 64, 128)},
}


def get_format(name: str) -> WeightFormat:
    """The format called `name`; FormatError listing the known names otherwise."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise FormatError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})")
    return fmt
