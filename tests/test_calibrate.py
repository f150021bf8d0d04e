"""ninfer-pack calibrate: per-input-channel mean squares of every weight's activations.

Oracle: the same statistic gathered from Hugging Face transformers' own modules (forward pre-hooks on every
nn.Linear, the router and the experts module) on the same fp32 weights and windows; for the MTP head, which
transformers does not run, the same hooks on its transformers parts wired as the head (test_reference_model.HFMtp)
over transformers' own final hidden states.
Tolerance: both sides are fp32 through 4 layers (relative error ~1e-6 on the activations), so mean squares agree
to rtol 1e-4.
"""

from __future__ import annotations

import torch
import pytest

from cli_runner import error_line, run_main
from ninfer_pack import calibrate as cal
from ninfer_pack import cli
from ninfer_pack.source import Checkpoint
from ninfer_rt.errors import NinferError

LM = "model.language_model."


class _Statistics:
    """Mean x² per input channel of every matrix, gathered by forward pre-hooks on transformers' modules:
    each nn.Linear and router on its input, a fused experts module per routed (token, expert)."""

    def __init__(self):
        self.sums, self.rows, self.hooks = {}, {}, []
        self.only = ""  # while set, inputs of other matrices are not counted

    def add(self, name, x):
        if not name.startswith(self.only):
            return
        x = x.reshape(-1, x.shape[-1]).double()
        self.sums[name] = self.sums.get(name, 0) + (x * x).sum(0)
        self.rows[name] = self.rows.get(name, 0) + x.shape[0]

    def watch(self, named_modules, canonical):
        """Hook each (module name, module); canonical(module name) is the checkpoint's name without '.weight'."""
        for mname, mod in named_modules:
            kind = type(mod).__name__
            if isinstance(mod, torch.nn.Linear) or kind.endswith("TopKRouter"):
                self.hooks.append(mod.register_forward_pre_hook(
                    lambda m, args, n=canonical(mname) + ".weight": self.add(n, args[0])))
            elif kind.endswith("MoeExperts"):
                def experts(m, args, n=canonical(mname)):
                    h, idx = args[0], args[1]                                    # h: [T, H], idx: [T, k]
                    I = m.down_proj.shape[-1]
                    for t in range(h.shape[0]):
                        for e in idx[t].tolist():
                            self.add(n + ".gate_up_proj", h[t:t + 1])
                            gu = h[t:t + 1] @ m.gate_up_proj[e].T
                            self.add(n + ".down_proj", torch.nn.functional.silu(gu[:, :I]) * gu[:, I:])
                self.hooks.append(mod.register_forward_pre_hook(experts))

    def result(self):
        for h in self.hooks:
            h.remove()
        return {n: (s / self.rows[n]).float() for n, s in self.sums.items()}, self.rows


