"""The GPU runtime's host side, on any machine: kernel builds for every target (and the instrumented timeline
build, and the stream GEMVs' static shared memory), launch-argument packing, the numpy RoPE twin, synthetic weight
tables, which sampling settings the device draws, and one-line errors without a GPU."""

from __future__ import annotations

import ctypes
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ninfer_rt.api import gpu_available
from ninfer_rt.gpu.attention import rope_inv_freq
from ninfer_rt.gpu.build import TARGETS, build_kernels, sources
from ninfer_rt.gpu.driver import KernelArgs, f32, i32, i64, ptr
from ninfer_rt.gpu.engine import context_bucket
from tests.cli_runner import error_line, run_main


FATBIN_MAGIC = 0xBA55ED50


def elf_sms(image: bytes) -> list[int]:
    """SM numbers of the ELF cubins inside a fatbin (80, 86, ..., 120), read from the container's entry headers,
    which stay plain when nvcc compresses an image (it does for large cubins). A container: magic u32, version
    u16, header size u16, payload size u64; each entry in the payload: kind u16 (1 PTX, 2 ELF), u16, header size
    u32, payload size u64, ..., SM number u32 at byte 28."""
    found, off = [], 0
    while off + 16 <= len(image):
        magic, _, hsize, size = struct.unpack_from("<IHHQ", image, off)
        assert magic == FATBIN_MAGIC, f"no fatbin container at byte {off}"
        e, end = off + hsize, off + hsize + size
        while e < end:
            kind, _, ehsize, esize = struct.unpack_from("<HHIQ", image, e)
            if kind == 2:
                found.append(struct.unpack_from("<I", image, e + 28)[0])
            e += ehsize + esize
        off = end
    return found


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_kernel_compiles_for_every_target(tmp_path):
    res = build_kernels(TARGETS, cache=tmp_path, jobs=2)
    assert not res.cached and set(res.images) == {s.stem for s in sources()}
    want = sorted(int(t[3:].rstrip("a")) for t in TARGETS)
    for stem, path in res.images.items():
        assert sorted(elf_sms(path.read_bytes())) == want, stem
    again = build_kernels(TARGETS, cache=tmp_path)  # same sources and compiler: the cache answers
    assert again.cached and again.directory == res.directory


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_stream_gemvs_keep_their_dynamic_shared_memory_on_128_bytes(tmp_path):
    """The stream GEMVs bulk-copy x̂ (or x and norm_w) into dynamic shared memory, which starts after their static
    shared memory: a 4-byte static flag that moved it 16 bytes off a 128-byte boundary cost the 27B's step ~8%
    (perf-history.md v47). ptxas's report for every stream entry point (gemv_*_s1*, and the several-row gemv_*_s2..4
    beside them) on sm_90a: static bytes a multiple of 128."""
    import re
    import subprocess

    from ninfer_rt.gpu.build import NVCC_FLAGS, kernels_dir
    src = kernels_dir() / "gemv_stream.cu"
    out = subprocess.run([shutil.which("nvcc"), "-cubin", *NVCC_FLAGS, "-arch=sm_90a", "-Xptxas=-v", f"-I{src.parent}",
                          "-o", str(tmp_path / "g.cubin"), str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    static, fn = {}, None
    for line in out.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            fn = m.group(1)
        elif fn and (m := re.search(r"(\d+) bytes smem", line)):
            static[fn] = int(m.group(1))
    assert len(static) >= 18 and all(re.fullmatch(r"gemv_\w+_s[1-4]\w*", f) for f in static), sorted(static)
    off = {f: b for f, b in static.items() if b % 128}
    assert not off, f"static shared memory not a multiple of 128 bytes: {off}"


def elf_global_functions(cubin: bytes) -> set[str]:
    """Names of the global functions (the kernel entry points) in an ELF64 cubin's symbol table."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        stroff = sections[link][4]
        for o in range(off, off + size, entsize):
            name, info = struct.unpack_from("<IB", cubin, o)
            if info & 0xF == 2 and info >> 4 == 1:  # STT_FUNC, STB_GLOBAL
                names.add(cubin[stroff + name:cubin.index(b"\0", stroff + name)].decode())
    return names


def _nvrtc_missing() -> str | None:
    """Why NVRTC cannot build here, or None."""
    from ninfer_rt.gpu.build import cuda_include_dir
    try:
        from cuda.bindings import nvrtc
        nvrtc.nvrtcVersion()
    except Exception as e:  # not installed, or the library is not found
        return f"NVRTC is not usable here ({type(e).__name__})"
    return None if cuda_include_dir() else "no CUDA headers for NVRTC"


@pytest.mark.skipif(shutil.which("nvcc") is None or _nvrtc_missing() is not None,
                    reason="needs both nvcc and NVRTC (pip install 'ninfer[gpu]')")
def test_nvrtc_builds_every_kernel_as_nvcc_does(tmp_path):
    """Without a toolkit the runtime builds with NVRTC: every source compiles for sm_90a, and each cubin has the
    same kernel entry points as nvcc's cubin of that source."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from ninfer_rt.gpu.build import NVCC_FLAGS, kernels_dir
    res = build_kernels(("sm_90a",), cache=tmp_path / "rtc", use_nvcc=False, jobs=2)
    assert res.compiler == "nvrtc" and set(res.images) == {s.stem for s in sources()}

    def nvcc_cubin(src):
        out = tmp_path / f"{src.stem}.nvcc.cubin"
        subprocess.run([shutil.which("nvcc"), "-cubin", "-arch=sm_90a", *NVCC_FLAGS, "-I", str(kernels_dir()),
                        "-o", str(out), str(src)], check=True, capture_output=True)
        return src.stem, out.read_bytes()

    with ThreadPoolExecutor(2) as pool:
        for stem, ref in pool.map(nvcc_cubin, sources()):
            got = res.images[stem].read_bytes()
            assert got[:4] == b"\x7fELF" and elf_global_functions(got) == elf_global_functions(ref), stem


def test_nvrtc_problems_are_one_line(tmp_path, monkeypatch):
    """No CUDA headers, or an NVRTC library that does not load: one GpuError line saying what to install."""
    import sys
    import types

    from ninfer_rt.gpu import build
    from ninfer_rt.gpu.driver import GpuError
    fake = types.ModuleType("cuda.bindings.nvrtc")

    def missing(*args):
        raise RuntimeError('Failure finding "libnvrtc.so.13": No such file\nmore detail')

    fake.nvrtcCreateProgram = missing
    bindings = types.ModuleType("cuda.bindings")
    bindings.nvrtc = fake
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.nvrtc", fake)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(build, "cuda_include_dir", lambda: None)
    with pytest.raises(GpuError, match="needs the CUDA headers") as e:
        build_kernels(("sm_90a",), cache=tmp_path, use_nvcc=False)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(build, "cuda_include_dir", lambda: tmp_path)
    with pytest.raises(GpuError, match="NVRTC is not usable") as e:
        build_kernels(("sm_90a",), cache=tmp_path, use_nvcc=False)
    assert "\n" not in str(e.value) and "libnvrtc" in str(e.value)


def test_nvcc_keeps_its_intermediates_in_the_build_folder(tmp_path, monkeypatch):
    """nvcc writes tmpxft_* files under TMPDIR: pointed at the build's temporary folder, which an interrupted or
    failed build removes, none outlive it (no nvcc is run: the call is recorded)."""
    from ninfer_rt.gpu import build

    seen = []

    def fake_run(cmd, **kw):
        seen.append((cmd, kw.get("env", {}).get("TMPDIR")))
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"fatbin")
        return SimpleNamespace(returncode=0, stderr="", stdout="")

    monkeypatch.setattr(build.subprocess, "run", fake_run)
    src = sources()[0]
    out = tmp_path / "b" / "x.fatbin"
    out.parent.mkdir()
    build._nvcc_one("nvcc", src, out, ("sm_90a",), ptx=False)
    assert seen == [(seen[0][0], str(out.parent))] and out.read_bytes() == b"fatbin"


def test_unknown_target_is_one_line(tmp_path):
    from ninfer_rt.gpu.driver import GpuError
    with pytest.raises(GpuError, match="unknown kernel target 'sm_99'"):
        build_kernels(("sm_99",), cache=tmp_path)


def test_kernel_args_point_at_their_values():
    args = KernelArgs([ptr(0xDEADBEEF00), i32(-3), f32(1.5), i64(1 << 40)])
    arr = (ctypes.c_void_p * 4).from_address(args.address)
    assert ctypes.c_uint64.from_address(arr[0]).value == 0xDEADBEEF00
    assert ctypes.c_int32.from_address(arr[1]).value == -3
    assert ctypes.c_float.from_address(arr[2]).value == 1.5
    assert ctypes.c_int64.from_address(arr[3]).value == 1 << 40


def test_context_buckets_are_powers_of_two():
    assert [context_bucket(n) for n in (1, 1024, 1025, 8193, 262144)] == [1024, 1024, 2048, 16384, 262144]


@pytest.mark.parametrize("yarn", [False, True])
def test_numpy_rope_frequencies_equal_the_reference(yarn):
    """The GPU path's numpy inv_freq is bit-identical to ops.rope_inv_freq (plain and YaRN)."""
    import json
    from ninfer_rt.config import ModelSpec
    from ninfer_rt.gpu.bench import CONFIGS
    from ninfer_rt.reference import ops

    cfg = json.loads((CONFIGS / "qwen3.6-35b-a3b.json").read_text())
    if yarn:
        cfg["text_config"]["rope_parameters"].update(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=262144)
    spec = ModelSpec.from_config(cfg)
    got, scale = rope_inv_freq(spec)
    want, want_scale = ops.rope_inv_freq(spec.rotary_dim, spec.rope_theta, spec.yarn)
    assert got.dtype == np.float32 and np.array_equal(got, want.numpy()) and scale == pytest.approx(want_scale)


@pytest.mark.parametrize("name", ["qwen3.6-35b-a3b", "qwen3.6-27b"])
def test_synthetic_table_is_the_packers_plan(name):
    """Synthetic bench weights have exactly the names, shapes, formats and sizes quantize would write."""
    from ninfer_pack.plan import plan_artifact
    from ninfer_rt.formats import get_format
    from ninfer_rt.gpu.bench import builtin_spec
    from ninfer_rt.gpu.loader import synthetic_table
    from ninfer_rt.recipe import load_recipe

    spec, recipe = builtin_spec(name), load_recipe(name)
    table = synthetic_table(spec, recipe)
    shapes = {n: tuple(i.shape) for n, i in spec.tensor_shapes().items()}
    planned, _ = plan_artifact(spec, shapes, recipe)
    want = {t.name: (tuple(t.plan.shape), t.format, t.nbytes) for t in planned if t.group == "text"}
    got = {n: (s, f, get_format(f).nbytes(s)) for n, s, f in table}
    assert got == want


@pytest.mark.parametrize("argv, what", [
    (["bench"], "give an artifact path or --synthetic"),
    (["bench", "--synthetic", "qwen9"], "unknown model shape"),
    (["bench", "--synthetic", "qwen3.6-27b", "--recipe", "nope"], "nope"),
    (["bench", "/nonexistent.ninfer"], "/nonexistent.ninfer"),
    (["bench", __file__], "not a ninfer artifact"),  # a file that is no artifact
    (["bench", __file__, "--recipe", "qwen3.6-27b"], "--recipe applies to --synthetic only"),
    (["build-kernels", "--arch", "sm_99"], "unknown kernel target"),
    (["bench", "--synthetic", "qwen3.6-27b", "--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["bench", "--synthetic", "qwen3.6-27b", "--decode-batch", "1,4"], "--decode-batch: sequence counts must be >= 2"),
    (["bench", "--synthetic", "qwen3.6-27b", "--decode-batch", "four"], "--decode-batch: expected comma-separated"),
    (["bench", "--synthetic", "qwen3.6-27b", "--decode-tokens", "1"], "--decode-tokens: token counts must be 2 to 8"),
    (["bench", "--synthetic", "qwen3.6-27b", "--decode-tokens", "4,9"], "--decode-tokens: token counts must be 2"),
    (["run", "missing.ninfer", "--prompt", "hi", "--prefill-chunk", "-3"], "--prefill-chunk must be >= 1"),
])
def test_cli_misuse_is_one_line(argv, what, capsys):
    from ninfer_rt.cli import main
    code, out, err = run_main(main, "ninfer-rt", argv, capsys)
    assert code == 1 and what in error_line(err)


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_bench_without_a_gpu_is_one_line(capsys):
    from ninfer_rt.cli import main
    code, out, err = run_main(main, "ninfer-rt", ["bench", "--synthetic", "qwen3.6-35b-a3b"], capsys)
    line = error_line(err)
    assert code == 1 and ("cuda" in line.lower() or "gpu" in line.lower())


# ------------------------------------------------------------------------------------------ instrumented builds

def test_defines_reach_the_compiler_and_the_cache_key(tmp_path, monkeypatch):
    """build_kernels(defines=...) passes -D to every nvcc command and builds into another cache entry; without
    defines the key is the one it always was (the runtime's cache stays valid)."""
    from types import SimpleNamespace

    from ninfer_rt.gpu import build
    cmds = []

    def run(cmd, **kw):
        cmds.append(cmd)
        return SimpleNamespace(returncode=0, stdout="Cuda compilation tools, release 0.0\n", stderr="")

    monkeypatch.setattr(build, "nvcc_path", lambda: "/fake/nvcc")
    monkeypatch.setattr(build.subprocess, "run", run)
    plain = build.build_kernels(("sm_90a",), cache=tmp_path)
    stamped = build.build_kernels(("sm_90a",), cache=tmp_path, defines=("NINFER_TIMELINE",))
    n = len(build.sources())
    compiles = [c for c in cmds if "-fatbin" in c]
    assert len(compiles) == 2 * n and plain.directory != stamped.directory
    assert not any("-DNINFER_TIMELINE" in c for c in compiles[:n])
    assert all("-DNINFER_TIMELINE" in c for c in compiles[n:])
    srcs = build.sources()
    assert build.cache_key(srcs, ("sm_90a",), "nvcc x") == build.cache_key(srcs, ("sm_90a",), "nvcc x", ())


def _uses_timeline(src, seen=None) -> bool:
    """Whether a kernel source, or a local header it includes (transitively), places timeline marks or waits of its
    own (NINFER_TL_MARK, NINFER_TL_WAIT, NINFER_TL_USE): the code a stamped build compiles differently beyond
    ninfer_pdl_begin()'s stamp (common.cuh, which defines them, aside)."""
    import re

    seen = set() if seen is None else seen
    if src.name in seen or not src.exists() or src.name == "common.cuh":
        return False
    seen.add(src.name)
    text = src.read_text()
    if re.search(r"NINFER_TL_(MARK|WAIT|USE)\(", text):
        return True
    return any(_uses_timeline(src.parent / h, seen) for h in re.findall(r'#include "([^"]+)"', text))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_timeline_build_keeps_every_entry_point(tmp_path):
    """kernels/common.cuh's NINFER_TIMELINE stamps compile into every kernel file that places marks or waits of its
    own, and into norm.cu (only the stamp) with the same entry points as its plain build, each with the stamp ring
    bench/decode_timeline.py reads. (v111's stream GEMV header left its marks outside the stamp's scope: every
    stamped build failed, and decode_timeline with it, while the plain builds stayed green.) The marked files are
    built stamped only: test_every_kernel_compiles_for_every_target builds them plain."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from ninfer_rt.gpu.build import NVCC_FLAGS, kernels_dir
    srcs = [kernels_dir() / "norm.cu"] + [s for s in sources() if _uses_timeline(s)]
    assert {"gemv_stream", "moe_fused", "deltanet_step"} <= {s.stem for s in srcs}  # the walk finds the markers

    def compile_(job):
        src, tag, extra = job
        out = tmp_path / f"{src.stem}-{tag}.cubin"
        done = subprocess.run([shutil.which("nvcc"), "-cubin", "-arch=sm_90a", *NVCC_FLAGS, *extra, "-I",
                               str(src.parent), "-o", str(out), str(src)], capture_output=True, text=True)
        assert done.returncode == 0, f"{src.name} {tag}: {done.stderr[-1500:]}"
        return (src.stem, tag), out.read_bytes()

    jobs = [(src, "stamped", ["-DNINFER_TIMELINE"]) for src in srcs] + [(srcs[0], "plain", [])]
    with ThreadPoolExecutor(2) as pool:
        images = dict(pool.map(compile_, sorted(jobs, key=lambda j: j[0].stem != "gemv_stream")))  # longest first
    plain = images["norm", "plain"]
    assert elf_global_functions(images["norm", "stamped"]) == elf_global_functions(plain)
    assert b"ninfer_tl_count" not in plain
    for src in srcs:
        assert b"ninfer_tl_count" in images[src.stem, "stamped"], src.name
