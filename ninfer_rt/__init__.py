"""ninfer-rt: load a .ninfer artifact and run Qwen3.5/3.6 models (reference on CPU, CUDA kernels on GPU).

`ninfer_rt.load(path, device="cpu")` returns a Model (ninfer_rt.api); it is imported on first use, so
`import ninfer_rt` stays light.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load", "__version__"]


def __getattr__(name: str):
    """Resolve `load` from ninfer_rt.api on first access (PEP 562)."""
    if name == "load":
        from ninfer_rt.api import load

        return load
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
