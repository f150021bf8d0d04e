"""The PyTorch reference backend: the oracle every CUDA kernel and the GPU model are tested against.

`ops` holds the reference ops (naive on purpose), `model` the ReferenceModel built from them. torch is
imported only when one of the names below is first used, so importing ninfer_rt never pulls it in.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"ReferenceModel": "model", "Cache": "model", "KVCache": "model", "DeltaState": "model"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import the submodule that defines `name` on first access (PEP 562)."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
