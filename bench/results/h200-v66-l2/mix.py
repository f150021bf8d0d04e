import os, subprocess, sys
import numpy as np
sys.path.insert(0, os.getcwd())
from ninfer_rt.gpu.driver import Gpu, ptr, i32, i64
out = os.environ.get("OUT", "/tmp"); here = os.path.dirname(os.path.abspath(__file__))
subprocess.run(["nvcc", "-cubin", "-O3", "-arch=sm_90a", "-o", f"{out}/mix.cubin", f"{here}/mix.cu"], check=True)
dev = Gpu(); dev.pdl = False
m = dev.load_module(open(f"{out}/mix.cubin", "rb").read())
mix, rd = m.function("mix"), m.function("rd")
MB = 1 << 20
A = dev.alloc(64 * MB); B = dev.alloc(64 * MB); F = dev.alloc(512 * MB); o = dev.alloc(3 * 1024 * 8); u = dev.alloc(4096 * 4)
dev.memset(A, 1, 64 * MB); dev.memset(B, 2, 64 * MB); dev.memset(F, 3, 512 * MB)
dev.set_max_dynamic_smem(mix, 110 * 1024); dev.synchronize()
grid = 264
for per, lsu in ((100096, 0), (100096, 37888), (100096, 75776), (0, 37888), (0, 75776), (50048, 37888), (50048, 0)):
    for mode in ((1 if per else 0) | (2 if lsu else 0),):
        res = []
        for rep in range(5):
            dev.launch(rd, 1056, 256, [ptr(F), i64(512 * MB // 16), ptr(u)])
            dev.launch(mix, grid, 256, [ptr(A), ptr(B), i32(per), i32(lsu), i32(mode), ptr(o)], smem=max(per, 16))
            dev.synchronize()
            t = dev.download(o, (grid, 3), np.uint64).astype(np.int64)
            t0 = t[:, 0].min()
            res.append(((np.median(t[:, 1] - t0), (t[:, 1] - t0).max(), np.median(t[:, 2] - t0), (t[:, 2] - t0).max())))
        r = np.median(np.array(res), axis=0) / 1000
        print(f"bulk {per * grid / MB:5.1f} MB + registers {lsu * grid / MB:5.1f} MB: registers in {r[0]:.2f} / {r[1]:.2f} us, "
              f"bulk in {r[2]:.2f} / {r[3]:.2f} us (median / last block, from the first block's start)", flush=True)
