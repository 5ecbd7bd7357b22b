"""Batched greedy generation with a KV cache, and the attention work of its prefill.

Prefill runs the prompts through the model's configured attention (dense, or sparse routing at
each row's budget with the runtime floor) and keeps every layer's k, v; decode steps then attend
densely to that cache (as MoBA's authors evaluate: sparsity decides the prompt's attention,
generated tokens see all of it). A batch's prompts are right-padded to a multiple of the
attention block; cache slot = position, so a row holds its prompt at slots 0..n-1 and its i-th
generated token at slot n+i. One compiled prefill per padded length, one decode step per cache
length.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsb.models.stats import host_scalars, pop_layer_stats


@dataclasses.dataclass
class Generated:
    """A batch's greedy continuations and what its prefill did.

    `tokens[b]`: new tokens of prompt b (up to and including eos). `stats`: the sparse layers'
    statistics (models/stats.py: summed over layers for counts, else layer means), empty when
    dense. `attention_pairs` / `dense_pairs`: (query block, key block) pairs the prefill's
    attention computed, summed over layers, kv heads and prompts, and the dense causal count
    over the prompts' own blocks (dense: equal). `step_logits`: float32 [B, V] per decode
    position when asked for (tests)."""

    tokens: list[list[int]]
    stats: dict[str, float]
    attention_pairs: float
    dense_pairs: float
    step_logits: list[np.ndarray] | None = None


@nnx.jit(static_argnames=("cache_len",))
def _prefill(model, tokens_BxT, segment_ids_BxT, positions_BxT, budgets_B, last_B, cache_len: int):
    """(float32 logits [B, V] at each row's last prompt token, KV cache padded to cache_len, stats)."""
    hidden_BxTxE, kvs = model.prefill(tokens_BxT, segment_ids_BxT, positions_BxT, budgets_B)
    stats = pop_layer_stats(model)
    B, T = tokens_BxT.shape
    last_Bx1xE = hidden_BxTxE[jnp.arange(B), last_B][:, None]
    pad = ((0, 0), (0, cache_len - T), (0, 0), (0, 0))
    cache = [(jnp.pad(k, pad), jnp.pad(v, pad)) for k, v in kvs]
    return model.head(last_Bx1xE)[:, 0], cache, stats


@nnx.jit(donate_argnames=("cache",))
def _decode(model, tokens_B, positions_B, cache):
    logits_Bx1xV, cache = model.decode(tokens_B[:, None], positions_B[:, None], cache)
    return logits_Bx1xV[:, 0], cache


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def work_block(model_cfg) -> int:
    """The block that attention work is counted in (and prompts are padded to): the sparse
    router's block, else the dense kernel's."""
    return model_cfg.sparse.block_size if model_cfg.attention == "sparse" else model_cfg.attention_block


def dense_causal_pairs(lengths: list[int], block_size: int, kv_heads: int, layers: int) -> float:
    """Causal (query block, key block) pairs of dense attention over each prompt's own blocks."""
    blocks = [-(-n // block_size) for n in lengths]
    return float(layers * kv_heads * sum(nb * (nb + 1) // 2 for nb in blocks))


def generate(model, prompts: list[list[int]], max_new_tokens: int, *, eos_id: int | None = None,
             budgets: list[int] | None = None, keep_logits: bool = False) -> Generated:
    """Greedy continuations of `prompts` (token lists, one document each) in one batch.

    `budgets`: per-prompt sparse budgets (model.attention=sparse), default the config's start
    budget. Prompt + max_new_tokens must fit the model's positions; the caller checks context."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs a non-empty list of non-empty prompts")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cfg = model.cfg
    block = work_block(cfg)
    lengths = [len(p) for p in prompts]
    B, T = len(prompts), _round_up(max(lengths), block)
    tokens = np.zeros((B, T), np.int32)
    segment_ids = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        segment_ids[b, : len(p)] = 1
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    budgets_B = np.full((B,), cfg.sparse.start_budget, np.int32) if budgets is None else np.asarray(budgets, np.int32)
    cache_len = _round_up(max(lengths) + max_new_tokens, block)
    logits, cache, stats = _prefill(model, jnp.asarray(tokens), jnp.asarray(segment_ids), jnp.asarray(positions),
                                    jnp.asarray(budgets_B), jnp.asarray(np.asarray(lengths) - 1), cache_len)
    stats = host_scalars(stats)
    dense = dense_causal_pairs(lengths, block, cfg.kv_heads, cfg.layers)
    done = np.zeros((B,), bool)
    out: list[list[int]] = [[] for _ in prompts]
    kept = [] if keep_logits else None
    position = np.asarray(lengths, np.int32)
    for step in range(max_new_tokens):
        if kept is not None:
            kept.append(np.asarray(logits))
        nxt = np.asarray(jnp.argmax(logits, axis=-1), np.int32)
        for b in np.flatnonzero(~done):
            out[b].append(int(nxt[b]))
            done[b] = eos_id is not None and nxt[b] == eos_id
        if done.all() or step == max_new_tokens - 1:
            break
        logits, cache = _decode(model, jnp.asarray(nxt), jnp.asarray(position), cache)
        position = position + 1
    return Generated(out, stats, stats.get("attn_block_pairs", dense), dense, kept)
