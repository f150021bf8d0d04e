"""The DeltaNet mixer of one prompt chunk (conv, delta rule, gated norm): token-by-token vs chunked delta rule.

    python bench/deltanet_bench.py [--tokens 4096] [--json PATH]

Times deltanet.decode on one sequence of T tokens at the 35B-A3B and 27B head shapes (random inputs, a fresh
state), once with the recurrent delta rule and once with the chunked one, as the median of 5 rounds of 3 calls
between two events after a warm-up call. deltanet.chunked_supported says which one prefill takes. Exits with a
one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import eager_ms, open_gpu  # noqa: E402

from ninfer_rt.gpu import deltanet  # noqa: E402

SHAPES = [("35B-A3B", dict(nk=16, nv=32, dk=128, dv=128)), ("27B", dict(nk=16, nv=48, dk=128, dv=128))]
KC = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens in the timed call (a prefill chunk)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()
    if args.tokens < 1:
        sys.exit(f"deltanet_bench: --tokens must be >= 1, got {args.tokens}")

    gpu, k, console = open_gpu("deltanet_bench")
    from rich.table import Table


    rng = np.random.default_rng(0)
    T = args.tokens
    rows = []
    for name, d in SHAPES:
        nk, nv, dk, dv = d["nk"], d["nv"], d["dk"], d["dv"]
        cd = deltanet.conv_dim_of(nk, nv, dk, dv)
        ld = cd + nv * dv
        bufs = []

        def put(a):
            p = gpu.alloc(a.nbytes)
            gpu.upload(p, a)
            bufs.append(p)
            return p

        def empty(nbytes):
            p = gpu.alloc(nbytes)
            bufs.append(p)
            return p

        try:
            call = dict(mixed=put(rng.standard_normal((T, ld)).astype(np.float32)), ld_mixed=ld,
                        ba=put(rng.standard_normal((T, 2 * nv)).astype(np.float32)),
                        conv_w=put((rng.standard_normal((KC, cd)) * 0.5).astype(np.float32)),
                        A_log=put(np.log(rng.uniform(0.05, 2.0, nv)).astype(np.float32)),
                        dt_bias=put(rng.normal(0.0, 0.5, nv).astype(np.float32)),
                        norm_w=put(np.ones(dv, np.float32)),
                        conv_state=put(np.zeros((1, deltanet.ring_rows(KC), cd), np.float32)),
                        ssm_state=put(np.zeros((1, nv, dk, dv), np.float32)),
                        slot=put(np.zeros(1, np.int32)), pos=put(np.zeros(1, np.int32)), B=1, T=T, nk=nk, nv=nv,
                        dk=dk, dv=dv, Kc=KC, eps=1e-6, out=empty(T * nv * dv * 4),
                        scratch=empty(deltanet.chunked_scratch_bytes(1, T, cd, nv, dk)))
            for chunked in (False, True):
                if chunked and not deltanet.chunked_supported(k, dk=dk, dv=dv):
                    continue
                times = eager_ms(gpu, lambda: deltanet.decode(k, chunked=chunked, **call), rounds=5, reps=3)
                rows.append({"model": name, **d, "tokens": T, "delta_rule": "chunked" if chunked else "recurrent",
                             "ms": statistics.median(times),
                             "prefill_takes_it": chunked == deltanet.chunked_supported(k, dk=dk, dv=dv)})
        finally:
            for p in bufs:
                gpu.free(p)

    table = Table(title=f"DeltaNet mixer (conv + delta rule + gated norm), one sequence of {T} tokens")
    for col in ("heads", "delta rule", "ms / layer", "prefill uses"):
        table.add_column(col, justify="left" if col in ("heads", "delta rule") else "right")
    for r in rows:
        table.add_row(f"{r['model']} ({r['nv']} × {r['dk']}/{r['dv']})", r["delta_rule"], f"{r['ms']:.3f}",
                      "yes" if r["prefill_takes_it"] else "")
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": gpu.info.name, "arch": gpu.info.arch, "rows": rows}, indent=1))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
