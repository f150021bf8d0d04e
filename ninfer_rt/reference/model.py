"""The PyTorch reference model of the Qwen3.5/3.6 text path and its MTP head: the oracle for the GPU model.

It reads like the architecture (qwen36-architecture.md §3, §5):

    x = embed_tokens[ids]
    for each layer:  x += GatedDeltaNet | GatedAttention (norm(x));  x += MoE | MLP (norm(x))
    logits = lm_head(norm(x))

Weights are read by canonical name (docs/architecture.md): `model.language_model.layers.{L}...`, fused expert
banks `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I], `lm_head.weight`, `mtp.*`.
One sequence, no batch dimension; the maths lives in `ops`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import ConfigError, SourceError
from . import ops

LM = "model.language_model."
MTP = "mtp."


class _Reader:
    """Takes canonical tensors out of the weights mapping, checking shape and converting dtype."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self.weights, self.dtype = weights, dtype

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.weights:
            raise SourceError(f"missing tensor {name}")
        t = torch.as_tensor(self.weights[name])
        if tuple(t.shape) != tuple(shape):
            raise ConfigError(f"tensor {name} has shape {list(t.shape)}, the config implies {list(shape)}")
        return t.detach().to(dtype or self.dtype)


# ---------------------------------------------------------------------------------------------- state


@dataclass
class KVCache:
    """Keys (after k_norm and RoPE) and raw values of one full-attention layer."""

    k: torch.Tensor  # [S, nKV, d]
    v: torch.Tensor  # [S, nKV, d]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add the keys/values of T new tokens ([T, nKV, d] each)."""
        self.k, self.v = torch.cat([self.k, k]), torch.cat([self.v, v])


@dataclass
class DeltaState:
    """Decode state of one DeltaNet layer: the last K-1 pre-conv inputs and the fp32 recurrent state."""

    conv: torch.Tensor  # [conv_dim, K-1], model dtype, oldest column first
    ssm: torch.Tensor   # [nv, dk, dv], fp32
    # Cache.track arms the next forward to run token by token and keep the states after each of its T tokens
    # (conv [T, conv_dim, K-1], ssm [T, nv, dk, dv]), so that Cache.rewind can keep a prefix without a second forward
    tracking: bool = False
    trail: tuple[torch.Tensor, torch.Tensor] | None = None


class Cache:
    """Decode state of one sequence: a KVCache per full-attention layer, a DeltaState per DeltaNet layer,
    and the number of positions consumed so far."""

    def __init__(self, spec, dtype: torch.dtype = torch.float32, layer_types: tuple[str, ...] | None = None):
        self.pos = 0
        self.fed = 0  # positions the last forward added (what rewind may take back of a tracked one)
        self.layers: list[KVCache | DeltaState] = []
        for kind in spec.layer_types if layer_types is None else layer_types:
            if kind == "full_attention":
                empty = torch.zeros(0, spec.num_key_value_heads, spec.head_dim, dtype=dtype)
                self.layers.append(KVCache(empty, empty.clone()))
            else:
                self.layers.append(DeltaState(
                    torch.zeros(spec.conv_dim, spec.linear_conv_kernel_dim - 1, dtype=dtype),
                    torch.zeros(spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim)))

    def clone(self) -> Cache:
        """An independent copy (a sequence continued in another slot: the backend's copy_cache)."""
        return copy.deepcopy(self)

    def track(self) -> None:
        """Arm the next forward (a verification, a few tokens): its DeltaNet layers run token by token (the
        recurrent form) and keep every token's state, so that `rewind` may then drop its last tokens."""
        for st in self.layers:
            if isinstance(st, DeltaState):
                st.tracking, st.trail = True, None

    def rewind(self, drop: int) -> None:
        """Drop the last `drop` positions of the last forward, which `track` armed and which fed more than
        `drop`: the KV caches are cut, each DeltaNet state is the one its trail kept after the last token left."""
        deltas = [st for st in self.layers if isinstance(st, DeltaState)]
        if not 0 <= drop < self.fed or any(st.trail is None for st in deltas):
            raise ValueError(f"rewind: {drop} of {self.fed} positions, or the last forward was not tracked")
        keep = self.fed - drop
        for st in self.layers:
            if isinstance(st, DeltaState):
                if drop:
                    st.conv, st.ssm = st.trail[0][keep - 1].clone(), st.trail[1][keep - 1].clone()
                st.trail = None
            else:
                st.k, st.v = st.k[:self.pos - drop], st.v[:self.pos - drop]
        self.pos -= drop
        self.fed = 0

    def truncate(self, pos: int) -> None:
        """Keep the first pos positions. Only KV caches can: a DeltaNet state has no earlier positions in it."""
        if any(isinstance(st, DeltaState) for st in self.layers):
            raise ValueError("truncate: a DeltaNet state cannot rewind (restore a clone instead)")
        if not 0 <= pos <= self.pos:
            raise ValueError(f"truncate: position {pos} outside [0, {self.pos}]")
        for kv in self.layers:
            kv.k, kv.v = kv.k[:pos], kv.v[:pos]
        self.pos = pos


