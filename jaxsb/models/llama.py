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
from jaxsb.models.attention import attend, current_override, sparse_attend, sparse_options
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

    def __call__(self, x_BxTxE, segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B):
        cfg = self.cfg
        B, T, _ = x_BxTxE.shape
        q_BxTxHxD = self.q_proj(x_BxTxE).reshape(B, T, cfg.heads, cfg.head_dim)
        k_BxTxKxD = self.k_proj(x_BxTxE).reshape(B, T, cfg.kv_heads, cfg.head_dim)
        v_BxTxKxD = self.v_proj(x_BxTxE).reshape(B, T, cfg.kv_heads, cfg.head_dim)
        q_BxTxHxD = apply_rope(q_BxTxHxD, cos_BxTxD, sin_BxTxD)
        k_BxTxKxD = apply_rope(k_BxTxKxD, cos_BxTxD, sin_BxTxD)
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
        return self.o_proj(out_BxTxHxD.reshape(B, T, cfg.heads * cfg.head_dim))


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

    def __call__(self, x_BxTxE, segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B):
        x_BxTxE = x_BxTxE + self.attn(self.attn_norm(x_BxTxE), segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B)
        return x_BxTxE + self.mlp(self.mlp_norm(x_BxTxE))


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
        default `cfg.sparse.top_k` for every row. Ignored by the dense implementations."""
        cfg = self.cfg
        if budgets_B is None:
            budgets_B = jnp.full((x_BxTxE.shape[0],), cfg.sparse.top_k, jnp.int32)
        cos_BxTxD, sin_BxTxD = rope_cos_sin(positions_BxT, cfg.head_dim, cfg.rope_theta, cfg.rope)
        segment_ids_BxT = segment_ids_BxT.astype(jnp.int32)
        x_BxTxE = x_BxTxE.astype(_dtype(cfg.dtype))
        run = _run_block_remat if cfg.remat else _run_block
        for block in self.layers:
            x_BxTxE = run(block, x_BxTxE, segment_ids_BxT, cos_BxTxD, sin_BxTxD, budgets_B)
        x_BxTxE = self.final_norm(x_BxTxE)
        if cfg.tie_embeddings:
            head_ExV = self.embed.embedding[...].astype(x_BxTxE.dtype).T
        else:
            head_ExV = self.lm_head.kernel[...].astype(x_BxTxE.dtype)
        # logits accumulate in float32 even when the matmul inputs are bfloat16
        return jnp.einsum("bte,ev->btv", x_BxTxE, head_ExV, preferred_element_type=jnp.float32)

    def __call__(self, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array, positions_BxT: jax.Array,
                 budgets_B: jax.Array | None = None) -> jax.Array:
        return self.from_embeddings(self.embed_tokens(tokens_BxT), segment_ids_BxT, positions_BxT, budgets_B)
