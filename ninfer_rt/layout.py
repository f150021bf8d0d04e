"""Layout transforms: checkpoint tensors (canonical names) -> the tensors the GPU kernels read, and back.

Every transform is a named pair of pure numpy functions, forward and inverse, that move rows (axis 0, or
axis 1 of an expert bank) and never touch values, so they work bit-exactly on any dtype: float32, uint16
bf16 bit patterns, or per-row companions of a weight (quantization codes, scales) that share its leading
dims but not its last one.

The tensor plan (`plan_tensors`) says which checkpoint tensors become which artifact tensor, by which
transform with which parameters. It is JSON-able: the artifact header stores it, and the runtime inverts a
tensor with `apply_inverse` without the packer. A fused tensor is named in brace form,
`model.language_model.layers.3.self_attn.{q_proj,k_proj,v_proj}.weight`, so `grep q_proj` still finds it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from ninfer_rt.errors import ConfigError

GATE_UP_TILE = 16  # rows of gate (then of up) per output tile of the fused SwiGLU GEMV


def _check_rest(parts: Sequence[np.ndarray], what: str) -> None:
    """All parts must agree in every dim after the row axis."""
    rest = {p.shape[1:] for p in parts}
    if len(rest) != 1:
        raise ValueError(f"{what}: parts disagree after the row axis: {[p.shape for p in parts]}")


# ---------------------------------------------------------------------------------------------------------
# Gated attention: q_proj (query and gate interleaved per head) + k_proj + v_proj -> one [q | k | v | gate].

def fuse_qkvg(q_proj: np.ndarray, k_proj: np.ndarray, v_proj: np.ndarray, *, num_heads: int,
              num_kv_heads: int, head_dim: int) -> np.ndarray:
    """Fuse the gated-attention input projections into one row block, gate last.

    Before (nH heads, nKV KV heads, head dim d, hidden H):
        q_proj [nH·2d, H]   rows per head h: [query_h (d rows) | gate_h (d rows)], heads one after another
        k_proj [nKV·d, H]   v_proj [nKV·d, H]
    After:
        [nH·d (query, head-major) | nKV·d (k) | nKV·d (v) | nH·d (gate, head-major), H]
    Why: one GEMV yields everything attention needs; q, k, v come out contiguous for q/k-norm, RoPE and the
    KV-cache write, and the output gate, needed only after attention, sits apart at the end.
    """
    nh, nkv, d = num_heads, num_kv_heads, head_dim
    if q_proj.shape[0] != nh * 2 * d or k_proj.shape[0] != nkv * d or v_proj.shape[0] != nkv * d:
        raise ValueError(f"fuse_qkvg: rows {q_proj.shape[0]}, {k_proj.shape[0]}, {v_proj.shape[0]} do not fit "
                         f"num_heads={nh}, num_kv_heads={nkv}, head_dim={d}")
    _check_rest([q_proj, k_proj, v_proj], "fuse_qkvg")
    rest = q_proj.shape[1:]
    qg = q_proj.reshape(nh, 2, d, *rest)  # [head, (query, gate), d, ...]
    query = qg[:, 0].reshape(nh * d, *rest)
    gate = qg[:, 1].reshape(nh * d, *rest)
    return np.ascontiguousarray(np.concatenate([query, k_proj, v_proj, gate], axis=0))


def split_qkvg(fused: np.ndarray, *, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of fuse_qkvg: [q | k | v | gate] -> (q_proj with query/gate re-interleaved per head, k_proj, v_proj)."""
    nh, nkv, d = num_heads, num_kv_heads, head_dim
    if fused.shape[0] != 2 * nh * d + 2 * nkv * d:
        raise ValueError(f"split_qkvg: {fused.shape[0]} rows do not fit num_heads={nh}, "
                         f"num_kv_heads={nkv}, head_dim={d}")
    rest = fused.shape[1:]
    query, k, v, gate = np.split(fused, np.cumsum([nh * d, nkv * d, nkv * d]), axis=0)
    q_proj = np.stack([query.reshape(nh, d, *rest), gate.reshape(nh, d, *rest)], axis=1).reshape(nh * 2 * d, *rest)
    return np.ascontiguousarray(q_proj), np.ascontiguousarray(k), np.ascontiguousarray(v)


