"""`jaxsb.planner.work`: the work counts of a Plan against the kernels' own block tables.

The oracle lays the plan out with the executor's layout and asks the kernels which block pairs
they compute: the dense kernel's `block_kinds` (kernels_pallas/flash_attention/xla.py) for a
device's own region and for a Ulysses group's whole stream, the ring chunk's `pair_flags`
(kernels_pallas/ring_chunk/tables.py) for every (device, visiting shard) round of a ring, and the router
(`jaxsb.models.router.route`) for block-sparse attention."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsb.plan.layout import layout_microbatch
from jaxsb.plan import GroupSpec, build_plan
from jaxsb.planner.work import FEATURES, microbatch_work, placeholder_sequences, plan_work
from jaxsb.models.router import route
from kernels_pallas.flash_attention.xla import PARTIAL, SKIP, block_kinds, make_flash_blocks
from kernels_pallas.ring_chunk import tables


def dense_kinds(seg, block):
    """The dense kernel's [nq, nk] SKIP/FULL/PARTIAL table for one region (causal)."""
    blocks = make_flash_blocks(len(seg), True, block, block)
    s = jnp.asarray(seg, jnp.int32)[None]
    pad = lambda n: jnp.pad(s, ((0, 0), (0, n - s.shape[1])), mode="edge")  # noqa: E731
    return np.asarray(block_kinds(pad(blocks.Tq), pad(blocks.Tk), blocks)), blocks.bq


def ring_kinds(seg_q, pos_q, seg_k, pos_k, block, own):
    blocks = tables.make_chunk_blocks(len(seg_q), len(seg_k), 8, block, block, own, pallas=False)
    sq, pq = tables.pad_ids(jnp.asarray(seg_q)[None], jnp.asarray(pos_q)[None], blocks.Lqp, tables.Q_FILL)
    sk, pk = tables.pad_ids(jnp.asarray(seg_k)[None], jnp.asarray(pos_k)[None], blocks.Lkp, tables.K_FILL)
    allowed, full = tables.pair_flags(tables.block_summaries(sq, pq, blocks.bq), tables.block_summaries(sk, pk, blocks.bk),
                                      blocks.bq, blocks.bk, own)
    kinds = np.asarray(tables.row_kinds(allowed, full))[0]
    return kinds, blocks.bq


