"""MoBA-style block router: picks, per query block, the top-k key blocks to attend to.

`route(q, k, segment_ids, budgets, block_size)` returns the metadata that
`kernels_pallas.block_sparse_attention` consumes: `block_indices [B, K, nq, max_blocks]`,
`block_counts [B, K, nq]`, plus a `Coverage` of how much routing mass the selection keeps.
The budget (number of key blocks per query block) is per sequence, `budgets [B]`, so a tuner
(SparseBalance) can change it every step without recompiling: only `max_blocks` is static.

Scoring, per document (segment ids are assumed packed: each document one contiguous run,
padding id 0 at the end; other layouts stay leak-free because the kernel masks by segment,
they are just routed as runs):
  * A key block j < n can only matter to the tokens of query block n that belong to the
    document running through n's first token: any document present in both blocks contains
    every position between them, hence n's first token. Documents that start inside block n
    see only block n (the diagonal). So the score of (n, j) is computed for that one document d:
      score = mean(q over block n's tokens of d, and over the G query heads of kv head k)
            . mean(k over block j's tokens of d) / sqrt(D)
    i.e. mean-pooled queries and keys, pooled only over the same document (a key block
    straddling two documents is pooled over d's part only). Ineligible blocks: j > n (future,
    causal at block level) and blocks holding no token of d.
  * The diagonal block n is always selected (first slot); its score (same formula, over d's
    tokens of block n) only enters the coverage.
  * counts = min(max(budget, 1), eligible blocks, max_blocks); the list is ordered diagonal
    first, then by decreasing score; entries past the count are unspecified (the kernel
    ignores them).
Coverage: softmax over the eligible block scores of each (row, kv head, query block); the
share held by the selected blocks, in [0, 1], 1 when every eligible block is selected.
Averaged over query blocks (weighted by their non-padding tokens) per (row, kv head) and per row.

Coverage curve (SparseBalance's C(k), for choosing budgets; `coverage_curves`): per (row, kv
head, query block), the softmax over the causally visible key-block scores above, sorted in
decreasing order; c(k) = the mass of the k largest, for k = 1 .. max_k, and exactly 1 once k
reaches the number of visible blocks (a query block with <= k visible blocks keeps everything).
A document's curve C(k) is c(k) averaged over the kv heads and over the query blocks routed for
that document (those whose first token is the document's: `document_coverage_curves`, host
side). C(k) is the mass of the best k blocks; the router's own selection puts the diagonal
first, so the mass it keeps with budget k is at most C(k).

Runtime quality floor (SparseBalance's Algorithm 1, `route(..., floor=(k_base, p))`): from the
same scores, each query block takes the curve C(k) of the document routed for it (c(k)
averaged over the kv heads and over that document's query blocks in the row:
`document_curves`; under Ulysses the kv heads are spread over devices and `head_sum` adds
their partial sums). A document whose planned budget k loses more than p against the base
budget, C(k_base) - C(k) > p, runs at k_min(p) instead, the smallest k with
C(k) >= C(k_base) - p (`apply_floor`); raised budgets (k > k_base) are never touched.
Budgets stay data: `max_blocks` (static) bounds them and the curves (C(k) for k past
max_blocks is taken as C(max_blocks), so k_base is used as min(k_base, max_blocks)); the
kernels follow the final counts. The decisions come back in `Coverage.floor` (`Floor`:
planned and final budget per query block, whether it was overridden, its real tokens).

Selection is not differentiable (inputs are stop_gradient-ed); everything is jit-able with
static `block_size` / `max_blocks` / `floor`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Floor(NamedTuple):
    """The runtime floor's decisions per (row, query block) [B, nq]; with `curve_bins`, also the
    documents' curves summed per length bin (`length_bin_sums`), for planning later steps."""

    planned: jax.Array  # int32: the planned budget (clipped to [1, max_blocks])
    final: jax.Array  # int32: the budget the block runs at
    overridden: jax.Array  # bool: the floor raised it
    tokens: jax.Array  # float32: the block's real (non-padding) tokens
    coverage: jax.Array  # float32: C(final) of the block's document
    drop: jax.Array  # float32: C(k_base) - C(final) of the block's document (<= p; < 0 when raised)
    bin_sums: jax.Array | None = None  # [LENGTH_BINS, K]: sum of C(1..K) over real query blocks per bin
    bin_blocks: jax.Array | None = None  # [LENGTH_BINS]: how many real query blocks per bin


