"""jaxsb.models.router.route: diagonal always selected, no future or foreign-document blocks, counts
follow the budgets, coverage in [0, 1], top-k equals a brute-force numpy router, deterministic."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsb.models.router import coverage_curves, document_coverage_curves, route
from tolerances import tol
from attention_inputs import segments

T, BS, H, K, D = 75, 8, 4, 2, 8  # 10 blocks, the last one partial
NB = -(-T // BS)
# Row 0: a document over many blocks, a one-token document, one more, padding.
# Row 1: short documents (one of length 1), a block-straddling layout, no padding.
DOCS = [[50, 1, 20], [7, 1, 30, 12, 25]]


def _segments(docs_per_row):
    return np.asarray(segments(T, docs_per_row))


def _qk(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(2, T, H, D)).astype(np.float32), rng.normal(size=(2, T, K, D)).astype(np.float32)


def _brute_force(q, k, seg, budgets):
    """Independent numpy router: per query block n, the document d of its first token; every
    block j <= n holding d is eligible; score = mean q over (d's tokens of n, heads of the
    group) . mean k over d's tokens of j / sqrt(D). Returns selected sets, counts, scores."""
    B = q.shape[0]
    G = H // K
    segp = np.concatenate([seg, -np.ones((B, NB * BS - T), np.int32)], 1)
    sel, counts, all_scores = {}, np.zeros((B, K, NB), int), {}
    for b in range(B):
        # document of a token = its run of equal ids
        run = np.zeros(NB * BS, int)
        for t in range(1, NB * BS):
            run[t] = run[t - 1] + (segp[b, t] != segp[b, t - 1])
        for kh in range(K):
            for n in range(NB):
                d = run[n * BS]
                qtok = [t for t in range(n * BS, (n + 1) * BS) if run[t] == d]
                qbar = np.mean([q[b, t, kh * G + g] if t < T else np.zeros(D) for t in qtok for g in range(G)], 0)
                scores = {}
                for j in range(n + 1):
                    ktok = [t for t in range(j * BS, (j + 1) * BS) if run[t] == d]
                    if ktok:
                        kbar = np.mean([k[b, t, kh] if t < T else np.zeros(D) for t in ktok], 0)
                        scores[j] = float(qbar @ kbar) / math.sqrt(D)
                c = min(max(budgets[b], 1), len(scores))
                others = sorted((j for j in scores if j != n), key=lambda j: -scores[j])
                sel[b, kh, n] = {n, *others[: c - 1]}
                counts[b, kh, n] = c
                all_scores[b, kh, n] = scores
    return sel, counts, all_scores


@pytest.mark.parametrize("budgets", [[1, 1], [2, 4], [3, 100]], ids=["diag", "mixed", "all"])
def test_matches_brute_force(budgets):
    q, k = _qk()
    seg = _segments(DOCS)
    idx, counts, cov = jax.jit(route, static_argnums=(4,))(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(seg), jnp.asarray(budgets), BS
    )
    idx, counts = np.asarray(idx), np.asarray(counts)
    sel, want_counts, scores = _brute_force(q, k, seg, budgets)
    np.testing.assert_array_equal(counts, want_counts)
    for (b, kh, n), want in sel.items():
        got = idx[b, kh, n, : counts[b, kh, n]]
        assert got[0] == n, "the diagonal block must come first"
        assert len(set(got.tolist())) == len(got), "repeated block"
        assert set(got.tolist()) == want, (b, kh, n, got, want)
    # coverage: softmax mass of the selected blocks over the eligible ones
    kept = np.zeros((2, K, NB))
    for (b, kh, n), s in scores.items():
        js = np.array(list(s))
        p = np.exp(np.array([s[j] for j in js]) - max(s.values()))
        kept[b, kh, n] = p[np.isin(js, list(sel[b, kh, n]))].sum() / p.sum()
    w = (np.concatenate([seg, np.zeros((2, NB * BS - T), np.int32)], 1).reshape(2, NB, BS) > 0).sum(-1)
    want_cov = (kept * w[:, None]).sum(-1) / w.sum(-1)[:, None]
    np.testing.assert_allclose(np.asarray(cov.per_kv_head), want_cov, **tol("router_coverage", "float32"))
    np.testing.assert_allclose(np.asarray(cov.per_row), want_cov.mean(-1), **tol("router_coverage", "float32"))