def _hf_statistics(model, windows, mtp_tensors=None) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """{canonical name: mean x² [K]}, {name: rows} from transformers' modules, window by window; with
    mtp_tensors, also the MTP head's (test_reference_model.HFMtp: transformers' parts wired as the head) over
    each window's pairs (h_p after the final norm, x_{p+1}) at positions p."""
    stats = _Statistics()
    stats.watch(model.named_modules(),
                lambda n: LM + n[len("model."):] if n.startswith("model.") else n)
    mtp = None
    if mtp_tensors is not None:
        from test_reference_model import HFMtp

        mtp = HFMtp(model, mtp_tensors)
        stats.watch(mtp.layer.named_modules(), lambda n: "mtp.layers.0." + n)
        stats.watch([("fc", mtp.fc)], lambda n: "mtp." + n)
    try:
        with torch.no_grad():
            for w in windows:
                out = model(torch.tensor([w]), output_hidden_states=True)
                if mtp is not None:
                    h = out.hidden_states[-1][0]                                 # [T, H], after the final norm
                    stats.only = "mtp."  # the head's logits reuse lm_head: calibrate counts the model's only
                    mtp(h[:-1], torch.tensor(w[1:]), torch.arange(len(w) - 1))
                    stats.only = ""
    finally:
        result = stats.result()
    return result


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_importance_is_transformers_activations(models, tmp_path, one_thread, moe):
    import checkpoints

    model = models["causal_moe" if moe else "causal_dense"]
    src, tensors = checkpoints.write_checkpoint(tmp_path, model, prefix="causal", dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    V = model.config.vocab_size
    windows = [torch.randint(0, V, (n,), generator=g).tolist() for n in (23, 9)]
    with Checkpoint.open(src) as ckpt:
        got = cal.calibrate(ckpt, windows)
        mtp_matrices = {n for n, s in ckpt.shapes().items() if n.startswith("mtp.") and len(s) >= 2}
    want, rows = _hf_statistics(model, windows, {k: v for k, v in tensors.items() if k.startswith("mtp.")})
    # every matrix of the text path and of the MTP head, and nothing else (the router's x² is the layer's)
    assert {n for n in want if n.startswith("mtp.")} <= mtp_matrices
    assert set(got.importance) == set(want) | mtp_matrices
    for name, w in want.items():
        torch.testing.assert_close(got.importance[name], w, rtol=1e-4, atol=1e-7, msg=name)
        assert got.rows[name] == rows[name], name
    assert rows["mtp.fc.weight"] == sum(len(w) - 1 for w in windows)
    assert got.windows == 2 and got.tokens == 32


def test_one_layer_at_a_time(tiny_moe, monkeypatch, one_thread):
    """Every tensor the text path and the MTP head use is read once (the embedding again for the head's inputs),
    and each is released with its layer: at no read do tensors of another layer stay in memory."""
    from ninfer_rt.reference.weights import LazyCheckpointWeights

    with Checkpoint.open(tiny_moe) as ckpt:
        reads, live_layers = [], []
        real = LazyCheckpointWeights._load

        def layer(name):
            return {name.split(".layers.")[1].split(".")[0]} if ".layers." in name else set()

        def spy(self, name):
            reads.append(name)
            live_layers.append(set().union(layer(name), *map(layer, self.live)))
            return real(self, name)

        monkeypatch.setattr(LazyCheckpointWeights, "_load", spy)
        cal.calibrate(ckpt, [[1, 2, 3, 4, 5, 6]])
        embed = LM + "embed_tokens.weight"
        assert reads.count(embed) == 2 and len(reads) == len(set(reads)) + 1
        assert all(len(s) <= 1 for s in live_layers)
        used = {n for n in ckpt.shapes() if not n.startswith("model.visual.")}
        assert used - set(reads) == {"lm_head.weight"}  # the lm_head's statistic needs only its input


def test_windows():
    from ninfer_pack.windows import token_windows

    assert token_windows(list(range(10)), 4, 100) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert token_windows(list(range(9)), 4, 100) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a lone last token: dropped
    assert token_windows(list(range(10)), 4, 6) == [[0, 1, 2, 3], [4, 5]]
    assert token_windows(list(range(11)), 4, 100, min_len=4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(NinferError, match="at least 2"):
        token_windows([1, 2, 3], 1, 10)


def run(args, capsys):
    return run_main(cli.main, "ninfer-pack", args, capsys)


def test_cli_feeds_quantize(tmp_path, capsys, one_thread):
    """calibrate writes an importance file that quantize --importance takes, and it changes the codes."""
    text = tmp_path / "cal.txt"
    text.write_text("The lighthouse keeper wrote in his log every evening. " * 40, encoding="utf-8")
    imp = tmp_path / "imp.safetensors"
    code, _, err = run(["calibrate", "builtin:tiny-moe", "--text", text, "--out", imp, "--window", 64,
                        "--max-tokens", 256], capsys)
    assert code == 0, err
    assert "256 tokens in 4 windows" in err
    from ninfer_pack.pipeline import load_importance

    loaded = load_importance(imp)
    assert f"{LM}layers.0.linear_attn.in_proj_qkv.weight" in loaded and "mtp.fc.weight" in loaded
    arts = {}
    for name, extra in (("plain", []), ("calibrated", ["--importance", imp])):
        arts[name] = tmp_path / f"{name}.ninfer"
        code, _, err = run(["quantize", "builtin:tiny-moe", "--recipe", "tiny", "--out", arts[name], *extra], capsys)
        assert code == 0, err
    from ninfer_rt.format import Artifact

    with Artifact.open(arts["plain"]) as a, Artifact.open(arts["calibrated"]) as b:
        name = f"{LM}layers.0.linear_attn.{{in_proj_qkv,in_proj_z}}.weight"
        assert bytes(a.raw(name)) != bytes(b.raw(name))
    code, _, err = run(["calibrate", "builtin:tiny-moe", "--text", text, "--out", imp], capsys)
    assert code == 1 and "exists; pass --overwrite" in error_line(err)


@pytest.mark.parametrize("case", ["missing", "not-utf8", "empty", "window", "out-dir"])
def test_cli_bad_input(tmp_path, capsys, case):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 10, encoding="utf-8")
    out = tmp_path / "imp.safetensors"
    args = ["calibrate", "builtin:tiny-moe", "--text", text, "--out", out]
    if case == "missing":
        args[3] = tmp_path / "nope.txt"
    elif case == "not-utf8":
        text.write_bytes(b"\xff\xfe\xfa bad")
    elif case == "empty":
        text.write_text("", encoding="utf-8")
    elif case == "window":
        args += ["--window", 1]
    else:
        args[5] = tmp_path
    code, _, err = run(args, capsys)
    line = error_line(err)
    assert code == 1 and {"missing": "no such text file", "not-utf8": "UTF-8", "empty": "no tokens",
                          "window": "at least 2", "out-dir": "is a directory"}[case] in line
    assert not out.exists() and not list(tmp_path.glob(".imp*"))


@pytest.mark.parametrize("case", ["missing", "not-utf8"])
def test_cli_checks_the_text_before_opening_the_checkpoint(tmp_path, capsys, monkeypatch, case):
    """A Hub source is downloaded when it opens: a missing or unreadable --text is refused first."""
    text = tmp_path / "t.txt"
    if case == "not-utf8":
        text.write_bytes(b"\xff\xfe\xfa bad")
    monkeypatch.setattr("ninfer_pack.source.Checkpoint.open", lambda *a, **k: pytest.fail("opened first"))
    code, _, err = run(["calibrate", "Qwen/Qwen3.6-35B-A3B", "--text", text, "--out", tmp_path / "i.safetensors"],
                       capsys)
    assert code == 1 and {"missing": "no such text file", "not-utf8": "UTF-8"}[case] in error_line(err)


def test_cli_refuses_a_window_whose_attention_does_not_fit(tmp_path, capsys, monkeypatch):
    """The reference's attention holds two fp32 [heads, n, n] score tensors and an [n, n] mask: a window of 600 on
    the tiny MoE (4 heads) needs (2 x 4 x 4 + 1) x 600^2 bytes = 11.9 MB for it beside the weights; refused in one
    line before any weight is read when that is more than the memory left."""
    import ninfer_pack.numerics as numerics
    from ninfer_pack.source import Checkpoint

    spec = Checkpoint.open("builtin:tiny-moe").spec
    assert spec.num_attention_heads == 4
    base = numerics.memory_needed(spec)
    assert numerics.memory_needed(spec, [600], logits=False) - base == 33 * 600 * 600
    monkeypatch.setattr(numerics, "available_memory", lambda: base + 33 * 600 * 600 - 1)
    monkeypatch.setattr("ninfer_pack.calibrate.calibrate", lambda *a, **k: pytest.fail("ran before the check"))
    text = tmp_path / "t.txt"
    text.write_text("The lighthouse keeper wrote in his log every evening. " * 200, encoding="utf-8")
    out = tmp_path / "i.safetensors"
    code, _, err = run(["calibrate", "builtin:tiny-moe", "--text", text, "--out", out, "--window", 600,
                        "--max-tokens", 600], capsys)
    assert code == 1 and "calibrate runs the fp32 reference on the CPU: needs ~" in error_line(err)
    assert not out.exists()


def test_card_carries_calibration_and_quality(tiny_moe, tmp_path, capsys, one_thread):
    """quantize records how its importance was measured (recipe.calibration); publish --numerics puts the
    verify --numerics report's figures in the card, and refuses a report that is not one or is another recipe's."""
    import json

    from ninfer_rt.format import Artifact

    text = tmp_path / "cal.txt"
    text.write_text("A ship passed too close to the rocks that night. " * 30, encoding="utf-8")
    imp, art = tmp_path / "imp.safetensors", tmp_path / "cal.ninfer"
    assert run(["calibrate", tiny_moe, "--text", text, "--out", imp, "--max-tokens", 300, "--window", 100],
               capsys)[0] == 0
    assert run(["quantize", tiny_moe, "--recipe", "tiny", "--importance", imp, "--out", art], capsys)[0] == 0
    with Artifact.open(art) as a:
        cal_info = a.header["recipe"]["calibration"]
    assert cal_info["tokens"] == 300 and cal_info["windows"] == 3 and cal_info["source"] == str(tiny_moe)
    code, o, e = run(["verify", art, "--source", tiny_moe, "--numerics", "--json"], capsys)
    assert code == 0, e
    report = tmp_path / "numerics.json"
    report.write_text(o, encoding="utf-8")
    num = json.loads(o)["numerics"]
    stage = tmp_path / "stage"
    code, _, e = run(["publish", art, "--repo", "me/tiny", "--base-model", "Qwen/Qwen3.6-35B-A3B", "--dry-run",
                      stage, "--numerics", report], capsys)
    assert code == 0, e
    card = (stage / "README.md").read_text()
    assert "## Quality" in card and "on 300 tokens in 3 windows" in card
    assert f"| {num['kld_mean']:.6f} ± {num['kld_mean_stderr']:.6f} | {num['kld_p99']:.6f} |" in card
    assert f"{num['scored']:,} scored positions (prose, code, numbers, chat)" in card
    bad = tmp_path / "bad.json"
    edited = [json.dumps({"numerics": {**num, key: value}}) for key, value in
              (("kld_mean", "x"), ("scored", "many"), ("prompts", 5), ("prompts", [1, 2]), ("same_top", None))]
    for content, why in (("{not json", "not a readable JSON report"), ('{"ok": true}', "not the output of"),
                         (o.replace(num["artifact_sha256"], "0" * 64), "measured on another artifact"),
                         *((text, "must be a") for text in edited)):  # hand-edited: refused in one line
        bad.write_text(content, encoding="utf-8")
        code, _, e = run(["publish", art, "--repo", "me/tiny", "--base-model", "Qwen/Qwen3.6-35B-A3B",
                          "--dry-run", tmp_path / "s2", "--numerics", bad], capsys)
        assert code == 1 and why in error_line(e)
        assert not (tmp_path / "s2").exists()
    # the same recipe quantized without the importance weights is another artifact: its card takes no such report
    plain = tmp_path / "plain.ninfer"
    assert run(["quantize", tiny_moe, "--recipe", "tiny", "--out", plain], capsys)[0] == 0
    code, _, e = run(["publish", plain, "--repo", "me/tiny", "--base-model", "Qwen/Qwen3.6-35B-A3B", "--dry-run",
                      tmp_path / "s3", "--numerics", report], capsys)
    assert code == 1 and "measured on another artifact" in error_line(e) and not (tmp_path / "s3").exists()