LENGTH_BINS = 24  # document lengths binned by floor(log2(tokens)), 1 .. 2^24 tokens


def length_bin_sums(doc_curves, doc_tokens, real, curve_k: int):
    """(sums [LENGTH_BINS, curve_k], blocks [LENGTH_BINS]): each real query block adds its
    document's curve (cut or extended with 1 — all blocks visible — to curve_k) to the bin of
    the document's length floor(log2(tokens)); a document counts once per query block, so the
    bin's mean is the query-block-weighted mean of its documents' curves."""
    M = doc_curves.shape[-1]
    c = doc_curves[..., :curve_k] if M >= curve_k else jnp.concatenate(
        [doc_curves, jnp.ones(doc_curves.shape[:-1] + (curve_k - M,), doc_curves.dtype)], axis=-1)
    bins = jnp.clip(jnp.floor(jnp.log2(jnp.maximum(doc_tokens, 1.0))), 0, LENGTH_BINS - 1).astype(jnp.int32)
    onehot = ((bins[..., None] == jnp.arange(LENGTH_BINS)) & real[..., None]).astype(jnp.float32)
    sums = jnp.einsum("bnc,bnk->ck", onehot, c, precision=lax.Precision.HIGHEST)
    return sums, onehot.sum((0, 1))


def document_tokens(doc_q, doc_k, tokens_k):
    """[B, nq]: the real tokens of each query block's document (over the key-side blocks)."""
    same = (doc_k[:, None, :] == doc_q[:, :, None]) & (doc_q[:, :, None] > 0)
    return (same * tokens_k[:, None, :]).sum(-1)


class Coverage(NamedTuple):
    """Routing mass kept by the selection: per (row, kv head) [B, K] and per row [B]; `floor`
    when the runtime floor ran."""

    per_kv_head: jax.Array
    per_row: jax.Array
    floor: Floor | None = None


def block_curves(scores, max_k: int):
    """c(1..max_k) [B, K, nq, max_k] per (row, kv head, query block) from routing scores
    [B, K, nq, nb] (-inf where ineligible): the sorted softmax masses' running sum, exactly 1
    once k reaches the visible blocks."""
    p = jax.nn.softmax(scores, axis=-1)  # ineligible (-inf) blocks get 0
    top, _ = lax.top_k(p, max_k)
    curve = jnp.cumsum(top, axis=-1)
    visible = jnp.isfinite(scores).sum(-1, keepdims=True)
    return jnp.where(jnp.arange(1, max_k + 1) >= visible, 1.0, jnp.minimum(curve, 1.0))


def routed_documents(segment_ids, B: int, T: int, block_size: int):
    """[B, nq] int32: the segment id of each query block's first token (0 for padding)."""
    nb = -(-T // block_size)
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    return _pad_t(seg, nb * block_size)[:, ::block_size]


def document_curves(curves, routed, head_sum=None):
    """[B, nq, max_k]: for each query block, C(k) of the document routed for it — c(k) averaged
    over the kv heads (`head_sum` adds partial head sums across devices, e.g. a psum under
    Ulysses) and over the document's query blocks; a padding block (id <= 0) keeps its own."""
    c = curves.sum(1)
    heads = jnp.float32(curves.shape[1])
    if head_sum is not None:
        c, heads = head_sum(c), head_sum(heads)
    return document_mean(c, routed, routed, c, heads)


def document_mean(sums_k, doc_q, doc_k, own_q, heads):
    """[B, nq, M]: per query block with document doc_q > 0, the mean over the key-side blocks
    of the same document (doc_k [B, nk]) of their head-summed curves sums_k [B, nk, M], over
    `heads`; a padding query block (doc_q <= 0) keeps its own head sum own_q [B, nq, M]."""
    same = ((doc_k[:, None, :] == doc_q[:, :, None]) & (doc_q[:, :, None] > 0)).astype(jnp.float32)
    total = jnp.einsum("bnj,bjk->bnk", same, sums_k, precision=lax.Precision.HIGHEST)
    count = same.sum(-1)[..., None]
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), own_q) / heads


