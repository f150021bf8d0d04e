"""verify --numerics: the quantization cost (KLD, same-top, Δp, PPL, per-layer divergence) measured on the
fp32 reference model, checked against an independent computation and against properties the maths implies.

The tiny built-ins have random weights, so their next-token distributions are nearly uniform (PPL ≈ 550 of a
500-token vocab): KLDs are small in absolute terms and same-top rates low, but they scale with the bit width
exactly as quantization theory says, which is what the bounds below test.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ninfer_pack.numerics import (DIVERGENCE_THRESHOLD, PROMPTS, first_divergent, largest_jump, layer_diffs,
                                  measure, run_reference, tokenize_prompts)
from ninfer_pack.pipeline import quantize
from ninfer_rt.recipe import load_recipe, parse_recipe
from ninfer_pack.source import Checkpoint
from ninfer_pack.tiny import materialize_builtin
from ninfer_rt.errors import ConfigError, SourceError
from ninfer_rt.format import Artifact
from ninfer_rt.reference.model import ReferenceModel
from ninfer_rt.reference.weights import artifact_weights, checkpoint_weights
from ninfer_rt.tokenizer import Tokenizer
from cli_runner import error_line
from test_pack_cli import run


@pytest.fixture(scope="module")
def builtins(tmp_path_factory):
    root = tmp_path_factory.mktemp("builtin")
    return {kind: materialize_builtin(f"builtin:tiny-{kind}", cache_dir=root) for kind in ("moe", "dense")}


@pytest.fixture(scope="module")
def packer(tmp_path_factory):
    """pack(kind source dir, recipe) -> artifact path, each made once per module."""
    root, made = tmp_path_factory.mktemp("art"), {}

    def pack(src, recipe):
        key = (str(src), recipe if isinstance(recipe, str) else recipe.name)
        if key not in made:
            made[key] = root / f"{len(made)}.ninfer"
            quantize(str(src), recipe, made[key])
        return made[key]
    return pack


def uniform_recipe(fmt: str):
    """Every matmul weight in `fmt`; what cannot or should not be quantized kept exact, as the real recipes do."""
    return parse_recipe({"name": f"all-{fmt}", "description": f"every linear weight {fmt}", "rules": [
        {"pattern": r"model\.visual\..*", "format": "bf16"},
        {"pattern": r"(model\.language_model|mtp)\.layers\.\d+\.linear_attn\.(A_log|dt_bias)", "format": "fp32"},
        {"pattern": r".*norm(_embedding|_hidden)?\.weight", "format": "bf16"},
        {"pattern": r".*linear_attn\.(in_proj_a|in_proj_b|conv1d)\.weight", "format": "bf16"},
        {"pattern": r".*", "format": fmt}]})


def test_bf16_recipe_is_lossless(builtins, packer):
    # The bf16 artifact decodes to the checkpoint's exact values, so both fp32 runs see identical weights and
    # (deterministic CPU kernels) give identical logits: 0 measured. The bound allows a changed fp32 reduction
    # order: logit noise ~1e-6 * |logit| gives a KLD ~1e-12, so 1e-10 nats; hidden states within 1e-6 relative.
    rep = measure(packer(builtins["moe"], "bf16"), str(builtins["moe"]))
    print(f"bf16: mean KLD {rep.kld_mean:.3g}, max {rep.kld_max:.3g}, same top {rep.same_top:.4f}")
    assert rep.recipe == "bf16" and rep.scored > 300
    assert 0 <= rep.kld_max <= 1e-10 and abs(rep.kld_mean) <= 1e-10
    assert rep.same_top == 1.0
    assert abs(rep.ppl_ratio - 1) <= 1e-9 and rep.rms_dp <= 1e-9 and rep.rms_dp_top <= 1e-9
    assert all(d.rel_rms <= 1e-6 for d in rep.layers) and len(rep.layers) == 9  # embedding + 8 layers
    assert rep.first_divergent_layer is None


def quantized_formats(recipe: str) -> list[str]:
    """The recipe's q{b}g{G} formats, finest first (more bits, then smaller groups)."""
    fmts = {r.format for r in load_recipe(recipe).rules if r.format.startswith("q")}
    return sorted(fmts, key=lambda f: (-int(f[1]), int(f.split("g")[1])))


