"""The model on the GPU: buffers, caches and the forward step as a sequence of our kernels.

One step runs B sequences × T new tokens (M = B·T rows, row b·T + t) through every layer:

    x = embed(ids)                                                       # x: [M, H] fp32 residual stream
    per layer:  h = rmsnorm(x)
                DeltaNet:  [qkv|z] = W h; [b|a] = W h; o = deltanet(…); x += W_out o
                Attention: [q|k|v|gate] = W h; q = prepare(…) (writes K/V); o = attend(…); x += W_o o
                h = rmsnorm(x)
                MoE:  route(W_r h); act = SwiGLU_e(h); x += Σ w_e W_down,e act; x += σ(g)·shared(h)
                MLP:  x += W_down SwiGLU(h)
    logits = lm_head(rmsnorm(x[rows]))

At decode (M ≤ 8) no h is materialised: each consumer normalises x as it stages it (the GEMV prologue, the
fused DeltaNet step, the MoE kernels). A one-token step runs a DeltaNet layer as three launches (in_proj GEMV,
the fused step, out_proj GEMV), an attention layer as five (q|k|v|gate GEMV, prepare, split-KV decode, combine,
o_proj), and the MoE block as one (moe.fused: routing, routed and shared experts, the residual add, with a grid
barrier). Its router logits are not a launch of their own where router_fold fits: the DeltaNet step or the
attention combine two launches back adds them up. Batched rows take separate MoE launches (ffn.py).

Decode steps (T ≤ 8) are captured as CUDA graphs, one per (B, T, context bucket): the kernels read ids, pos
and slot from device arrays, so a graph replays for every token until the context passes its bucket.
Prefill runs the same step on chunks of the prompt (tensor-core GEMM for the projections when there are
more than 8 rows). Weights are read from the artifact layout in place (ninfer_rt.gpu.loader).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ninfer_rt.errors import NinferError
from ninfer_rt.formats import round_up
from ninfer_rt.gpu import (PREFILL_CHUNK, attention, buffers, deltanet, draws, ffn, gemm, linear, misc, mixer, moe,
                           mtp, router_fold)
from ninfer_rt.gpu.driver import Event, Gpu
from ninfer_rt.gpu.kernels import Kernels, LaunchRecorder
from ninfer_rt.gpu.loader import DeviceWeights
from ninfer_rt.gpu.weights import k_view

LM = "model.language_model."
MTP = mtp.MTP
GEMV_MAX_ROWS = 8        # the GEMV reads weights once for up to 8 rows; more rows go to the tensor-core GEMM
MIN_BUCKET = 1024        # smallest context bucket of a decode graph
# a plain arg-max draw taken by the lm_head GEMV's own blocks where it runs as one block-kernel launch (one row),
# not by argmax_rows + argmax_finish after it (perf.md v115)
ARGMAX_IN_LM_HEAD = True


def context_bucket(n: int) -> int:
    """The decode-graph bucket holding contexts up to n: a power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << max(0, (n - 1).bit_length()))


class Step(NamedTuple):
    """One forward's shape and outputs, and the key of its captured graph: B sequences of T rows each at a context
    bucket. logit_rows: "last", each sequence's last row's logits into logits[b] and their arg-max; "all", every
    row's (M ≤ logit_rows); "none", no lm_head (a prefill chunk before the last); "hidden", every row's post-norm
    hidden state into buf.h (the MTP head's input) and the logits as "last". draw: ("argmax" | "sample", vocab,
    *flags) with "last" or "hidden", each sequence's next token over ids < vocab into the draw slots instead of the
    arg-max (draws.py: flags "logprobs", "penalized" and "masked"). vocab: the rows' arg-max over
    ids < vocab rather than < sample_vocab (a verification's top1). trail: the DeltaNet layers keep each token's state
    (rewind)."""

    B: int
    T: int
    bucket: int
    logit_rows: str = "last"
    draw: tuple | None = None
    vocab: int | None = None
    trail: bool = False


