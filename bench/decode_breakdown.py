"""What each kind of launch costs a decode step in the graph: the step recaptured with those launches left out.

    python bench/decode_breakdown.py [--model qwen3.6-35b-a3b ...] [--context 8192] [--json PATH]

Kernels timed alone, or serialized under ncu, overstate what a launch costs the step: in a decode graph,
programmatic dependent launch overlaps each kernel's start with its predecessor's tail, and the MoE's shared
expert runs on a side stream. Here each variant leaves out one kind of launch (the projections by tensor name,
the other ops by wrapper), recaptures the decode graph and times one step (median of 5 rounds of 20 replays,
best of 3); the step time minus the variant's is that launch kind's in-graph cost, summed over the layers.
Left-out launches leave their outputs stale, which changes no launch shape or byte count (synthetic weights,
routing by whatever logits the buffer holds), so the other kernels run as in the full step. Exits with a
one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import open_gpu, patched, step_rows_out, synthetic_model, time_fresh_step  # noqa: E402

from ninfer_rt.gpu import attention, deltanet, misc, moe  # noqa: E402

MODULES = {"attention": attention, "deltanet": deltanet, "misc": misc, "moe": moe}
# (label, weight-name substrings whose projections are left out, module functions left out, a tensor-name
# substring the model must have for the variant to apply)
VARIANTS = [
    ("DeltaNet in_proj_qkv|z GEMV", ["in_proj_qkv"], [], "in_proj_qkv"),
    ("DeltaNet step", [], ["deltanet.step"], "linear_attn."),
    ("DeltaNet out_proj GEMV", ["linear_attn.out_proj"], [], "linear_attn.out_proj"),
    ("attention q|k|v|gate GEMV", ["q_proj"], [], "q_proj"),
    ("attention prepare (norms, RoPE, KV write)", [], ["attention.prepare"], "self_attn."),
    ("attention decode", [], ["attention.decode"], "self_attn."),
    ("attention o_proj GEMV", ["o_proj"], [], "o_proj"),
    ("MoE router GEMV", ["shared_expert_gate"], [], "shared_expert_gate"),
    ("MoE shared expert (side stream)", ["shared_expert.{gate", "shared_expert.down"], [], "shared_expert.down"),
    ("MoE routed gate/up (with routing)", [], ["moe.gate_up_routed"], "experts."),
    ("MoE routed down", [], ["moe.down"], "experts."),
    ("MoE: all of it", ["shared_expert"], ["moe.gate_up_routed", "moe.down"], "experts."),
    ("dense MLP gate|up GEMV", ["mlp.{gate_proj"], [], "mlp.{gate_proj"),
    ("dense MLP down GEMV", ["mlp.down_proj"], [], "mlp.down_proj"),
    ("lm_head GEMV and arg-max", ["lm_head", "embed_tokens"], ["misc.argmax"], ""),
]


def _launch_nothing(*args, **kwargs) -> None:
    """Stands in for a left-out launch wrapper."""


def _skip_linear(model, names: list[str]):
    """model._linear that launches nothing for weights whose name contains one of `names`."""
    orig = type(model)._linear

    def linear(w, **kw):
        if any(n in w.name for n in names):
            return
        orig(model, w, **kw)
    return linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["qwen3.6-35b-a3b", "qwen3.6-27b"],
                    help="synthetic model shapes (ninfer_rt/configs), recipe of the same name")
    ap.add_argument("--context", type=int, default=8192, help="context length of the timed steps")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()

    gpu, k, console = open_gpu("decode_breakdown")
    from ninfer_rt.gpu.engine import context_bucket

    rows = []
    for name in args.model:
        with synthetic_model(gpu, k, name, context_bucket(args.context + 1)) as model:
            tensor_names = " ".join(model.w.matrices)
            for label, names, funcs, requires in [("full step", [], [], "")] + VARIANTS:
                if requires not in tensor_names:
                    continue  # nothing of this kind in this model
                model._linear = _skip_linear(model, names)
                try:
                    with patched(MODULES, {f: _launch_nothing for f in funcs}):
                        s = time_fresh_step(model, args.context)
                finally:
                    del model._linear
                rows.append({"model": name, "left_out": label, "context": args.context, "ms": 1e3 * s})
                console.print(f"{name} @{args.context} without {label}: {1e3 * s:.3f} ms/step", highlight=False)

    for r in rows:
        full = next(b for b in rows if b["model"] == r["model"] and b["left_out"] == "full step")
        r["cost_ms"] = full["ms"] - r["ms"]
    step_rows_out(console, gpu, f"decode step at {args.context:,} context, graph replay: cost of each launch kind",
                  [("model", True), ("left out", True), ("ms / step", False), ("in-graph cost ms", False),
                   ("share", False)],
                  lambda r: (r["model"], r["left_out"], f"{r['ms']:.3f}", f"{r['cost_ms']:.3f}",
                             f"{100 * r['cost_ms'] / (r['ms'] + r['cost_ms']):.1f}%"), rows, args.json)


if __name__ == "__main__":
    main()
