"""numerics: what quantization cost, measured on the reference model, in llama.cpp's terms.

`measure(artifact, source)` runs fixed built-in prompts (prose, code, numbers, a chat exchange), tokenized with
the artifact's own tokenizer, through the fp32 CPU reference model twice: on the source checkpoint's weights
and on the artifact's decoded weights. Each prompt is one window; as `llama-perplexity --kl-divergence` does,
only the second half of a window is scored (positions first = T // 2 .. T - 2, each predicting the prompt's
next token), so every scored prediction has context. The statistics are llama.cpp's:

- KLD(source || artifact) per scored position, in nats: mean (± standard error), median, 99%, 99.9%, max;
  percentiles interpolate linearly between sorted values at fraction * (n - 1), as llama.cpp does;
- same top p: how often both argmaxes agree;
- Δp = p_artifact(y) - p_source(y): mean and RMS for y the prompt's next token (llama.cpp's "RMS Δp"), and RMS
  for y the source's top token (how much the favourite's probability moves);
- PPL of both on the prompts' own next tokens, and PPL(artifact) / PPL(source).

llama.cpp stores the base log-probabilities in 16 bits and drops terms below e^-16; here both distributions are
exact fp32 logits, normalised in float64, so the numbers are the same quantities without that truncation.

Where the difference starts: the residual stream after the embedding and after every decoder layer is compared
(relative RMS difference ||h_art - h_src|| / ||h_src|| over all prompt tokens). The first divergent layer is the
first whose relative difference exceeds DIVERGENCE_THRESHOLD (see there for why that value); the largest jump
is the stage that adds the most difference, which points at a damaged or unusually sensitive layer.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from ninfer_rt.errors import ConfigError, NinferError, SourceError
from ninfer_rt.format import Artifact
from ninfer_rt.hostmem import available_memory, check_fits
from ninfer_rt.reference.stream import lm_head, release, run_layers
from ninfer_rt.reference.weights import LazyArtifactWeights, LazyCheckpointWeights
from ninfer_rt.tokenizer import Tokenizer
from ninfer_pack.source import Checkpoint

# Written for ninfer; varied on purpose: English prose, Python, digits and symbols, a ChatML exchange.
PROMPTS: tuple[tuple[str, str], ...] = (
    ("prose",
     "The lighthouse keeper wrote in his log every evening, whether or not anything had happened. Most entries "
     "were short: the wind, the colour of the sea, a ship that passed too close to the rocks. After thirty "
     "years the books filled a whole shelf, and the young engineer who came to automate the light spent his "
     "first night reading them instead of the manual."),
    ("code",
     "def moving_average(values, window):\n"
     "    \"\"\"Mean of each run of `window` consecutive values.\"\"\"\n"
     "    if window <= 0:\n"
     "        raise ValueError(\"window must be positive\")\n"
     "    total, out = 0.0, []\n"
     "    for i, v in enumerate(values):\n"
     "        total += v\n"
     "        if i >= window:\n"
     "            total -= values[i - window]\n"
     "        if i >= window - 1:\n"
     "            out.append(total / window)\n"
     "    return out\n"),
    ("numbers",
     "Quarterly report, 2024: revenue 1,284,500 EUR (+7.3%), costs 1,102,060 EUR, margin 14.2%. Units shipped: "
     "Q1 3,412; Q2 3,987; Q3 4,105; Q4 4,660. Average price 97.85 EUR, down from 101.20. Forecast for 2025: "
     "5% to 9% growth, with 16,500 units at 95.00 EUR each, i.e. 1,567,500 EUR."),
    ("chat",
     "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
     "<|im_start|>user\nHow long does it take to boil an egg so the yolk stays soft?<|im_end|>\n"
     "<|im_start|>assistant\nAbout six minutes in water that is already boiling, then move the egg into cold "
     "water for a minute so it stops cooking. For a firmer yolk, go to eight or nine minutes.<|im_end|>\n"
     "<|im_start|>user\nAnd for a large egg straight from the fridge?<|im_end|>\n"
     "<|im_start|>assistant\nAdd about a minute: seven minutes for soft, ten for firm.<|im_end|>\n"),
)

# On the relative RMS difference of the residual stream. 2^-8 is bf16's unit roundoff, the most that rounding a
# hidden state to bf16 (as every bf16 runtime does) can change it; fp32 noise (~1e-6) and the bf16 recipe's
# floor (exactly 0 on a bf16 checkpoint) lie far below. Above it, a stage differs by more than bf16 can explain.
DIVERGENCE_THRESHOLD = 2.0 ** -8

WINDOW_MIN = 4  # tokens a scored window needs: its second half, each predicting the next, is at least one


@dataclass
class LayerDiff:
    """Relative RMS difference of the residual stream after one stage: the embedding or a decoder layer."""

    index: int       # -1 for the embedding, else the decoder layer
    kind: str        # "embedding", "linear_attention" or "full_attention"
    rel_rms: float   # ||h_artifact - h_source|| / ||h_source|| over every prompt token
    added: float     # rel_rms minus the previous stage's: the difference this stage adds


@dataclass
class NumericsReport:
    """Quantization cost of an artifact against its source; field meanings in the module docstring."""

    artifact: str
    artifact_sha256: str         # the artifact's header SHA-256 (Artifact.header_sha256): which artifact was measured
    source: str
    recipe: str
    prompts: list[dict]          # name, tokens, scored positions
    scored: int                  # scored positions in total
    kld_mean: float
    kld_mean_stderr: float
    kld_median: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    same_top: float              # fraction in [0, 1]
    same_top_stderr: float
    dp_mean: float               # of the next token
    rms_dp: float                # of the next token (llama.cpp)
    rms_dp_top: float            # of the source's top token
    ppl_source: float
    ppl_artifact: float
    ppl_ratio: float
    threshold: float
    first_divergent_layer: int | None   # -1 = the embedding; None = no stage above the threshold
    largest_jump_layer: int | None      # the stage adding the most difference; None = identical streams
    layers: list[LayerDiff] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-able dict of every field (non-finite floats become None)."""
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v
        return clean(asdict(self))


