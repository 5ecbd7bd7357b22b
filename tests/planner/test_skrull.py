"""Skrull's cost model and planner (jaxsb/planner/skrull.py): numbers by hand, feasible and
deterministic plans, DACP against brute force on tiny groups, the too-long error."""

import itertools
import math

import numpy as np
import pytest

from jaxsb.plan import SHARDED, PlanError, validate
from jaxsb.planner.skrull import SkrullPlanner, bimodal_lengths, long_sft_lengths
from jaxsb.planner.skrull_cost import SkrullCost, _interp_latency_us

PEAK = 989e12
MIB = float(1 << 20)


# ------------------------------------------------------------------------------ cost model


def test_flops_and_compute_by_hand():
    c = SkrullCost("skrull-h100:qwen2.5-0.5b")
    assert (c.hidden, c.layers, c.kv_hidden, c.token_capacity) == (896, 24, 128, 26000)
    per_layer = 20 * 896**2 * 1000 + 4 * 896 * 128 * 1000 + 4 * 896 * 1000**2
    assert c.flops(1000) == pytest.approx(24 * per_layer, rel=1e-12)
    alpha_ms = 1e3 / (PEAK * 0.40)
    beta_ms = 24 * 5e-3
    assert c.full_ms(1000) == pytest.approx(3 * (alpha_ms * 24 * per_layer + beta_ms), rel=1e-12)
    # a piece of a sharded sequence: 1/d of all FLOPs (load-balanced layout), the whole beta
    assert c.share_ms(1000, 8) == pytest.approx(3 * (alpha_ms * 24 * per_layer / 8 + beta_ms), rel=1e-12)
    assert c.share_ms(1000, 1) == c.full_ms(1000)
    c7 = SkrullCost("qwen2.5-7b", mfu=0.5, beta_us_per_layer=0.0)
    assert (c7.hidden, c7.layers, c7.kv_hidden, c7.token_capacity) == (3584, 28, 512, 13000)
    per_layer7 = 20 * 3584**2 * 4096 + 4 * 3584 * 512 * 4096 + 4 * 3584 * 4096**2
    assert c7.full_ms(4096) == pytest.approx(3 * 28 * per_layer7 / (PEAK * 0.5) * 1e3, rel=1e-12)
    assert c7.name == "skrull-h100:qwen2.5-7b"


def test_collective_table_interpolation():
    sizes, ag = (2, 64, 1024), (53, 489, 6468)
    assert _interp_latency_us(sizes, ag, 0) == 0.0
    assert _interp_latency_us(sizes, ag, 0.5) == 53  # latency floor below 2 MiB
    assert _interp_latency_us(sizes, ag, 64) == 489
    assert _interp_latency_us(sizes, ag, 33) == pytest.approx(53 + (489 - 53) * 31 / 62)
    assert _interp_latency_us(sizes, ag, 2048) == pytest.approx(6468 + (6468 - 489) * 1024 / 960)


def test_communication_by_hand():
    c7 = SkrullCost("qwen2.5-7b")
    assert c7.comm_ms(1, 10**6) == 0.0 and c7.comm_ms(8, 0) == 0.0
    # 100 tokens: K and V of 512 wide in bf16 = 0.2 MB, below the table: floors 53 (all-gather,
    # fwd and again in bwd) + 59 (reduce-scatter of dK/dV), per layer, 28 layers
    assert c7.comm_ms(8, 100) == pytest.approx(28 * (2 * 53 + 59) * 1e-3)
    mb = 10000 * 2 * 512 * 2 / MIB
    ag = 53 + (489 - 53) * (mb - 2) / 62
    rs = 59 + (459 - 59) * (mb - 2) / 62
    assert c7.comm_ms(8, 10000, "ring") == pytest.approx(28 * (2 * ag + rs) * 1e-3)
    # ulysses: per rank, q/k/v (3584 + 2*512 wide) and the output (3584 wide), fwd and bwd
    per_rank = 80000 / 8 * 2 / MIB
    qkv = _interp_latency_us((2, 64, 1024), (81, 502, 6630), per_rank * (3584 + 1024))
    out = _interp_latency_us((2, 64, 1024), (81, 502, 6630), per_rank * 3584)
    assert c7.comm_ms(8, 80000, "ulysses") == pytest.approx(28 * 2 * (qkv + out) * 1e-3)
    with pytest.raises(ValueError, match="scheme"):
        c7.comm_ms(8, 100, "local")


