"""The GPU path of ninfer-rt: cuda-python and numpy only (no torch).

driver.py is the one module that calls the CUDA driver; build.py compiles kernels/*.cu; kernels.py loads them;
the op wrappers (linear.py, moe.py, deltanet.py, attention.py, misc.py) compute launch shapes; engine.py runs
the model.
"""

# Prompt tokens per prefill step: each step reads every projection and (nearly) every expert once, so larger
# chunks read the weights fewer times per prompt. 35B on the H200, 8K prompt: 512 -> 7.7K tok/s, 4096 -> 14.7K
# (+0.45 GiB of activations), 8192 -> 15.7K (+1.0 GiB); docs/perf.md v7. Here so the CLI's help needs no CUDA.
PREFILL_CHUNK = 4096