# ---------------------------------------------------------------------------------------------- statistics


def _quantile(sorted_v: torch.Tensor, q: float) -> float:
    """llama.cpp's percentile: linear interpolation at q * (n - 1) in the sorted values."""
    n = sorted_v.numel()
    p = q * (n - 1)
    i = min(int(p), n - 1)
    frac = p - i
    return float((1 - frac) * sorted_v[i] + frac * sorted_v[min(i + 1, n - 1)])


def _mean_stderr(x: torch.Tensor) -> tuple[float, float]:
    """Mean and its standard error sqrt((E[x^2] - E[x]^2) / (n - 1)), as llama.cpp reports them."""
    n = x.numel()
    m = float(x.mean())
    if n < 2:
        return m, float("nan")
    return m, math.sqrt(max(float((x * x).mean()) - m * m, 0.0) / (n - 1))


def token_stats(logits_src: torch.Tensor, logits_art: torch.Tensor, targets: torch.Tensor) -> dict:
    """llama.cpp's token statistics of scored positions: logits [N, V] of each model, targets [N] next tokens.

    Returns per-position tensors (kld, nll_src, nll_art, same_top, dp, dp_top) as float64.
    """
    ls = torch.log_softmax(logits_src.double(), -1)                             # ls: [N, V]
    la = torch.log_softmax(logits_art.double(), -1)
    rows = torch.arange(targets.numel())
    top = ls.argmax(-1)                                                          # top: [N]
    p_src, p_art = ls.exp(), la.exp()
    return {
        "kld": (p_src * (ls - la)).sum(-1),
        "nll_src": -ls[rows, targets],
        "nll_art": -la[rows, targets],
        "same_top": (top == la.argmax(-1)).double(),
        "dp": p_art[rows, targets] - p_src[rows, targets],
        "dp_top": p_art[rows, top] - p_src[rows, top],
    }


