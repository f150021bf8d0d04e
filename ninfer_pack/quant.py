"""Choosing integer codes and scales for the q{b}g{G} formats (byte layouts live in ninfer_rt.formats).

Every group of G consecutive weights along K gets one fp16 scale s and codes q = clamp(round(w / s)) in
[-2^(b-1), 2^(b-1) - 1]; the stored value is s * q. Max-abs (s = max|w| / (2^(b-1) - 1)) never clips but
wastes resolution on heavy-tailed groups, so the search tries clipped and sign-flipped scales and keeps,
per group, the one with the lowest importance-weighted squared error of the values actually stored.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ninfer_rt.errors import NinferError

K_ALIGN = 128  # ninfer_rt.formats pads K to this; codes and scales come out already padded
CLIP_FACTORS = tuple(round(0.5 + 0.05 * i, 2) for i in range(11))  # 0.5, 0.55, ..., 1.0; 21 steps gain < 0.3%
_CHUNK_ELEMS = 1 << 18  # weights per chunk: its ~6 fp32 temporaries (6 MB) stay in cache across candidates


def _fp16(s: torch.Tensor) -> torch.Tensor:
    """Round to the fp16 value actually stored, kept in fp32 so errors are measured on it."""
    return s.to(torch.float16).to(torch.float32)


def _codes(w: torch.Tensor, s: torch.Tensor, qmin: int, qmax: int, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """q = clamp(round(w / s)) as fp32; w: [n, g, G], s: [n, g, 1]; a zero scale gives zero codes.

    w / s is computed as w * fp32(1/s): a product is several times cheaper than a division on CPU, and
    check_decoded's allowance covers the extra rounding.
    """
    inv = torch.where(s == 0, 0.0, 1.0 / s)  # s == 0 only for an all-zero group or an fp16 underflow
    return torch.mul(w, inv, out=out).round_().clamp_(qmin, qmax)


def _err(w: torch.Tensor, s: torch.Tensor, imp: torch.Tensor | None, qmin: int, qmax: int,
         buf: torch.Tensor) -> torch.Tensor:
    """Σ_k imp_k (w_k - s q_k)^2 per group for q = _codes(w, s): [n, g]; buf is scratch shaped like w."""
    d = _codes(w, s, qmin, qmax, out=buf).mul_(s).sub_(w).square_()
    if imp is not None:
        d.mul_(imp)
    return d.sum(-1)


def _search(w: torch.Tensor, imp: torch.Tensor | None, qmin: int, qmax: int) -> torch.Tensor:
    """Per-group scale (fp32 holding fp16 values) with the lowest weighted error; w: [n, g, G] -> [n, g, 1]."""
    buf = torch.empty_like(w)
    amax, where_max = w.abs().max(-1, keepdim=True)
    signed_max = w.gather(-1, where_max)  # the largest-magnitude element with its sign: [n, g, 1]
    # max-abs goes first and only a strictly lower error replaces it, so the search never does worse
    best_s = _fp16(amax / qmax)
    best_e = _err(w, best_s, imp, qmin, qmax, buf)
    bases = (amax / qmax, signed_max / qmin)  # the second maps the largest element to qmin (Q4_0's trick)
    for c in CLIP_FACTORS:
        for i, base in enumerate(bases):
            if i == 0 and c == 1.0:
                continue
            s = _fp16(base * c)
            e = _err(w, s, imp, qmin, qmax, buf)
            better = e < best_e
            best_e = torch.where(better, e, best_e)
            best_s = torch.where(better.unsqueeze(-1), s, best_s)
    # one least-squares step for the winner's codes: s* = Σ imp w q / Σ imp q^2
    q = _codes(w, best_s, qmin, qmax)
    iq = q if imp is None else q * imp
    num, den = (iq * w).sum(-1, keepdim=True), (iq * q).sum(-1, keepdim=True)
    s = _fp16(torch.where(den > 0, num / torch.where(den > 0, den, 1.0), best_s))
    e = _err(w, s, imp, qmin, qmax, buf)
    return torch.where((e < best_e).unsqueeze(-1), s, best_s)


def quantize_rows(w: torch.Tensor, bits: int, group: int, importance: torch.Tensor | None = None,
                  search: bool = True, first_row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales for a [R, K] float matrix: (q int8 [R, Kp], scales float16 [R, Kp/G]).

    K is zero-padded to Kp = round_up(K, 128) first, so groups wholly in the padding get scale 0.
    search=False: max-abs, s = max|w| / (2^(b-1) - 1). search=True: per group, the fp16 scale minimising
    Σ_k importance_k (w_k - s q_k)^2 over clip factors CLIP_FACTORS of max-abs and of the scale that maps
    the largest-magnitude element to -2^(b-1), then one least-squares refinement. importance: [K], >= 0,
    default ones (e.g. mean squared activation per input channel). Rows are processed in chunks.
    first_row: the index of w's first row in the whole tensor, so errors name the row a user can find.
    """
    if bits not in (4, 5, 6, 8) or group not in (32, 64, 128):
        raise ValueError(f"no format q{bits}g{group}: bits must be 4, 5, 6 or 8 and group 32, 64 or 128")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_rows needs a float [R, K] matrix, got {w.dtype} {list(w.shape)}")
    rows, k = w.shape
    kp = -(-k // K_ALIGN) * K_ALIGN
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    imp = None
    if importance is not None:
        imp = importance.detach().to(torch.float32).reshape(-1)
        if imp.numel() != k or not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
            raise NinferError(f"importance must be {k} finite values >= 0, got {list(importance.shape)}")
        imp = torch.nn.functional.pad(imp, (0, kp - k)).reshape(1, kp // group, group)
    q_out = torch.empty(rows, kp, dtype=torch.int8)
    s_out = torch.empty(rows, kp // group, dtype=torch.float16)
    step = max(1, _CHUNK_ELEMS // kp)
    for r0 in range(0, rows, step):
        # wc: [n, Kp/G, G]
        wc = torch.nn.functional.pad(w[r0:r0 + step].detach().to(torch.float32), (0, kp - k))
        wc = wc.reshape(-1, kp // group, group)
        if not bool(torch.isfinite(wc).all()):
            r, c = (~torch.isfinite(wc.reshape(-1, kp))).nonzero()[0].tolist()
            raise NinferError(f"weight row {first_row + r0 + r} col {c} is {wc.reshape(-1, kp)[r, c].item()}: "
                              f"only finite values can be quantized")
        s = _search(wc, imp, qmin, qmax) if search else _fp16(wc.abs().amax(-1, keepdim=True) / qmax)
        if not bool(torch.isfinite(s).all()):
            r = int((~torch.isfinite(s)).reshape(s.shape[0], -1).any(-1).nonzero()[0])
            raise NinferError(f"weight row {first_row + r0 + r}: a group's scale overflows fp16 (max 65504)")
        q_out[r0:r0 + step] = _codes(wc, s, qmin, qmax).reshape(-1, kp).to(torch.int8)
        s_out[r0:r0 + step] = s.reshape(-1, kp // group).to(torch.float16)
    return q_out, s_out


def _f64(x) -> torch.Tensor:
    """A float64 copy of a torch or numpy block (decoded arrays are often read-only views of a file)."""
    return torch.from_numpy(np.array(x, dtype=np.float64)) if isinstance(x, np.ndarray) else x.to(torch.float64)


def check_decoded(w, w_hat, scales, bits: int, group: int) -> tuple[bool, str]:
    """Exact check that w_hat [R, K] (decoded) is a correct q{bits}g{group} encoding of w [R, K].

    With s the float32 value of an element's fp16 scale and qmin/qmax the code range, every element is
      in range (|w/s| <= qmax + 1/2): |w - ŵ| <= |s|/2 + 2^-23 |w|, or
      clipped (beyond it): ŵ == s * qmax or s * qmin, the end on the side of w/s, exactly.
    The allowance 2^-23 |w| = 2 u |w| (u = 2^-24, fp32 unit roundoff) covers an encoder computing w/s in
    fp32 with up to two roundings (a division, or a reciprocal then a product): |fl(w/s) - w/s| <= 2u|w/s|.
    Within that same slack of the boundary either rule is accepted. s * q itself is exact in fp32.
    Groups lying wholly in the K padding must have scale 0. Accepts torch tensors or numpy arrays.
    Returns (ok, detail); detail names the worst element (row, column, values) when not ok.
    """
    scales = torch.tensor(scales) if isinstance(scales, np.ndarray) else scales  # small: copy, may be read-only
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if len(w.shape) != 2 or tuple(w_hat.shape) != tuple(w.shape):
        return False, f"shapes differ: source {list(w.shape)}, decoded {list(w_hat.shape)}"
    rows, k = w.shape
    kp = -(-k // K_ALIGN) * K_ALIGN
    if tuple(scales.shape) != (rows, kp // group):
        return False, f"scales are {list(scales.shape)}, expected {[rows, kp // group]}"
    if not bool(torch.isfinite(scales).all()):
        r, g = (~torch.isfinite(scales)).nonzero()[0].tolist()
        return False, f"row {r}: group {g} has scale {scales[r, g].item()}"
    real_groups = -(-k // group)
    if bool((scales[:, real_groups:] != 0).any()):
        r, g = (scales[:, real_groups:] != 0).nonzero()[0].tolist()
        g += real_groups
        return False, f"row {r}: padding group {g} has scale {scales[r, g].item()}, not 0"
    worst, n_bad, n_clipped = (-math.inf, None), 0, 0
    step = max(1, _CHUNK_ELEMS // kp)
    for r0 in range(0, rows, step):
        # all [n, K] in float64, where every quantity below is exact or carries only 2^-53 error
        wc, hc = _f64(w[r0:r0 + step]), _f64(w_hat[r0:r0 + step])
        s = scales[r0:r0 + step].to(torch.float64).repeat_interleave(group, dim=1)[:, :k]
        ratio = torch.where(s == 0, torch.where(wc == 0, 0.0, math.inf), wc.abs() / s.abs())
        slack = ratio * 2.0 ** -23
        err = (wc - hc).abs()
        bound = s.abs() / 2 + wc.abs() * 2.0 ** -23
        end = torch.where(wc * s > 0, s * qmax, s * qmin)
        in_range = ratio <= qmax + 0.5 + slack
        clipped = ratio > qmax + 0.5 - slack
        excess = torch.minimum(torch.where(in_range, err - bound, math.inf),
                               torch.where(clipped, (hc - end).abs(), math.inf))
        excess = torch.where(torch.isnan(excess), math.inf, excess)  # a NaN decode fails
        n_clipped += int((ratio > qmax + 0.5).sum())
        bad = excess > 0
        n_bad += int(bad.sum())
        if bool(bad.any()):
            r, c = divmod(int(excess.reshape(-1).argmax()), k)
            if float(excess[r, c]) > worst[0]:
                what = (f"clipped, expected the code-range end {end[r, c].item():.9g}"
                        if ratio[r, c] > qmax + 0.5 else "in range")
                worst = (float(excess[r, c]),
                         f"row {r0 + r} col {c}: w={wc[r, c].item():.9g} decoded={hc[r, c].item():.9g} "
                         f"scale={s[r, c].item():.9g} ({what}; bound {bound[r, c].item():.3g})")
    if n_bad:
        return False, f"{n_bad} of {rows * k} elements wrong; worst {worst[1]}"
    return True, f"{rows * k} elements within |s|/2 + 2^-23|w|, {n_clipped} clipped to the code range"
