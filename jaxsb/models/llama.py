"""LLaMA-family decoder in Flax NNX: RMSNorm, rotate-half RoPE (jaxsb/models/rope.py), GQA
attention (optional q/k/v[/o] biases: Qwen2, Llama attention_bias), SwiGLU MLP.

Rows are packed: one row of T tokens holds several documents. The caller passes, per token,
a segment id (which document; 0 = padding) and a position (restarting at 0 at every
document), so a token sees only earlier tokens of its own document and RoPE phases match
what the document would get on its own.

Numerics: parameters are stored in `cfg.param_dtype`, matmuls run in `cfg.dtype`; RMSNorm
statistics, RoPE phases, attention softmax and the output logits are float32.

Dimension letters: B rows, T tokens, H query heads, K kv heads, D head_dim, E hidden,
F ffn width, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsb.config import ModelConfig
from jaxsb.models.attention import attend, cached_attention, current_override, sparse_attend, sparse_options
from jaxsb.models.rope import apply_rope, rope_cos_sin


def _dtype(name: str):
    return jnp.dtype(name)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, statistics in float32 (as Hugging Face LlamaRMSNorm)."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        x = x_BxTxE.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def _linear(din: int, dout: int, cfg: ModelConfig, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=bias, dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.param_dtype),
                      kernel_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query self-attention; kv heads are shared by heads/kv_heads query heads."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        qkv_bias, o_bias = cfg.attention_bias != "none", cfg.attention_bias == "qkvo"
        self.q_proj = _linear(cfg.hidden, cfg.heads * cfg.head_dim, cfg, rngs, qkv_bias)
        self.k_proj = _linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, cfg, rngs, qkv_bias)
        self.v_proj = _linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, cfg, rngs, qkv_bias)
        self.o_proj = _linear(cfg.heads * cfg.head_dim, cfg.hidden, cfg, rngs, o_bias)

    def _qkv(self, x_BxTxE, cos_BxTxD, sin_BxTxD):
        """q [B,T,H,D] and k, v [B,T,K,D], RoPE applied to q and k."""
        cfg = self.cfg
        B, T, _ = x_BxTxE.shape
        q_BxTxHxD = self.q_proj(x_BxTxE).reshape(B, T, cfg.heads, cfg.head_dim)
        k_BxTxKxD = self.k_proj(x_BxTxE).reshape(B, T, cfg.kv_heads, cfg.head_dim)
        v_BxTxKxD = self.v_proj(x_BxTxE).reshape(B, T, cfg.kv_heads, cfg.head_dim)
        return apply_rope(q_BxTxHxD, cos_BxTxD, sin_BxTxD), apply_rope(k_BxTxKxD, cos_BxTxD, sin_BxTxD), v_BxTxKxD

    def _out(self, out_BxTxHxD):
        B, T = out_BxTxHxD.shape[:2]
        return self.o_proj(out_BxTxHxD.reshape(B, T, self.cfg.heads * self.cfg.head_dim))

    def __call__(self, x_BxTxE, segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B, kv_out: bool = False):
        """The layer's output [B,T,E]; with `kv_out` also its (k, v) [B,T,K,D] (a KV-cache prefill)."""
        cfg = self.cfg
        q_BxTxHxD, k_BxTxKxD, v_BxTxKxD = self._qkv(x_BxTxE, cos_BxTxD, sin_BxTxD)
        override = current_override()
        if override is not None:  # sequence-parallel execution (jaxsb/parallel/executor.py)
            out_BxTxHxD, stats = override(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, budgets_B)
            for name, value in stats.items():
                self.sow(nnx.Intermediate, name, value)
        elif cfg.attention == "sparse":
            out_BxTxHxD, stats = sparse_attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, budgets_B,
                                               **sparse_options(cfg))
            # per-layer routing statistics, collected by the trainer (nnx.Intermediate)
            for name, value in stats.items():
                self.sow(nnx.Intermediate, name, value)
        else:
            out_BxTxHxD = attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT,
                                 implementation=cfg.attention, block=cfg.attention_block)
        out_BxTxE = self._out(out_BxTxHxD)
        return (out_BxTxE, (k_BxTxKxD, v_BxTxKxD)) if kv_out else out_BxTxE

    def decode(self, x_BxNxE, cos_BxNxD, sin_BxNxD, cache_k_BxSxKxD, cache_v_BxSxKxD, positions_BxN):
        """N new tokens per row at `positions_BxN`: their k, v are written into the cache at
        slots = positions, then they attend densely to the cache slots <= their position.
        Returns (out [B,N,E], cache_k, cache_v)."""
        q_BxNxHxD, k_BxNxKxD, v_BxNxKxD = self._qkv(x_BxNxE, cos_BxNxD, sin_BxNxD)
        rows_Bx1 = jnp.arange(x_BxNxE.shape[0])[:, None]
        cache_k_BxSxKxD = cache_k_BxSxKxD.at[rows_Bx1, positions_BxN].set(k_BxNxKxD.astype(cache_k_BxSxKxD.dtype))
        cache_v_BxSxKxD = cache_v_BxSxKxD.at[rows_Bx1, positions_BxN].set(v_BxNxKxD.astype(cache_v_BxSxKxD.dtype))
        out_BxNxHxD = cached_attention(q_BxNxHxD, cache_k_BxSxKxD, cache_v_BxSxKxD, positions_BxN)
        return self._out(out_BxNxHxD), cache_k_BxSxKxD, cache_v_BxSxKxD


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg.hidden, cfg.ffn, cfg, rngs)
        self.up_proj = _linear(cfg.hidden, cfg.ffn, cfg, rngs)
        self.down_proj = _linear(cfg.ffn, cfg.hidden, cfg, rngs)

    def __call__(self, x_BxTxE):
        return self.down_proj(jax.nn.silu(self.gate_proj(x_BxTxE)) * self.up_proj(x_BxTxE))


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        norm = dict(eps=cfg.norm_eps, dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.param_dtype))
        self.attn_norm = RMSNorm(cfg.hidden, **norm)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden, **norm)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BxTxE, segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B, kv_out: bool = False):
        attn = self.attn(self.attn_norm(x_BxTxE), segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B, kv_out)
        attn_BxTxE, kv = attn if kv_out else (attn, None)
        x_BxTxE = x_BxTxE + attn_BxTxE
        x_BxTxE = x_BxTxE + self.mlp(self.mlp_norm(x_BxTxE))
        return (x_BxTxE, kv) if kv_out else x_BxTxE

    def decode(self, x_BxNxE, cos_BxNxD, sin_BxNxD, cache_k, cache_v, positions_BxN):
        """As __call__ for N new tokens against the layer's KV cache (Attention.decode)."""
        attn_BxNxE, cache_k, cache_v = self.attn.decode(self.attn_norm(x_BxNxE), cos_BxNxD, sin_BxNxD,
                                                        cache_k, cache_v, positions_BxN)
        x_BxNxE = x_BxNxE + attn_BxNxE
        return x_BxNxE + self.mlp(self.mlp_norm(x_BxNxE)), cache_k, cache_v