def test_group_time_and_memory_by_hand():
    c = SkrullCost("qwen2.5-0.5b")
    t = c.group_time_ms(2, [1000], [[500], [700, 100]])
    expect = c.share_ms(1000, 2) + max(c.full_ms(500), c.full_ms(700) + c.full_ms(100)) + c.comm_ms(2, 1000)
    assert t == pytest.approx(expect, rel=1e-12)
    assert c.group_time_ms(1, [300, 400]) == pytest.approx(c.full_ms(300) + c.full_ms(400))
    assert c.group_time_ms(8, []) == 0.0
    overlap = SkrullCost("qwen2.5-0.5b", overlap=True)
    assert overlap.group_time_ms(2, [1000], [[500], [700]]) == pytest.approx(
        c.share_ms(1000, 2) + max(c.comm_ms(2, 1000), c.full_ms(700)))
    assert c.rank_tokens(4, [1001], [[10], [], [30]]) == [261, 251, 281, 251]
    assert c.group_memory_mb(4, [1001], [[10], [], [30]]) == pytest.approx(281 * c.memory_limit_mb / 26000)
    assert c.group_memory_mb(1, [26000]) == pytest.approx(c.memory_limit_mb)
    with pytest.raises(ValueError, match="degree 2"):
        c.group_time_ms(2, [], [[1], [2], [3]])


# --------------------------------------------------------------------------------- helpers


def check_feasible(plan, planner, lengths):
    """Every sequence once, dp groups of degree cp per micro-batch, capacity on every rank."""
    validate(plan)
    cost, dp, cp, cap = planner.cost, planner.dp, planner.cp, planner.capacity
    seen = []
    for m, mb in enumerate(plan.template.microbatches):
        for g in range(dp):
            group = mb.groups[g]
            assert (group.start, group.degree) == (g * cp, cp)
            sharded, local = plan.sequences_of(m, g)
            seen += sharded + [i for ids in local.values() for i in ids]
            sh = [lengths[i] for i in sharded]
            loc = [[lengths[i] for i in local.get(r, [])] for r in range(cp)]
            assert max(cost.rank_tokens(cp, sh, loc)) <= cap, (m, g)
            assert cost.group_memory_mb(cp, sh, loc) <= cost.memory_limit_mb * (1 + 1e-12)
        assert all(grp.degree == 1 for grp in mb.groups[dp:])
    assert sorted(seen) == list(range(len(lengths)))
    assert plan.lengths == tuple(int(x) for x in lengths)
    assert cost.plan_time_ms(plan) == pytest.approx(plan.predicted_ms, rel=1e-9)


BATCHES = {
    "long-sft": lambda seed: long_sft_lengths(256, seed, long_frac=0.02),
    "bimodal": lambda seed: bimodal_lengths(256, seed),
    "uniform": lambda seed: np.random.default_rng(seed).integers(1, 20000, 256),
}


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "qwen2.5-7b"])
@pytest.mark.parametrize("mix", sorted(BATCHES))
def test_plans_feasible_and_deterministic(model, mix):
    cost = SkrullCost(model)
    for seed in range(2):
        lengths = BATCHES[mix](seed)
        skrull = SkrullPlanner(cost, 32, dp=4, cp=8, seqs_per_dp_rank=64)
        skrull_solution = skrull.solve(lengths)
        plan = skrull_solution.plan
        check_feasible(plan, skrull, lengths)
        info = skrull_solution.info
        assert not info["fell_back"] and info["num_microbatches"] == len(plan.template.microbatches)
        assert info["solve_seconds"] > 0 and info["message"]
        assert info["lower_bound_ms"] <= plan.predicted_ms * (1 + 1e-9)
        # same input -> same plan, from the same planner and from a fresh one
        assert skrull.plan(lengths) == plan
        assert SkrullPlanner(cost, 32, dp=4, cp=8, seqs_per_dp_rank=64).plan(list(lengths)) == plan
        # the static baseline: every sequence sharded, feasible too
        static = SkrullPlanner(cost, 32, dp=4, cp=8, seqs_per_dp_rank=64, all_sharded=True)
        static_solution = static.solve(lengths)
        splan = static_solution.plan
        check_feasible(splan, static, lengths)
        assert all(p.rank == SHARDED for p in splan.placements)
        assert static_solution.info["local_sequences"] == 0
        # same GDS micro-batches, all sharded: DACP's k = 0; it can only do better
        gds_only = SkrullPlanner(cost, 32, dp=4, cp=8, all_sharded=True, gds=True).plan(lengths)
        assert plan.predicted_ms <= gds_only.predicted_ms * (1 + 1e-12)


