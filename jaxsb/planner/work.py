"""The work a Plan makes the devices do, counted the way the executor's kernels do it.

`microbatch_work(plan, m, ...)` lays micro-batch m out exactly as the executor does
(`jaxsb.plan.layout.layout_microbatch`, on placeholder tokens) and counts, summed over all
devices:

* `tokens`: buffer tokens (shard region + local region, padding and idle devices included:
  every device runs the model on its whole buffer);
* `pairs`: attention (query, key) token pairs in the block pairs the kernels compute, by the
  kernels' own rules. Each kernel cuts its queries and keys into blocks of `block` tokens (the
  region length when shorter) and skips a block pair from per-block summaries:
  - dense on one device (kernels_pallas/flash_attention/xla.py `block_kinds`): the ranges of
    nonzero segment ids overlap, or both blocks hold padding (id 0); key block <= query block;
    FULL (no mask) when both blocks hold one and the same id and the key block is strictly
    before the query block;
  - ring rounds (kernels_pallas/ring_chunk/tables.py `pair_flags`): the ranges of
    real ids overlap and the first real key position <= the last real query position; padding
    pairs only in the device's own round, between blocks that share tokens; FULL when both
    blocks hold one id and every key position <= every query position;
  - Ulysses: the dense rule over the group's whole stream (the heads are split, not the pairs);
  - block-sparse (the router picks among the key blocks of the query's own document, up to
    its diagonal): each query block computes min(budget, such blocks), at least its own;
* `masked_pairs`: the pairs of those blocks that need the mask (not FULL). Block-sparse blocks
  all count as masked;
* `ring_rounds`: rounds of the ring (the longest ring group's degree, 0 without a ring) and
  `ring_tokens` = ring_rounds x shard_len (what each device sends per round);
* `ulysses_tokens`: shard_len when the micro-batch is Ulysses (each device's all-to-all volume).

These are the features of the calibrated cost model (`jaxsb.planner.cost.CalibratedCost`): on a
host whose devices share its cores the step time is a sum over the devices' work, so it is a
linear function of these counts.
"""

from __future__ import annotations

import numpy as np

from jaxsb.plan import Plan

FEATURES = ("microbatches", "tokens", "pairs", "masked_pairs", "ring_rounds", "ring_tokens", "ulysses_tokens")


