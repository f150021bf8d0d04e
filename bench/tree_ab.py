"""A/B of two source trees' kernels on a synthetic model's decode step: this checkout against a git revision.

    python bench/tree_ab.py --base REV | --base-tree PATH [--model qwen3.6-27b ...] [--context 8192 ...]
                            [--rounds 2] [--arch sm_90a] [--work /tmp/tree_ab] [--json PATH]
    python bench/tree_ab.py --base REV --extract-only --work .dbg/ab   # the base tree only, to carry elsewhere
    python bench/tree_ab.py --base-tree .dbg/ab/base --variant .dbg/ab/v1 .dbg/ab/v2   # more trees in one call

planner_ab.py compares planner constants within one build; a kernel change needs two builds. This extracts REV's
ninfer_rt, kernels, bench and recipes (`git archive`) under --work, builds both trees' kernels at once, each into its
own kernel cache, then times each model's step in alternating processes, one tree after the other (the order
flips every round, so drift between processes cancels): planner_ab.py's "default" rows, best of 3 medians each.
The table gives each tree's range over the rounds and the change of this checkout against REV. --variant adds
more trees (named by their directory), built with the two and timed in the same rounds, the order rotating every
round, so several kernel changes share one build and one call. Where there is no git
history (the device machine's copy of a checkout), extract the base tree beforehand and pass --base-tree. Bad
input (no git, an unknown revision, a failed build or run) exits with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE_PATHS = ("ninfer_rt", "kernels", "bench", "recipes", "pyproject.toml")
NO_VARIANT = "<defaults only>"  # planner_ab.py --only text no label contains: only its default rows run


class AbError(Exception):
    """A one-line reason the A/B cannot go on."""


def _last_line(text: str) -> str:
    """A child's last output line: its one-line reason."""
    return (text.strip().splitlines() or ["(no output)"])[-1]