def test_invariants_on_random_layouts():
    """Diagonal first, nothing from the future or from blocks without the query block's first
    document, counts == min(budget, eligible) <= max_blocks, coverage in [0, 1] and == 1 iff
    every eligible block is selected."""
    rng = np.random.default_rng(1)
    for trial in range(3):
        docs = []
        for _ in range(2):
            lengths, left = [], T - int(rng.integers(0, 9))
            while left > 0:
                lengths.append(int(min(left, rng.integers(1, 40))))
                left -= lengths[-1]
            docs.append(lengths)
        seg = _segments(docs)
        q, k = _qk(seed=trial + 2)
        budgets = rng.integers(1, NB + 1, size=2)
        idx, counts, cov = route(jnp.asarray(q), jnp.asarray(k), jnp.asarray(seg), jnp.asarray(budgets), BS, max_blocks=6)
        idx, counts = np.asarray(idx), np.asarray(counts)
        assert idx.shape == (2, K, NB, 6) and counts.shape == (2, K, NB)
        segp = np.concatenate([seg, -np.ones((2, NB * BS - T), np.int32)], 1)
        for b in range(2):
            for kh in range(K):
                for n in range(NB):
                    c = counts[b, kh, n]
                    assert 1 <= c <= min(budgets[b], 6)
                    got = idx[b, kh, n, :c]
                    assert got[0] == n
                    assert np.all(got <= n), "block from the future"
                    first = n * BS
                    start = first
                    while start > 0 and segp[b, start - 1] == segp[b, first]:
                        start -= 1
                    eligible = n - start // BS + 1
                    assert np.all(got >= start // BS), "block without the query's document"
                    assert c == min(budgets[b], eligible, 6)
        cov_h = np.asarray(cov.per_kv_head)
        assert np.all((cov_h >= 0) & (cov_h <= 1 + 1e-6))
    # every eligible block selected -> coverage exactly 1; diagonal only on one long doc -> < 1
    q, k = _qk(seed=9)
    seg = jnp.asarray(_segments(DOCS))
    _, _, cov = route(jnp.asarray(q), jnp.asarray(k), seg, jnp.array([NB, NB]), BS)
    np.testing.assert_allclose(np.asarray(cov.per_row), 1.0, **tol("router_coverage", "float32"))
    _, _, cov = route(jnp.asarray(q), jnp.asarray(k), None, jnp.array([1, 1]), BS)
    assert np.all(np.asarray(cov.per_row) < 0.9)


def test_deterministic_and_not_differentiated():
    q, k = (jnp.asarray(x) for x in _qk(seed=3))
    seg = jnp.asarray(_segments(DOCS))
    budgets = jnp.array([3, 5])
    f = jax.jit(route, static_argnums=(4,))
    a, b, eager = f(q, k, seg, budgets, BS), f(q, k, seg, budgets, BS), route(q, k, seg, budgets, BS)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y)  # same program twice: bit for bit
    # eager vs jit: same selection; coverage may differ in the last bit (fusion order)
    np.testing.assert_array_equal(a[0], eager[0])
    np.testing.assert_array_equal(a[1], eager[1])
    np.testing.assert_allclose(a[2].per_row, eager[2].per_row, **tol("router_coverage", "float32"))
    g = jax.grad(lambda q: route(q, k, seg, budgets, BS)[2].per_row.sum())(q)
    assert np.all(np.asarray(g) == 0.0)


def test_budgets_are_data_under_jit():
    q, k = (jnp.asarray(x) for x in _qk(seed=4))
    f = jax.jit(lambda b: route(q, k, None, b, BS, max_blocks=4)[1])
    assert np.all(np.asarray(f(jnp.array([1, 1]))) == 1)
    c = np.asarray(f(jnp.array([4, 2])))
    np.testing.assert_array_equal(c[0, 0], np.minimum(np.arange(1, NB + 1), 4))
    np.testing.assert_array_equal(c[1, 0], np.minimum(np.arange(1, NB + 1), 2))
    assert f._cache_size() == 1