def summarize_tokens(t: dict) -> dict:
    """The report's scalar statistics from `token_stats` output (possibly concatenated over windows)."""
    kld = t["kld"]
    s = torch.sort(kld).values
    kld_mean, kld_se = _mean_stderr(kld)
    same, n = float(t["same_top"].mean()), kld.numel()
    nll_s, nll_a = float(t["nll_src"].mean()), float(t["nll_art"].mean())
    return {
        "scored": n,
        "kld_mean": kld_mean, "kld_mean_stderr": kld_se,
        "kld_median": _quantile(s, 0.5), "kld_p99": _quantile(s, 0.99), "kld_p999": _quantile(s, 0.999),
        "kld_max": float(s[-1]),
        "same_top": same, "same_top_stderr": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else float("nan"),
        "dp_mean": float(t["dp"].mean()),
        "rms_dp": float(t["dp"].pow(2).mean().sqrt()),
        "rms_dp_top": float(t["dp_top"].pow(2).mean().sqrt()),
        "ppl_source": math.exp(nll_s), "ppl_artifact": math.exp(nll_a), "ppl_ratio": math.exp(nll_a - nll_s),
    }


def layer_diffs(stream_src: Sequence[torch.Tensor], stream_art: Sequence[torch.Tensor],
                layer_types: Sequence[str]) -> list[LayerDiff]:
    """Per stage (embedding, then each layer): relative RMS difference of the residual streams ([T, H] each,
    all prompt tokens concatenated) and how much it grew over the previous stage."""
    out, prev = [], 0.0
    for i, (hs, ha) in enumerate(zip(stream_src, stream_art)):
        hs, ha = hs.double(), ha.double()
        rel = float((ha - hs).norm() / hs.norm().clamp_min(1e-300))
        out.append(LayerDiff(i - 1, "embedding" if i == 0 else layer_types[i - 1], rel, rel - prev))
        prev = rel
    return out


def largest_jump(layers: Sequence[LayerDiff]) -> int | None:
    """Index of the stage that adds the most difference (-1 = embedding), or None when nothing differs."""
    best = max(layers, key=lambda d: d.added, default=None)
    return best.index if best is not None and best.added > 0 else None


def first_divergent(layers: Sequence[LayerDiff], threshold: float = DIVERGENCE_THRESHOLD) -> int | None:
    """Index of the first stage whose relative difference exceeds `threshold` (-1 = embedding), or None."""
    return next((d.index for d in layers if d.rel_rms > threshold), None)


# ---------------------------------------------------------------------------------------------- runs


@dataclass
class ReferenceRun:
    """One model's outputs over the prompt windows."""

    logits: list[torch.Tensor]   # per window: scored logits [T - 1 - first, V]
    stream: list[torch.Tensor]   # per stage: residual stream of every window, concatenated [sum T, H]


def score_range(T: int) -> tuple[int, int]:
    """Scored logit rows [first, last) of a T-token window: its second half, each predicting the next token."""
    return T // 2, T - 1


def run_reference(spec, weights: Mapping[str, torch.Tensor], windows: Sequence[Sequence[int]]) -> ReferenceRun:
    """Run each window from an empty cache through the fp32 reference model, one decoder layer at a time
    (reference.stream: with lazy weights only that layer is in memory); keep scored logits and streams."""
    run = run_layers(spec, weights, windows, keep_stream=True)
    head = lm_head(spec, weights)
    logits = []
    with torch.no_grad():
        for ids, h in zip(windows, run.hidden):
            a, b = score_range(len(ids))
            logits.append((h @ head.T).float()[a:b].clone())  # every row, as the whole model computes them
    del head
    release(weights)
    return ReferenceRun(logits, run.stream)