class GpuModel:
    """The text model of `spec` on `gpu`, with `slots` sequences of up to `max_ctx` positions each. ordered_moe
    (MoE models): a prompt chunk's routed experts summed in slot order (gemm.moe_grouped's slot_y: fp32 rows of
    chunk · top_k · H over the mixer's buffer), so a prompt gives the same bits every run, for ~3% of its time
    (bench/prefill_moe_sum.py)."""

    def __init__(self, gpu: Gpu, kernels: Kernels, spec, weights: DeviceWeights, *, slots: int = 1,
                 max_ctx: int = 4096, kv_dtype: str = "int8", prefill_chunk: int | None = None,
                 sample_vocab: int | None = None, logit_rows: int | None = None, gemm_kernel: str = "auto",
                 ordered_moe: bool = True):
        if kv_dtype not in ("int8", "bf16"):
            raise NinferError(f"kv cache dtype {kv_dtype!r}: choose int8 or bf16")
        if max_ctx > spec.max_position_embeddings:
            raise NinferError(f"context {max_ctx} is longer than the model's {spec.max_position_embeddings}")
        self.gpu, self.k, self.spec, self.w = gpu, kernels, spec, weights
        if gemm_kernel not in gemm.KERNELS:
            raise NinferError(f"gemm kernel {gemm_kernel!r}: choose one of {', '.join(gemm.KERNELS)}")
        self.gemm_kernel = gemm_kernel  # the prefill GEMMs' kernel (gemm.KERNELS; "auto" picks per launch)
        self.ordered_moe = ordered_moe and spec.is_moe
        self.slots, self.max_ctx, self.kv_dtype = slots, max_ctx, kv_dtype
        prefill_chunk = PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        self.rows = max(prefill_chunk, slots * GEMV_MAX_ROWS)
        self.prefill_chunk = prefill_chunk
        s = spec
        self.H, self.V = s.hidden_size, s.vocab_size
        # ids the device argmax may pick: the tokenizer's, not the padded rows of the embedding
        self.sample_vocab = min(sample_vocab or s.vocab_size, s.vocab_size)
        self.qkvg_cols = (2 * s.num_attention_heads + 2 * s.num_key_value_heads) * s.head_dim
        self.mixed_cols = max(self.qkvg_cols, s.conv_dim + s.value_dim)
        self.embed_w = weights.matrix(LM + "embed_tokens.weight")
        self.lm_head = weights.matrices.get("lm_head.weight") or self.embed_w
        self.has_mtp = MTP + "fc.weight" in weights.matrices  # loaded with the MTP head (speculative decoding)
        # rows of logits one step can produce (prefill with all_logits asks for more than decode's)
        self.logit_rows = max(logit_rows or slots * GEMV_MAX_ROWS, slots)
        # per-slot DeltaNet state: the ring of conv inputs and the fp32 recurrent state
        self.conv_bytes = deltanet.conv_state_bytes(s.linear_conv_kernel_dim, s.conv_dim)
        self.ssm_bytes = s.linear_num_value_heads * s.linear_key_head_dim * s.linear_value_head_dim * 4
        inv_freq, self.rope_scale = attention.rope_inv_freq(s)
        self._allocs: list[int] = []
        self.inv_freq = self._alloc(inv_freq.nbytes)
        gpu.upload(self.inv_freq, inv_freq)
        self._alloc_state()
        self.buf = buffers.alloc(self, self.rows, decode_rows=GEMV_MAX_ROWS, layer_prefix=LM + "layers.")
        if self.has_mtp:
            mtp.alloc(self)
        # v71/v72: layer -> (the step's or the combine's fold arguments, the MoE's acc)
        self._folds = router_fold.layer_folds(gpu, self.k, s, self.w.matrix, self.w.param, self.kv, self.buf.x,
                                              self._alloc, LM, rows=GEMV_MAX_ROWS)
        self.pos = self._alloc(4 * slots)
        self.slot = self._alloc(4 * slots)
        self.graphs: dict[tuple, object] = {}  # Step, ("mtp", T, bucket) or ("rewind", slot, keep) -> captured graph
        self._carveout_planned: set[tuple] = set()  # the decode steps (B, T, trail) the shared carveout holds
        self._trails: dict[int, int] = {}  # verification trails per DeltaNet layer (verify(trail=True) allocates)
        # batched decode runs the MoE's shared expert on a side stream, beside the router and the routed gate/up
        self._side_streams = (gpu.new_stream(), gpu.new_stream(high_priority=True))  # moe.SHARED_STREAM_PRIORITY
        self._fork, self._join = Event(timing=False), Event(timing=False)
        self.draws = draws.Draws(gpu, self._alloc, slots, self.V)  # the decode loops' draws on the device

    # ------------------------------------------------------------------------------------------- memory

    def _alloc(self, nbytes: int) -> int:
        p = self.gpu.alloc(round_up(max(int(nbytes), 1), 256))
        self._allocs.append(p)
        return p

    def _alloc_state(self) -> None:
        s, g = self.spec, self.gpu
        self.kv: dict[int, attention.KVCache] = {}
        self.conv_state: dict[int, int] = {}
        self.ssm_state: dict[int, int] = {}
        # the MTP head's attention layer (index num_hidden_layers) has a KV cache of its own
        for i, kind in enumerate(s.layer_types + (("full_attention",) if self.has_mtp else ())):
            if kind == "full_attention":
                n = attention.KVCache.nbytes(self.slots, self.max_ctx, s.num_key_value_heads, s.head_dim,
                                             self.kv_dtype)
                base = self._alloc(n)
                g.memset(base, 0, n)
                self.kv[i] = attention.KVCache.at(base, self.slots, self.max_ctx, s.num_key_value_heads,
                                                  s.head_dim, self.kv_dtype)
            else:
                conv, ssm = self.slots * self.conv_bytes, self.slots * self.ssm_bytes
                self.conv_state[i], self.ssm_state[i] = self._alloc(conv), self._alloc(ssm)
                g.memset(self.conv_state[i], 0, conv)
                g.memset(self.ssm_state[i], 0, ssm)

    def reset_slot(self, slot: int) -> None:
        """Forget a sequence: zero its DeltaNet states (its KV entries are overwritten as positions refill)."""
        for i in self.conv_state:
            self.gpu.memset(self.conv_state[i] + slot * self.conv_bytes, 0, self.conv_bytes)
            self.gpu.memset(self.ssm_state[i] + slot * self.ssm_bytes, 0, self.ssm_bytes)

    def copy_slot(self, src: int, dst: int, positions: int) -> None:
        """Make slot dst a copy of slot src as it stands after `positions` tokens: the DeltaNet conv and recurrent
        states whole, the KV entries of positions [0, positions). Ordered on the stream like the steps."""
        self._check([0], positions, [src, dst])
        for i in self.conv_state:
            self.gpu.copy(self.conv_state[i] + dst * self.conv_bytes, self.conv_state[i] + src * self.conv_bytes,
                          self.conv_bytes)
            self.gpu.copy(self.ssm_state[i] + dst * self.ssm_bytes, self.ssm_state[i] + src * self.ssm_bytes,
                          self.ssm_bytes)
        for kv in self.kv.values():
            kv.copy_positions(self.gpu, src, dst, positions)

    def _fold_for(self, i: int, B: int, T: int) -> tuple | None:
        """router_fold.fold_for of layer i at B sequences of T tokens: the step's (the combine's) fold arguments,
        or None where the router GEMV runs. Decided before the mixer's launch, so that acc is only ever added to
        when the MoE reads and clears it."""
        return router_fold.fold_for(self.k, self.spec, self.w.matrix, LM, self._folds, i, B, T, GEMV_MAX_ROWS)

    def free(self) -> None:
        for g in self.graphs.values():
            g.destroy()
        self.graphs.clear()
        for p in self._allocs:
            self.gpu.free(p)
        self._allocs.clear()

    # ------------------------------------------------------------------------------------------- the step

    def _linear(self, w, *, x: int, M: int, y: int, mode: str = "store", ldx: int | None = None,
                ldy: int | None = None, row_scale: int = 0, norm_w: int = 0, stream=None) -> None:
        """y (op)= W x: the fp32 GEMV for up to 8 rows (with the RMSNorm of x fused when norm_w is given), the
        tensor-core GEMM above that (x must then be normalised already, and bf16)."""
        w = k_view(w)
        if M > GEMV_MAX_ROWS:
            assert not norm_w, "the GEMM path takes normalised input"
            kern = self.gemm_kernel
            if kern == "wgmma_ss" and not (w.quantized and gemm.dequant_bytes(w) <= self.buf.wscratch_bytes):
                kern = "wgmma"  # bf16 weights and the lm_head: nothing to dequantize, or no room
            gemm.gemm(self.k, w, x=x, M=M, y=y, ldx=ldx, ldy=ldy, mode=mode, row_scale=row_scale, stream=stream,
                      kernel=kern, scratch=self.buf.wscratch, scratch_bytes=self.buf.wscratch_bytes)
        else:
            linear.gemv(self.k, w, x=x, M=M, y=y, ldx=ldx, ldy=ldy, mode=mode, row_scale=row_scale, norm_w=norm_w,
                        norm_eps=self.spec.rms_norm_eps, stream=stream)

    def _prefix(self, i: int) -> str:
        """Layer i's tensor prefix; i = num_hidden_layers is the MTP head's layer."""
        return f"{LM}layers.{i}." if i < self.spec.num_hidden_layers else f"{MTP}layers.0."

    def _kind(self, i: int) -> str:
        return self.spec.layer_types[i] if i < self.spec.num_hidden_layers else "full_attention"

    def _layer(self, i: int, B: int, T: int, ctx_bucket: int, trail: bool = False) -> None:
        """Decoder layer i (the MTP head's at i = num_hidden_layers) on x: [M, H] fp32, in place; `folded` (the
        mixer's launch added the router's logits into the fold accumulator) tells the MoE to route on them."""
        P = self.w.param
        M, p = B * T, self._prefix(i)
        prefill = M > GEMV_MAX_ROWS
        src, nw = self._norm_input(P(p + "input_layernorm.weight"), M)
        if self._kind(i) == "full_attention":
            folded = mixer.attention(self, i, p + "self_attn.", B, T, ctx_bucket, src=src, norm_w=nw,
                                     prefill=prefill)
        else:
            folded = mixer.deltanet(self, i, p + "linear_attn.", B, T, src=src, norm_w=nw, prefill=prefill,
                                    trail=trail)
        post = P(p + "post_attention_layernorm.weight")
        src, nw = self._norm_input(post, M)
        if self.spec.is_moe:
            ffn.moe_block(self, i, p + "mlp.", M, src=src, norm_w=nw, post=post, folded=folded, prefill=prefill)
        else:
            ffn.dense_mlp(self, i, p + "mlp.", M, src=src, norm_w=nw, prefill=prefill)

    def _norm_input(self, w: int, M: int) -> tuple[int, int]:
        """(src, norm_w): what a layer's projections read for rms_norm(x) with weight w. At decode x itself and w,
        each consumer normalising as it stages x (GEMV prologue, the DeltaNet step, the routed gate/up); for a
        prompt chunk h in bf16 (the GEMMs' input), and no weight."""
        b = self.buf
        if M <= GEMV_MAX_ROWS:
            return b.x, w
        misc.rms_norm(self.k, x=b.x, y=b.h16, M=M, D=self.H, w=w, eps=self.spec.rms_norm_eps, out="bf16")
        return b.h16, 0

    def _o_input(self, M: int, D: int) -> int:
        """The mixer output o [M, D] as the next projection reads it: fp32 for the GEMV, bf16 for the GEMM."""
        if M <= GEMV_MAX_ROWS:
            return self.buf.o
        misc.cast_bf16(self.k, x=self.buf.o, y=self.buf.o16, M=M, D=D)
        return self.buf.o16

    def _step(self, step: Step) -> None:
        """Enqueue one forward of M = B·T rows whose ids, pos and slot are already on the device (Step says what
        it leaves)."""
        B, T, logit_rows = step.B, step.T, step.logit_rows
        b, s, M = self.buf, self.spec, B * T
        linear.embed(self.k, self.embed_w, ids=b.tokens, M=M, out=b.x)
        for i in range(s.num_hidden_layers):
            self._layer(i, B, T, step.bucket, step.trail)
        if logit_rows == "none":
            return
        norm = self.w.param(LM + "norm.weight")
        # an arg-max alone (into buf.argmax, or the draw slots) is the lm_head's to take; other draws come after it
        if step.draw is None:
            pick = (b.argmax, step.vocab or self.sample_vocab, b.scratch)
        elif step.draw[0] == "argmax" and len(step.draw) == 2:
            pick = (self.draws.out, step.draw[1], self.draws.scratch)
        else:
            pick = None
        if logit_rows == "hidden":  # for the MTP head: every row's post-norm h (fp32), each sequence's last logits
            misc.rms_norm(self.k, x=b.x, y=b.h, M=M, D=self.H, w=norm, eps=s.rms_norm_eps, out="f32")
            self._lm_head(x=b.h + 4 * (T - 1) * self.H, M=B, ldx=T * self.H, pick=pick)
            rows = B
        elif logit_rows == "all":
            h, out = (b.h, "f32") if M <= GEMV_MAX_ROWS else (b.h16, "bf16")
            misc.rms_norm(self.k, x=b.x, y=h, M=M, D=self.H, w=norm, eps=s.rms_norm_eps, out=out)
            self._lm_head(x=h, M=M, pick=pick)
            rows = M
        else:  # row b·T + T-1 of each sequence: a strided view of x
            last, ld = b.x + 4 * (T - 1) * self.H, T * self.H
            if B <= GEMV_MAX_ROWS:  # the final norm fused into the lm_head GEMV
                self._lm_head(x=last, M=B, ldx=ld, norm_w=norm, pick=pick)
            else:
                misc.rms_norm(self.k, x=last, y=b.h16, M=B, D=self.H, w=norm, eps=s.rms_norm_eps, ldx=ld,
                              out="bf16")
                self._lm_head(x=b.h16, M=B, pick=pick)
            rows = B
        if pick is None:
            self._enqueue_draw(*step.draw, rows=rows)

    def _lm_head(self, *, x: int, M: int, ldx: int | None = None, norm_w: int = 0,
                 pick: tuple[int, int, int] | None = None) -> None:
        """logits rows 0..M-1 = lm_head(x); with pick (out, vocab, scratch), also out int32 [M] = their arg-max over
        ids < vocab: in the GEMV's own launch where it can take it (linear.argmax_fits), else by misc.argmax after it
        (on that scratch)."""
        b, w = self.buf, k_view(self.lm_head)
        if pick is not None and ARGMAX_IN_LM_HEAD and linear.argmax_fits(self.k, w, M):
            linear.gemv(self.k, w, x=x, M=M, y=b.logits, ldx=ldx, norm_w=norm_w, norm_eps=self.spec.rms_norm_eps,
                        argmax=(b.amax, *pick[:2]))
            return
        self._linear(self.lm_head, x=x, M=M, y=b.logits, ldx=ldx, norm_w=norm_w)
        if pick is not None:
            out, vocab, scratch = pick
            misc.argmax(self.k, logits=b.logits, ld=self.V, M=M, V=vocab, out=out, scratch=scratch)

    def _enqueue_draw(self, how: str, vocab: int, *flags: str, rows: int = 1) -> None:
        """The draw op (how, vocab, *flags) over logits rows 0..rows-1 (draws.py)."""
        self.draws.enqueue(self.k, self.buf.logits, self.slot, how, vocab, *flags, rows=rows)

    def set_penalties(self, slot: int, record: np.ndarray, counts: np.ndarray | None = None,
                      seen: np.ndarray | None = None) -> None:
        """Slot's penalties and, where given, its sequence's state, for its draws (Draws.set_penalties)."""
        self.draws.set_penalties(slot, record, counts, seen)

    # ------------------------------------------------------------------------------------------- host API

    def _set_batch(self, tokens: np.ndarray | None, pos: list[int], slots: list[int]) -> None:
        """The step's inputs; tokens None: the tokens the latest draw left in the first B draw slots, copied on
        the device (the host has not read them yet)."""
        if tokens is None:
            self.gpu.copy(self.buf.tokens, self.draws.out, 4 * len(pos))
        else:
            self.gpu.upload(self.buf.tokens, np.asarray(tokens, np.int32), stream=self.gpu.stream)
        self.gpu.upload(self.pos, np.asarray(pos, np.int32), stream=self.gpu.stream)
        self.gpu.upload(self.slot, np.asarray(slots, np.int32), stream=self.gpu.stream)

    @property
    def side(self):
        """The stream batched decode runs the MoE's shared expert on: the greatest-priority one where
        moe.SHARED_STREAM_PRIORITY asks, else the plain one."""
        return self._side_streams[1 if moe.SHARED_STREAM_PRIORITY else 0]

    def bucket(self, end: int) -> int:
        """The graph bucket of a step whose tokens end before position `end`: context_bucket, within the cache."""
        return min(context_bucket(end), self.max_ctx)

    def _check(self, pos: list[int], T: int, slots: list[int]) -> None:
        if any(not 0 <= sl < self.slots for sl in slots):
            raise NinferError(f"slot out of range [0, {self.slots})")
        if max(pos) + T > self.max_ctx:
            raise NinferError(f"context {max(pos) + T} exceeds the cache's {self.max_ctx} positions")

    def decode(self, tokens: np.ndarray | None, pos: list[int], slots: list[int], *, graph: bool = True,
               draw: tuple[int, np.ndarray | None] | None = None, hidden: bool = False) -> None:
        """One decode step for B = len(pos) sequences of T = tokens.size // B new tokens each (T ≤ 8).

        Leaves logits of each sequence's last token in the logits buffer (rows 0..B-1) and their argmax; or,
        with draw = (vocab, record) and B = 1, the next token in the same graph (`drawn()`): the arg-max over
        ids < vocab (record None) or a draw under a misc.sample_params record, instead of the argmax. hidden:
        also every row's post-norm hidden state (`hidden(B·T)`: the MTP head's input), the lm_head then reading
        it rather than normalising x itself. With draw and B > 1, record is None (every row's arg-max) or B records, one
        a sequence (`drawn_rows(B)`). draw = (vocab, record, True): each slot's penalties first (set_penalties), the
        drawn tokens counted in their slots' state. A fourth element, B logprob counts (None: none for that row), also
        leaves each such row's logprobs record (`draws.logprobs`); a fifth, True: each row drawn over its slot's
        mask (set_mask). tokens None (with draw): sequence b's token is the one the latest draw left in draw slot b
        on the device (the same sequences in the same rows), so a step can be enqueued before the host reads the
        tokens before it.
        """
        B = len(pos)
        if tokens is None and draw is None:
            raise NinferError("decode: tokens fed from the draw slots need a draw")
        T = 1 if tokens is None else tokens.size // B
        if not 1 <= T <= GEMV_MAX_ROWS or (tokens is not None and T * B != tokens.size) or B > self.slots:
            raise NinferError(f"decode takes 1..{GEMV_MAX_ROWS} tokens for each of at most {self.slots} sequences")
        self._check(pos, T, slots)
        if draw is not None and (T != 1 or not 1 <= draw[0] <= self.V
                                 or (draw[1] is not None and len(draw[1]) != B)
                                 or (len(draw) > 3 and draw[3] is not None and len(draw[3]) != B)):
            raise NinferError(f"decode draws one token for each sequence of one row over 1..{self.V} ids, one params "
                              f"record (and logprob count) each; got T = {T}, vocab = {draw[0]}, "
                              f"{'no' if draw[1] is None else len(draw[1])} records for B = {B}")
        self._set_batch(tokens, pos, slots)
        self._run(Step(B, T, self.bucket(max(pos) + T), "hidden" if hidden else "last",
                       draw=None if draw is None else self._draw_op(*draw)), graph)

    def verify(self, tokens: np.ndarray, pos: int, slot: int, *, graph: bool = True, trail: bool = False,
               vocab: int | None = None) -> None:
        """One step of T = tokens.size (<= 8) new tokens of one sequence leaving the logits of every row (rows
        0..T-1) and their argmax (over ids < vocab where given, else < sample_vocab; `argmax(T)` reads them, with no
        launch after the step): speculative decoding's verification. trail: every DeltaNet layer also keeps its
        state after each token but the last, so that `rewind` can then keep any prefix of the tokens."""
        T = tokens.size
        if not 1 <= T <= GEMV_MAX_ROWS:
            raise NinferError(f"verify takes 1..{GEMV_MAX_ROWS} tokens, got {T}")
        if vocab is not None and not 1 <= vocab <= self.V:
            raise NinferError(f"verify: arg-maxes over ids < {vocab}, outside 1..{self.V}")
        self._check([pos], T, [slot])
        if trail:
            self._alloc_trails()
        self._set_batch(tokens, [pos], [slot])
        self._run(Step(1, T, self.bucket(pos + T), "all", vocab=None if vocab is None else int(vocab), trail=trail),
                  graph)

    def _alloc_trails(self) -> None:
        """The verification trails, once: per DeltaNet layer fp32 [GEMV_MAX_ROWS - 1, nv, dk, dv] (deltanet.step's
        trail at B = 1), where every DeltaNet layer takes the one-launch step."""
        if self._trails or not self.conv_state:
            return
        s = self.spec
        for i in self.conv_state:
            w_ba = self.w.matrix(self._prefix(i) + "linear_attn.{in_proj_b,in_proj_a}.weight")
            if not deltanet.step_supported(w_ba, T=GEMV_MAX_ROWS, dk=s.linear_key_head_dim,
                                           dv=s.linear_value_head_dim, Kc=s.linear_conv_kernel_dim):
                raise NinferError(f"layer {i}: its DeltaNet shape has no one-launch step, so no verification trail")
        self._trails = {i: self._alloc((GEMV_MAX_ROWS - 1) * self.ssm_bytes) for i in self.conv_state}

    def rewind(self, slot: int, keep: int, T: int, *, graph: bool = True) -> None:
        """After verify(T tokens, trail=True) of the sequence in `slot`: leave it as if only its first `keep`
        tokens had been fed (1 <= keep <= T), each DeltaNet state the trail's row keep - 1. The conv rings and the
        KV caches need nothing: a trail's step wrote every position into the ring, and the next step's position
        (the caller's) overwrites and masks what was fed past keep. Ordered on the stream like the steps; with
        graph, the layers' copies replay as one captured graph per (slot, keep) (30 host copy calls took ~0.17 ms)."""
        if not 1 <= keep <= T <= GEMV_MAX_ROWS or not 0 <= slot < self.slots:
            raise NinferError(f"rewind keeps 1..T of T <= {GEMV_MAX_ROWS} tokens of a slot, got {keep} of {T} in "
                              f"slot {slot}")
        if keep == T:
            return
        if not self._trails and self.conv_state:
            raise NinferError("rewind needs a verification with trail=True first")

        def copies():
            for i, tr in self._trails.items():
                self.gpu.copy(self.ssm_state[i] + slot * self.ssm_bytes, tr + (keep - 1) * self.ssm_bytes,
                              self.ssm_bytes, stream=self.gpu.stream)
        self._graphed(("rewind", slot, keep), copies, graph)

    def draft_graph(self, T: int, bucket: int):
        """The captured graph of a draft step of T rows that ran before; KeyError if none did."""
        return self.graphs[("mtp", T, bucket)]

    def step_graph(self, step: Step):
        """The captured graph of a step that ran before (benchmarks replay it alone); KeyError if none was."""
        return self.graphs[step]

    def _run(self, step: Step, graph: bool) -> None:
        """Enqueue a step directly, or replay (capturing on first use) its graph, kept under the step.

        Decode steps (up to 8 rows) launch with programmatic dependent launch where the GPU has it: hundreds
        of short kernels, each launch overlapping the end of the one before. Prefill's large kernels do not.
        """
        decode = step.B * step.T <= GEMV_MAX_ROWS
        self.gpu.pdl = self.gpu.pdl_capable and decode
        if decode and (step.B, step.T, step.trail) not in self._carveout_planned:
            self._plan_carveout(step)
        self._graphed(step, lambda: self._step(step), graph)

    def _graphed(self, key: tuple, enqueue, graph: bool) -> None:
        """enqueue() directly, or replay (capturing on first use) the graph it makes, kept under `key`."""
        if not graph:
            enqueue()
            return
        g = self.graphs.get(key)
        if g is None:
            self.gpu.begin_capture()
            try:
                enqueue()
            finally:
                g = self.gpu.end_capture(node_priority=moe.SHARED_STREAM_PRIORITY)
            self.graphs[key] = g
        g.launch(self.gpu.stream)

    def _plan_carveout(self, step: Step) -> None:
        """A dry run of the decode step (its launches recorded, none enqueued), so that the kernels' shared
        carveout (kernels.SHARED_CARVEOUT) holds its launches before it first runs or is captured. Every launch of
        the step goes through self.k, the draws' too (Draws.enqueue takes it): run, they would count a token drawn
        from the last step's logits into each penalized slot's state (perf.md v112)."""
        real, rec = self.k, LaunchRecorder(self.k)
        self.k = rec
        try:
            self._step(step)
        finally:
            self.k = real
        real.share_carveout(rec.launches)
        self._carveout_planned.add((step.B, step.T, step.trail))

    def forget_carveout(self) -> None:
        """Forget the shared carveout's plan (the kernels' and which steps it holds): the next decode step plans it
        again (planner A/Bs change constants that act only then)."""
        self.k.reset_shared_carveout()
        self._carveout_planned.clear()

    def prefill(self, tokens: np.ndarray, slot: int, start: int = 0, all_logits: bool = False,
                hidden: bool = False):
        """Run a prompt through one sequence's slot from position `start`, in chunks.

        Returns the logits of every position (float32 [T, V]) when all_logits; with hidden, every position's
        post-norm hidden state (float32 [T, H], the MTP head's input); else None. The last token's logits are left
        in logits row 0 (and argmax row 0).
        """
        tokens = np.asarray(tokens, np.int32)
        n = tokens.size
        self._check([start], n, [slot])
        chunk = min(self.prefill_chunk, self.logit_rows) if all_logits else self.prefill_chunk
        out = []
        for c0 in range(0, n, chunk):
            piece = tokens[c0:c0 + chunk]
            T = piece.size
            self._set_batch(piece, [start + c0], [slot])
            last = c0 + T == n
            # full chunks replay a captured graph (host launch cost is ~500 launches per chunk otherwise)
            rows = "all" if all_logits else "hidden" if hidden else "last" if last else "none"
            self._run(Step(1, T, self.bucket(start + c0 + T), rows), graph=T == chunk and not all_logits)
            if all_logits or hidden:
                out.append(self.logits(T) if all_logits else self.hidden(T))
        return np.concatenate(out) if all_logits or hidden else None

    def hidden(self, rows: int) -> np.ndarray:
        """buf.h's first `rows` rows (float32 [rows, H]): the post-norm hidden states a verification ("all") or a
        prefill with hidden left, or the MTP head's output (draft)."""
        return self.gpu.download(self.buf.h, (rows, self.H), np.float32)

    def draft(self, hidden: np.ndarray, ids: np.ndarray, pos: int, slot: int, *, graph: bool = True) -> int:
        """The MTP head (mtp.py) over T = ids.size rows of the sequence in `slot`: row t pairs hidden[t] (float32
        [T, H]: the main model's post-norm state at position pos + t, or the head's own output when chaining) with
        ids[t]; the head's KV cache takes positions pos .. pos + T - 1. Leaves the last chunk's rows' output in
        `hidden(rows)` (prompts run in prefill chunks) and the last row's draft logits in logits row 0; returns
        rows."""
        if not self.has_mtp:
            raise NinferError("draft: the model was loaded without its MTP head (mtp.* tensors)")
        ids, hidden = np.asarray(ids, np.int32), np.ascontiguousarray(hidden, np.float32)
        if ids.ndim != 1 or hidden.shape != (ids.size, self.H) or not ids.size:
            raise NinferError(f"draft: hidden {hidden.shape} and ids {ids.shape} must be [T, {self.H}] and [T]")
        self._check([pos], ids.size, [slot])
        for c0 in range(0, ids.size, self.prefill_chunk):
            T = min(self.prefill_chunk, ids.size - c0)
            self.gpu.upload(self.buf.hin, hidden[c0:c0 + T], stream=self.gpu.stream)
            self._set_batch(ids[c0:c0 + T], [pos + c0], [slot])
            bucket, decode = self.bucket(pos + c0 + T), T <= GEMV_MAX_ROWS
            self.gpu.pdl = self.gpu.pdl_capable and decode
            self._graphed(("mtp", T, bucket), lambda: mtp.step(self, T, bucket, prefill=not decode),
                          graph and decode)
        return T

    def logits(self, rows: int) -> np.ndarray:
        """The logits buffer's first `rows` rows (float32 [rows, V]), after the stream finishes."""
        return self.gpu.download(self.buf.logits, (rows, self.V), np.float32)

    def logits_row(self, row: int) -> np.ndarray:
        """One row of the logits buffer (float32 [V]), after the stream finishes."""
        return self.gpu.download(self.buf.logits + 4 * row * self.V, (self.V,), np.float32)

    def argmax(self, rows: int) -> np.ndarray:
        return self.gpu.download(self.buf.argmax, (rows,), np.int32)

    def top1(self, rows: int, vocab: int) -> np.ndarray:
        """The arg-max over ids < vocab of each of the logits buffer's first `rows` rows (int32 [rows]; ties to
        the lowest id), computed on the device after the step: only the ids cross to the host."""
        if not 1 <= rows <= self.logit_rows or not 1 <= vocab <= self.V:
            raise NinferError(f"top1: {rows} rows of ids < {vocab} (the buffer holds {self.logit_rows} rows of "
                              f"{self.V})")
        misc.argmax(self.k, logits=self.buf.logits, ld=self.V, M=rows, V=vocab, out=self.buf.argmax,
                    scratch=self.buf.scratch)
        return self.argmax(rows)

    def draw(self, vocab: int, record: np.ndarray | None = None, slot: int | None = None, penalized: bool = False,
             masked: bool = False, row: int = 0) -> int:
        """The next token from logits row `row` over ids < vocab into draw slot `row` (the others keep theirs), with
        only the id coming back to the host: the arg-max (record None; ties to the lowest id) or a draw under a
        misc.sample_params record; penalized / masked: slot's penalties first (and the token counted) / over slot's
        mask (the row's slot: the latest step's row 0's where None). (A decode step draws inside its graph instead:
        decode(..., draw=...), then drawn().)"""
        if not 0 <= row < min(self.logit_rows, self.slots):
            raise NinferError(f"draw: row {row} of {min(self.logit_rows, self.slots)} draw rows")
        if slot is not None:
            self.gpu.upload(self.slot, np.array([slot], np.int32), stream=self.gpu.stream)
        self.draws.enqueue(self.k, self.buf.logits + 4 * row * self.V, self.slot,
                           *self._draw_op(vocab, record, penalized, masked=masked), at=row)
        return self.draws.drawn(row)

    def set_mask(self, slot: int, bits: np.ndarray | None) -> None:
        """Slot's mask for its masked draws, None: every id (Draws.set_mask)."""
        self.draws.set_mask(slot, bits)

    def _draw_op(self, vocab: int, record: np.ndarray | None, penalized: bool = False, tops=None,
                 masked: bool = False) -> tuple:
        """The draw's op (draws.py), its params record and logprob counts queued for upload."""
        return self.draws.op(vocab, record, penalized, tops, masked)

    def drawn(self) -> int:
        """The token in the draw slot (after the stream finishes)."""
        return self.draws.drawn()

    def drawn_rows(self, B: int) -> np.ndarray:
        """The tokens in the first B draw slots, int32 [B] (after the stream finishes)."""
        return self.draws.drawn_rows(B)