def test_per_token_budgets_give_each_document_its_own():
    """budgets [B, T]: two block-aligned documents in one row with budgets 1 and 3 are routed
    exactly as when each is alone in a row with a per-row budget."""
    q, k = (jnp.asarray(x) for x in _qk(seed=5))
    T = q.shape[1]
    half = (T // 2 // BS) * BS
    seg = jnp.asarray(np.r_[np.ones(half), 2 * np.ones(T - half)].astype(np.int32))[None].repeat(2, 0)
    per_token = jnp.where(seg == 1, 1, 3)
    idx, counts, _ = route(q, k, seg, per_token, BS)
    for doc, budget in ((1, 1), (2, 3)):
        _, want, _ = route(q, k, seg, jnp.array([budget, budget]), BS)
        blocks = np.flatnonzero(np.asarray(seg[0, ::BS]) == doc)
        np.testing.assert_array_equal(np.asarray(counts)[..., blocks], np.asarray(want)[..., blocks])
    assert np.asarray(counts)[..., half // BS:].max() > 1  # the second document uses its larger budget


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_blocks": 11}, "max_blocks=11"),
        ({"block_size": 0}, "block_size=0"),
        ({"budgets": jnp.array([1, 2, 3])}, "budgets.shape=(3,)"),
        ({"budgets": jnp.ones((2, 5), jnp.int32)}, "budgets.shape=(2, 5)"),
        ({"segment_ids": jnp.ones((2, 7), jnp.int32)}, "(2, 7)"),
    ],
)
def test_argument_errors(kwargs, message):
    q, k = (jnp.asarray(x) for x in _qk())
    args = {"q": q, "k": k, "segment_ids": None, "budgets": jnp.array([1, 1]), "block_size": BS}
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        route(**args)
    assert message in str(info.value)


def test_coverage_curves_match_numpy():
    """c(k) per (row, kv head, query block) = the k largest softmax masses over the visible
    key-block scores of the brute-force router (1 once k reaches the visible count); a
    document's C(k) = the mean over kv heads and its query blocks; the router's kept mass with
    budget k (diagonal first) never exceeds C(k)'s block value."""
    q, k = _qk(3)
    seg = _segments(DOCS)
    max_k = 6
    curves, routed = coverage_curves(jnp.asarray(q), jnp.asarray(k), jnp.asarray(seg), BS, max_k)
    curves, routed = np.asarray(curves), np.asarray(routed)
    _, _, scores = _brute_force(q, k, seg, [1, 1])
    want = np.zeros((2, K, NB, max_k))
    for (b, kh, n), sc in scores.items():
        v = np.array(list(sc.values()), np.float64)
        p = np.sort(np.exp(v - v.max()) / np.exp(v - v.max()).sum())[::-1]
        want[b, kh, n] = [1.0 if kk >= len(p) else p[:kk].sum() for kk in range(1, max_k + 1)]
    np.testing.assert_allclose(curves, want, **tol("router_coverage", np.float32))
    assert (np.diff(curves, axis=-1) >= -1e-6).all() and (curves <= 1.0).all()
    assert routed.tolist() == [[int(seg[b, n * BS]) for n in range(NB)] for b in range(2)]
    docs = document_coverage_curves(curves, routed)
    assert sorted(docs) == sorted({(b, int(d)) for b in range(2) for d in routed[b] if d > 0})
    for (b, d), c in docs.items():
        blocks = [n for n in range(NB) if seg[b, n * BS] == d]
        np.testing.assert_allclose(c, want[b][:, blocks].mean(axis=(0, 1)), **tol("router_coverage", np.float32))
    for budget in (1, 2, 4):
        _, _, cov = route(jnp.asarray(q), jnp.asarray(k), jnp.asarray(seg), jnp.asarray([budget, budget]), BS)
        # per (row, kv head), both weighted by the blocks' real tokens as the router averages
        segp = np.concatenate([seg, np.zeros((2, NB * BS - T), seg.dtype)], 1).reshape(2, NB, BS)
        w = (segp > 0).sum(-1)[:, None, :]
        best = (curves[..., budget - 1] * w).sum(-1) / w.sum(-1)
        assert (np.asarray(cov.per_kv_head) <= best + 1e-6).all()
        if budget == 1:  # the diagonal alone is rarely the best block: strictly less somewhere
            assert (np.asarray(cov.per_kv_head) < best - 1e-3).any()