def routed_blocks(seg, pos, budgets, block):
    """Selected blocks per query block by the real router on one region (random q, k)."""
    T = len(seg)
    Tp = -(-T // block) * block
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, Tp, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, Tp, 1, 8)), jnp.float32)
    s = np.zeros((1, Tp), np.int32)
    s[0, :T] = seg
    b = np.zeros((1, Tp), np.int32)
    b[0, :T] = budgets
    _, counts, _ = route(q, k, jnp.asarray(s), jnp.asarray(b), block)
    return int(np.asarray(counts)[0, 0, :-(-T // block)].sum()) * block * block


def kernel_pairs(plan, m, block, sparse=False, align=1):
    """[computed, masked] token pairs of micro-batch m, from the kernels' own tables."""
    buf = layout_microbatch(plan, m, placeholder_sequences(plan.lengths), align=align, default_budget=1)
    seg, pos, bud = buf["segment_ids"], buf["positions"], buf["budgets"]
    mb = plan.template.microbatches[m]
    S, L = mb.shard_len, mb.local_len

    def count(kinds, b):
        return np.array([(kinds != SKIP).sum(), (kinds == PARTIAL).sum()]) * b * b

    def local(sl, pl, bl):
        if sparse:
            return np.array([1, 1]) * routed_blocks(sl, pl, bl, block)
        return count(*dense_kinds(sl, block))

    total = np.zeros(2, np.int64)
    for g in mb.groups:
        devs = list(range(g.start, g.start + g.degree))
        if g.scheme == "ulysses" and g.degree > 1:
            total += local(*(np.concatenate([a[d, :S] for d in devs]) for a in (seg, pos, bud)))
        elif mb.scheme == "ring":
            for d in devs:
                for e in devs:
                    total += count(*ring_kinds(seg[d, :S], pos[d, :S], seg[e, :S], pos[e, :S], block, d == e))
        else:
            for d in devs:
                total += local(seg[d, :S], pos[d, :S], bud[d, :S])
        for d in devs if L else ():
            total += local(seg[d, S:], pos[d, S:], bud[d, S:])
    return total


LENGTHS = [700, 130, 45, 1, 260, 512, 90, 333, 64, 20]
PLANS = {
    "local": [[GroupSpec(1, "local", (0,)), GroupSpec(1, "local", (1, 2, 3)), GroupSpec(1, "local", (4, 5)),
               GroupSpec(1, "local", (6, 7, 8, 9))]],
    "ring 8": [[GroupSpec(8, "ring", tuple(range(10)))]],
    "ring 4,2,1,1": [[GroupSpec(4, "ring", (0, 1)), GroupSpec(2, "ring", (5, 2)), GroupSpec(1, "local", (4,)),
                      GroupSpec(1, "local", (7, 3, 6, 8, 9))]],
    "ulysses 4+4": [[GroupSpec(4, "ulysses", (0, 1, 2)), GroupSpec(4, "ulysses", (5, 4, 3, 6, 7, 8, 9))]],
    "skrull mix": [[GroupSpec(4, "ring", (0,), ((1,), (2, 3), (4,), ())), GroupSpec(4, "ring", (5,), ((6,), (7,), (8,), (9,)))]],
    "two micro-batches": [[GroupSpec(8, "ring", (0, 1))], [GroupSpec(4, "ulysses", (2, 3, 4)),
                                                           GroupSpec(1, "local", (5, 6, 7, 8, 9))]],
}


CASES = [(name, 256, False) for name in PLANS] + [("ring 4,2,1,1", 128, False), ("ulysses 4+4", 64, True)]


@pytest.mark.parametrize("name, block, sparse", CASES)
def test_pairs_match_the_kernels_tables(name, block, sparse):
    align = block if sparse else 1
    budgets = [1 + i % 3 for i in range(len(LENGTHS))] if sparse else None
    plan = build_plan(8, PLANS[name], LENGTHS, budgets=budgets, align=align)
    total = np.zeros(len(FEATURES))
    for m, mb in enumerate(plan.template.microbatches):
        w = microbatch_work(plan, m, attention_block=256, sparse_block=block if sparse else 0, align=align) \
            if sparse else microbatch_work(plan, m, attention_block=block, align=align)
        assert [w["pairs"], w["masked_pairs"]] == kernel_pairs(plan, m, block, sparse, align).tolist(), (name, m)
        assert w["tokens"] == 8 * (mb.shard_len + mb.local_len)
        ring = max([g.degree for g in mb.groups if g.scheme == "ring"], default=0)
        assert (w["ring_rounds"], w["ring_tokens"]) == (ring, ring * mb.shard_len)
        assert w["ulysses_tokens"] == (mb.shard_len if any(g.scheme == "ulysses" for g in mb.groups) else 0)
        total += [w[f] for f in FEATURES]
    kw = dict(attention_block=256, sparse_block=block, align=align) if sparse else dict(attention_block=block)
    np.testing.assert_array_equal(plan_work(plan, **kw), total)


def test_what_the_counts_see():
    """Facts the calibrated cost depends on: idle devices compute their padding; a 384-token
    buffer in 256-token blocks costs as 512; packed documents cost their own triangles."""
    one = build_plan(8, [[GroupSpec(1, "local", (0,))]], [384])
    w = microbatch_work(one, 0, attention_block=256)
    # the busy device: blocks (0,0), (1,0), (1,1) of 256; 7 idle devices: one 384-token padding
    # segment each, also 3 block pairs
    assert w["pairs"] == 8 * 3 * 256 * 256 and w["tokens"] == 8 * 384
    # one long document in whole blocks: only the diagonal blocks need the mask
    ring = build_plan(8, [[GroupSpec(8, "ring", (0,))]], [8 * 512])
    w = microbatch_work(ring, 0, attention_block=256)
    assert w["pairs"] == (16 * 17 // 2) * 256 * 256 and w["masked_pairs"] == 16 * 256 * 256
    packed = build_plan(8, [[GroupSpec(1, "local", (0, 1))]], [256, 256])
    single = build_plan(8, [[GroupSpec(1, "local", (0,))]], [512])
    assert (microbatch_work(packed, 0, attention_block=256)["pairs"]
            < microbatch_work(single, 0, attention_block=256)["pairs"])
