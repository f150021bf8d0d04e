"""Quantize throughput and peak host memory on a generated multi-GB checkpoint.

Generates a checkpoint with the exact Qwen3.6-35B-A3B widths (hidden 2048, 256 experts, vocab 248,320)
but only --layers layers, in shards of --shard-gb, then runs `ninfer-pack quantize` in a child process and
reads the child's peak RSS. Target (issue 2): peak RSS < 4 GB + one shard. Prints a table, writes JSON.
With --calibrate-tokens N it first runs `ninfer-pack calibrate` on N tokens of generated text (windows of 512)
the same way: seconds, tokens/s and peak RSS of a reference run that holds one layer at a time.

    python bench/quantize_bench.py --layers 4 --recipe qwen3.6-35b-a3b --json bench/results/quantize.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ninfer_rt.config import ModelSpec  # noqa: E402
from ninfer_pack.plan import builtin_config_path  # noqa: E402
from ninfer_pack.tiny_tokenizer import tiny_tokenizer_files  # noqa: E402


# The child reports its own VmHWM: getrusage(RUSAGE_CHILDREN) would count the parent's pages at fork (Linux
# keeps the pre-exec high-water mark), and this parent holds the generated tensors' memory.
CHILD = """
import sys
from ninfer_pack.cli import main
peak_file = sys.argv[1]
sys.argv = ["ninfer-pack", *sys.argv[2:]]
try:
    main()
finally:
    kib = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
    open(peak_file, "w").write(str(kib * 1024))
"""


def synthetic_config(layers: int) -> dict:
    """The 35B-A3B config.json cut to `layers` layers (every 4th is full attention), text only, no MTP."""
    cfg = json.loads(builtin_config_path("qwen3.6-35b-a3b").read_text())
    tc = cfg["text_config"]
    tc["num_hidden_layers"] = layers
    tc["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    tc["mtp_num_hidden_layers"] = 0
    cfg.pop("vision_config", None)
    return cfg


def write_checkpoint(dest: Path, layers: int, shard_bytes: int, seed: int = 0) -> tuple[int, int]:
    """Random bf16 tensors of the spec's shapes, in shards of about shard_bytes; returns (total, largest shard)."""
    cfg = synthetic_config(layers)
    spec = ModelSpec.from_config(cfg)
    (dest / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, total, largest, files, weight_map = 0, 0, 0, [], {}

    def flush():
        nonlocal shard, size, largest
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(dest / name))
            files.append(name)
            weight_map.update({k: name for k in shard})
            largest = max(largest, size)
            shard, size = {}, 0

    for name, info in spec.tensor_shapes().items():
        if info.group != "text":
            continue
        dtype = torch.float32 if name.endswith(("A_log", "linear_attn.norm.weight")) else torch.bfloat16
        t = (torch.randn(info.shape, generator=g) * 0.02).to(dtype)
        if size + t.nbytes > shard_bytes:
            flush()
        shard[name] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    for name, data in tiny_tokenizer_files().items():  # any valid tokenizer: the bench measures the weights
        (dest / name).write_bytes(data)
    return total, largest


def child(tmp: Path, *argv: str) -> tuple[float, int]:
    """`ninfer-pack ARGV` in a child process: (wall seconds, the child's peak RSS in bytes)."""
    peak_file = tmp / "peak"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, str(peak_file), *argv], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, int(peak_file.read_text())


def calibrate(ckpt: Path, tmp: Path, tokens: int) -> dict:
    """`ninfer-pack calibrate` on `tokens` tokens of generated text (the tiny tokenizer: about a token a
    character), in windows of 512."""
    g = torch.Generator().manual_seed(1)
    words = ["the", "keeper", "wrote", "in", "his", "log", "every", "evening", "wind", "sea", "ship", "light"]
    text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (tokens,), generator=g))
    (tmp / "cal.txt").write_text(text, encoding="utf-8")
    wall, peak = child(tmp, "calibrate", str(ckpt), "--text", str(tmp / "cal.txt"), "--out",
                       str(tmp / "imp.safetensors"), "--window", "512", "--max-tokens", str(tokens))
    return {"tokens": tokens, "window": 512, "seconds": round(wall, 2), "peak_rss_bytes": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (35B-A3B widths)")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="shard size in GB")
    ap.add_argument("--recipe", default="qwen3.6-35b-a3b")
    ap.add_argument("--workdir", default=None, help="where to generate (default: a temp dir, removed after)")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--calibrate-tokens", type=int, default=0, help="also time `calibrate` on this many tokens")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        ckpt, art = Path(tmp) / "ckpt", Path(tmp) / "out.ninfer"
        ckpt.mkdir()
        t0 = time.perf_counter()
        total, largest = write_checkpoint(ckpt, args.layers, int(args.shard_gb * 1e9))
        gen_s = time.perf_counter() - t0
        os.sync()
        cal = calibrate(ckpt, Path(tmp), args.calibrate_tokens) if args.calibrate_tokens else None
        wall, peak = child(Path(tmp), "quantize", str(ckpt), "--recipe", args.recipe, "--out", str(art))
        out_bytes = art.stat().st_size
    limit = 4e9 + largest
    res = {"bench": "quantize", "recipe": args.recipe, "layers": args.layers, "source_bytes": total,
           "largest_shard_bytes": largest, "artifact_bytes": out_bytes, "generate_s": round(gen_s, 1),
           "quantize_s": round(wall, 2), "gb_per_s": round(total / 1e9 / wall, 4), "peak_rss_bytes": peak,
           "rss_limit_bytes": int(limit), "rss_ok": peak < limit, "cpu": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    t = Table(title=f"quantize: {args.layers} layers of Qwen3.6-35B-A3B widths, recipe {args.recipe}")
    for col in ("source GB", "largest shard GB", "artifact GB", "seconds", "GB/s", "peak RSS GB", "limit GB", "ok"):
        t.add_column(col, justify="right")
    t.add_row(f"{total / 1e9:.2f}", f"{largest / 1e9:.2f}", f"{out_bytes / 1e9:.2f}", f"{wall:.1f}",
              f"{res['gb_per_s']:.3f}", f"{peak / 1e9:.2f}", f"{limit / 1e9:.2f}", "yes" if res["rss_ok"] else "NO")
    Console().print(t)
    if cal:
        res["calibrate"] = cal
        t = Table(title=f"calibrate: {args.layers} layers of Qwen3.6-35B-A3B widths, {cal['tokens']} tokens")
        for col in ("seconds", "tokens/s", "peak RSS GB"):
            t.add_column(col, justify="right")
        t.add_row(f"{cal['seconds']:.1f}", f"{cal['tokens'] / cal['seconds']:.1f}",
                  f"{cal['peak_rss_bytes'] / 1e9:.2f}")
        Console().print(t)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