# ---------------------------------------------------------------------------------------------- blocks


class GatedAttention:
    """Full attention with per-head q/k RMSNorm, partial mRoPE and a sigmoid output gate (§3.3)."""

    def __init__(self, spec, read: _Reader, p: str):
        H, d, nH, nKV = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads
        self.nH, self.nKV, self.d, self.eps = nH, nKV, d, spec.rms_norm_eps
        # q_proj rows interleave per head: [q_h (d rows) | gate_h (d rows)] for h = 0..nH-1
        self.q_proj = read(p + "q_proj.weight", (nH * 2 * d, H))
        self.k_proj = read(p + "k_proj.weight", (nKV * d, H))
        self.v_proj = read(p + "v_proj.weight", (nKV * d, H))
        self.o_proj = read(p + "o_proj.weight", (H, nH * d))
        self.q_norm = read(p + "q_norm.weight", (d,))
        self.k_norm = read(p + "k_norm.weight", (d,))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """h [T, H], cos/sin [T, rot] -> [T, H]; appends this step's keys/values to `kv`."""
        T, d = h.shape[0], self.d
        qg = (h @ self.q_proj.T).view(T, self.nH, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(T, self.nH * d)               # q: [T, nH, d]
        k = (h @ self.k_proj.T).view(T, self.nKV, d)
        v = (h @ self.v_proj.T).view(T, self.nKV, d)
        q = ops.apply_rope(ops.rms_norm_zc(q, self.q_norm, self.eps), cos, sin)
        k = ops.apply_rope(ops.rms_norm_zc(k, self.k_norm, self.eps), cos, sin)
        kv.append(k, v)
        return ops.gated_attention(q, gate, kv.k, kv.v) @ self.o_proj.T


class GatedDeltaNet:
    """Linear attention: causal conv, gated delta rule with fp32 state, SiLU-gated RMSNorm (§3.4)."""

    def __init__(self, spec, read: _Reader, p: str):
        H, K = spec.hidden_size, spec.linear_conv_kernel_dim
        self.nk, self.nv = spec.linear_num_key_heads, spec.linear_num_value_heads
        self.dk, self.dv = spec.linear_key_head_dim, spec.linear_value_head_dim
        self.key_dim, self.value_dim, self.eps = spec.key_dim, spec.value_dim, spec.rms_norm_eps
        self.in_proj_qkv = read(p + "in_proj_qkv.weight", (spec.conv_dim, H))   # rows [q | k | v], head-major
        self.in_proj_z = read(p + "in_proj_z.weight", (self.value_dim, H))
        self.in_proj_b = read(p + "in_proj_b.weight", (self.nv, H))
        self.in_proj_a = read(p + "in_proj_a.weight", (self.nv, H))
        self.conv = read(p + "conv1d.weight", (spec.conv_dim, 1, K))[:, 0]      # conv: [conv_dim, K]
        # the decay is computed in fp32 whatever the model dtype (vLLM keeps A_log in fp32 too)
        self.A_log = read(p + "A_log", (self.nv,), torch.float32)
        self.dt_bias = read(p + "dt_bias", (self.nv,), torch.float32)
        self.norm = read(p + "norm.weight", (self.dv,))
        self.out_proj = read(p + "out_proj.weight", (H, self.value_dim))

    def __call__(self, h: torch.Tensor, st: DeltaState) -> torch.Tensor:
        """h [T, H] -> [T, H]; updates `st`. T == 1 takes the recurrent (decode) form, T > 1 the chunked one."""
        T = h.shape[0]
        mixed = h @ self.in_proj_qkv.T                                           # mixed: [T, conv_dim]
        z = (h @ self.in_proj_z.T).view(T, self.nv, self.dv)
        beta = torch.sigmoid(h @ self.in_proj_b.T)                               # beta: [T, nv]
        a = h @ self.in_proj_a.T                                                 # a: [T, nv]
        g = -self.A_log.exp() * torch.nn.functional.softplus(a.float() + self.dt_bias)  # g ≤ 0: log-decay

        conv_trail = ops.conv_state_trail(mixed, st.conv) if st.tracking else None
        if T == 1:
            c, st.conv = ops.causal_conv1d_step(mixed[0], self.conv, st.conv)
            c = c[None]
        else:
            c, st.conv = ops.causal_conv1d(mixed, self.conv, st.conv)
        q, k, v = c.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q, k = q.reshape(T, self.nk, self.dk), k.reshape(T, self.nk, self.dk)
        v = v.reshape(T, self.nv, self.dv)

        if st.tracking:  # a verification: token by token, every token's state kept for Cache.rewind
            o, st.ssm, ssm_trail = ops.gated_delta_rule_recurrent(q, k, v, g, beta, st.ssm, trail=True)
            st.trail, st.tracking = (conv_trail, ssm_trail), False
        else:
            rule = ops.gated_delta_rule_recurrent if T == 1 else ops.gated_delta_rule_chunked
            o, st.ssm = rule(q, k, v, g, beta, st.ssm)                           # o: [T, nv, dv]
        y = ops.gated_rms_norm(o, z, self.norm, self.eps).reshape(T, self.value_dim)
        return y @ self.out_proj.T


class MLP:
    """Dense SwiGLU FFN (§3.5)."""

    def __init__(self, read: _Reader, p: str, H: int, I: int):
        self.gate = read(p + "gate_proj.weight", (I, H))
        self.up = read(p + "up_proj.weight", (I, H))
        self.down = read(p + "down_proj.weight", (H, I))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> [T, H]."""
        return ops.swiglu_mlp(h, self.gate, self.up, self.down)


class SparseMoE:
    """Top-k routed experts (fused banks) plus a sigmoid-gated shared expert (§3.6)."""

    def __init__(self, spec, read: _Reader, p: str):
        H, E, I, Is = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size, \
            spec.shared_expert_intermediate_size
        self.top_k = spec.num_experts_per_tok
        self.router = read(p + "gate.weight", (E, H))
        self.gate_up = read(p + "experts.gate_up_proj", (E, 2 * I, H))
        self.down = read(p + "experts.down_proj", (E, H, I))
        self.shared = MLP(read, p + "shared_expert.", H, Is)
        self.shared_gate = read(p + "shared_expert_gate.weight", (1, H))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> [T, H]."""
        s = self.shared
        return ops.moe(h, self.router, self.gate_up, self.down, self.top_k, s.gate, s.up, s.down, self.shared_gate)


class DecoderLayer:
    """Pre-norm residual block: x += mixer(norm(x)); x += ffn(norm(x))."""

    def __init__(self, spec, read: _Reader, p: str, kind: str):
        H = spec.hidden_size
        self.kind = kind
        self.input_norm = read(p + "input_layernorm.weight", (H,))
        self.post_norm = read(p + "post_attention_layernorm.weight", (H,))
        if kind == "full_attention":
            self.mixer = GatedAttention(spec, read, p + "self_attn.")
        elif kind == "linear_attention":
            self.mixer = GatedDeltaNet(spec, read, p + "linear_attn.")
        else:
            raise ConfigError(f"layer_types: unknown layer type {kind!r} for {p}")
        if spec.is_moe:
            self.ffn = SparseMoE(spec, read, p + "mlp.")
        else:
            self.ffn = MLP(read, p + "mlp.", H, spec.intermediate_size)
        self.eps = spec.rms_norm_eps

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 state: KVCache | DeltaState) -> torch.Tensor:
        """x [T, H] -> [T, H]; updates this layer's `state`."""
        h = ops.rms_norm_zc(x, self.input_norm, self.eps)
        x = x + (self.mixer(h, cos, sin, state) if self.kind == "full_attention" else self.mixer(h, state))
        return x + self.ffn(ops.rms_norm_zc(x, self.post_norm, self.eps))


