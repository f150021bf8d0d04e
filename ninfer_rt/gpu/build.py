"""Ahead-of-time and on-demand builds of kernels/*.cu into a cache of fatbins.

`build_kernels` compiles every op-family source with nvcc into one fatbin per source holding cubins for the
requested targets (by default all of TARGETS) plus PTX for the lowest, so a newer GPU can still JIT it.
Without nvcc it compiles with NVRTC (cuda-python's `cuda.bindings.nvrtc`, pip wheel nvidia-cuda-nvrtc) to a
cubin for one target. The cache key hashes the sources, the compiler's identity and the targets, so an edit
or a new compiler rebuilds and a stale binary is never loaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ninfer_rt.gpu.driver import GpuError

# cubin targets: RTX 50xx (primary), H100/H200, RTX 40xx/L4, RTX 30xx/A10, A100
TARGETS = ("sm_120a", "sm_90a", "sm_89", "sm_86", "sm_80")
PTX_TARGET = "compute_80"  # embedded PTX: any later GPU can JIT it
NVCC_FLAGS = ("-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "-Xptxas=-warn-spills")


def kernels_dir() -> Path:
    """The kernel sources: kernels/ beside the ninfer_rt package in a checkout (or an editable install), else
    the copy an installed wheel carries as ninfer_rt/_kernels (pyproject.toml maps kernels/ there)."""
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent / "kernels"
    return checkout if any(checkout.glob("*.cu")) else package / "_kernels"


def sources(root: Path | None = None) -> list[Path]:
    """Every op-family source, sorted: kernels/*.cu (headers *.cuh are included by them)."""
    root = root or kernels_dir()
    found = sorted(root.glob("*.cu"))
    if not found:
        raise GpuError(f"no kernel sources (*.cu) under {root}")
    return found


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ninfer" / "kernels"


def _gencode(target: str) -> str:
    """sm_90a -> -gencode=arch=compute_90a,code=sm_90a (the -arch shorthand also runs a plain sm_90 pass)."""
    if not target.startswith("sm_"):
        raise GpuError(f"unknown kernel target {target!r} (known: {', '.join(TARGETS)})")
    return f"-gencode=arch=compute_{target[3:]},code={target}"


def check_targets(targets) -> tuple[str, ...]:
    targets = tuple(targets)
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise GpuError(f"unknown kernel target {bad[0]!r} (known: {', '.join(TARGETS)})")
    return targets


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def _compiler_id(nvcc: str | None) -> str:
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        return "nvcc " + out.strip().splitlines()[-1]
    return "nvrtc"


def cache_key(srcs: list[Path], targets: tuple[str, ...], compiler: str, defines: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    root = srcs[0].parent
    for p in sorted(list(root.glob("*.cu")) + list(root.glob("*.cuh"))):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(("|".join(targets) + "|" + compiler + "|" + " ".join(NVCC_FLAGS)).encode())
    if defines:  # the default build's key stays what it was
        h.update(("|-D" + " -D".join(defines)).encode())
    return h.hexdigest()[:16]


@dataclass
class BuildResult:
    directory: Path
    images: dict[str, Path]  # source stem -> fatbin/cubin path
    compiler: str
    targets: tuple[str, ...]
    cached: bool


def _nvcc_one(nvcc: str, src: Path, out: Path, targets: tuple[str, ...], ptx: bool, defines=()) -> None:
    cmd = [nvcc, "-fatbin", *NVCC_FLAGS, *(f"-D{d}" for d in defines), *(_gencode(t) for t in targets)]
    if ptx:
        cmd.append(f"-gencode=arch={PTX_TARGET},code={PTX_TARGET}")
    cmd += ["-I", str(src.parent), "-o", str(out), str(src)]
    # nvcc's intermediates (tmpxft_*) in the build's own folder, which an interrupted build removes
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(out.parent)})
    if r.returncode != 0:
        first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:300])
        raise GpuError(f"nvcc failed on {src.name}: {first}")


def cuda_include_dir() -> Path | None:
    """Where NVRTC finds cuda_fp16.h / cuda_bf16.h: the CUDA runtime wheel (nvidia-cuda-runtime: nvidia/cu13/include,
    or nvidia/cuda_runtime/include for CUDA 12), else a toolkit's include folder (beside nvcc, /usr/local/cuda)."""
    candidates = []
    try:
        import nvidia  # namespace package of NVIDIA's pip wheels
        for base in nvidia.__path__:
            candidates += [Path(base) / sub / "include" for sub in ("cu13", "cu12", "cuda_runtime")]
    except ImportError:
        pass
    nvcc = nvcc_path()
    if nvcc:
        candidates.append(Path(nvcc).resolve().parents[1] / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return next((c for c in candidates if (c / "cuda_fp16.h").is_file()), None)


def _nvrtc_one(src: Path, out: Path, target: str, defines=()) -> None:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        raise GpuError("neither nvcc nor cuda-python's NVRTC is available to build the kernels") from None
    include = cuda_include_dir()
    if include is None:
        raise GpuError("NVRTC needs the CUDA headers (cuda_fp16.h): pip install 'ninfer[gpu]' (nvidia-cuda-runtime) "
                       "or install a CUDA toolkit")

    def ok(res, what):
        err, *vals = res
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise GpuError(f"NVRTC {what} failed on {src.name}: {err}")
        return vals[0] if vals else None

    try:  # the library itself loads on first use
        prog = ok(nvrtc.nvrtcCreateProgram(src.read_bytes(), src.name.encode(), 0, [], []), "create")
    except GpuError:
        raise
    except Exception as e:  # cuda.pathfinder's DynamicLibNotFoundError and the like
        raise GpuError(f"NVRTC is not usable ({str(e).splitlines()[0][:160]}): pip install 'ninfer[gpu]' "
                       "(nvidia-cuda-nvrtc) or put nvcc on PATH") from None
    opts = [f"--gpu-architecture={target}".encode(), b"-std=c++17", b"--use_fast_math",
            f"-I{src.parent}".encode(), f"-I{include}".encode(), b"-default-device",
            *(f"-D{d}".encode() for d in defines)]
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        size = ok(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        ok(nvrtc.nvrtcGetProgramLog(prog, log), "log")
        first = next((ln for ln in log.decode(errors="replace").splitlines() if "error" in ln), "")
        raise GpuError(f"NVRTC failed on {src.name}: {first}")
    size = ok(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
    cubin = b" " * size
    ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
    out.write_bytes(cubin)


def build_kernels(targets=TARGETS, *, cache: Path | None = None, force: bool = False,
                  use_nvcc: bool | None = None, jobs: int = 1, progress=None, defines=()) -> BuildResult:
    """Compile every kernels/*.cu for `targets` into the cache (or reuse a matching earlier build).

    use_nvcc None picks nvcc when it is on PATH, else NVRTC (one target only). progress(name) is called
    before each source. defines: preprocessor macros (NAME or NAME=VALUE) for instrumented builds such as
    NINFER_TIMELINE; they are part of the cache key. Files appear atomically: a build goes to a temporary folder
    renamed into place.
    """
    targets = check_targets(targets)
    nvcc = nvcc_path() if use_nvcc in (None, True) else None
    if use_nvcc and not nvcc:
        raise GpuError("nvcc was asked for but is not on PATH")
    if not nvcc and len(targets) != 1:
        raise GpuError("NVRTC builds one target at a time: pass the GPU's target (e.g. --arch sm_90a)")
    srcs = sources()
    compiler = _compiler_id(nvcc)
    defines = tuple(defines)
    key = cache_key(srcs, targets, compiler, defines)
    directory = (cache or cache_root()) / key
    images = {s.stem: directory / (s.stem + (".fatbin" if nvcc else ".cubin")) for s in srcs}
    if not force and all(p.is_file() for p in images.values()):
        return BuildResult(directory, images, compiler, targets, True)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=key + ".", dir=directory.parent))
    try:
        def one(src: Path) -> None:
            if progress:
                progress(src.name)
            out = tmp / images[src.stem].name
            if nvcc:
                _nvcc_one(nvcc, src, out, targets, ptx=True, defines=defines)
            else:
                _nvrtc_one(src, out, targets[0], defines)

        if jobs > 1:  # nvcc processes, or NVRTC programs (thread-safe, one per source)
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(jobs) as pool:
                list(pool.map(one, srcs))
        else:
            for s in srcs:
                one(s)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return BuildResult(directory, images, compiler, targets, False)
