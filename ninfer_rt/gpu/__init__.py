"""The GPU path of ninfer-rt: cuda-python and numpy only (no torch).

driver.py is the one module that calls the CUDA driver; build.py compiles kernels/*.cu; kernels.py loads them;
the op wrappers (linear.py, moe.py, deltanet.py, attention.py, misc.py) compute launch shapes; engine.py runs
the model.
"""

# Prompt tokens per prefill step: each step reads every projection and (nearly) every expert once, and fills the
# expert tiles better, so larger chunks cost less per token. 35B on the H200 (perf-history.md v18): 8K prompt 2048 ->
# 17.5K tok/s, 4096 -> 20.0K, 8192 -> 21.4K (+0.82 GiB at 262K context: 24.4 GiB in all); 64K prompt 9.7K, 10.5K,
# 10.8K. `--prefill-chunk` trades it back for memory. Here so the CLI's help needs no CUDA.
PREFILL_CHUNK = 8192
