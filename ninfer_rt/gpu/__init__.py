"""The GPU path of ninfer-rt: cuda-python and numpy only (no torch).

driver.py is the one module that calls the CUDA driver; build.py compiles kernels/*.cu; kernels.py loads them;
the op wrappers (linear.py, moe.py, deltanet.py, attention.py, misc.py) compute launch shapes; engine.py runs
the model.
"""
