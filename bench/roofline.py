"""Bytes read per decoded token (batch 1) and the bandwidth ceiling, from a recipe's exact tensor sizes.

    python bench/roofline.py --model qwen3.6-35b-a3b --context 8192 --bandwidth 4.18e12

Routed experts count top-k of E per layer; everything else on the text path is read once per token; the
DeltaNet state is read and written; the KV cache (INT8: one fp16 scale per 64 values) is read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer_rt.config import ModelSpec  # noqa: E402
from ninfer_pack.plan import builtin_config_path, plan_artifact  # noqa: E402
from ninfer_rt.recipe import load_recipe  # noqa: E402


def bytes_per_token(spec: ModelSpec, recipe: str, context: int, kv_bits: int = 8) -> dict:
    """Per-token read traffic by component, in bytes."""
    shapes = {n: i.shape for n, i in spec.tensor_shapes().items() if i.group == "text"}
    planned, _ = plan_artifact(spec, shapes, load_recipe(recipe))
    weights = 0.0
    for t in planned:
        if "embed_tokens" in t.name:
            weights += t.nbytes / t.plan.shape[0]  # one row gathered
        elif ".mlp.experts." in t.name:
            weights += t.nbytes * spec.num_experts_per_tok / spec.num_experts
        else:
            weights += t.nbytes
    n_lin = len(spec.linear_attention_layers)
    state = 2 * n_lin * spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim * 4
    per_tok_kv = len(spec.full_attention_layers) * 2 * spec.num_key_value_heads * spec.head_dim
    kv = context * per_tok_kv * (kv_bits / 8 + (2 / 64 if kv_bits == 8 else 0))
    return {"weights": weights, "deltanet_state": state, "kv_cache": kv, "total": weights + state + kv}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3.6-35b-a3b", help="built-in config name")
    ap.add_argument("--recipe", default=None, help="recipe (default: same name as the model)")
    ap.add_argument("--context", type=int, nargs="+", default=[0, 8192, 65536, 262144])
    ap.add_argument("--bandwidth", type=float, default=4.18e12, help="bytes/s (H200 measured read: 4.18e12)")
    ap.add_argument("--kv-bits", type=int, default=8, choices=(8, 16))
    args = ap.parse_args()
    spec = ModelSpec.from_file(builtin_config_path(args.model))
    rows = []
    for c in args.context:
        b = bytes_per_token(spec, args.recipe or args.model, c, args.kv_bits)
        rows.append({"context": c, **{k: round(v) for k, v in b.items()},
                     "ceiling_tok_s": round(args.bandwidth / b["total"], 1)})
    print(json.dumps({"model": args.model, "bandwidth": args.bandwidth, "kv_bits": args.kv_bits, "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
