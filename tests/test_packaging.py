"""The wheel: it must carry every package and the kernel sources, so `pip install ninfer` and a first GPU run
can build the kernels without a checkout. Oracle: the source tree itself (what a wheel built from it holds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_package_list_matches_the_tree():
    """pyproject.toml lists its packages by hand (kernels/ is mapped in as ninfer_rt._kernels): every folder with
    an __init__.py must be on that list, and nothing else."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    tree = {str(p.parent.relative_to(ROOT)).replace(os.sep, ".")
            for top in ("ninfer_pack", "ninfer_rt") for p in (ROOT / top).rglob("__init__.py")}
    assert listed == tree | {"ninfer_rt._kernels"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of what the build reads (setuptools writes build/ beside the sources)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, src / name)
    for name in ("ninfer_pack", "ninfer_rt", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(out), str(src)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"pip wheel failed: {r.stderr.strip()[-500:]}")
    (path,) = out.glob("ninfer-*.whl")
    return path


def test_wheel_carries_the_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources and all(f"ninfer_rt/_kernels/{n}" in names for n in sources)
    assert all(f"ninfer_rt/configs/{p.name}" in names for p in (ROOT / "ninfer_rt" / "configs").glob("*.json"))


def test_installed_wheel_finds_and_compiles_its_kernels(wheel, tmp_path):
    """Installed away from the checkout, ninfer_rt.gpu.build finds the packaged sources; with nvcc on PATH one of
    them compiles from there (the whole set is CI's compile test)."""
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    probe = ("import sys; from ninfer_rt.gpu import build; d = build.kernels_dir(); "
             "print(d); print(len(build.sources(d)))")
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-500:]
    where, count = r.stdout.split()
    assert Path(where) == target / "ninfer_rt" / "_kernels"
    assert int(count) == len(list((ROOT / "kernels").glob("*.cu")))
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here: the packaged sources were found but not compiled")
    src = Path(where) / "norm.cu"
    r = subprocess.run([nvcc, "-cubin", "-arch=sm_80", "-I", where, "-o", str(tmp_path / "norm.cubin"), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    assert (tmp_path / "norm.cubin").read_bytes()[:4] == b"\x7fELF"