class MTPHead:
    """The multi-token-prediction block (§5): fc over [norm_e(embed(next_id)), norm_h(hidden)] (embedding first),
    one full-attention decoder layer with its own KV cache, then mtp.norm. Reads `mtp.layers.0` only: every
    released checkpoint has mtp_num_hidden_layers = 1."""

    def __init__(self, spec, read: _Reader):
        H = spec.hidden_size
        self.fc = read(MTP + "fc.weight", (H, 2 * H))
        self.norm_embedding = read(MTP + "pre_fc_norm_embedding.weight", (H,))
        self.norm_hidden = read(MTP + "pre_fc_norm_hidden.weight", (H,))
        self.norm = read(MTP + "norm.weight", (H,))
        self.layer = DecoderLayer(spec, read, MTP + "layers.0.", "full_attention")
        self.eps = spec.rms_norm_eps

    def __call__(self, embedded: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv: KVCache) -> torch.Tensor:
        """embedded [T, H] (embed(x_{p+1})), hidden [T, H] (h_p) -> the head's output post mtp.norm [T, H]."""
        e = ops.rms_norm_zc(embedded, self.norm_embedding, self.eps)              # e: [T, H]
        hh = ops.rms_norm_zc(hidden, self.norm_hidden, self.eps)                  # hh: [T, H]
        u = torch.cat([e, hh], -1) @ self.fc.T                                  # u: [T, H]
        return ops.rms_norm_zc(self.layer(u, cos, sin, kv), self.norm, self.eps)