def _numpy_floor(scores, routed, planned, base, p, max_k):
    """The runtime floor from the same scores, in float64 numpy: per (row, kv head, query block)
    the sorted softmax masses' running sum (1 once k covers the visible blocks), averaged over
    kv heads and the query blocks of the block's document; override when C(base) - C(k) > p.
    Returns (final, overridden, C(final), C(base) - C(final)) per (row, query block)."""
    B, Kh, nq, _ = scores.shape
    curves = np.zeros((B, Kh, nq, max_k))
    for b, kh, n in np.ndindex(B, Kh, nq):
        s = scores[b, kh, n][np.isfinite(scores[b, kh, n])]
        w = np.exp(s - s.max())
        w = np.sort(w / w.sum())[::-1]
        c = np.cumsum(w)
        curves[b, kh, n] = [1.0 if kk >= len(s) else min(c[kk - 1], 1.0) for kk in range(1, max_k + 1)]
    final, over = planned.copy(), np.zeros_like(planned, bool)
    cov, drop = np.zeros(planned.shape), np.zeros(planned.shape)
    for b, n in np.ndindex(B, nq):
        d = routed[b, n]
        blocks = np.nonzero(routed[b] == d)[0] if d > 0 else [n]
        C = curves[b][:, blocks].mean(axis=(0, 1))
        kb = min(base, max_k)
        if d > 0 and C[kb - 1] - C[planned[b, n] - 1] > p:
            over[b, n] = True
            final[b, n] = 1 + sum(C[kk - 1] < C[kb - 1] - p for kk in range(1, kb))
        cov[b, n] = C[final[b, n] - 1]
        drop[b, n] = C[kb - 1] - cov[b, n]
    return final, over, cov, drop


@pytest.mark.parametrize("base,p", [(4, 0.05), (3, 0.2), (6, 0.0)])
def test_runtime_floor_matches_numpy(base, p):
    from jaxsb.models.router import block_scores

    q, k = _qk(seed=3)
    seg = _segments(DOCS)
    budgets = np.array([[1, 2, 1, 3, 1, 2, 1, 2, 1, 1], [2, 1, 1, 1, 4, 1, 2, 1, 1, 1]])  # per query block
    per_token = np.repeat(budgets, BS, axis=1)[:, :T]
    scores, _ = block_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(seg), BS)
    routed = np.concatenate([seg, np.zeros((2, NB * BS - T), int)], 1)[:, ::BS]
    want_final, want_over, want_cov, want_drop = _numpy_floor(np.asarray(scores, np.float64), routed, budgets,
                                                              base, p, NB)
    _, counts, cov = jax.jit(route, static_argnames=("block_size", "floor"))(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(seg), jnp.asarray(per_token), block_size=BS, floor=(base, p))
    np.testing.assert_array_equal(np.asarray(cov.floor.planned), budgets)
    np.testing.assert_array_equal(np.asarray(cov.floor.overridden), want_over)
    np.testing.assert_array_equal(np.asarray(cov.floor.final), want_final)
    assert want_over.any() and not want_over.all()
    np.testing.assert_allclose(np.asarray(cov.floor.coverage), want_cov, **tol("router_coverage", np.float32))
    np.testing.assert_allclose(np.asarray(cov.floor.drop), want_drop, **tol("router_coverage", np.float32))
    real = routed > 0
    assert (want_drop[real] <= p + 1e-12).all()  # the floor's guarantee, for every routed document
    eligible = np.isfinite(np.asarray(scores)).sum(-1)
    np.testing.assert_array_equal(np.asarray(counts), np.minimum(want_final[:, None, :], eligible))
    # raised budgets are never touched, p >= 1 never overrides
    _, _, high = route(jnp.asarray(q), jnp.asarray(k), jnp.asarray(seg), jnp.asarray([8, 8]), BS, floor=(base, p))
    assert not np.asarray(high.floor.overridden).any()
    _, _, off = route(jnp.asarray(q), jnp.asarray(k), jnp.asarray(seg), jnp.asarray(per_token), BS, floor=(base, 1.0))
    assert not np.asarray(off.floor.overridden).any()
    with pytest.raises(ValueError, match="floor=.* must be"):
        route(jnp.asarray(q), jnp.asarray(k), jnp.asarray(seg), jnp.asarray([1, 1]), BS, floor=(0, 0.1))