@pytest.mark.parametrize("recipe, kind", [("tiny", "moe"), ("qwen3.6-35b-a3b", "moe"), ("qwen3.6-27b", "dense")])
def test_shipped_recipe_kld(builtins, packer, recipe, kind):
    """A mix lies between its finest and its coarsest format applied everywhere: above the first (the mix's
    quantized weights are used), below the second (the mix spends its bits where they count). The gaps are
    several standard errors wide (measured: 35B mix 0.0044 between 0.0008 and 0.0172, 27B 0.0052 between
    0.00004 and 0.0100)."""
    rep = measure(packer(builtins[kind], recipe), str(builtins[kind]))
    finest, *_, coarsest = quantized_formats(recipe)
    lo, hi = (measure(packer(builtins[kind], uniform_recipe(f)), str(builtins[kind])) for f in (finest, coarsest))
    print(f"{recipe} on tiny-{kind}: mean KLD {rep.kld_mean:.5f} ± {rep.kld_mean_stderr:.5f} (all {finest} "
          f"{lo.kld_mean:.5f}, all {coarsest} {hi.kld_mean:.5f}), 99% {rep.kld_p99:.4f}, same top {rep.same_top:.3f}, "
          f"PPL ratio {rep.ppl_ratio:.4f}")
    sigma = 3 * max(rep.kld_mean_stderr, lo.kld_mean_stderr, hi.kld_mean_stderr)
    assert lo.kld_mean + sigma < rep.kld_mean < hi.kld_mean - sigma
    assert lo.same_top >= rep.same_top >= hi.same_top
    assert rep.kld_median <= rep.kld_p99 <= rep.kld_p999 <= rep.kld_max
    # every shipped recipe quantizes the embedding (q8 or q6), beyond bf16 rounding
    assert rep.first_divergent_layer == -1 and rep.layers[0].rel_rms > DIVERGENCE_THRESHOLD


def test_more_bits_give_lower_kld(builtins, packer):
    # One more bit halves the quantization step, so the error variance drops 4x per bit and KLD (second order
    # in the logit error) with it: q8 vs q4 predicts ~256x. Measured: q8 4.1e-5, q6 7.6e-4, q4 8.7e-3 (212x).
    src = builtins["dense"]
    reps = {f: measure(packer(src, uniform_recipe(f)), str(src)) for f in ("q8g32", "q6g64", "q4g32")}
    kld = {f: r.kld_mean for f, r in reps.items()}
    print("mean KLD by format:", {f: f"{v:.3g}" for f, v in kld.items()})
    assert kld["q8g32"] < kld["q6g64"] < kld["q4g32"]
    assert kld["q4g32"] > 64 * kld["q8g32"]  # the quadratic law's 256x, with 4x for a tiny model's nonlinearity
    assert reps["q8g32"].same_top > reps["q4g32"].same_top
    assert reps["q8g32"].layers[-1].rel_rms < reps["q6g64"].layers[-1].rel_rms < reps["q4g32"].layers[-1].rel_rms


