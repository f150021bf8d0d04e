"""A weight tensor resident in device memory, in the artifact's own byte layout (docs/format.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ninfer_rt.formats import get_format, round_up, K_ALIGN


@dataclass(frozen=True)
class DeviceWeight:
    """fmt and logical shape as in the artifact header; base is the device address of the tensor's first byte.

    Quantized formats: planes qs / qh / scales at their 256-byte-aligned offsets, R = prod(shape[:-1]) rows of
    Kp = round_up(K, 128) elements. Raw formats (bf16, f16, fp32): one plane 'data', row-major, K unpadded.
    """

    name: str
    fmt: str
    shape: tuple[int, ...]
    base: int

    @property
    def format(self):
        return get_format(self.fmt)

    @property
    def quantized(self) -> bool:
        return self.format.is_quantized

    @property
    def bits(self) -> int:
        return self.format.bits if self.quantized else 16

    @property
    def group(self) -> int:
        return self.format.group if self.quantized else 0

    @property
    def rows(self) -> int:
        """R: every row of every expert (prod of all dims but the last)."""
        return math.prod(self.shape[:-1])

    @property
    def k(self) -> int:
        return self.shape[-1]

    @property
    def kp(self) -> int:
        """Stored row length: K padded to 128 for quantized formats, K itself for raw ones."""
        return round_up(self.k, K_ALIGN) if self.quantized else self.k

    @property
    def nbytes(self) -> int:
        return self.format.nbytes(self.shape)

    def planes(self) -> tuple[int, int, int]:
        """Device addresses (qs, qh, scales); qh is 0 for 4- and 8-bit; (data, 0, 0) for raw formats."""
        p = {pl.name: self.base + pl.offset for pl in self.format.planes(self.shape)}
        if not self.quantized:
            return p["data"], 0, 0
        return p["qs"], p.get("qh", 0), p["scales"]


def k_view(w: DeviceWeight) -> DeviceWeight:
    """A quantized [N, K] weight seen as [N, round_up(K, 32)]: the same bytes (rows are stored padded to 128 with
    zero codes), so kernels that step K in 32s can read it; the input rows must be zero in [K, round_up(K, 32))."""
    if w.k % 32 == 0 or not w.quantized or len(w.shape) != 2:
        return w
    return DeviceWeight(w.name, w.fmt, (w.shape[0], round_up(w.k, 32)), w.base)