def test_gds_adds_microbatches_until_they_fit():
    cost = SkrullCost("qwen2.5-7b")  # 13K tokens per rank: 4 x 13K per CP group of 4
    lengths = [30000, 30000, 20000, 20000, 9000, 9000, 9000, 9000] + [1500] * 24
    planner = SkrullPlanner(cost, 8, dp=2, cp=4)
    solution = planner.solve(lengths)
    plan = solution.plan
    check_feasible(plan, planner, lengths)
    per_rank = sum(lengths) / 2
    assert solution.info["num_microbatches"] >= math.ceil(per_rank / (4 * 13000))
    assert solution.info["num_microbatches"] > 1
    more = SkrullPlanner(cost, 8, dp=2, cp=4, extra_microbatches=2)
    more_solution = more.solve(lengths)
    plan2 = more_solution.plan
    check_feasible(plan2, more, lengths)
    assert more_solution.info["microbatches_tried"] == 3
    assert plan2.predicted_ms <= plan.predicted_ms * (1 + 1e-12)


def test_cp1_and_ulysses_and_mesh_defaults():
    cost = SkrullCost("qwen2.5-0.5b")
    lengths = list(long_sft_lengths(40, 3))
    p1 = SkrullPlanner(cost, 4, dp=4, cp=1)
    plan = p1.plan(lengths)
    validate(plan)
    assert all(g.degree == 1 for mb in plan.template.microbatches for g in mb.groups)
    assert cost.plan_time_ms(plan) == pytest.approx(plan.predicted_ms)
    pu = SkrullPlanner(cost, 16, cp=8, scheme="ulysses")
    assert (pu.dp, pu.cp) == (2, 8)
    plan = pu.plan(lengths)
    check_feasible(plan, pu, lengths)
    assert {g.scheme for mb in plan.template.microbatches for g in mb.groups} == {"ulysses"}
    with pytest.raises(ValueError, match="at most"):
        SkrullPlanner(cost, 8, dp=2, cp=8)
    budgets = list(range(1, len(lengths) + 1))  # sparse budgets ride along unchanged
    assert pu.plan(lengths, budgets=budgets).budgets == tuple(budgets)


def test_time_limit_falls_back_and_says_so():
    cost = SkrullCost("qwen2.5-0.5b")
    lengths = bimodal_lengths(64, 1)
    planner = SkrullPlanner(cost, 16, dp=2, cp=8, time_limit_s=0.0)
    solution = planner.solve(lengths)
    plan = solution.plan
    check_feasible(plan, planner, lengths)
    assert solution.info["fell_back"] is True
    assert "time limit" in solution.info["message"]
    assert all(p.rank == SHARDED for p in plan.placements)


def test_too_long_sequence_names_length_and_capacity():
    cost = SkrullCost("qwen2.5-7b")
    planner = SkrullPlanner(cost, 32, dp=4, cp=8)
    planner.plan([8 * 13000, 100])  # exactly 8 x C fits
    with pytest.raises(PlanError, match=r"length 104001 .*13000 per rank"):
        planner.plan([100, 8 * 13000 + 1])
    with pytest.raises(PlanError, match="length 0"):
        planner.plan([0, 5])


def test_capacity_from_memory_for_other_cost_models():
    """A cost model without `token_capacity` gets one from `group_memory_mb` and the generic
    (non-vectorised) DACP path, which picks the same plan."""
    inner = SkrullCost("qwen2.5-0.5b")

    class Opaque:
        name = "opaque"
        memory_limit_mb = inner.memory_limit_mb
        group_time_ms = staticmethod(inner.group_time_ms)
        group_memory_mb = staticmethod(inner.group_memory_mb)
        plan_time_ms = staticmethod(inner.plan_time_ms)

    derived = SkrullPlanner(Opaque(), 16, dp=2, cp=8)
    assert derived.capacity in (25999, 26000)
    lengths = bimodal_lengths(64, 5)
    generic = SkrullPlanner(Opaque(), 16, dp=2, cp=8, token_capacity=26000).plan(lengths)
    fast = SkrullPlanner(inner, 16, dp=2, cp=8).plan(lengths)
    assert generic.placements == fast.placements
    assert generic.predicted_ms == pytest.approx(fast.predicted_ms, rel=1e-12)