def _run_block(block: Block, x_BxTxE, segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B):
    return block(x_BxTxE, segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B)


_run_block_remat = nnx.remat(_run_block)


class Llama(nnx.Module):
    """Decoder-only LM. `model(tokens, segment_ids, positions) -> float32 logits [B,T,V]`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size <= 0:
            raise ValueError(f"Llama needs cfg.vocab_size > 0, got {cfg.vocab_size} "
                             "(resolve 0 = 'from tokenizer' before building the model)")
        cfg.validate()
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, dtype=_dtype(cfg.dtype),
                               param_dtype=_dtype(cfg.param_dtype),
                               embedding_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.final_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, dtype=_dtype(cfg.dtype),
                                  param_dtype=_dtype(cfg.param_dtype))
        if not cfg.tie_embeddings:
            self.lm_head = _linear(cfg.hidden, cfg.vocab_size, cfg, rngs)

    def embed_tokens(self, tokens_BxT: jax.Array) -> jax.Array:
        """Input embeddings [B,T,E] in the compute dtype."""
        return self.embed(tokens_BxT)

    def from_embeddings(self, x_BxTxE: jax.Array, segment_ids_BxT: jax.Array,
                        positions_BxT: jax.Array, budgets_B: jax.Array | None = None) -> jax.Array:
        """The decoder stack and head applied to given input embeddings; float32 logits.

        `budgets_B`: per-row sparse-attention budget in key blocks (model.attention=sparse);
        default `cfg.sparse.start_budget` for every row. Ignored by the dense implementations."""
        hidden_BxTxE, _ = self._stack(x_BxTxE, segment_ids_BxT, positions_BxT, budgets_B, kv_out=False)
        return self.head(hidden_BxTxE)

    def _stack(self, x_BxTxE, segment_ids_BxT, positions_BxT, budgets_B, kv_out: bool):
        """(final-normed hidden states [B,T,E], per layer (k, v) when `kv_out` else None)."""
        cfg = self.cfg
        if budgets_B is None:
            budgets_B = jnp.full((x_BxTxE.shape[0],), cfg.sparse.start_budget, jnp.int32)
        cos_BxTxD, sin_BxTxD = rope_cos_sin(positions_BxT, cfg.head_dim, cfg.rope_theta, cfg.rope)
        segment_ids_BxT = segment_ids_BxT.astype(jnp.int32)
        x_BxTxE = x_BxTxE.astype(_dtype(cfg.dtype))
        if kv_out:  # a KV-cache prefill: no gradients, so no remat
            kvs = []
            for block in self.layers:
                x_BxTxE, kv = block(x_BxTxE, segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B, kv_out=True)
                kvs.append(kv)
            return self.final_norm(x_BxTxE), kvs
        run = _run_block_remat if cfg.remat else _run_block
        for block in self.layers:
            x_BxTxE = run(block, x_BxTxE, segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B)
        return self.final_norm(x_BxTxE), None

    def head(self, hidden_BxTxE: jax.Array) -> jax.Array:
        """float32 logits [B,T,V] of final-normed hidden states."""
        if self.cfg.tie_embeddings:
            head_ExV = self.embed.embedding[...].astype(hidden_BxTxE.dtype).T
        else:
            head_ExV = self.lm_head.kernel[...].astype(hidden_BxTxE.dtype)
        # logits accumulate in float32 even when the matmul inputs are bfloat16
        return jnp.einsum("bte,ev->btv", hidden_BxTxE, head_ExV, preferred_element_type=jnp.float32)

    def prefill(self, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array, positions_BxT: jax.Array,
                budgets_B: jax.Array | None = None):
        """The prompt under the configured attention (dense or sparse), for a KV cache:
        (final-normed hidden states [B,T,E], per layer (k, v) [B,T,K,D]). jaxsb/models/decode.py."""
        return self._stack(self.embed_tokens(tokens_BxT), segment_ids_BxT, positions_BxT, budgets_B, kv_out=True)

    def decode(self, tokens_BxN: jax.Array, positions_BxN: jax.Array, cache: list):
        """N new tokens per row at `positions_BxN` against the per-layer KV cache [(k, v)
        [B,S,K,D]] (slot = position; dense attention to slots <= position). Returns (float32
        logits [B,N,V], the updated cache)."""
        cfg = self.cfg
        cos_BxNxD, sin_BxNxD = rope_cos_sin(positions_BxN, cfg.head_dim, cfg.rope_theta, cfg.rope)
        x_BxNxE = self.embed_tokens(tokens_BxN).astype(_dtype(cfg.dtype))
        new_cache = []
        for block, (cache_k, cache_v) in zip(self.layers, cache):
            x_BxNxE, cache_k, cache_v = block.decode(x_BxNxE, cos_BxNxD, sin_BxNxD, cache_k, cache_v, positions_BxN)
            new_cache.append((cache_k, cache_v))
        return self.head(self.final_norm(x_BxNxE)), new_cache

    def __call__(self, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array, positions_BxT: jax.Array,
                 budgets_B: jax.Array | None = None) -> jax.Array:
        return self.from_embeddings(self.embed_tokens(tokens_BxT), segment_ids_BxT, positions_BxT, budgets_B)
