import os, subprocess, sys, json
import numpy as np
sys.path.insert(0, os.getcwd())
from ninfer_rt.gpu.driver import Gpu, Event, ptr, i32, i64, _driver, _check
out = os.environ.get("OUT", "/tmp")
here = os.path.dirname(os.path.abspath(__file__))
subprocess.run(["nvcc", "-cubin", "-O3", "-arch=sm_90a", "-o", f"{out}/l2p.cubin", f"{here}/l2p.cu"], check=True)
dev = Gpu()
d = _driver()
A = d.CUdevice_attribute
def attr(a): return int(_check(d.cuDeviceGetAttribute(a, dev.device), "attr"))
info = {"l2": attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        "max_persisting": attr(A.CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE),
        "max_window": attr(A.CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE)}
print(info, flush=True)
m = dev.load_module(open(f"{out}/l2p.cubin", "rb").read())
pf, rd, spin, rdl, pf16 = (m.function(n) for n in ("pf", "rd", "spin", "rdl", "pf16"))
dev.pdl = False
MB = 1 << 20
P = dev.alloc(64 * MB); S = dev.alloc(256 * MB); F = dev.alloc(512 * MB); o = dev.alloc(4096 * 4)
dev.memset(P, 1, 64 * MB); dev.memset(S, 2, 256 * MB); dev.memset(F, 3, 512 * MB); dev.synchronize()
def read(p, nbytes, grid=1056):
    dev.launch(rd, grid, 256, [ptr(p), i64(nbytes // 16), ptr(o)])
def timed_read(p, nbytes):
    dev.launch(spin, 1, 32, [i64(200000)])
    e0, e1 = Event(), Event(); e0.record(dev.stream); read(p, nbytes); e1.record(dev.stream); e1.synchronize()
    return e0.elapsed_ms(e1) * 1000
def setaside(n):
    _check(d.cuCtxSetLimit(d.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, n), "setlimit")
    _check(d.cuCtxResetPersistingL2Cache(), "reset")
rows = []
for sa in (0, 32 * MB):
    setaside(sa)
    for pmb in (8, 16, 24):
        for mode in (0, 2, 3, 4, 5):  # 0 no prefetch, 1 plain, 2 evict_last
            for smb in (0, 24, 48):
                ts = []
                for rep in range(3):
                    read(F, 512 * MB); dev.synchronize()   # flush L2
                    _check(d.cuCtxResetPersistingL2Cache(), "reset")
                    if mode == 3: read(P, pmb * MB)
                    elif mode == 4: dev.launch(rdl, 1056, 256, [ptr(P), i64(pmb * MB // 16), ptr(o)])
                    elif mode == 5: dev.launch(pf16, 256, 32, [ptr(P), i64(pmb * MB)])
                    elif mode: dev.launch(pf, 256, 32, [ptr(P), i64(pmb * MB), i32(mode)])
                    dev.launch(spin, 1, 32, [i64(100000)])
                    dev.synchronize()
                    if smb: read(S, smb * MB)
                    dev.synchronize()
                    ts.append(timed_read(P, pmb * MB))
                t = min(ts)
                rows.append(dict(setaside=sa, p_mb=pmb, mode=mode, stream_mb=smb, us=round(t, 2), tbps=round(pmb * MB / t / 1e6, 2)))
                print(rows[-1], flush=True)
json.dump({"info": info, "rows": rows}, open(f"{out}/l2p.json", "w"), indent=1)