def extract_tree(rev: str, dest: Path, repo: Path = ROOT) -> Path:
    """REV's TREE_PATHS (those it has) under dest, by git archive; returns dest."""
    have = subprocess.run(["git", "-C", str(repo), "ls-tree", "--name-only", rev], capture_output=True, text=True)
    if have.returncode:
        raise AbError(f"git cannot read revision {rev!r} in {repo}: {_last_line(have.stderr)}")
    paths = [p for p in TREE_PATHS if p in have.stdout.split()]
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, *paths], capture_output=True)
    if archive.returncode:
        raise AbError(f"git archive {rev} failed: {archive.stderr.decode(errors='replace').strip()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def tree_env(tree: Path, cache: Path) -> dict:
    """The environment a child runs a tree's code in: its sources first on the path, its own kernel cache."""
    return {**os.environ, "PYTHONPATH": str(tree), "XDG_CACHE_HOME": str(cache)}


def summarize(rows: list[dict]) -> list[dict]:
    """Per (model, context, tree): the step's ms over every default row of every round (min, median, max), and the
    median's change against the base tree's."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["context"], r["tree"]), []).append(r["ms"])
    out = []
    for (model, ctx, tree), ms in groups.items():
        base = groups.get((model, ctx, "base"))
        med = statistics.median(ms)
        out.append({"model": model, "context": ctx, "tree": tree, "runs": len(ms), "min": min(ms), "median": med,
                    "max": max(ms), "vs_base": med / statistics.median(base) - 1 if base else None})
    return out


def round_order(names: list[str], r: int) -> list[str]:
    """The trees in the order round r times them: rotated by r, so over len(names) rounds each tree takes every
    place once (two trees alternate), and drift between processes falls on all alike."""
    k = r % len(names)
    return names[k:] + names[:k]


def _build(trees: dict[str, tuple[Path, Path]], arch: list[str], jobs: int) -> None:
    """Every tree's kernels at once, each into its cache."""
    cmd = [sys.executable, "-m", "ninfer_rt.cli", "build-kernels", "--jobs", str(jobs),
           *(a for t in arch for a in ("--arch", t))]
    procs = {name: subprocess.Popen(cmd, cwd=tree, env=tree_env(tree, cache), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for name, (tree, cache) in trees.items()}
    for name, p in procs.items():
        out, _ = p.communicate()
        if p.returncode:
            raise AbError(f"the {name} tree's kernels did not build: {_last_line(out)}")


def default_rows(doc) -> list[dict]:
    """The "default" and "default again" rows of a planner_ab.py --json document ({"device": ..., "rows": [...]},
    as gpu_common.step_rows_out writes it)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise AbError("planner_ab.py's JSON has no list of rows")
    return [r for r in doc["rows"] if r.get("variant") in ("default", "default again")]


def _step_rows(tree: Path, cache: Path, model: str, contexts: list[int]) -> list[dict]:
    """planner_ab.py's default rows for one model, run from `tree` in a child process."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.json"
        cmd = [sys.executable, str(tree / "bench" / "planner_ab.py"), "--model", model, "--context",
               *map(str, contexts), "--only", NO_VARIANT, "--json", str(out)]
        p = subprocess.run(cmd, cwd=tree, env=tree_env(tree, cache), capture_output=True, text=True)
        if p.returncode or not out.exists():
            raise AbError(f"planner_ab.py failed in {tree}: {_last_line(p.stdout + p.stderr)}")
        return default_rows(json.loads(out.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base_arg = ap.add_mutually_exclusive_group(required=True)
    base_arg.add_argument("--base", help="git revision of the base tree (this checkout is the other)")
    base_arg.add_argument("--base-tree", type=Path, help="an extracted base tree (its ninfer_rt, kernels, bench)")
    ap.add_argument("--extract-only", action="store_true", help="with --base: extract the tree to WORK/base, stop")
    ap.add_argument("--model", nargs="+", default=["qwen3.6-27b"], help="synthetic model shapes, recipe of the same name")
    ap.add_argument("--context", type=int, nargs="+", default=[8192], help="context lengths of the timed steps")
    ap.add_argument("--variant", type=Path, nargs="+", default=[],
                    help="more source trees timed in the same rounds, each named by its directory")
    ap.add_argument("--rounds", type=int, default=2, help="processes per tree and model, alternating")
    ap.add_argument("--arch", nargs="+", default=[], help="kernel targets to build (default: build-kernels' own)")
    ap.add_argument("--jobs", type=int, default=6, help="compiler processes per tree")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tree_ab",
                    help="where the base tree and both kernel caches go")
    ap.add_argument("--json", type=Path, help="also write every row and the summary as JSON here")
    args = ap.parse_args()
    try:
        if args.rounds < 1:
            raise AbError(f"--rounds must be at least 1, got {args.rounds}")
        if args.base_tree:
            base = args.base_tree.resolve()
            if not (base / "kernels").is_dir() or not (base / "bench" / "planner_ab.py").is_file():
                raise AbError(f"{base} is not a source tree (no kernels/ or bench/planner_ab.py)")
        else:
            base = extract_tree(args.base, args.work / "base")
            if args.extract_only:
                print(base)
                return
        trees = {"new": (ROOT, args.work / "cache-new"), "base": (base, args.work / "cache-base")}
        for v in args.variant:
            if v.name in trees or not (v / "bench" / "planner_ab.py").is_file():
                raise AbError(f"--variant {v}: not a source tree, or its name {v.name!r} is taken")
            trees[v.name] = (v.resolve(), args.work / f"cache-{v.name}")
        _build(trees, args.arch, args.jobs)
        rows, names = [], list(trees)
        for r in range(args.rounds):
            for model in args.model:
                for name in round_order(names, r):
                    for row in _step_rows(*trees[name], model, args.context):
                        rows.append({**row, "tree": name, "round": r + 1})
                        print(f"round {r + 1} {name} {model} @{row['context']}: {row['ms']:.3f} ms/step", flush=True)
    except AbError as e:
        sys.exit(f"tree_ab: {e}")
    summary = summarize(rows)
    from rich.console import Console
    from rich.table import Table

    label = args.base or str(args.base_tree)
    table = Table(title=f"decode step, this checkout against {label} (ms; min / median / max over the rounds)")
    for col in ("model", "context", "tree", "runs", "ms", "vs base"):
        table.add_column(col, justify="left" if col in ("model", "tree") else "right")
    for s in summary:
        vs = "" if s["tree"] == "base" or s["vs_base"] is None else f"{100 * s['vs_base']:+.2f}%"
        table.add_row(s["model"], f"{s['context']:,}", s["tree"], str(s["runs"]),
                      f"{s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f}", vs)
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"base": label, "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