def test_statistics_match_an_independent_computation(builtins, packer):
    src = builtins["dense"]
    art_path = packer(src, "tiny")
    rep = measure(art_path, str(src))

    # The same two runs, done here by hand: the llama.cpp window rule is logits[T//2 : T-1] vs ids[T//2+1 : T].
    ckpt = Checkpoint.open(str(src))
    with Artifact.open(art_path) as art:
        tok = Tokenizer.from_resources({n: art.resource(n) for n in art.resources})
        models = [ReferenceModel(ckpt.spec, checkpoint_weights(ckpt, ("text",))),
                  ReferenceModel(ckpt.spec, artifact_weights(art, ("text",)))]
    ls, la, tg, hs, ha = [], [], [], [], []
    with torch.no_grad():
        for _name, text in PROMPTS:
            ids = torch.tensor(tok.encode(text))
            T = len(ids)
            (l0, h0, s0), (l1, h1, s1) = [m.forward_with_hidden(ids, return_layers=True) for m in models]
            assert l0.shape == (T, ckpt.spec.vocab_size)
            ls.append(l0[T // 2:T - 1])
            la.append(l1[T // 2:T - 1])
            tg.append(ids[T // 2 + 1:])
            hs.append(torch.stack(s0))
            ha.append(torch.stack(s1))
    ls, la, tg = torch.cat(ls).double(), torch.cat(la).double(), torch.cat(tg)
    log_p, log_q = F.log_softmax(ls, -1), F.log_softmax(la, -1)
    kld = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).numpy()  # KL(source || artifact)
    p, q = log_p.exp(), log_q.exp()
    rows = torch.arange(len(tg))
    dp = (q[rows, tg] - p[rows, tg]).numpy()
    top = p.argmax(-1)
    dp_top = (q[rows, top] - p[rows, top]).numpy()

    # Both sides are float64 from the same fp32 logits: only summation order differs (~1e-15 relative).
    close = dict(rel=1e-9, abs=1e-14)
    assert rep.scored == len(kld) == sum(len(tok.encode(t)) - 1 - len(tok.encode(t)) // 2 for _n, t in PROMPTS)
    assert rep.kld_mean == pytest.approx(kld.mean(), **close)
    assert rep.kld_mean_stderr == pytest.approx(kld.std(ddof=0) / math.sqrt(len(kld) - 1), **close)
    assert rep.kld_median == pytest.approx(np.median(kld), **close)
    assert rep.kld_p99 == pytest.approx(np.percentile(kld, 99), **close)    # numpy's linear = llama.cpp's rule
    assert rep.kld_p999 == pytest.approx(np.percentile(kld, 99.9), **close)
    assert rep.kld_max == pytest.approx(kld.max(), **close)
    assert rep.same_top == float((la.argmax(-1) == top).double().mean())
    assert rep.dp_mean == pytest.approx(dp.mean(), **close)
    assert rep.rms_dp == pytest.approx(np.sqrt((dp ** 2).mean()), **close)
    assert rep.rms_dp_top == pytest.approx(np.sqrt((dp_top ** 2).mean()), **close)
    ppl_s = math.exp(F.cross_entropy(ls, tg).item())
    ppl_a = math.exp(F.cross_entropy(la, tg).item())
    assert rep.ppl_source == pytest.approx(ppl_s, **close) and rep.ppl_artifact == pytest.approx(ppl_a, **close)
    assert rep.ppl_ratio == pytest.approx(ppl_a / ppl_s, **close)

    # per stage: ||Δh|| / ||h|| over every token of every prompt, in numpy
    hs, ha = torch.cat(hs, 1).double().numpy(), torch.cat(ha, 1).double().numpy()  # [L+1, sum T, H]
    rel = np.linalg.norm((ha - hs).reshape(len(hs), -1), axis=1) / np.linalg.norm(hs.reshape(len(hs), -1), axis=1)
    assert [d.rel_rms for d in rep.layers] == pytest.approx(rel.tolist(), rel=1e-9)
    assert [d.index for d in rep.layers] == list(range(-1, ckpt.spec.num_hidden_layers))


def test_residual_stream_is_the_model_path(builtins):
    # return_layers exposes what the model computes: stage 0 is the embedding rows, and the final norm of the
    # last stage is the post-norm hidden state whose projection gives the logits.
    ckpt = Checkpoint.open(str(builtins["moe"]))
    model = ReferenceModel(ckpt.spec, checkpoint_weights(ckpt, ("text",)))
    ids = torch.tensor([5, 77, 300, 12, 9, 401, 3])
    with torch.no_grad():
        logits, h, stream = model.forward_with_hidden(ids, return_layers=True)
        plain_logits, plain_h = model.forward_with_hidden(ids)
    x = stream[-1].double()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ckpt.spec.rms_norm_eps) * (1 + model.norm.double())
    assert len(stream) == ckpt.spec.num_hidden_layers + 1
    assert torch.equal(stream[0], model.embed[ids])
    assert torch.allclose(normed.float(), h, rtol=1e-5, atol=1e-6)  # fp32 rounding of a 64-wide RMS
    assert torch.equal(logits, plain_logits) and torch.equal(h, plain_h)


def test_divergence_points_at_the_damaged_layer(builtins):
    # Perturb one layer's weights: causality keeps every earlier stage bit-identical, and the per-layer table
    # must name that layer, both as first divergent and as the largest jump.
    ckpt = Checkpoint.open(str(builtins["dense"]))
    spec, w = ckpt.spec, checkpoint_weights(ckpt, ("text",))
    windows = tokenize_prompts(Tokenizer.from_resources(ckpt.resources), PROMPTS[:2], spec.vocab_size)
    base = run_reference(spec, w, windows)
    g = torch.Generator().manual_seed(0)
    for layer, name, scale, diverges in ((5, "mlp.down_proj.weight", 0.3, True),
                                         (6, "input_layernorm.weight", 0.05, False)):
        n = f"model.language_model.layers.{layer}.{name}"
        bad = dict(w, **{n: w[n] + scale * w[n].pow(2).mean().sqrt() * torch.randn(w[n].shape, generator=g)})
        d = layer_diffs(base.stream, run_reference(spec, bad, windows).stream, spec.layer_types)
        print(f"damaged layer {layer}:", " ".join(f"{x.index}:{x.rel_rms:.2e}" for x in d))
        assert all(x.rel_rms == 0 for x in d[:layer + 1])  # stages -1 .. layer-1
        assert largest_jump(d) == layer
        # a 0.3-RMS change of a down projection is far beyond bf16 rounding; 5% noise on a norm weight is not
        assert first_divergent(d) == (layer if diverges else None)


def test_bad_inputs(builtins, packer):
    dense_art = packer(builtins["dense"], "tiny")
    with pytest.raises(SourceError, match="family differs"):
        measure(dense_art, str(builtins["moe"]))
    with pytest.raises(ConfigError, match="prompt 'short'"):
        measure(dense_art, str(builtins["dense"]), prompts=[("short", "hi")])


def test_cli_numerics(builtins, packer, capsys):
    src = builtins["dense"]
    art = packer(src, "qwen3.6-27b")
    code, o, e = run(["verify", art, "--source", src, "--numerics"], capsys)
    assert code == 0, e
    assert "sound" in e
    for label in ("Mean KLD", "99.9% KLD", "Same top p", "RMS Δp", "PPL ratio", "First divergent",
                  "hidden-state difference per stage", "full_attention", "layer 7"):
        assert label in o, label

    code, o, e = run(["verify", art, "--source", src, "--numerics", "--json"], capsys)
    assert code == 0, e
    report = json.loads(o)
    assert report["ok"] and report["tensors"]
    num = report["numerics"]
    for key in ("kld_mean", "kld_mean_stderr", "kld_median", "kld_p99", "kld_p999", "kld_max", "same_top",
                "dp_mean", "rms_dp", "rms_dp_top", "ppl_source", "ppl_artifact", "ppl_ratio", "threshold",
                "first_divergent_layer", "largest_jump_layer", "layers", "prompts", "scored", "recipe"):
        assert key in num, key
    assert len(num["layers"]) == 9 and set(num["layers"][0]) == {"index", "kind", "rel_rms", "added"}
    assert num["kld_mean"] == measure(art, str(src)).kld_mean  # the CLI reports the library's numbers

    code, _o, e = run(["verify", art, "--numerics"], capsys)
    assert code == 1 and "--source" in error_line(e)


def test_memory_is_checked_before_loading(builtins, packer, capsys, monkeypatch):
    import ninfer_pack.numerics as numerics
    from ninfer_pack.plan import CONFIGS_DIR
    from ninfer_rt.config import ModelSpec
    from ninfer_rt.errors import NinferError

    avail = numerics.available_memory()  # this machine is Linux: /proc/meminfo is readable
    assert avail is not None and 0 < avail < 1 << 50
    # one layer at a time: the 35B's largest stage is a DeltaNet + MoE layer, 256 experts x (2 x 512 x 2048 +
    # 2048 x 512) + router 256 x 2048 + shared 3 x 512 x 2048 + gate 2048 + in_proj 12288 x 2048 + b|a 64 x 2048
    # + conv 8192 x 4 + out_proj 2048 x 4096 + norms 2 x 2048 + 128 + 2 x 32 = 842.7 M parameters, plus two
    # copies of its largest tensor (the gate|up bank, 536.9 M) while it decodes: 4 x 1,916.4 M = 7.67 GB in fp32
    # (the whole text model would be 139 GB)
    monkeypatch.setattr(numerics, "available_memory", lambda: 5 * 10**9)
    spec = ModelSpec.from_file(CONFIGS_DIR / "qwen3.6-35b-a3b.json")
    with pytest.raises(NinferError, match=r"^--numerics runs the fp32 reference on the CPU: needs ~7.67 GB, "
                                          r"5 GB available$"):
        numerics.check_memory(spec)
    monkeypatch.setattr(numerics, "available_memory", lambda: 8 * 10**9)
    numerics.check_memory(spec)
    # --text windows add their logits: 8 windows of 512 keep 255 scored rows each from both runs, and one
    # window's 512 rows exist whole at a time: (2 x 8 x 255 + 512) rows x 248,320 x 4 bytes = 4.56 GB more; and
    # one window's attention: two fp32 [16 heads, 512, 512] scores and a [512, 512] bool mask, 33.8 MB
    assert numerics.memory_needed(spec, [512] * 8) - numerics.memory_needed(spec) == 4_561_141_760 + 33_816_576
    with pytest.raises(NinferError, match=r"needs ~12.3 GB, 8 GB available$"):
        numerics.check_memory(spec, [512] * 8)
    monkeypatch.setattr(numerics, "available_memory", lambda: None)  # unreadable: no check
    numerics.check_memory(spec)

    # through the CLI: refused before the tensor-by-tensor comparison and before any weight is loaded
    monkeypatch.setattr(numerics, "available_memory", lambda: 1000)
    monkeypatch.setattr(numerics, "LazyCheckpointWeights", lambda *a, **k: pytest.fail("loaded before the check"))
    monkeypatch.setattr("ninfer_pack.verify.compare_tensor", lambda *a, **k: pytest.fail("compared first"))
    src = builtins["dense"]
    art = packer(src, "qwen3.6-27b")
    code, _o, e = run(["verify", art, "--source", src, "--numerics"], capsys)
    assert code == 1 and re.search(r"^error: --numerics runs the fp32 reference on the CPU: needs ~\S+ GB, "
                                   r"1e-06 GB available$", error_line(e)), e
    with pytest.raises(NinferError, match="needs"):
        measure(art, str(src))


def test_verify_checks_the_artifact_and_text_before_opening_the_source(builtins, packer, capsys, tmp_path,
                                                                       monkeypatch):
    """A Hub --source is downloaded when it opens: a missing artifact or --text file is refused first."""
    art = packer(builtins["dense"], "qwen3.6-27b")
    monkeypatch.setattr("ninfer_pack.source.Checkpoint.open", lambda *a, **k: pytest.fail("opened first"))
    code, _o, e = run(["verify", tmp_path / "missing.ninfer", "--source", "Qwen/Qwen3.6-35B-A3B"], capsys)
    assert code == 1 and "no such file" in error_line(e)
    code, _o, e = run(["verify", art, "--source", "Qwen/Qwen3.6-35B-A3B", "--numerics", "--text",
                       tmp_path / "nope.txt"], capsys)
    assert code == 1 and "no such text file" in error_line(e)


def test_text_windows_are_scored(builtins, packer, capsys, tmp_path):
    """verify --numerics --text FILE scores windows of the file (each window's second half) and reports the
    library's numbers for the same windows; --text alone is refused in one line."""
    src = builtins["dense"]
    art = packer(src, "qwen3.6-27b")
    text = tmp_path / "eval.txt"
    text.write_text(PROMPTS[0][1] + "\n" + PROMPTS[1][1], encoding="utf-8")
    code, o, e = run(["verify", art, "--source", src, "--numerics", "--json", "--text", text, "--window", 40,
                      "--max-tokens", 100], capsys)
    assert code == 0, e
    num = json.loads(o)["numerics"]
    with Artifact.open(art) as a:
        ids = Tokenizer.from_resources({n: a.resource(n) for n in a.resources}).encode(text.read_text())[:100]
    cuts = [ids[i:i + 40] for i in range(0, len(ids), 40)]
    cuts = [c for c in cuts if len(c) >= 4]
    assert [p["name"] for p in num["prompts"]] == [f"eval.txt[{i}]" for i in range(len(cuts))]
    assert [p["tokens"] for p in num["prompts"]] == [len(c) for c in cuts]
    assert num["scored"] == sum(len(c) - 1 - len(c) // 2 for c in cuts)
    lib = measure(art, str(src), windows=[(f"w{i}", c) for i, c in enumerate(cuts)])
    assert num["kld_mean"] == lib.kld_mean and num["ppl_ratio"] == lib.ppl_ratio
    code, _o, e = run(["verify", art, "--text", text], capsys)
    assert code == 1 and "add --numerics" in error_line(e)
    with pytest.raises(ConfigError, match="window 'short'"):
        measure(art, str(src), windows=[("short", [1, 2, 3])])
