import os, subprocess, sys, json
sys.path.insert(0, os.getcwd())
from ninfer_rt.gpu.driver import Gpu, Event, ptr, i32, i64, _driver, _check
out = os.environ.get("OUT", "/tmp"); here = os.path.dirname(os.path.abspath(__file__))
subprocess.run(["nvcc", "-cubin", "-O3", "-arch=sm_90a", "-o", f"{out}/bulk.cubin", f"{here}/bulk.cu"], check=True)
dev = Gpu(); dev.pdl = False; d = _driver()
m = dev.load_module(open(f"{out}/bulk.cubin", "rb").read())
bulk, cpa, spin, rd = (m.function(n) for n in ("bulk", "cpa", "spin", "rd"))
MB = 1 << 20
P = dev.alloc(64 * MB); F = dev.alloc(512 * MB); o = dev.alloc(4096 * 4)
dev.memset(P, 1, 64 * MB); dev.memset(F, 3, 512 * MB); dev.synchronize()
for fn in (bulk, cpa):
    dev.set_max_dynamic_smem(fn, 200 * 1024)
def t(fn, grid, per, piece):
    ts = []
    for rep in range(5):
        dev.launch(rd, 1056, 256, [ptr(F), i64(512 * MB // 16), ptr(o)])
        dev.launch(spin, 1, 32, [i64(100000)])
        e0, e1 = Event(), Event(); e0.record(dev.stream)
        dev.launch(fn, grid, 256, [ptr(P), i32(per), i32(piece), ptr(o)], smem=per)
        e1.record(dev.stream); e1.synchronize(); ts.append(e0.elapsed_ms(e1) * 1000)
    return min(ts)
for name, fn in (("bulk", bulk), ("cp.async", cpa)):
    for grid, per in ((264, 100096), (264, 50048), (132, 200192), (264, 25024)):
        for piece in ((4096, 16384, 32768, 100096) if fn is bulk else (0,)):
            if piece > per: continue
            us = t(fn, grid, per, piece)
            print(f"{name} grid {grid} per-block {per} piece {piece}: {us:.2f} us, {grid * per / us / 1e6:.2f} TB/s", flush=True)
