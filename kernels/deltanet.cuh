// deltanet.cuh: what the two DeltaNet files share (deltanet.cu: conv, recurrent, gated norm and the fused
// decode step; deltanet_chunked.cu: the chunked delta rule for prefill). No op lives here.
#pragma once

#define DN_L2_EPS 1e-6f  // ops.L2NORM_EPS: q and k are scaled by rsqrt(Σx² + eps)