def apply_floor(doc_curves, planned, base: int, p: float, routed=None):
    """(final [B, nq] int32, overridden [B, nq] bool, coverage [B, nq], drop [B, nq]): the
    module docstring's floor on planned budgets [B, nq] given each query block's document
    curve [B, nq, M]; coverage = C(final), drop = C(k_base) - C(final)."""
    M = doc_curves.shape[-1]
    kb = max(1, min(int(base), M))
    planned = jnp.clip(planned.astype(jnp.int32), 1, M)
    c_base = doc_curves[..., kb - 1]
    c_plan = jnp.take_along_axis(doc_curves, (planned - 1)[..., None], axis=-1)[..., 0]
    overridden = c_base - c_plan > p
    if routed is not None:
        overridden = overridden & (routed > 0)
    # C is non-decreasing: the k < kb below the target are a prefix; k_min is the next one
    k_min = 1 + (doc_curves[..., : kb - 1] < (c_base - p)[..., None]).sum(-1)
    final = jnp.where(overridden, k_min, planned).astype(jnp.int32)
    c_final = jnp.take_along_axis(doc_curves, (final - 1)[..., None], axis=-1)[..., 0]
    return final, overridden, c_final, c_base - c_final


def _pad_t(x, n, value=0):
    if x.shape[1] == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, n - x.shape[1])
    return jnp.pad(x, widths, constant_values=value)


def _run_starts(seg_BxT):
    """[B, T] int32: index of the first token of each token's run of equal segment ids."""
    T = seg_BxT.shape[1]
    pos = jnp.arange(T, dtype=jnp.int32)
    boundary = jnp.concatenate(
        [jnp.ones_like(seg_BxT[:, :1], bool), seg_BxT[:, 1:] != seg_BxT[:, :-1]], axis=1
    )
    return lax.cummax(jnp.where(boundary, pos, 0), axis=1)


