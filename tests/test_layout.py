"""Layout transforms and the tensor plan: bit-exact inverses, independent expectations, full coverage."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt import layout as L
from ninfer_rt.config import ModelSpec
from ninfer_rt.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "ninfer_rt" / "configs"
RNG = np.random.default_rng(1234)


def rand(shape, dtype):
    """Random data of any dtype; uint16 covers every bf16 bit pattern (NaNs and infs included)."""
    if np.dtype(dtype).kind in "ui":
        info = np.iinfo(dtype)
        return RNG.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)
    return RNG.standard_normal(shape).astype(dtype)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact equality (dtype, shape and every byte)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


DTYPES = [np.float32, np.uint16, np.int8]


# ---------------------------------------------------------------------------------------------------------
# Round trips.

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,d,rest", [(4, 2, 32, (64,)), (3, 1, 8, (5,)), (1, 1, 1, (1,)), (5, 5, 4, (7,)),
                                           (24, 4, 16, (3,)), (7, 3, 2, (2, 3))])
def test_qkvg_roundtrip(dtype, nh, nkv, d, rest):
    q, k, v = rand((nh * 2 * d, *rest), dtype), rand((nkv * d, *rest), dtype), rand((nkv * d, *rest), dtype)
    fused = L.fuse_qkvg(q, k, v, num_heads=nh, num_kv_heads=nkv, head_dim=d)
    assert fused.shape == (2 * nh * d + 2 * nkv * d, *rest)
    q2, k2, v2 = L.split_qkvg(fused, num_heads=nh, num_kv_heads=nkv, head_dim=d)
    assert same(q2, q) and same(k2, k) and same(v2, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,rest", [([8, 1], (16,)), ([3, 5, 7], (9,)), ([1], (1,)), ([256, 1], (4,)),
                                       ([2, 2], (3, 5))])
def test_concat_rows_roundtrip(dtype, rows, rest):
    parts = [rand((n, *rest), dtype) for n in rows]
    fused = L.concat_rows(parts)
    assert fused.shape == (sum(rows), *rest)
    back = L.split_rows(fused, rows)
    assert len(back) == len(parts) and all(same(a, b) for a, b in zip(back, parts))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,i,rest", [(8, 32, (64,)), (1, 16, (1,)), (3, 48, (5,)), (2, 64, (3, 2))])
def test_gate_up_roundtrip(dtype, e, i, rest):
    bank = rand((e, 2 * i, *rest), dtype)
    inter = L.interleave_gate_up(bank)
    assert inter.shape == bank.shape and not (i > 16 and same(inter, bank))
    assert same(L.deinterleave_gate_up(inter)[0], bank)
    gate, up = rand((i, *rest), dtype), rand((i, *rest), dtype)
    pair = L.interleave_gate_up(gate, up)
    assert pair.shape == (2 * i, *rest)
    g2, u2 = L.deinterleave_gate_up(pair, pair=True)
    assert same(g2, gate) and same(u2, up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c,kc", [(128, 4), (1, 1), (7, 3), (8192, 4)])
def test_conv_roundtrip(dtype, c, kc):
    w = rand((c, 1, kc), dtype)
    taps = L.conv_taps_major(w)
    assert taps.shape == (kc, c) and taps.flags.c_contiguous
    assert same(L.conv_channels_major(taps), w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,n,k", [(8, 32, 64), (1, 1, 1), (3, 5, 7)])
def test_stack_roundtrip(dtype, e, n, k):
    experts = [rand((n, k), dtype) for _ in range(e)]
    bank = L.stack_experts(experts)
    assert bank.shape == (e, n, k) and all(same(bank[j], experts[j]) for j in range(e))
    assert all(same(a, b) for a, b in zip(L.unstack_experts(bank), experts))


# ---------------------------------------------------------------------------------------------------------
# Independent expectations.

@pytest.mark.parametrize("nh,nkv,d", [(4, 2, 32), (3, 1, 8), (5, 5, 4)])
def test_fuse_qkvg_matches_hand_split(nh, nkv, d):
    H = 6
    q, k, v = rand((nh * 2 * d, H), np.float32), rand((nkv * d, H), np.float32), rand((nkv * d, H), np.float32)
    fused = L.fuse_qkvg(q, k, v, num_heads=nh, num_kv_heads=nkv, head_dim=d)
    # Expectation 1: the reshape [nH, 2, d, H] of q_proj (HF chunks each head's 2d outputs into query, gate).
    q4 = q.reshape(nh, 2, d, H)
    want = np.concatenate([q4[:, 0].reshape(-1, H), k, v, q4[:, 1].reshape(-1, H)])
    assert same(fused, want)
    # Expectation 2: row by row, head h's query rows are q_proj[2dh : 2dh+d], its gate rows the next d.
    for h in range(nh):
        assert same(fused[h * d:(h + 1) * d], q[2 * d * h:2 * d * h + d])
        g0 = nh * d + 2 * nkv * d
        assert same(fused[g0 + h * d:g0 + (h + 1) * d], q[2 * d * h + d:2 * d * (h + 1)])
    # Expectation 3: HF's own arithmetic, y.view(T, nH, 2d).chunk(2, -1), on y = x q_projᵀ.
    x = RNG.integers(-4, 5, size=(3, H)).astype(np.float64)  # small ints: every product and sum is exact
    y = x @ q.astype(np.float64).T
    query_hf, gate_hf = np.split(y.reshape(3, nh, 2 * d), 2, axis=-1)
    yf = x @ fused.astype(np.float64).T
    assert np.array_equal(yf[:, :nh * d], query_hf.reshape(3, -1))
    assert np.array_equal(yf[:, -nh * d:], gate_hf.reshape(3, -1))


def silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("e,i", [(3, 32), (2, 48), (1, 16)])
def test_interleaved_swiglu_tile_by_tile(e, i):
    H, tile = 10, L.GATE_UP_TILE
    # Small integers in float64: every dot product is exact, so the comparison can be bit-exact.
    bank = RNG.integers(-3, 4, size=(e, 2 * i, H)).astype(np.float64)
    x = RNG.integers(-3, 4, size=H).astype(np.float64)
    inter = L.interleave_gate_up(bank)
    for j in range(e):
        want = silu(bank[j, :i] @ x) * (bank[j, i:] @ x)
        y = inter[j] @ x  # one fused GEMV; each output tile of 2·16 rows carries matching gate and up
        got = np.concatenate([silu(y[t * 2 * tile:t * 2 * tile + tile]) * y[t * 2 * tile + tile:(t + 1) * 2 * tile]
                              for t in range(i // tile)])
        assert np.array_equal(got, want)
    # pair form: dense/shared MLP gate [I, H] + up [I, H]
    gate, up = bank[0, :i], bank[0, i:]
    y = L.interleave_gate_up(gate, up) @ x
    got = np.concatenate([silu(y[t * 2 * tile:t * 2 * tile + tile]) * y[t * 2 * tile + tile:(t + 1) * 2 * tile]
                          for t in range(i // tile)])
    assert np.array_equal(got, silu(gate @ x) * (up @ x))


def test_conv_taps_major_matches_causal_conv():
    C, K, T = 12, 4, 6
    w = RNG.integers(-3, 4, size=(C, 1, K)).astype(np.float64)
    x = RNG.integers(-3, 4, size=(T + K - 1, C)).astype(np.float64)  # K-1 rows of history, then T tokens
    taps = L.conv_taps_major(w)
    for t in range(T):
        want = np.array([sum(w[c, 0, i] * x[t + i, c] for i in range(K)) for c in range(C)])
        got = sum(taps[i] * x[t + i] for i in range(K))  # one coalesced row per tap
        assert np.array_equal(got, want)


def test_interleave_rejects_bad_intermediate():
    with pytest.raises(ValueError, match="multiple of tile 16"):
        L.interleave_gate_up(np.zeros((2, 40, 4), np.float32))
    with pytest.raises(ValueError, match="multiple of tile 16"):
        L.interleave_gate_up(np.zeros((24, 4), np.float32), np.zeros((24, 4), np.float32))


# ---------------------------------------------------------------------------------------------------------
# The tensor plan.

def tiny_checkpoint(moe: bool) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """A tiny VLM + MTP checkpoint in canonical form, built by transformers (independent of config.py's names)."""
    import hf_tiny

    model = hf_tiny.make_vlm(moe, num_layers=4)
    tensors = {n: t.detach().numpy() for n, t in model.state_dict().items()}
    tensors.update({n: t.numpy() for n, t in hf_tiny.mtp_tensors(model.config.text_config, per_expert=False).items()})
    return ModelSpec.from_config(model.config.to_dict()), tensors


@pytest.fixture(scope="module", params=[True, False], ids=["moe", "dense"])
def tiny(request):
    return (request.param, *tiny_checkpoint(request.param))


def expected_groups(names: set[str], moe: bool) -> Counter:
    """Transform counts predicted from the names alone (independent of layout's group table)."""
    n_full = sum(1 for n in names if n.endswith("self_attn.q_proj.weight"))
    n_lin = sum(1 for n in names if n.endswith("linear_attn.in_proj_qkv.weight"))
    n_layers = sum(1 for n in names if n.endswith("input_layernorm.weight"))
    c = Counter(fuse_qkvg=n_full, conv_taps_major=n_lin)
    c["concat_rows"] = 2 * n_lin + (n_layers if moe else 0)
    c["interleave_gate_up"] = 2 * n_layers if moe else n_layers
    fused_parts = 3 * n_full + 4 * n_lin + (4 * n_layers if moe else 2 * n_layers)
    c["identity"] = len(names) - fused_parts - (n_layers if moe else 0) - n_lin
    return c


def check_coverage(plans, names):
    parts = Counter(p for plan in plans for p in plan.parts)
    assert set(parts) == set(names) and max(parts.values()) == 1


def test_plan_tiny_checkpoint(tiny):
    moe, spec, tensors = tiny
    shapes = {n: a.shape for n, a in tensors.items()}
    plans = L.plan_tensors(spec, list(shapes), shapes)
    check_coverage(plans, shapes)
    assert Counter(p.transform for p in plans) == expected_groups(set(shapes), moe)
    names = {p.name for p in plans}
    for pre in ("model.language_model.layers.3.", "mtp.layers.0."):
        assert pre + "self_attn.{q_proj,k_proj,v_proj}.weight" in names
        if moe:
            assert pre + "mlp.{gate,shared_expert_gate}.weight" in names
            assert pre + "mlp.shared_expert.{gate_proj,up_proj}.weight" in names
            assert pre + "mlp.experts.gate_up_proj" in names
        else:
            assert pre + "mlp.{gate_proj,up_proj}.weight" in names
    assert "model.language_model.layers.0.linear_attn.{in_proj_qkv,in_proj_z}.weight" in names
    assert "model.language_model.layers.0.linear_attn.{in_proj_b,in_proj_a}.weight" in names
    for plan in plans:
        assert L.expand_name(plan.name) == list(plan.parts)
        # the plan survives the artifact header (JSON) unchanged
        again = L.TensorPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
        assert again == plan
        out = L.apply_forward(again, {p: tensors[p] for p in plan.parts})
        assert out.shape == plan.shape
        back = L.apply_inverse(again, out)
        assert list(back) == list(plan.parts) and all(same(back[p], tensors[p]) for p in plan.parts)
        bits = {p: tensors[p].view(np.uint16) for p in plan.parts}  # bf16-style bit patterns (halves of fp32)
        back = L.apply_inverse(plan, L.apply_forward(plan, [bits[p] for p in plan.parts]))
        assert all(same(back[p], bits[p]) for p in plan.parts)


def test_plan_order_independent(tiny):
    _, spec, tensors = tiny
    names = list(tensors)
    RNG.shuffle(names)
    plans = L.plan_tensors(spec, names, {n: a.shape for n, a in tensors.items()})
    check_coverage(plans, names)
    assert names[0] in plans[0].parts  # plans come in order of first appearance


@pytest.mark.parametrize("config", ["qwen3.6-35b-a3b", "qwen3.6-27b"])
def test_plan_exact_configs(config):
    spec = ModelSpec.from_file(CONFIGS / f"{config}.json")
    shapes = {n: i.shape for n, i in spec.tensor_shapes().items()}
    plans = L.plan_tensors(spec, shapes)
    check_coverage(plans, shapes)
    assert Counter(p.transform for p in plans) == expected_groups(set(shapes), spec.is_moe)
    n_full = spec.layer_types.count("full_attention") + spec.mtp_num_hidden_layers
    qkvg = [p for p in plans if p.transform == "fuse_qkvg"]
    assert len(qkvg) == n_full
    d, nh, nkv, H = spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads, spec.hidden_size
    assert all(p.shape == (2 * nh * d + 2 * nkv * d, H) for p in qkvg)
    by_name = {p.name: p for p in plans}
    conv = by_name["model.language_model.layers.0.linear_attn.conv1d.weight"]
    assert conv.shape == (spec.linear_conv_kernel_dim, spec.conv_dim)
    if spec.is_moe:
        router = by_name["model.language_model.layers.0.mlp.{gate,shared_expert_gate}.weight"]
        assert router.shape == (spec.num_experts + 1, H) and router.params == {"rows": [spec.num_experts, 1]}
    else:
        mlp = by_name["model.language_model.layers.0.mlp.{gate_proj,up_proj}.weight"]
        assert mlp.shape == (2 * spec.intermediate_size, H)
    assert [L.TensorPlan.from_dict(json.loads(json.dumps(p.to_dict()))) for p in plans] == plans  # header JSON


# ---------------------------------------------------------------------------------------------------------
# Errors.

@pytest.fixture(scope="module")
def spec35():
    return ModelSpec.from_file(CONFIGS / "qwen3.6-35b-a3b.json")


def test_plan_missing_part(spec35):
    names = [n for n in spec35.tensor_shapes() if n != "model.language_model.layers.3.self_attn.k_proj.weight"]
    with pytest.raises(ConfigError, match=r"layers\.3\.self_attn\.\{q_proj,k_proj,v_proj\}.*k_proj"):
        L.plan_tensors(spec35, names)


def test_plan_unknown_and_duplicate(spec35):
    names = list(spec35.tensor_shapes())
    with pytest.raises(ConfigError, match="listed twice"):
        L.plan_tensors(spec35, names + names[:1])
    with pytest.raises(ConfigError, match="model.language_model.layers.99.foo"):
        L.plan_tensors(spec35, names + ["model.language_model.layers.99.foo"])


def test_plan_intermediate_not_multiple_of_16(spec35):
    shapes = {n: i.shape for n, i in spec35.tensor_shapes().items()}
    bad = "model.language_model.layers.5.mlp.experts.gate_up_proj"
    shapes[bad] = (256, 2 * 40, 2048)
    with pytest.raises(ConfigError, match=bad.replace(".", r"\.")) as e:
        L.plan_tensors(spec35, shapes, shapes)
    assert "\n" not in str(e.value)
    shapes = {n: i.shape for n, i in spec35.tensor_shapes().items()}
    pre = "model.language_model.layers.5.mlp.shared_expert."
    shapes[pre + "gate_proj.weight"] = shapes[pre + "up_proj.weight"] = (40, 2048)
    shapes[pre + "down_proj.weight"] = (2048, 40)
    with pytest.raises(ConfigError, match=r"shared_expert\.\{gate_proj,up_proj\}"):
        L.plan_tensors(spec35, shapes, shapes)


def test_plan_head_mismatch(spec35):
    shapes = {n: i.shape for n, i in spec35.tensor_shapes().items()}
    bad = "model.language_model.layers.3.self_attn.q_proj.weight"
    shapes[bad] = (4096, 2048)  # the gate half missing
    with pytest.raises(ConfigError, match=bad.replace(".", r"\.")):
        L.plan_tensors(spec35, shapes, shapes)


def test_apply_checks_parts():
    plan = L.TensorPlan("x.{a,b}.w", ("x.a.w", "x.b.w"), ((2, 4), (3, 4)), "concat_rows", {"rows": [2, 3]}, (5, 4))
    with pytest.raises(ConfigError, match="x.b.w"):
        L.apply_forward(plan, {"x.a.w": np.zeros((2, 4))})
    with pytest.raises(ConfigError, match="x.b.w"):
        L.apply_forward(plan, {"x.a.w": np.zeros((2, 4)), "x.b.w": np.zeros((4, 4))})
    with pytest.raises(ConfigError, match="unknown layout transform"):
        L.apply_inverse(L.TensorPlan("y", ("y",), ((1,),), "nope", {}, (1,)), np.zeros(1))
