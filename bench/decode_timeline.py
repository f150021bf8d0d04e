"""Where a decode step's time goes in the graph, launch by launch: every warp of every kernel stamped.

    python bench/decode_timeline.py [--model qwen3.6-35b-a3b ...] [--context 8192] [--batch B] [--json PATH]
                                    [--set deltanet.STEP_PAIRS=False ...]

The kernels are rebuilt with -DNINFER_TIMELINE (kernels/common.cuh): ninfer_pdl_begin() (or _early) then records,
for lane 0 of every warp, the global time when the warp called it (its "entry": after whatever the kernel issues
before the wait, such as a GEMV's first weight tiles), when the wait on the predecessor returned, and when the warp
exited, with its grid id and block. One replay of the real decode graph (synthetic weights, INT8 KV) is stamped
after warm-up replays, and each grid is matched to the launch the engine enqueued (same image, grids in launch
order).
Per launch, in µs:

    release  first return from the PDL wait (the predecessor finished and its writes are visible)
    gap      release minus the previous launch's (same stream) last warp exit: the completion signal's latency
    work     last exit minus release: what the launch adds to the chain once it may run
    tail     last exit minus the median warp exit: the slowest warps' lag
    late     last warp entry minus release: warps that reached the wait only after it had been released (not
             resident yet, or still issuing their pre-wait loads)
and how its blocks end (a block's entry is its first warp's, its exit its last warp's): the share of late blocks
(entry more than 0.5 µs after the release), exit percentiles, how much later the late blocks end, whether the
last block out was a late one, and the rank correlation of the blocks' entries with their index. Kernels that
place NINFER_TL_MARK(i) get a third table: when the warps' own waits returned, then per slot when the warps reached
it (median and last, after the release), so a mark late after the release is told from a late wait.

The stamps cost a few instructions and one atomic per warp, so the stamped step is somewhat slower than the
plain one (its replay time is printed beside the table). A wrong match would show as a negative gap: their count
is printed too. Exits with a one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import parse_settings, patched, planner_modules, synthetic_model, time_fresh_step  # noqa: E402

MARKS = 8  # NINFER_TL_MARKS
RECORD = np.dtype([("grid", "<u8"), ("pre", "<u8"), ("post", "<u8"), ("exit", "<u8"), ("mark", "<u8", (MARKS,)),
                   ("block", "<u4"), ("warp", "<u4"), ("smid", "<u4"), ("line", "<u4")])  # NinferTlRecord
LAST_OUT = 8  # blocks whose SMs each launch's row names: the last ones out


def _records(gpu, k) -> dict[str, np.ndarray]:
    """Each image's stamped warps since the last reset, by image name."""
    out = {}
    for m in k.modules:
        cp, cn = m.global_address("ninfer_tl_count")
        counts = gpu.download(cp, (cn // 4,), np.uint32)
        if not counts.any():  # no kernel of this image in the step
            continue
        rp, rn = m.global_address("ninfer_tl")
        per_sm = rn // RECORD.itemsize // len(counts)  # NINFER_TL_PER_SM, as the image was built
        if counts.max() > per_sm:
            sys.exit(f"decode_timeline: {m.name} overflowed its ring ({counts.max()} records on one SM)")
        recs = gpu.download(rp, (len(counts) * per_sm,), RECORD).reshape(len(counts), per_sm)
        out[m.name] = np.concatenate([recs[s, :c] for s, c in enumerate(counts) if c])
    return out


def _reset(gpu, k) -> None:
    for m in k.modules:
        cp, cn = m.global_address("ninfer_tl_count")
        gpu.memset(cp, 0, cn)
    gpu.synchronize()


def _image_of(k, name: str) -> str:
    from ninfer_rt.gpu.driver import GpuError

    for m in k.modules:
        try:
            m.function(name)
            return m.name
        except GpuError:
            continue
    raise KeyError(name)


def _after(t, release: float) -> float:
    """A stamp (ns) as µs after the launch's release, rounded to the ns."""
    return round((float(t) - release) / 1e3, 3)


def _block_stats(r: np.ndarray) -> dict:
    """How one launch's blocks spread (µs): the share of late blocks (the first warp reached its wait more than
    0.5 µs after the release: not resident yet, or still issuing its pre-wait loads), block exits at the
    50th/90th percentile and last, relative to the release; the mean exit of late blocks minus that of the
    others; whether the last block out was late; the mean spread of warp exits inside a block; the SMs of the
    last LAST_OUT blocks out, to tell slow SMs from late starts; and the rank correlation of the blocks' entries
    with their index (1: blocks enter in index order, so a static split could give later ones less work)."""
    order = np.argsort(r["block"], kind="stable")
    r = r[order]
    starts = np.flatnonzero(np.r_[True, r["block"][1:] != r["block"][:-1]])
    entry = np.minimum.reduceat(r["pre"], starts).astype(np.float64)
    exit_ = np.maximum.reduceat(r["exit"], starts).astype(np.float64)
    first_out = np.minimum.reduceat(r["exit"], starts).astype(np.float64)
    sm = r["smid"][starts]
    release = float(r["post"].min())
    late = entry > release + 500  # ns
    lag = float(exit_[late].mean() - exit_[~late].mean()) / 1e3 if late.any() and (~late).any() else 0.0
    q = lambda v: _after(v, release)  # noqa: E731
    rank = np.argsort(np.argsort(entry, kind="stable"), kind="stable").astype(np.float64)
    order_corr = float(np.corrcoef(np.arange(rank.size), rank)[0, 1]) if rank.size > 1 else 0.0
    return {"late_blocks": float(late.mean()), "exit_p50": q(np.percentile(exit_, 50)),
            "exit_p90": q(np.percentile(exit_, 90)), "exit_max": q(exit_.max()), "late_exit_lag": round(lag, 3),
            "last_out_was_late": bool(late[np.argmax(exit_)]),
            "warp_spread": round(float((exit_ - first_out).mean()) / 1e3, 3),
            "last_out_sms": [int(v) for v in sm[np.argsort(-exit_, kind="stable")[:LAST_OUT]]],
            "entry_index_corr": round(order_corr, 3)}


def _p50_last(t: np.ndarray, release: float) -> list[float]:
    """Stamps (ns) as [p50, max] µs after the release."""
    t = t.astype(np.float64)
    return [_after(np.percentile(t, 50), release), _after(t.max(), release)]


def _marks(r: np.ndarray) -> list:
    """Per NINFER_TL_MARK slot, the warps that reached it: [p50, max] µs after the launch's release (None: no
    warp did)."""
    release = float(r["post"].min())
    out = []
    for i in range(MARKS):
        m = r["mark"][:, i]
        m = m[m != 0]
        out.append(_p50_last(m, release) if m.size else None)
    return out


def _wait_return(r: np.ndarray) -> list[float]:
    """When the warps' waits on the predecessor returned: [p50, max] µs after the launch's release (its first)."""
    return _p50_last(r["post"], float(r["post"].min()))


def _warp_records(r: np.ndarray) -> list[list]:
    """Each warp's stamps as [block, warp, SM, entry, wait return, exit, mark 0..], µs after the release (marks
    never reached: None)."""
    release = float(r["post"].min())
    us = lambda v: _after(v, release)  # noqa: E731
    return [[int(w["block"]), int(w["warp"]), int(w["smid"]), us(w["pre"]), us(w["post"]), us(w["exit"]),
             *[us(m) if m else None for m in w["mark"]]] for w in np.sort(r, order=["block", "warp"])]


def _launch_rows(launches, recs: dict[str, np.ndarray], keep: str | None = None) -> list[dict]:
    """One row per enqueued launch (name, image, stream), matched to its grid's stamps: per image, grids in
    ascending grid id are the launches in enqueue order. Launches whose label contains keep also carry every
    warp's stamps."""
    grids = {img: sorted(set(r["grid"].tolist())) for img, r in recs.items()}
    taken = defaultdict(int)
    rows = []
    for name, img, stream in launches:
        i = taken[img]
        if i >= len(grids.get(img, [])):
            sys.exit(f"decode_timeline: no stamps for launch {len(rows)} ({name}); the match failed")
        gid = grids[img][i]
        taken[img] += 1
        r = recs[img][recs[img]["grid"] == gid]
        rows.append({"kernel": name, "stream": stream, "warps": int(r.size), "blocks": int(np.unique(r["block"]).size),
                     "first_entry": int(r["pre"].min()), "last_entry": int(r["pre"].max()),
                     "release": int(r["post"].min()), "median_exit": int(np.median(r["exit"])),
                     "last_exit": int(r["exit"].max()), "marks": _marks(r), "wait_return": _wait_return(r),
                     **_block_stats(r)})
        if keep and keep in name:
            rows[-1]["warp_records"] = _warp_records(r)
    t0 = min(r["first_entry"] for r in rows)
    last_on = {}
    for r in rows:
        for key in ("first_entry", "last_entry", "release", "median_exit", "last_exit"):
            r[key] = (r[key] - t0) / 1e3  # ns -> µs from the step's first stamp
        prev = last_on.get(r["stream"])
        r["gap"] = r["release"] - prev["last_exit"] if prev else 0.0
        r["work"] = r["last_exit"] - r["release"]
        r["tail"] = r["last_exit"] - r["median_exit"]
        r["late"] = max(0.0, r["last_entry"] - r["release"])
        last_on[r["stream"]] = r
    return rows


def _family(name: str) -> str:
    """A launch label without its format suffix: gemv_q6_s1 mlp.down_proj.weight -> gemv_*_s1 mlp.down_proj.weight."""
    kernel, _, weight = name.partition(" ")
    parts = kernel.split("_")
    kernel = "_".join("*" if p in {"q4", "q5", "q6", "q8", "bf16"} or p.startswith(("q4g", "q5g", "q6g", "q8g"))
                      else p for p in parts)
    return f"{kernel} {weight}".strip()


def _tables(console, title: str, rows: list[dict]) -> None:
    """The launches grouped by kernel (and weight), two rich tables: where the time goes, how blocks end."""
    from rich.table import Table

    fam = defaultdict(list)
    for r in rows:
        fam[(_family(r["kernel"]), r["stream"])].append(r)
    groups = sorted(fam.items(), key=lambda kv: -sum(r["work"] for r in kv[1]))
    table = Table(title=f"{title}: launches by kernel, µs (mean per launch; sums over the step)")
    for col in ("kernel", "stream", "launches", "gap", "work", "tail", "late", "Σ gap", "Σ work"):
        table.add_column(col, justify="left" if col in ("kernel", "stream") else "right")
    for (kern, stream), rs in groups:
        mean = lambda key: statistics.fmean(float(r[key]) for r in rs)  # noqa: E731
        table.add_row(kern, stream, str(len(rs)), f"{mean('gap'):.2f}", f"{mean('work'):.2f}", f"{mean('tail'):.2f}",
                      f"{mean('late'):.2f}", f"{sum(r['gap'] for r in rs):.1f}", f"{sum(r['work'] for r in rs):.1f}")
    console.print(table)
    table = Table(title=f"{title}: how blocks end, µs after the release (mean per launch)")
    for col in ("kernel", "stream", "late blocks", "exit p50", "p90", "last", "late blocks' lag", "last out late",
                "warp spread", "entry ~ index"):
        table.add_column(col, justify="left" if col in ("kernel", "stream") else "right")
    for (kern, stream), rs in groups:
        mean = lambda key: statistics.fmean(float(r[key]) for r in rs)  # noqa: E731
        table.add_row(kern, stream, f"{100 * mean('late_blocks'):.0f}%", f"{mean('exit_p50'):.2f}",
                      f"{mean('exit_p90'):.2f}", f"{mean('exit_max'):.2f}", f"{mean('late_exit_lag'):.2f}",
                      f"{100 * mean('last_out_was_late'):.0f}%", f"{mean('warp_spread'):.2f}",
                      f"{mean('entry_index_corr'):+.2f}")
    console.print(table)
    marked = [(key, rs) for key, rs in groups if any(m is not None for m in rs[0]["marks"])]
    if marked:
        table = Table(title=f"{title}: NINFER_TL_MARK slots, µs after the release (mean per launch of the warps' "
                            "median / last)")
        table.add_column("kernel")
        table.add_column("wait returned", justify="right")
        for i in range(MARKS):
            table.add_column(f"mark {i}", justify="right")
        def cell(got: list) -> str:  # the mean over launches of [p50, last] pairs
            if not got:
                return ""
            return f"{statistics.fmean(g[0] for g in got):.2f} / {statistics.fmean(g[1] for g in got):.2f}"

        for (kern, _), rs in marked:
            cells = [cell([r["wait_return"] for r in rs])]
            cells += [cell([r["marks"][i] for r in rs if r["marks"][i] is not None]) for i in range(MARKS)]
            table.add_row(kern, *cells)
        console.print(table)
    gemvs = [r for r in rows if r["kernel"].startswith("gemv_") and "_s1" in r["kernel"]]
    if gemvs:
        seen = Counter(sm for r in gemvs for sm in r["last_out_sms"])
        top = ", ".join(f"SM {sm} ×{n}" for sm, n in seen.most_common(8))
        even = LAST_OUT * len(gemvs) / max(1, len(seen))
        console.print(f"{title}: SMs among the last {LAST_OUT} blocks out of the {len(gemvs)} stream GEMVs, most "
                      f"often: {top} (no SM preferred: ~{even:.1f} each over {len(seen)} SMs)", highlight=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["qwen3.6-35b-a3b", "qwen3.6-27b"],
                    help="synthetic model shapes (ninfer_rt/configs), recipe of the same name")
    ap.add_argument("--context", type=int, default=8192, help="context length of the stamped step")
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences in the stamped step (each its own slot at the same context)")
    ap.add_argument("--jobs", type=int, default=8, help="parallel compiler processes for the stamped build")
    ap.add_argument("--smem-carveout", type=int, default=None,
                    help="shared-memory carveout (percent) every kernel prefers; default: the runtime's")
    ap.add_argument("--json", type=Path, help="also write every launch's row as JSON here")
    ap.add_argument("--warps", metavar="TEXT",
                    help="in the JSON, every warp's stamps of the launches whose label contains TEXT")
    ap.add_argument("--set", nargs="+", default=[], metavar="MODULE.ATTR=VALUE",
                    help="planner constants for the stamped step, as planner_ab's variants set them "
                         "(e.g. deltanet.STEP_PAIRS=False)")
    args = ap.parse_args()
    modules = planner_modules()
    try:
        settings = parse_settings(args.set, modules)
    except ValueError as e:
        sys.exit(f"decode_timeline: {e}")

    from rich.console import Console

    from ninfer_rt.gpu.build import TARGETS, build_kernels
    from ninfer_rt.gpu.driver import Gpu, GpuError
    from ninfer_rt.gpu import kernels
    from ninfer_rt.gpu.engine import context_bucket
    from ninfer_rt.gpu.kernels import Kernels

    try:
        gpu = Gpu(0)
    except GpuError as e:
        sys.exit(f"decode_timeline: no GPU ({e})")
    console = Console(width=200)
    arch = gpu.info.arch if gpu.info.arch in TARGETS else "sm_80"
    t = time.time()
    try:
        k = Kernels(gpu, build_kernels((arch,), jobs=args.jobs, defines=("NINFER_TIMELINE",)))
    except GpuError as e:  # a kernel that does not compile with the stamps: its nvcc line, not a traceback
        sys.exit(f"decode_timeline: the stamped build failed: {e}")
    console.print(f"{gpu.info.name}: stamped kernels ready in {time.time() - t:.0f} s", highlight=False)

    if args.smem_carveout is not None:
        kernels.SMEM_CARVEOUT = args.smem_carveout
    out = {"device": gpu.info.name, "arch": gpu.info.arch, "context": args.context, "batch": args.batch,
           "set": settings, "models": {}}
    for name in args.model:
        with synthetic_model(gpu, k, name, context_bucket(args.context + 1), slots=args.batch) as model, \
                patched(modules, settings):
            launches, images = [], {}  # images: entry point -> the image holding it, looked up once
            plain_launch, weight = k.launch, [""]

            def logged(fn, grid, block, a, smem=0, stream=None, cluster=None):
                label = f"{fn} {weight[0]}".strip()
                if fn not in images:
                    images[fn] = _image_of(k, fn)
                launches.append((label, images[fn], "side" if stream is model.side else "main"))
                plain_launch(fn, grid, block, a, smem, stream, cluster)

            from ninfer_rt.gpu import linear as linear_mod
            plain_gemv = linear_mod.gemv

            def gemv(kk, w, **kw):  # GEMV launches are labelled with their weight, less the layer prefix
                weight[0] = re.sub(r"^.*layers\.\d+\.", "", w.name)
                try:
                    plain_gemv(kk, w, **kw)
                finally:
                    weight[0] = ""

            k.launch, linear_mod.gemv = logged, gemv
            try:
                step_s = time_fresh_step(model, args.context, args.batch)  # captures (logging the launches) and times
            finally:
                k.launch, linear_mod.gemv = plain_launch, plain_gemv
            graph = next(iter(model.graphs.values()))
            for _ in range(5):
                graph.launch(gpu.stream)
            _reset(gpu, k)
            graph.launch(gpu.stream)
            gpu.synchronize()
            rows = _launch_rows(launches, _records(gpu, k), args.warps)
        span = max(r["last_exit"] for r in rows) - min(r["release"] for r in rows)
        main = [r for r in rows if r["stream"] == "main"]
        console.print(f"{name} @ {args.context} × {args.batch}: stamped step {1e3 * step_s:.3f} ms (graph replay); "
                      f"the stamped replay: {len(rows)} launches, {span:.1f} µs from the first release to the last exit; main "
                      f"stream Σ gap {sum(r['gap'] for r in main):.1f} µs, Σ work "
                      f"{sum(r['work'] for r in main):.1f} µs; negative gaps (match check): "
                      f"{sum(r['gap'] < 0 for r in rows)}", highlight=False)
        _tables(console, f"{name} @ {args.context:,}", rows)
        out["models"][name] = {"stamped_step_ms": 1e3 * step_s, "span_us": span, "launches": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