def tokenize_prompts(tok: Tokenizer, prompts: Sequence[tuple[str, str]], vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt; each needs at least WINDOW_MIN tokens so its second half scores something."""
    windows = []
    for name, text in prompts:
        ids = tok.encode(text)
        if len(ids) < WINDOW_MIN:
            raise ConfigError(f"prompt {name!r}: only {len(ids)} tokens; a window needs at least {WINDOW_MIN}")
        if max(ids) >= vocab_size:
            raise ConfigError(f"prompt {name!r}: token id {max(ids)} is outside the model's vocab ({vocab_size})")
        windows.append(ids)
    return windows


def _spec_mismatch(a, b) -> str | None:
    """Name of the first ModelSpec field where a and b differ (None when equal)."""
    if a == b:
        return None
    da, db = a.to_dict(), b.to_dict()
    return next((k for k in da if k != "raw" and da[k] != db.get(k)), "config")


def attention_bytes(spec, n: int) -> int:
    """Peak bytes of the reference's causal attention over one window of n tokens (ops.gated_attention): two fp32
    score tensors [heads, n, n] at once (the masked copy beside the scores, then the softmax beside it) and the
    bool mask [n, n]. Quadratic: a long --window is refused by it before the run."""
    return (2 * 4 * spec.num_attention_heads + 1) * n * n


def memory_needed(spec, lengths: Sequence[int] = (), logits: bool = True) -> int:
    """Bytes the layer-by-layer runs need at most: one stage's fp32 weights (the embedding, a decoder layer or
    the lm_head) plus two more fp32 copies of the largest tensor while it decodes, the longest window's
    attention, and with `logits` for windows of `lengths` tokens the logits: the scored rows of both runs kept,
    one window's whole logits at a time. The residual streams are small beside them."""
    V = spec.vocab_size
    extra = max((attention_bytes(spec, n) for n in lengths), default=0)
    if logits:
        scored = sum(score_range(n)[1] - score_range(n)[0] for n in lengths)
        extra += 4 * V * (2 * scored + max(lengths, default=0))
    stages: dict[str, int] = {}
    largest = 0
    for name, info in spec.tensor_shapes().items():
        if info.group != "text":
            continue
        n = math.prod(info.shape)
        layer = re.match(r"(.*\.layers\.\d+)\.", name)
        stage = layer[1] if layer else name  # a decoder layer's tensors together; the rest one by one
        stages[stage] = stages.get(stage, 0) + n
        largest = max(largest, n)
    return 4 * (max(stages.values()) + 2 * largest) + extra


def check_memory(spec, lengths: Sequence[int] = (), logits: bool = True,
                 what: str = "--numerics runs the fp32 reference on the CPU") -> None:
    """Refuse, before anything is loaded, a run (memory_needed: windows of `lengths` tokens) that exceeds the
    available RAM. Skipped where the available memory cannot be read."""
    check_fits(memory_needed(spec, lengths, logits), what, available_memory())


def measure(artifact_path: str | Path, source: str, prompts: Sequence[tuple[str, str]] | None = None, *,
            windows: Sequence[tuple[str, Sequence[int]]] | None = None, revision: str | None = None,
            threshold: float = DIVERGENCE_THRESHOLD, progress: Callable[[str], None] | None = None) -> NumericsReport:
    """Run `prompts` ((name, text) pairs; default PROMPTS), or `windows` ((name, token ids) pairs, each at least
    WINDOW_MIN ids below the vocabulary size), through the reference model on the source's and on the artifact's
    weights (fp32, CPU) and report what the quantization cost."""
    if windows is not None and prompts is not None:
        raise NinferError("measure: give prompts or windows, not both")
    prompts = PROMPTS if prompts is None else tuple(prompts)
    say = progress or (lambda _msg: None)
    with Artifact.open(artifact_path) as art:
        check_memory(art.spec)  # before the checkpoint is opened (a Hub repo: downloaded) or a weight loaded
        with Checkpoint.open(source, revision=revision) as ckpt:
            spec = art.spec
            field_ = _spec_mismatch(spec, ckpt.spec)
            if field_ is not None:
                raise SourceError(f"{source} is not the model {artifact_path} was made from ({field_} differs)")
            recipe, art_sha = art.header.get("recipe", {}).get("name", "?"), art.header_sha256
            if windows is None:
                tok = Tokenizer.from_resources({n: art.resource(n) for n in art.resources})
                names, windows = [n for n, _ in prompts], tokenize_prompts(tok, prompts, spec.vocab_size)
            else:
                names, windows = [n for n, _ in windows], [list(w) for _, w in windows]
                for n, w in zip(names, windows):
                    if len(w) < WINDOW_MIN or not all(0 <= int(i) < spec.vocab_size for i in w):
                        raise ConfigError(f"window {n!r}: needs at least {WINDOW_MIN} ids in [0, {spec.vocab_size})")
            check_memory(spec, [len(w) for w in windows])  # with the logits, still before any weight is read

            # Source first, then the artifact, each one layer at a time.
            say(f"reference model on {source}")
            src = run_reference(spec, LazyCheckpointWeights(ckpt, ("text",)), windows)
            say(f"reference model on {artifact_path}")
            got = run_reference(spec, LazyArtifactWeights(art, ("text",)), windows)

    per_window = []
    for ids, ls, la in zip(windows, src.logits, got.logits):
        a, b = score_range(len(ids))
        per_window.append(token_stats(ls, la, torch.tensor(ids[a + 1:b + 1])))
    merged = {k: torch.cat([w[k] for w in per_window]) for k in per_window[0]}
    stats = summarize_tokens(merged)
    layers = layer_diffs(src.stream, got.stream, spec.layer_types)
    return NumericsReport(
        artifact=str(artifact_path), artifact_sha256=art_sha, source=str(source), recipe=recipe,
        prompts=[{"name": n, "tokens": len(ids), "scored": int(w["kld"].numel())}
                 for n, ids, w in zip(names, windows, per_window)],
        threshold=threshold, first_divergent_layer=first_divergent(layers, threshold),
        largest_jump_layer=largest_jump(layers), layers=layers, **stats)


