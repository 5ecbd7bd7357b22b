"""DeepSpeed-Ulysses sequence parallelism: all-to-all from sequence shards to head shards.

`ulysses_attention` runs inside `jax.shard_map`. The `degree` devices along `axis_name` form
one Ulysses group; rank r holds the contiguous tokens stream[r*T:(r+1)*T] of the group's
stream (B rows of n*T tokens, n = degree). One `all_to_all` turns that into "every token of
the stream, for 1/n of the heads"; `attention_fn` then sees an ordinary packed causal row
(segment ids all-gathered over the group), and a second `all_to_all` brings the output back
to sequence shards. The transpose of an all_to_all is an all_to_all, so plain autodiff gives
the backward pass (two more all_to_alls, no all_gather of activations).

Head layout. Query heads are split into n contiguous slices; device i gets slice i.
  * Query heads not divisible by n: zero query heads are appended up to Hp = ceil(H/n)*n
    and dropped on the way back (they receive a zero cotangent). Cost: every device runs
    attention for Hp/n heads instead of H/n, i.e. (Hp - H)/H extra attention work, plus the
    same fraction of extra all_to_all volume for q and the output.
  * KV heads. With G = H // K query heads per kv head, the local group size is
    G' = gcd(G, Hp/n), the largest group that both divides G and tiles a device's slice of
    Hp/n query heads. Each kv head is repeated r = G/G' times (consecutively, so query head h
    reads expanded kv head h // G', which is a copy of h // G), then zero kv heads are
    appended for the padded query heads (padded query heads h >= H read only padded kv heads
    since G' divides H), giving Kp = Hp/G' kv heads, Kp/n per device.
    If K % n == 0 then H % n == 0 and G' = G: no repetition, device i gets kv heads
    [i*K/n, (i+1)*K/n), exactly the ones its query heads read. Otherwise the kv heads are
    repeated (at most to one per query head, G' = 1), costing r times the k/v all_to_all
    volume; attention FLOPs do not change (each query head still reads one kv head).
    Caveat for routed (block-sparse) attention_fns: routing that pools queries over a kv
    head's group sees groups of G' heads instead of G when r > 1, so its selection can
    differ from the unsharded run; with K % n == 0 it is identical.

q, k and v travel in one fused all_to_all (they must share a dtype); the output in another.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class HeadLayout(NamedTuple):
    """How H query / K kv heads are laid out over a Ulysses group of `degree` devices.

    padded_heads Hp (query heads after zero padding, a multiple of degree); kv_repeat r (each
    kv head repeated r times); padded_kv_heads Kp = Hp / local_group; local_group G' (query
    heads per kv head after repetition)."""

    padded_heads: int
    kv_repeat: int
    padded_kv_heads: int
    local_group: int


def head_layout(heads: int, kv_heads: int, degree: int) -> HeadLayout:
    """The head padding / kv repetition policy described in the module docstring."""
    for name, value in (("heads", heads), ("kv_heads", kv_heads), ("degree", degree)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if heads % kv_heads:
        raise ValueError(f"query heads H={heads} must be a multiple of kv heads K={kv_heads}")
    group = heads // kv_heads
    padded = -(-heads // degree) * degree
    local_group = math.gcd(group, padded // degree)
    return HeadLayout(padded, group // local_group, padded // local_group, local_group)


def _pad_heads(x_BxTxNxD, n: int):
    extra = n - x_BxTxNxD.shape[2]
    if extra == 0:
        return x_BxTxNxD
    return jnp.pad(x_BxTxNxD, ((0, 0), (0, 0), (0, extra), (0, 0)))


def ulysses_attention(
    q_BxTxHxD: jax.Array,
    k_BxTxKxD: jax.Array,
    v_BxTxKxD: jax.Array,
    seg_BxT: jax.Array | None,
    *,
    axis_name: str,
    degree: int,
    attention_fn: Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array],
) -> jax.Array:
    """Attention over the whole group stream from sequence-sharded q/k/v; call inside shard_map.

    q [B,T,H,D], k/v [B,T,K,D] (this device's T tokens; H % K == 0, query head h reads kv head
    h // (H//K)), seg [B,T] int segment ids or None. `axis_name` is a shard_map axis of size
    `degree`. attention_fn(q [B,nT,h,D], k [B,nT,k,D], v [B,nT,k,D], seg [B,nT] or None) ->
    [B,nT,h,D] is called on the full stream for this device's heads (h = Hp/n query heads,
    k = Kp/n kv heads, query head i reads kv head i // (h//k)). Returns [B,T,H,D], this
    device's tokens, in attention_fn's output dtype.
    """
    for name, x in (("q", q_BxTxHxD), ("k", k_BxTxKxD), ("v", v_BxTxKxD)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, T, heads, head_dim], got {name}.shape={x.shape}")
    B, T, H, D = q_BxTxHxD.shape
    if k_BxTxKxD.shape != v_BxTxKxD.shape:
        raise ValueError(f"k and v shapes differ: {k_BxTxKxD.shape=} {v_BxTxKxD.shape=}")
    K = k_BxTxKxD.shape[2]
    if (k_BxTxKxD.shape[0], k_BxTxKxD.shape[1], k_BxTxKxD.shape[3]) != (B, T, D):
        raise ValueError("q [B,T,H,D] and k [B,T,K,D] disagree on B, T or D: "
                         f"{q_BxTxHxD.shape=} {k_BxTxKxD.shape=}")
    if not q_BxTxHxD.dtype == k_BxTxKxD.dtype == v_BxTxKxD.dtype:
        raise ValueError(
            "q, k and v must share a dtype (they travel in one all_to_all): "
            f"{q_BxTxHxD.dtype=} {k_BxTxKxD.dtype=} {v_BxTxKxD.dtype=}")
    if seg_BxT is not None and tuple(seg_BxT.shape) != (B, T):
        raise ValueError(f"seg_BxT.shape={tuple(seg_BxT.shape)} must be (B, T)={(B, T)}")
    layout = head_layout(H, K, degree)
    axis_size = lax.axis_size(axis_name)
    if axis_size != degree:
        raise ValueError(f"{degree=} must equal the size of mesh axis {axis_name!r} ({axis_size})")
    if degree == 1:
        return attention_fn(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, seg_BxT)

    n = degree
    Hp, r, Kp, _ = layout
    q = _pad_heads(q_BxTxHxD, Hp)
    k, v = k_BxTxKxD, v_BxTxKxD
    if r > 1:
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    k, v = _pad_heads(k, Kp), _pad_heads(v, Kp)
    hq, hk = Hp // n, Kp // n
    # One buffer [B, T, n, hq + 2 hk, D]: chunk i along axis 2 holds device i's heads.
    qkv = jnp.concatenate(
        [q.reshape(B, T, n, hq, D), k.reshape(B, T, n, hk, D), v.reshape(B, T, n, hk, D)], axis=3)
    # Send chunk i to rank i; received chunks are concatenated in rank order along tokens,
    # which is the stream order because rank r holds stream[r*T:(r+1)*T].
    qkv = lax.all_to_all(qkv, axis_name, split_axis=2, concat_axis=1, tiled=True)
    qkv = qkv.reshape(B, n * T, hq + 2 * hk, D)
    q_full, k_full, v_full = qkv[:, :, :hq], qkv[:, :, hq : hq + hk], qkv[:, :, hq + hk :]
    seg_full = None if seg_BxT is None else lax.all_gather(seg_BxT, axis_name, axis=1, tiled=True)

    out_full = attention_fn(q_full, k_full, v_full, seg_full)  # [B, nT, hq, D]
    if out_full.shape != (B, n * T, hq, D):
        raise ValueError(f"attention_fn returned {out_full.shape=}, expected {(B, n * T, hq, D)}")
    # Back to sequence shards: token chunk r to rank r, heads concatenated in rank order.
    out = lax.all_to_all(out_full, axis_name, split_axis=1, concat_axis=2, tiled=True)
    return out[:, :, :H]
