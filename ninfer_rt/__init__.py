"""ninfer-rt: load a .ninfer artifact and run Qwen3.5/3.6 models (reference on CPU, CUDA kernels on GPU)."""

__version__ = "0.1.0"