# ---------------------------------------------------------------------------------------------- tables


def _stage(i: int | None) -> str:
    return "none" if i is None else ("embedding" if i == -1 else f"layer {i}")


def report_tables(rep: NumericsReport) -> list:
    """Two rich tables for the CLI: the llama.cpp-style statistics, and the per-stage hidden-state differences."""
    from rich.table import Table

    t = Table(title=f"quantization cost: recipe {rep.recipe}, {rep.scored} scored tokens")
    t.add_column("statistic")
    t.add_column("value", justify="right")
    rows = [
        ("Mean KLD", f"{rep.kld_mean:.6f} ± {rep.kld_mean_stderr:.6f}"),
        ("Median KLD", f"{rep.kld_median:.6f}"),
        ("99.0% KLD", f"{rep.kld_p99:.6f}"),
        ("99.9% KLD", f"{rep.kld_p999:.6f}"),
        ("Maximum KLD", f"{rep.kld_max:.6f}"),
        ("Same top p", f"{100 * rep.same_top:.3f} ± {100 * rep.same_top_stderr:.3f} %"),
        ("Mean Δp", f"{100 * rep.dp_mean:.4f} %"),
        ("RMS Δp", f"{100 * rep.rms_dp:.4f} %"),
        ("RMS Δp of source top", f"{100 * rep.rms_dp_top:.4f} %"),
        ("PPL(source)", f"{rep.ppl_source:.4f}"),
        ("PPL(artifact)", f"{rep.ppl_artifact:.4f}"),
        ("PPL ratio", f"{rep.ppl_ratio:.6f}"),
        ("First divergent", f"{_stage(rep.first_divergent_layer)} (rel. diff > {rep.threshold:.2e})"),
        ("Largest jump", _stage(rep.largest_jump_layer)),
    ]
    for k, v in rows:
        t.add_row(k, v)

    lt = Table(title="hidden-state difference per stage (relative RMS, all prompt tokens)")
    for col, just in (("stage", "left"), ("type", "left"), ("rel. diff", "right"), ("added", "right"),
                      ("", "left")):
        lt.add_column(col, justify=just)
    for d in rep.layers:
        marks = [m for m, hit in (("first divergent", d.index == rep.first_divergent_layer),
                                  ("largest jump", d.index == rep.largest_jump_layer)) if hit]
        lt.add_row(_stage(d.index), d.kind, f"{d.rel_rms:.3e}", f"{d.added:+.2e}", ", ".join(marks),
                   style="bold" if marks else None)
    return [t, lt]


__all__ = ["PROMPTS", "DIVERGENCE_THRESHOLD", "LayerDiff", "NumericsReport", "measure", "token_stats",
           "summarize_tokens", "layer_diffs", "first_divergent", "largest_jump", "run_reference", "ReferenceRun",
           "tokenize_prompts", "score_range", "report_tables", "available_memory", "check_memory"]
