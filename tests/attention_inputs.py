"""Inputs shared by the attention kernel tests: packed segment ids, random q/k/v, random
block-sparse lists (with garbage past the counts), and outputs-with-gradients of a kernel."""

import jax
import jax.numpy as jnp
import numpy as np


def segments(T, docs_per_row):
    """[B, T] int32 from per-row lists of document lengths; the rest is padding (id 0)."""
    seg = np.zeros((len(docs_per_row), T), np.int32)
    for b, lengths in enumerate(docs_per_row):
        start = 0
        for i, n in enumerate(lengths):
            seg[b, start : start + n] = i + 1
            start += n
        assert start <= T
    return jnp.asarray(seg)


def packed_stream(length, docs):
    """seg, pos [length] int32: documents of the given lengths (ids 1, 2, ...) one after the
    other, each with its own positions from 0, then padding (id 0, position 0)."""
    seg = np.zeros(length, np.int32)
    pos = np.zeros(length, np.int32)
    start = 0
    for i, n in enumerate(docs):
        seg[start:start + n] = i + 1
        pos[start:start + n] = np.arange(n)
        start += n
    assert start <= length, (length, docs)
    return seg, pos


def random_qkv(B, T, H, K, D, dtype, seed=0):
    """q [B,T,H,D], k and v [B,T,K,D], standard normal."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(B, T, n, D)), dtype) for n in (H, K, K))


def random_blocks(B, K, nq, max_blocks, budget, seed=0):
    """Per (row, kv head, query block): the diagonal and a random subset of earlier blocks in
    random order; count = min(budget[b], n + 1, max_blocks); slots past the count hold garbage
    (out of range, negative, future and repeated indices)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(-7, 3 * nq, size=(B, K, nq, max_blocks)).astype(np.int32)
    counts = np.zeros((B, K, nq), np.int32)
    for b in range(B):
        for k in range(K):
            for n in range(nq):
                c = min(budget[b], n + 1, max_blocks)
                others = rng.permutation(n)[: c - 1]
                idx[b, k, n, :c] = rng.permutation(np.concatenate([[n], others]))
                counts[b, k, n] = c
    return jnp.asarray(idx), jnp.asarray(counts)


def out_and_vjp(fn, args, seed=1):
    """fn(*args) and its vjp with a random cotangent, compiled as one program."""
    rng = np.random.default_rng(seed)
    ct = jnp.asarray(rng.normal(size=args[0].shape), args[0].dtype)

    @jax.jit
    def run(*args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(ct)

    return run(*args)