# ---------------------------------------------------------------------------------------------------------
# Generic row fusion.

def concat_rows(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Stack matrices that read the same input on top of each other.

    Before: A [n1, K], B [n2, K], ...      After: [n1 + n2 + ..., K] = [A | B | ...] by rows
    Why: one GEMV over the shared input instead of several small ones. Used for DeltaNet
    [in_proj_qkv | in_proj_z] and [in_proj_b | in_proj_a], and the MoE router
    [mlp.gate (E rows) | shared_expert_gate (1 row)].
    """
    if not parts:
        raise ValueError("concat_rows: no parts")
    _check_rest(parts, "concat_rows")
    return np.ascontiguousarray(np.concatenate(list(parts), axis=0))


def split_rows(fused: np.ndarray, rows: Sequence[int]) -> list[np.ndarray]:
    """Inverse of concat_rows: cut [n1 + n2 + ..., K] back into parts of `rows` = [n1, n2, ...] rows."""
    if sum(rows) != fused.shape[0]:
        raise ValueError(f"split_rows: rows {list(rows)} sum to {sum(rows)}, the tensor has {fused.shape[0]}")
    return [np.ascontiguousarray(p) for p in np.split(fused, np.cumsum(rows)[:-1], axis=0)]


# ---------------------------------------------------------------------------------------------------------
# SwiGLU gate/up interleaving.

def _interleave_bank(bank: np.ndarray, tile: int) -> np.ndarray:
    # bank: [E, 2I, ...] gate rows 0..I-1, up rows I..2I-1 -> [E, I/tile, (gate, up), tile, ...]
    e, two_i, rest = bank.shape[0], bank.shape[1], bank.shape[2:]
    i = two_i // 2
    if two_i % 2 or i % tile:
        raise ValueError(f"interleave_gate_up: intermediate size I={two_i / 2:g} is not a multiple of tile {tile}")
    gate = bank[:, :i].reshape(e, i // tile, tile, *rest)
    up = bank[:, i:].reshape(e, i // tile, tile, *rest)
    return np.ascontiguousarray(np.stack([gate, up], axis=2).reshape(e, two_i, *rest))


def _deinterleave_bank(bank: np.ndarray, tile: int) -> np.ndarray:
    e, two_i, rest = bank.shape[0], bank.shape[1], bank.shape[2:]
    i = two_i // 2
    if two_i % 2 or i % tile:
        raise ValueError(f"deinterleave_gate_up: intermediate size I={two_i / 2:g} is not a multiple of tile {tile}")
    t = bank.reshape(e, i // tile, 2, tile, *rest)
    gate = t[:, :, 0].reshape(e, i, *rest)
    up = t[:, :, 1].reshape(e, i, *rest)
    return np.ascontiguousarray(np.concatenate([gate, up], axis=1))


def interleave_gate_up(*parts: np.ndarray, tile: int = GATE_UP_TILE) -> np.ndarray:
    """Interleave SwiGLU gate and up rows in tiles of `tile` rows.

    Before, either form:
        bank   gate_up [E, 2I, H]: per expert, gate rows 0..I-1 then up rows I..2I-1
        pair   gate [I, H] + up [I, H]: a dense MLP or a shared expert
    After:
        bank   [E, 2I, H];  pair  [2I, H]  (the bank form with E = 1, without the E axis)
        per expert, rows alternate gate[0:16], up[0:16], gate[16:32], up[16:32], ...
    Why: one output tile of the fused GEMV then holds matching gate and up values, so SwiGLU
    silu(gate)·up is applied in registers before anything is written.
    I must be a multiple of `tile`.
    """
    if len(parts) == 1:
        if parts[0].ndim < 2:
            raise ValueError(f"interleave_gate_up: a bank needs [E, 2I, ...], got {parts[0].shape}")
        return _interleave_bank(parts[0], tile)
    if len(parts) == 2:
        _check_rest(parts, "interleave_gate_up")
        if parts[0].shape[0] != parts[1].shape[0]:
            raise ValueError(f"interleave_gate_up: gate {parts[0].shape} and up {parts[1].shape} differ")
        return _interleave_bank(np.concatenate(parts, axis=0)[None], tile)[0]
    raise ValueError(f"interleave_gate_up: takes a bank or a (gate, up) pair, got {len(parts)} parts")


def deinterleave_gate_up(fused: np.ndarray, *, tile: int = GATE_UP_TILE, pair: bool = False) -> list[np.ndarray]:
    """Inverse of interleave_gate_up: [E, 2I, H] -> [gate_up bank [E, 2I, H]], or with pair=True
    [2I, H] -> [gate [I, H], up [I, H]]."""
    if not pair:
        return [_deinterleave_bank(fused, tile)]
    bank = _deinterleave_bank(fused[None], tile)[0]
    i = bank.shape[0] // 2
    return [np.ascontiguousarray(bank[:i]), np.ascontiguousarray(bank[i:])]


# ---------------------------------------------------------------------------------------------------------
# DeltaNet short convolution.

def conv_taps_major(conv: np.ndarray) -> np.ndarray:
    """Transpose the depthwise conv weight so each tap is a contiguous row.

    Before: conv1d.weight [C, 1, Kc]   (channel-major: the Kc taps of one channel are adjacent)
    After:  [Kc, C]                    (tap-major: tap k of all channels is one row; tap Kc-1 is the current token)
    Why: in decode each thread owns a channel; reading one tap for consecutive channels is then coalesced.
    """
    if conv.ndim != 3 or conv.shape[1] != 1:
        raise ValueError(f"conv_taps_major: expects [C, 1, Kc], got {conv.shape}")
    return np.ascontiguousarray(conv[:, 0, :].T)


def conv_channels_major(taps: np.ndarray) -> np.ndarray:
    """Inverse of conv_taps_major: [Kc, C] -> [C, 1, Kc]."""
    if taps.ndim != 2:
        raise ValueError(f"conv_channels_major: expects [Kc, C], got {taps.shape}")
    return np.ascontiguousarray(taps.T[:, None, :])


# ---------------------------------------------------------------------------------------------------------
# Expert stacking (the checkpoint reader's form change, per-expert -> bank).

def stack_experts(experts: Sequence[np.ndarray]) -> np.ndarray:
    """Stack per-expert matrices into one bank.

    Before: E tensors `experts.{e}.X_proj.weight` [N, K]     After: [E, N, K], expert e at index e
    Why: the official bf16 release stores routed experts as banks; per-expert checkpoints (FP8, HF
    save_pretrained, some MTP layers) are brought to the same canonical form.
    """
    if not experts:
        raise ValueError("stack_experts: no experts")
    if len({x.shape for x in experts}) != 1:
        raise ValueError(f"stack_experts: experts differ in shape: {sorted({x.shape for x in experts})}")
    return np.ascontiguousarray(np.stack(list(experts), axis=0))


def unstack_experts(bank: np.ndarray) -> list[np.ndarray]:
    """Inverse of stack_experts: [E, N, K] -> E arrays [N, K]."""
    return [np.ascontiguousarray(bank[e]) for e in range(bank.shape[0])]


# ---------------------------------------------------------------------------------------------------------
# Registry: name -> (forward(parts, **params) -> array, inverse(array, **params) -> parts).

Forward = Callable[..., np.ndarray]
Inverse = Callable[..., list]

TRANSFORMS: dict[str, tuple[Forward, Inverse]] = {
    "identity": (lambda parts: np.asarray(parts[0]), lambda a: [a]),
    "fuse_qkvg": (lambda parts, **p: fuse_qkvg(*parts, **p), lambda a, **p: list(split_qkvg(a, **p))),
    "concat_rows": (lambda parts, rows: concat_rows(parts), split_rows),
    "interleave_gate_up": (lambda parts, tile, pair: interleave_gate_up(*parts, tile=tile),
                           lambda a, tile, pair: deinterleave_gate_up(a, tile=tile, pair=pair)),
    "conv_taps_major": (lambda parts: conv_taps_major(parts[0]), lambda a: [conv_channels_major(a)]),
}  # stack_experts is not here: it defines the bank the checkpoint reader builds, never an artifact plan


@dataclass(frozen=True)
class TensorPlan:
    """One artifact tensor: made from checkpoint tensors `parts` (shapes `part_shapes`) by `transform`.

    name is the part's own name for a single part, brace form for fused parts; params are the transform's
    keyword arguments (JSON values); shape is the artifact tensor's shape after the transform.
    """

    name: str
    parts: tuple[str, ...]
    part_shapes: tuple[tuple[int, ...], ...]
    transform: str = "identity"
    params: dict = field(default_factory=dict)
    shape: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        """JSON form, as stored in the artifact header."""
        return {"name": self.name, "parts": list(self.parts), "part_shapes": [list(s) for s in self.part_shapes],
                "transform": self.transform, "params": dict(self.params), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "TensorPlan":
        """Inverse of to_dict."""
        return cls(name=d["name"], parts=tuple(d["parts"]), part_shapes=tuple(tuple(s) for s in d["part_shapes"]),
                   transform=d["transform"], params=dict(d["params"]), shape=tuple(d["shape"]))


def _transform(plan: TensorPlan) -> tuple[Forward, Inverse]:
    if plan.transform not in TRANSFORMS:
        raise ConfigError(f"{plan.name}: unknown layout transform '{plan.transform}' (known: {', '.join(TRANSFORMS)})")
    return TRANSFORMS[plan.transform]


def apply_forward(plan: TensorPlan, arrays: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> np.ndarray:
    """The artifact tensor of `plan` from its parts: a mapping part name -> array, or arrays in part order.

    Arrays may be the weights themselves or per-row companions (codes, scales) with the same leading dims.
    """
    forward, _ = _transform(plan)
    if isinstance(arrays, Mapping):
        missing = [p for p in plan.parts if p not in arrays]
        if missing:
            raise ConfigError(f"{plan.name}: part {missing[0]} not given")
        parts = [np.asarray(arrays[p]) for p in plan.parts]
    else:
        parts = [np.asarray(a) for a in arrays]
        if len(parts) != len(plan.parts):
            raise ConfigError(f"{plan.name}: {len(parts)} arrays for {len(plan.parts)} parts")
    for p, a, s in zip(plan.parts, parts, plan.part_shapes):
        if a.ndim != len(s) or a.shape[:-1] != tuple(s)[:-1]:
            raise ConfigError(f"{plan.name}: part {p} has shape {a.shape}, the plan expects {tuple(s)}")
    try:
        return forward(parts, **plan.params)
    except ValueError as e:
        raise ConfigError(f"{plan.name}: {e}") from None


def apply_inverse(plan: TensorPlan, array: np.ndarray) -> dict[str, np.ndarray]:
    """Invert `plan`: the artifact tensor (or a per-row companion of it) -> {checkpoint part name: array}."""
    _, inverse = _transform(plan)
    try:
        parts = inverse(np.asarray(array), **plan.params)
    except ValueError as e:
        raise ConfigError(f"{plan.name}: {e}") from None
    return dict(zip(plan.parts, parts, strict=True))


# ---------------------------------------------------------------------------------------------------------
# The tensor plan.

_LAYER = re.compile(r"(?:model\.language_model|mtp)\.layers\.\d+\.")

# Fused groups inside a decoder layer: (module prefix, member names, suffix, transform), parts in this order.
FUSED_GROUPS: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("self_attn.", ("q_proj", "k_proj", "v_proj"), ".weight", "fuse_qkvg"),
    ("linear_attn.", ("in_proj_qkv", "in_proj_z"), ".weight", "concat_rows"),
    ("linear_attn.", ("in_proj_b", "in_proj_a"), ".weight", "concat_rows"),
    ("mlp.", ("gate", "shared_expert_gate"), ".weight", "concat_rows"),
    ("mlp.shared_expert.", ("gate_proj", "up_proj"), ".weight", "interleave_gate_up"),
    ("mlp.", ("gate_proj", "up_proj"), ".weight", "interleave_gate_up"),
)
# Single tensors inside a decoder layer with a transform other than identity.
SINGLE_TRANSFORMS: dict[str, str] = {
    "mlp.experts.gate_up_proj": "interleave_gate_up",
    "linear_attn.conv1d.weight": "conv_taps_major",
}


def brace_name(prefix: str, members: Sequence[str], suffix: str) -> str:
    """`prefix{a,b,c}suffix`: the artifact name of a tensor fused from prefix+a+suffix, prefix+b+suffix, ..."""
    return f"{prefix}{{{','.join(members)}}}{suffix}"


def expand_name(name: str) -> list[str]:
    """The checkpoint names an artifact name stands for: brace form -> its parts, otherwise [name]."""
    m = re.fullmatch(r"([^{}]*)\{([^{}]+)\}([^{}]*)", name)
    if not m:
        return [name]
    return [m[1] + member + m[3] for member in m[2].split(",")]


def _group_of(name: str) -> tuple[str, int] | None:
    """(layer prefix, FUSED_GROUPS index) if `name` is a member of a fused group, else None."""
    m = _LAYER.match(name)
    if not m:
        return None
    local = name[m.end():]
    for gi, (module, members, suffix, _) in enumerate(FUSED_GROUPS):
        if local.startswith(module) and local.endswith(suffix) and local[len(module):-len(suffix)] in members:
            return m[0], gi
    return None


def _fused_params(transform: str, name: str, parts: Sequence[str], shapes: Sequence[tuple], spec) -> dict:
    """The transform's parameters for a fused group, with the shapes checked against the config."""
    if transform == "fuse_qkvg":
        nh, nkv, d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        want = (2 * nh * d, nkv * d, nkv * d)
        for p, s, rows in zip(parts, shapes, want):
            if len(s) != 2 or s[0] != rows:
                raise ConfigError(f"{p}: shape {tuple(s)} does not fit num_attention_heads={nh}, "
                                  f"num_key_value_heads={nkv}, head_dim={d} ({rows} rows expected)")
        return {"num_heads": nh, "num_kv_heads": nkv, "head_dim": d}
    if len({tuple(s[1:]) for s in shapes}) != 1:
        raise ConfigError(f"{name}: parts differ after the row axis: "
                          + ", ".join(f"{p} {tuple(s)}" for p, s in zip(parts, shapes)))
    if transform == "concat_rows":
        return {"rows": [int(s[0]) for s in shapes]}
    # interleave_gate_up, pair form
    if shapes[0] != shapes[1] or shapes[0][0] % GATE_UP_TILE:
        raise ConfigError(f"{name}: gate {tuple(shapes[0])} and up {tuple(shapes[1])} must match with rows a "
                          f"multiple of {GATE_UP_TILE}")
    return {"tile": GATE_UP_TILE, "pair": True}


def _out_shape(transform: str, shapes: Sequence[tuple]) -> tuple[int, ...]:
    if transform == "conv_taps_major":
        return (shapes[0][2], shapes[0][0])
    if transform in ("identity",) or (transform == "interleave_gate_up" and len(shapes) == 1):
        return tuple(shapes[0])
    return (sum(s[0] for s in shapes), *shapes[0][1:])  # row fusions


def plan_tensors(spec, names: Iterable[str], shapes: Mapping[str, Sequence[int]] | None = None) -> list[TensorPlan]:
    """Plan every checkpoint tensor in `names` into exactly one artifact tensor, in order of first appearance.

    spec: a ModelSpec (attention head counts and head_dim are read from it). shapes: the checkpoint's shapes;
    by default spec.tensor_shapes(). Raises ConfigError naming the tensor when a fused group is incomplete or
    a shape does not fit the transform (e.g. an intermediate size that is not a multiple of 16).
    """
    names = list(names)
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"tensor {dup} is listed twice")
    if shapes is None:
        shapes = {n: tuple(i.shape) for n, i in spec.tensor_shapes().items()}
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise ConfigError(f"tensor {unknown[0]} is not implied by config.json ({len(unknown)} such tensors)")
    present = set(names)
    plans: list[TensorPlan] = []
    done: set[str] = set()
    for n in names:
        if n in done:
            continue
        g = _group_of(n)
        if g is None:
            local = n[_LAYER.match(n).end():] if _LAYER.match(n) else ""
            transform = SINGLE_TRANSFORMS.get(local, "identity")
            s = tuple(shapes[n])
            params: dict = {}
            if transform == "interleave_gate_up":
                if len(s) != 3 or s[1] % (2 * GATE_UP_TILE):
                    raise ConfigError(f"{n}: shape {s} is not [E, 2I, H] with I a multiple of {GATE_UP_TILE}")
                params = {"tile": GATE_UP_TILE, "pair": False}
            elif transform == "conv_taps_major" and (len(s) != 3 or s[1] != 1):
                raise ConfigError(f"{n}: shape {s} is not [C, 1, Kc]")
            plans.append(TensorPlan(n, (n,), (s,), transform, params, _out_shape(transform, [s])))
            done.add(n)
            continue
        prefix, gi = g
        module, members, suffix, transform = FUSED_GROUPS[gi]
        parts = tuple(prefix + module + m + suffix for m in members)
        fused = brace_name(prefix + module, members, suffix)
        missing = [p for p in parts if p not in present]
        if missing:
            raise ConfigError(f"{fused}: part {missing[0]} is missing from the checkpoint")
        part_shapes = tuple(tuple(int(x) for x in shapes[p]) for p in parts)
        params = _fused_params(transform, fused, parts, part_shapes, spec)
        plans.append(TensorPlan(fused, parts, part_shapes, transform, params, _out_shape(transform, part_shapes)))
        done.update(parts)
    covered = [p for plan in plans for p in plan.parts]
    assert sorted(covered) == sorted(names), "every tensor lands in exactly one plan"
    return plans


