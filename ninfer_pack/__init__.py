"""ninfer-pack: quantize Qwen3.5/3.6 checkpoints into one verified, kernel-ready .ninfer artifact."""

from ninfer_rt import __version__

__all__ = ["__version__"]