# ------------------------------------------------------------------- DACP vs brute force


def brute_force(planner, lengths):
    """The best modelled group time over every local/sharded assignment within capacity."""
    cost, cp, cap, n = planner.cost, planner.cp, planner.capacity, len(lengths)
    best = math.inf
    for assign in itertools.product(range(-1, cp), repeat=n):
        sh = [lengths[i] for i in range(n) if assign[i] == -1]
        loc = [[lengths[i] for i in range(n) if assign[i] == r] for r in range(cp)]
        if max(cost.rank_tokens(cp, sh, loc)) <= cap:
            best = min(best, cost.group_time_ms(cp, sh, loc))
    return best


def random_group(rng, n, cap, kind):
    if kind == 0:
        return [int(x) for x in rng.integers(64, 4000, n)]
    if kind == 1:
        return [int(x) for x in np.where(rng.random(n) < 0.3, rng.integers(4000, 2 * cap, n),
                                         rng.integers(64, 1500, n))]
    return [int(x) for x in rng.integers(1, 3 * cap // 2, n)]


@pytest.mark.parametrize("model,cp,n,cap", [("qwen2.5-0.5b", 2, 4, 8000), ("qwen2.5-7b", 2, 4, 6000),
                                            ("qwen2.5-0.5b", 3, 5, 8000), ("qwen2.5-7b", 3, 5, 4000)])
def test_dacp_against_brute_force(model, cp, n, cap):
    """DACP is a heuristic: it is never better than the optimum (a check of both), is within 10%
    of it on every instance of these random families (measured on these seeds: worst 4.9% above),
    and equal to it on most of them (measured: 63% for 7B cp=2, 88-100% for the others)."""
    cost = SkrullCost(model, token_capacity=cap)
    planner = SkrullPlanner(cost, cp, dp=1, cp=cp)
    rng = np.random.default_rng(cp * 100 + n)
    ratios = []
    for trial in range(60 if cp == 2 else 24):
        lengths = random_group(rng, n, cap, trial % 3)
        if math.ceil(sum(lengths) / cp) > cap:
            assert planner.dacp(range(n), lengths) is None
            continue
        sharded, local, t = planner.dacp(range(n), lengths)
        assert sorted(sharded + [i for ids in local for i in ids]) == list(range(n))
        sh = [lengths[i] for i in sharded]
        loc = [[lengths[i] for i in ids] for ids in local]
        assert max(cost.rank_tokens(cp, sh, loc)) <= cap
        assert t == pytest.approx(cost.group_time_ms(cp, sh, loc), rel=1e-12)
        opt = brute_force(planner, lengths)
        assert t >= opt * (1 - 1e-12)
        ratios.append(t / opt)
    ratios = np.array(ratios)
    assert len(ratios) >= 10
    assert ratios.max() <= 1.10, ratios.max()
    assert (ratios <= 1 + 1e-9).mean() >= 0.5


@pytest.mark.parametrize("lengths,expect_local", [
    ([3000, 3000], 2),  # cp equal sequences: one whole per rank, no communication
    ([9000, 6000], 0),  # neither can stay whole next to its share of the other: all sharded
    ([9000, 800, 800, 800, 800], 4),  # the long one sharded, the short ones two per rank
])
def test_dacp_optimal_on_structured_groups(lengths, expect_local):
    cost = SkrullCost("qwen2.5-0.5b", token_capacity=8000)
    planner = SkrullPlanner(cost, 2, dp=1, cp=2)
    sharded, local, t = planner.dacp(range(len(lengths)), lengths)
    assert t == pytest.approx(brute_force(planner, lengths), rel=1e-12)
    assert sum(len(ids) for ids in local) == expect_local


# ------------------------------------------------------------------------ length mixes


def test_length_mixes():
    a = long_sft_lengths(100_000, 7)
    assert np.array_equal(a, long_sft_lengths(100_000, 7))
    assert not np.array_equal(a, long_sft_lengths(100_000, 8))
    long = a > 20000
    assert 0.0006 <= long.mean() <= 0.0014
    assert 36000 <= a[long].mean() <= 40000
    assert 800 <= a[~long].mean() <= 900 and a.min() >= 32
    b = bimodal_lengths(50_000, 7)
    assert 0.18 <= (b >= 8192).mean() <= 0.22 and b.max() <= 24576