class _Blocks:
    """Summaries of one region cut into blocks of `block` tokens. Past the end the blocks are
    filled with id -1 (matches nothing, as the ring's chunks) or, `edge_fill`, with the last id
    (as the dense kernel's queries)."""

    def __init__(self, seg: np.ndarray, pos: np.ndarray, block: int, num_segments: int = 0,
                 edge_fill: bool = False):
        T = len(seg)
        self.block = b = max(1, min(int(block), T))
        self.n = nb = -(-T // b)
        self.filled = nb * b > T
        seg = np.concatenate([seg, np.full(nb * b - T, seg[-1] if edge_fill else -1)]).reshape(nb, b)
        pos = np.concatenate([pos, np.zeros(nb * b - T, np.int64)]).reshape(nb, b)
        real, big = seg > 0, np.iinfo(np.int64).max
        self.slo, self.shi = np.where(real, seg, big).min(1), np.where(real, seg, -big).max(1)
        self.plo, self.phi = np.where(real, pos, big).min(1), np.where(real, pos, -big).max(1)
        self.pad = (seg == 0).any(1)
        self.smin, self.smax = seg.min(1), seg.max(1)
        self.pmin, self.pmax = pos.min(1), pos.max(1)
        if num_segments:  # exact per-document position ranges, for the router's candidates
            self.min_pos = np.full((nb, num_segments), big, np.int64)
            self.max_pos = np.full((nb, num_segments), -1, np.int64)
            rows, flat, ok = np.repeat(np.arange(nb), b), seg.reshape(-1), real.reshape(-1)
            np.minimum.at(self.min_pos, (rows[ok], flat[ok]), pos.reshape(-1)[ok])
            np.maximum.at(self.max_pos, (rows[ok], flat[ok]), pos.reshape(-1)[ok])

    def ids_overlap(self, keys: "_Blocks") -> np.ndarray:
        return np.maximum(self.slo[:, None], keys.slo[None]) <= np.minimum(self.shi[:, None], keys.shi[None])

    def one_id(self, keys: "_Blocks") -> np.ndarray:
        return ((self.smin == self.smax)[:, None] & (keys.smin == keys.smax)[None]
                & (self.smin[:, None] == keys.smin[None]))


def _dense_local(q: _Blocks) -> tuple[np.ndarray, np.ndarray]:
    """(computed, full) [n, n] of the one-device dense kernel on its own region."""
    below = np.tril(np.ones((q.n, q.n), bool))
    computed = (q.ids_overlap(q) | (q.pad[:, None] & q.pad[None])) & below
    full = q.one_id(q) & np.tril(below, -1)
    if q.filled:
        full[:, -1] = False
    return computed, full


def _ring_round(q: _Blocks, k: _Blocks, own: bool) -> tuple[np.ndarray, np.ndarray]:
    """(computed, full) [nq, nk] of one ring round (`own`: the device's own shard)."""
    computed = q.ids_overlap(k) & (k.plo[None] <= q.phi[:, None])
    if own:
        computed |= q.pad[:, None] & k.pad[None] & np.eye(q.n, k.n, dtype=bool)
    full = q.one_id(k) & (q.smin[:, None] >= 0) & (k.pmax[None] <= q.pmin[:, None])
    return computed, full


def _routed(q: _Blocks, keys: list[_Blocks], budgets: np.ndarray) -> int:
    """Block pairs the router selects for q's blocks among the key blocks of `keys`: the
    candidates are the blocks holding an earlier-or-equal position of the query's document;
    each query block takes min(budget, candidates), at least one (its diagonal)."""
    candidates = sum((k.min_pos[None, :, :] <= q.max_pos[:, None, :]).any(-1).sum(1) for k in keys)
    return int(np.maximum(1, np.minimum(candidates, budgets[::q.block])).sum())


def _count(computed: np.ndarray, full: np.ndarray, block: int) -> np.ndarray:
    return np.array([computed.sum(), (computed & ~full).sum()], np.int64) * block * block


def placeholder_sequences(lengths) -> list:
    """Sequences of the given lengths whose only meaningful field is their positions: what the
    layout needs to place segment ids and positions."""
    from jaxsb.plan.layout import SeqData

    out = []
    for n in lengths:
        z = np.zeros(n, np.int32)
        out.append(SeqData(z, z, np.ones(n, np.float32), np.arange(n, dtype=np.int32)))
    return out


def microbatch_work(plan: Plan, m: int, *, attention_block: int, sparse_block: int = 0,
                    align: int = 1, seqs: list | None = None) -> dict[str, float]:
    """The FEATURES of micro-batch m (see the module docstring). `sparse_block` > 0: the model
    attends block-sparse with blocks of that many tokens (and the plan's budgets); otherwise
    dense attention in blocks of `attention_block`. `seqs`: placeholder_sequences of the plan's
    lengths, when the caller already has them."""
    from jaxsb.plan.layout import layout_microbatch

    mb = plan.template.microbatches[m]
    N, S, L = plan.template.num_devices, mb.shard_len, mb.local_len
    buf = layout_microbatch(plan, m, seqs if seqs is not None else placeholder_sequences(plan.lengths),
                            align=align, default_budget=1)
    seg, pos, bud = (buf[f].astype(np.int64) for f in ("segment_ids", "positions", "budgets"))
    nseg = len(plan.lengths) + 1
    block = sparse_block or attention_block
    sparse = sparse_block > 0

    def region(dev, lo, hi, ring=False):
        return _Blocks(seg[dev, lo:hi], pos[dev, lo:hi], block, nseg if sparse else 0, edge_fill=not ring)

    def local(q: _Blocks, budgets: np.ndarray):
        if sparse:
            return np.array([1, 1], np.int64) * _routed(q, [q], budgets) * q.block * q.block
        return _count(*_dense_local(q), q.block)

    pairs = np.zeros(2, np.int64)  # computed, masked
    ring_degree = 0
    for group in mb.groups:
        devs = range(group.start, group.start + group.degree)
        if group.scheme == "ulysses" and group.degree > 1:
            stream = [np.concatenate([a[d, :S] for d in devs]) for a in (seg, pos, bud)]
            pairs += local(_Blocks(stream[0], stream[1], block, nseg if sparse else 0, edge_fill=True), stream[2])
        elif mb.scheme == "ring":  # every group of a ring micro-batch runs the ring, degree 1 too
            ring_degree = max(ring_degree, group.degree)
            shards = [region(d, 0, S, ring=True) for d in devs]
            for i, (d, q) in enumerate(zip(devs, shards)):
                if sparse:  # routed over the key blocks of the whole group
                    pairs += np.array([1, 1], np.int64) * _routed(q, shards, bud[d, :S]) * q.block * q.block
                    continue
                for j, k in enumerate(shards):
                    pairs += _count(*_ring_round(q, k, i == j), q.block)
        else:
            for d in devs:
                pairs += local(region(d, 0, S), bud[d, :S])
        if L:
            for d in devs:
                pairs += local(region(d, S, S + L), bud[d, S:])
    ulysses = any(g.scheme == "ulysses" and g.degree > 1 for g in mb.groups)
    return {"microbatches": 1.0, "tokens": float(N * (S + L)), "pairs": float(pairs[0]),
            "masked_pairs": float(pairs[1]),
            "ring_rounds": float(ring_degree), "ring_tokens": float(ring_degree * S),
            "ulysses_tokens": float(S if ulysses else 0)}


def plan_work(plan: Plan, **kw) -> np.ndarray:
    """[FEATURES] summed over the plan's micro-batches."""
    total = np.zeros(len(FEATURES))
    seqs = placeholder_sequences(plan.lengths)  # once for all micro-batches
    for m in range(len(plan.template.microbatches)):
        w = microbatch_work(plan, m, seqs=seqs, **kw)
        total += [w[f] for f in FEATURES]
    return total