def block_scores(q, k, segment_ids, block_size: int):
    """Routing scores [B, K, nq, nb] (float32; -inf where ineligible) and the per-query-block
    token weights [B, nq] (non-padding tokens). nq == nb == ceil(T / block_size)."""
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    bs = block_size
    nb = -(-T // bs)
    Tp = nb * bs
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    # Padded tail: id -1 of its own, never shared with a real token.
    seg_p = _pad_t(seg, Tp, value=-1)
    qg = _pad_t(q.astype(jnp.float32), Tp).reshape(B, Tp, K, G, D).mean(3)  # [B, Tp, K, D]
    kf = _pad_t(k.astype(jnp.float32), Tp)
    # Within-block inclusive-exclusive prefix sums: P[:, j, c] = sum of the first c tokens.
    def prefix(x):
        xb = x.reshape(B, nb, bs, K, D)
        zero = jnp.zeros((B, nb, 1, K, D), jnp.float32)
        return jnp.concatenate([zero, jnp.cumsum(xb, axis=2)], axis=2)  # [B, nb, bs+1, K, D]

    pq, pk = prefix(qg), prefix(kf)
    ksum = pk[:, :, bs]  # [B, nb, K, D] whole-block key sums

    starts = _run_starts(seg_p)  # [B, Tp]
    first = jnp.arange(nb) * bs
    rs = starts[:, first]  # [B, nq] start of the document through each block's first token
    # End (exclusive) of that document inside block n: first position whose run start differs.
    in_doc = starts.reshape(B, nb, bs) == rs[:, :, None]
    e = in_doc.sum(-1)  # [B, nq] tokens of d in block n (>= 1; runs are contiguous)
    bidx = jnp.arange(B)[:, None]
    nidx = jnp.arange(nb)[None, :]
    qbar = pq[bidx, nidx, e] / e[..., None, None]  # [B, nq, K, D]
    kdiag = pk[bidx, nidx, e] / e[..., None, None]  # [B, nq, K, D]
    # Partial first block of d (block js = rs // bs): its keys from rs to the block end.
    js = rs // bs
    off = rs - js * bs
    kpart = (ksum[bidx, js] - pk[bidx, js, off]) / (bs - off)[..., None, None]  # [B, nq, K, D]

    scale = 1.0 / math.sqrt(D)
    hi = lax.Precision.HIGHEST
    s_full = jnp.einsum("bnkd,bjkd->bknj", qbar, ksum / bs, precision=hi) * scale
    s_part = jnp.einsum("bnkd,bnkd->bkn", qbar, kpart, precision=hi) * scale
    s_diag = jnp.einsum("bnkd,bnkd->bkn", qbar, kdiag, precision=hi) * scale
    j = jnp.arange(nb)[None, None, None, :]
    n = jnp.arange(nb)[None, None, :, None]
    js_ = js[:, None, :, None]
    scores = jnp.where(j == js_, s_part[..., None], s_full)
    scores = jnp.where(j == n, s_diag[..., None], scores)
    eligible = (j <= n) & (j >= js_)
    scores = jnp.where(eligible, scores, -jnp.inf)
    weights = (seg_p.reshape(B, nb, bs) > 0).sum(-1).astype(jnp.float32)
    return scores, weights


def route(q, k, segment_ids, budgets, block_size: int = 128, max_blocks: int | None = None,
          floor: tuple[int, float] | None = None, head_sum=None, curve_bins: int | None = None):
    """Top-k key blocks per query block with a per-sequence k.

    q [B,T,H,D], k [B,T,K,D], segment_ids [B,T] int or None, budgets [B] int (key blocks per
    query block, clamped to [1, max_blocks]) or [B,T] per token (a query block takes the budget
    of its first token, i.e. of the document routed for it — per-sequence budgets in packed
    rows whose documents start at block boundaries), block_size and max_blocks static (max_blocks
    defaults to nb = ceil(T / block_size)). `floor` = (k_base, p) (static) runs the runtime
    floor (module docstring; `head_sum` as in `document_curves`; `curve_bins` = K also sums
    the documents' C(1..K) per length bin into `Floor.bin_sums`). Returns (block_indices
    [B,K,nb,max_blocks] int32, block_counts [B,K,nb] int32, Coverage).
    """
    B, T, H, D = q.shape
    K = k.shape[2]
    if H % K != 0:
        raise ValueError(f"query heads H={H} must be a multiple of kv heads K={K}")
    if k.shape[:2] != (B, T) or k.shape[3] != D:
        raise ValueError(f"q [B,T,H,D] and k [B,T,K,D] disagree: {q.shape=} {k.shape=}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    nb = -(-T // block_size)
    max_blocks = nb if max_blocks is None else max_blocks
    if not isinstance(max_blocks, int) or not 1 <= max_blocks <= nb:
        raise ValueError(f"max_blocks={max_blocks!r} must be an int in [1, {nb}] (T={T}, {block_size=})")
    if tuple(jnp.shape(budgets)) not in ((B,), (B, T)):
        raise ValueError(f"budgets.shape={tuple(jnp.shape(budgets))} must be (B,)={(B,)} or (B, T)={(B, T)}")
    if segment_ids is not None and tuple(segment_ids.shape) != (B, T):
        raise ValueError(f"segment_ids.shape={tuple(segment_ids.shape)} must be (B, T)={(B, T)}")
    if floor is not None and (len(floor) != 2 or int(floor[0]) < 1 or not 0 <= float(floor[1])):
        raise ValueError(f"floor={floor!r} must be (k_base >= 1, p >= 0)")

    q, k = lax.stop_gradient(q), lax.stop_gradient(k)
    scores, weights = block_scores(q, k, segment_ids, block_size)  # [B,K,nq,nb], [B,nq]
    eligible = jnp.isfinite(scores)
    n_eligible = eligible.sum(-1)  # >= 1: the diagonal
    diag = jnp.arange(nb)[:, None] == jnp.arange(nb)[None, :]
    ranked = jnp.where(diag, jnp.inf, scores)  # diagonal first, then by score
    # top_k breaks ties by the lower index, so the selection is deterministic.
    _, idx = lax.top_k(ranked, max_blocks)
    budgets = jnp.asarray(budgets, jnp.int32)
    if budgets.ndim == 2:  # per token -> per query block: the budget of the block's first token
        budget = budgets[:, :: block_size][:, None, :]  # [B, 1, nq]
    else:
        budget = budgets[:, None, None]
    budget = jnp.clip(budget, 1, max_blocks)
    floor_info = None
    if floor is not None:
        planned = jnp.broadcast_to(budget[:, 0, :], (B, nb))
        routed = routed_documents(segment_ids, B, T, block_size)
        doc = document_curves(block_curves(scores, max_blocks), routed, head_sum)
        final, overridden, c_final, drop = apply_floor(doc, planned, floor[0], floor[1], routed)
        bins = (None, None)
        if curve_bins:
            bins = length_bin_sums(doc, document_tokens(routed, routed, weights), (routed > 0) & (weights > 0),
                                   curve_bins)
        floor_info = Floor(planned, final, overridden, weights, c_final, drop, *bins)
        budget = final[:, None, :]
    counts = jnp.minimum(budget, n_eligible).astype(jnp.int32)

    # Coverage: softmax over eligible scores; selected = first `counts` ranked entries.
    p = jax.nn.softmax(jnp.where(eligible, scores, -jnp.inf), axis=-1)
    p_ranked = jnp.take_along_axis(p, idx, axis=-1)
    kept = (p_ranked * (jnp.arange(max_blocks) < counts[..., None])).sum(-1)
    kept = jnp.clip(kept, 0.0, 1.0)  # [B, K, nq]
    w = jnp.where(weights.sum(-1, keepdims=True) > 0, weights, 1.0)[:, None, :]  # [B, 1, nq]
    per_head = (kept * w).sum(-1) / w.sum(-1)
    return idx.astype(jnp.int32), counts, Coverage(per_head, per_head.mean(-1), floor_info)


def coverage_curves(q, k, segment_ids, block_size: int = 128, max_k: int | None = None):
    """(curves [B, K, nq, max_k] float32: c(1..max_k) per (row, kv head, query block), routed
    [B, nq] int32: the segment id of each query block's first token, 0 for padding) — the
    module docstring's coverage curve. max_k (static) defaults to nq."""
    q, k = lax.stop_gradient(q), lax.stop_gradient(k)
    scores, _ = block_scores(q, k, segment_ids, block_size)  # [B, K, nq, nb]
    B, T = q.shape[:2]
    nb = scores.shape[-1]
    max_k = nb if max_k is None else max_k
    if not isinstance(max_k, int) or not 1 <= max_k <= nb:
        raise ValueError(f"max_k={max_k!r} must be an int in [1, {nb}]")
    return block_curves(scores, max_k), routed_documents(segment_ids, B, T, block_size)


def document_coverage_curves(curves, routed) -> dict:
    """{(row, segment id): C(1..max_k)} on the host: c(k) averaged over kv heads and over the
    query blocks routed for that document (padding blocks, id 0, belong to none)."""
    import numpy as np

    curves, routed = np.asarray(curves, np.float64), np.asarray(routed)
    per_block = curves.mean(axis=1)  # [B, nq, max_k]
    out = {}
    for b in range(routed.shape[0]):
        for d in np.unique(routed[b]):
            if d > 0:
                out[(b, int(d))] = per_block[b, routed[b] == d].mean(axis=0)
    return out