def check_plans(spec, plans: Sequence[TensorPlan], groups: dict[str, str] | None = None) -> list[str]:
    """What is wrong with an artifact's tensor table for the model its header describes; empty when sound.

    Each stored plan must be the one plan_tensors makes from the spec for the same checkpoint names (parts,
    their shapes, transform, params, shape), in the group ("text", "mtp", "vision") the spec puts its parts in
    where `groups` ({tensor name: group}) is given, and every text tensor the spec implies must be there: a header
    edited or written for another model fails here, before any weight is decoded or loaded.
    """
    names = [p for plan in plans for p in plan.parts]
    try:
        want = {p.name: p for p in plan_tensors(spec, names)}
    except ConfigError as e:
        return [str(e)]
    problems, shapes = [], spec.tensor_shapes()
    for plan in plans:
        w = want.get(plan.name)
        if w is None:
            problems.append(f"{plan.name}: its parts do not make this tensor for this model")
            continue
        for what in ("parts", "part_shapes", "transform", "params", "shape"):
            got, expected = getattr(plan, what), getattr(w, what)
            if got != expected:
                problems.append(f"{plan.name}: {what} {_show(got)}, the model implies {_show(expected)}")
                break
        else:
            if groups is not None and groups.get(plan.name) != shapes[plan.parts[0]].group:
                problems.append(f"{plan.name}: group {groups.get(plan.name)!r}, the model implies "
                                f"{shapes[plan.parts[0]].group!r}")
    present = set(names)
    text = [n for n, info in shapes.items() if info.group == "text" and n not in present]
    if text:
        problems.append(f"{len(text)} tensors of the text model are missing, first {text[0]}")
    return problems


def _show(v) -> str:
    """A plan field for a one-line message: tuples as JSON-style lists."""
    if isinstance(v, tuple):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return repr(v) if isinstance(v, str) else str(v)