# ---------------------------------------------------------------------------------------------- model


class ReferenceModel:
    """Qwen3.5/3.6 text model (dense or MoE) plus its MTP head, computing in `dtype` (fp32 by default)."""

    def __init__(self, spec, weights: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        self.spec, self.dtype = spec, dtype
        self._yarn = spec.yarn  # None for plain RoPE
        self._read = _Reader(weights, dtype)
        H, V = spec.hidden_size, spec.vocab_size
        self.embed = self._read(LM + "embed_tokens.weight", (V, H))
        self.layers = [DecoderLayer(spec, self._read, f"{LM}layers.{i}.", kind)
                       for i, kind in enumerate(spec.layer_types)]
        self.norm = self._read(LM + "norm.weight", (H,))
        if spec.tie_word_embeddings and "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = self._read("lm_head.weight", (V, H))
        self._mtp: MTPHead | None = None  # built on first use: most callers never need the mtp.* tensors

    def new_cache(self) -> Cache:
        """Empty decode state for the main model."""
        return Cache(self.spec, self.dtype)

    def new_mtp_cache(self) -> Cache:
        """Empty decode state (one KV cache) for the MTP layer."""
        return Cache(self.spec, self.dtype, ("full_attention",))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        return ops.rope_cos_sin(positions, s.rotary_dim, s.rope_theta, s.mrope_section, self.dtype, self._yarn)

    def forward_with_hidden(self, ids: torch.Tensor, cache: Cache | None = None,
                            positions: torch.Tensor | None = None, *, return_layers: bool = False):
        """ids [T] -> (logits [T, V] fp32, final post-norm hidden states [T, H], the MTP input).

        Continues `cache` (advancing it by T) or, when None, runs from an empty one. `positions` ([T], or [3, T]
        T/H/W rows for multimodal input) defaults to cache.pos .. cache.pos + T - 1.
        With return_layers=True a third item is returned: the residual stream as a list of L + 1 tensors [T, H],
        index 0 the embeddings and index i the output of decoder layer i - 1 (before the final norm).
        """
        cache = self.new_cache() if cache is None else cache
        T = ids.shape[0]
        if positions is None:
            positions = torch.arange(cache.pos, cache.pos + T)
        cos, sin = self._rope(positions)                                         # cos/sin: [T, rot]
        x = self.embed[ids]                                                      # x: [T, H]
        stream = [x] if return_layers else None
        for layer, state in zip(self.layers, cache.layers):
            x = layer(x, cos, sin, state)
            if stream is not None:
                stream.append(x)
        cache.pos += T
        cache.fed = T  # what Cache.rewind may take back of a tracked forward
        x = ops.rms_norm_zc(x, self.norm, self.spec.rms_norm_eps)
        logits = (x @ self.lm_head.T).float()
        return (logits, x, stream) if return_layers else (logits, x)

    def forward(self, ids: torch.Tensor, cache: Cache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """ids [T] -> logits [T, V] fp32; see `forward_with_hidden`."""
        return self.forward_with_hidden(ids, cache, positions)[0]

    __call__ = forward

    def greedy(self, ids: torch.Tensor, max_new_tokens: int) -> list[int]:
        """Greedy continuation of the prompt `ids` [T]: prefill once, then decode token by token."""
        cache = self.new_cache()
        logits = self.forward(ids, cache)
        out = [int(logits[-1].argmax())]
        while len(out) < max_new_tokens:
            out.append(int(self.forward(torch.tensor(out[-1:]), cache)[-1].argmax()))
        return out

    def mtp_forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                    mtp_cache: Cache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP draft: row p pairs the post-norm hidden state h_p with token x_{p+1} at position p.

        hidden [T, H] (from `forward_with_hidden`, or the MTP's own output when chaining), next_ids [T],
        positions [T] -> (draft logits [T, V] fp32, MTP output hidden post mtp.norm [T, H]).
        Appends to `mtp_cache` (from `new_mtp_cache`), or runs from an empty one when None.
        """
        if self._mtp is None:
            if self.spec.mtp_num_hidden_layers < 1:
                raise ConfigError("mtp_num_hidden_layers: this model has no MTP layer")
            self._mtp = MTPHead(self.spec, self._read)
        mtp_cache = self.new_mtp_cache() if mtp_cache is None else mtp_cache
        cos, sin = self._rope(positions)
        out = self._mtp(self.embed[next_ids], hidden.to(self.dtype), cos, sin, mtp_cache.layers[0])
        mtp_cache.pos += next_ids.shape[0]
        return (out @ self.lm_head.T).float(), out

    def mtp_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                   mtp_cache: Cache | None = None) -> torch.Tensor:
        """Draft logits [T, V] fp32 of the MTP head; see `mtp_forward`."""
        return self.mtp_forward(hidden, next_ids, positions, mtp_cache)[0]
