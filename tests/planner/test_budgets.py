"""Sparse budgets as planner decisions: coverage curves and floors, SparseBalance's pipeline cost
model, the DST rules on hand cases, their properties on random batches for every budget
planner, and the simulator's SparseBalance setting (issue 12)."""

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from jaxsb.plan import GroupSpec, build_plan
from jaxsb.planner import dst
from jaxsb.planner.cost import load_preset
from jaxsb.planner.coverage import (MeasuredCoverage, coverage_at, coverage_drop, k_min, synthetic_coverage,
                                    synthetic_curve)
from jaxsb.planner.pipeline_cost import block_pairs, imbalance, pp_lower_bound_ms
from jaxsb.planner.simulation import synthetic_lengths
from jaxsb.planner.sparsebalance import JaxsbPipelinePlanner, SparseBalancePlanner, balanced_partition


# ------------------------------------------------------------------------------ coverage


def brute_force_curve(length, alpha, block, max_k):
    """Every row explicitly: V visible blocks, probabilities ~ j^-alpha sorted, top-k mass."""
    nb = -(-length // block)
    rows = []
    for v in range(1, nb + 1):
        r = np.arange(1, v + 1, dtype=np.float64) ** -alpha
        r /= r.sum()
        rows.append([r[:k].sum() for k in range(1, max_k + 1)])
    return np.mean(rows, axis=0)


@pytest.mark.parametrize("length,alpha", [(1000, 1.0), (32768, 0.8), (32768, 1.7), (300, 1.3), (256, 2.0)])
def test_synthetic_curve_matches_brute_force(length, alpha):
    np.testing.assert_allclose(synthetic_curve(length, alpha, 256, 64), brute_force_curve(length, alpha, 256, 64),
                               rtol=1e-12, atol=1e-12)


def test_synthetic_spread_is_like_the_papers_fig4():
    # a 32K sequence: concentrated ones reach 90% near k = 10, diffuse ones need k ~ 50
    k90 = lambda a: int(np.argmax(synthetic_curve(32768, a, 256, 64) >= 0.9)) + 1  # noqa: E731
    assert 8 <= k90(1.7) <= 12 and 45 <= k90(0.8) <= 55


def test_k_min_and_drop_on_a_hand_curve():
    c = np.array([0.5, 0.7, 0.8, 0.85, 0.9, 0.92])
    assert coverage_at(c, 3) == 0.8 and coverage_at(c, 99) == 0.92
    assert coverage_drop(c, 5, 2) == pytest.approx(0.2)
    assert k_min(c, 5, 0.1) == 3  # C(5) - C(3) = 0.1 <= 0.1; C(2) drops 0.2
    assert k_min(c, 5, 0.0) == 5
    assert k_min(c, 5, 0.5) == 1


def test_measured_coverage_file_and_its_errors(tmp_path):
    good = tmp_path / "cov.json"
    good.write_text(json.dumps(dict(block_size=256, max_k=3, documents=[
        dict(length=1000, curve=[0.5, 0.8, 1.0]), dict(length=40000, curve=[0.2, 0.3, 0.4])])))
    m = MeasuredCoverage.load(str(good))
    out = m.curves_for([900, 50000, 5000], max_k=5)
    np.testing.assert_allclose(out[0], [0.5, 0.8, 1.0, 1.0, 1.0])  # its own bin, extended with its last value
    np.testing.assert_allclose(out[1], [0.2, 0.3, 0.4, 0.4, 0.4])  # nearest bin
    bad = tmp_path / "bad.json"
    for doc, msg in [(dict(length=0, curve=[1.0]), "documents\\[0\\].length"),
                     (dict(length=5, curve=[0.5, 0.4]), "must not decrease"),
                     (dict(length=5, curve=[1.5]), "must lie in \\[0, 1\\]"),
                     (dict(curve=[1.0]), "'length' and 'curve'")]:
        bad.write_text(json.dumps(dict(block_size=256, documents=[doc])))
        with pytest.raises(ValueError, match=msg):
            MeasuredCoverage.load(str(bad))
    bad.write_text(json.dumps(dict(documents=[])))
    with pytest.raises(ValueError, match="missing field 'block_size'"):
        MeasuredCoverage.load(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        MeasuredCoverage.load(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read coverage file"):
        MeasuredCoverage.load(str(bad))


# ------------------------------------------------------------------ the pipeline cost model


def test_block_pairs_against_brute_force():
    for length, k in itertools.product([1, 255, 256, 257, 5000, 33000], [None, 1, 3, 32, 200]):
        nb = -(-length // 256)
        brute = sum(min(i + 1, k) if k else i + 1 for i in range(nb))
        assert block_pairs(length, k, 256) == brute


def test_layer_latency_by_hand_for_qwen25_3b():
    cost = load_preset("sparsebalance-h200:qwen2.5-3b", pp=4, tp=2)
    s, k, h = 32768, 32, 2048
    params = 2 * h * h + 2 * h * 256 + 3 * h * 11008
    per_ms = 2 * 989e12 / 1e3
    linear = 6 * params * s / (per_ms * 0.6)
    pairs = 32 * 33 // 2 + (128 - 32) * 32
    attn = 3.5 * pairs * 256**2 * 4 * 16 * 128 / (per_ms * 0.4)
    gate = 2 * s * 128 * 16 * 128 / (per_ms * 0.4)
    elem = 40 * s * h * 2 / (2 * 4.8e12 / 1e3)
    comm = 8 * s * h * 2 * 0.5 / (450e9 / 1e3)
    assert cost.layer_ms(s, k) == pytest.approx(linear + attn + gate + elem + comm, rel=1e-12)
    assert cost.sequence_ms(s, k) == pytest.approx(9 * cost.layer_ms(s, k), rel=1e-12)  # 36 layers / 4 stages
    assert cost.layer_ms(s, None) > cost.layer_ms(s, 64) > cost.layer_ms(s, 32) > cost.layer_ms(s, 8)
    assert cost.layer_ms(4096, 16) == cost.layer_ms(4096, 16)  # deterministic
    with pytest.raises(ValueError, match="no context parallelism"):
        cost.group_time_ms(2, [1000])
    with pytest.raises(ValueError, match="pp=5 must divide layers=36"):
        load_preset("sparsebalance-h200:qwen2.5-3b", pp=5)
    with pytest.raises(ValueError, match="unknown options"):
        load_preset("sparsebalance-h200:qwen2.5-3b", bogus=1)


def test_one_f_one_b_step_imbalance_and_memory_window():
    cost = load_preset("sparsebalance-h200:qwen2.5-0.5b", pp=4)
    times = [[10.0, 4.0], [2.0, 4.0], [3.0, 4.0]]  # [slot][rank]
    # rank 0: 15 + 3 * 10 = 45; rank 1: 12 + 3 * 4 = 24
    assert cost.combine_ms(times) == 45.0
    assert imbalance(times) == pytest.approx(10.0 / (27.0 / 6))  # Eq. 11: max / mean over micro-batches
    assert imbalance([[0.0]]) == 1.0
    plan = build_plan(1, [[GroupSpec(1, "local", (0,))], [GroupSpec(1, "local", (1,))],
                          [GroupSpec(1, "local", (2,))], [GroupSpec(1, "local", (3,))],
                          [GroupSpec(1, "local", (4,))]], [100, 5000, 100, 100, 6000])
    act = 34 * 896 * 6 / 2**20  # per token: 24 layers / 4 stages, tp 1
    # windows of 4 consecutive micro-batches: 5300 and 11200 tokens
    assert cost.plan_memory_mb(plan) == pytest.approx(cost.stage_states_mb() + 11200 * act, rel=1e-12)
    assert cost.plan_time_ms(plan) == pytest.approx(
        sum(cost.group_time_ms(1, [n]) for n in plan.lengths) + 3 * cost.group_time_ms(1, [6000]), rel=1e-12)
    floor_ms = [5.0, 1.0, 1.0, 1.0]
    # split documents allowed: the rank holding the 5.0 sequence has >= 5.0 of work, >= 2.5x that in 1F1B
    assert pp_lower_bound_ms(cost, floor_ms, dp=2, n_mb=2) == max(8 / 2, 5.0) * (1 + 3 / 2)
    assert pp_lower_bound_ms(cost, [1.0] * 8, dp=2, n_mb=2) == 8 / 2 * (1 + 3 / 2)


# ------------------------------------------------------------------------ DST on hand cases


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """A hand cost model: a group's time = sum over its sequences of budget (dense: blocks)."""

    name: str = "hand"
    block: int = 1
    memory_limit_mb: float = 1e9
    setting: str = "pipeline"

    def group_time_ms(self, degree, sharded_lengths, local_lengths=(), scheme="ulysses", budgets=None):
        lengths = list(sharded_lengths) + [n for ids in local_lengths for n in ids]
        ks = budgets or [None] * len(lengths)
        return float(sum(n if k is None else min(k, n) for n, k in zip(lengths, ks)))

    def combine_ms(self, times):
        return float(max(max(row) for row in times))  # everything waits for the slowest cell


def one_slot(lengths, groups):
    return build_plan(len(groups), [[GroupSpec(1, "local", tuple(g)) for g in groups]], lengths)


def linear_curve(n, max_k=16):
    return np.array([min(k, n) / n for k in range(1, max_k + 1)])


def test_dst_cuts_the_straggler_and_raises_the_bubble():
    cost = BlockCost()
    plan = one_slot([16, 16, 16], [[0], [1], [2]])
    curves = [linear_curve(16)] * 3
    # base budgets 8, 4, 2 are not uniform here: use per-cell anchors through one sequence each
    res = dst.tune(cost, plan, curves, base=8, p=1.0, anchor="mean", max_blocks=16, per_document=False,
                   raise_to="anchor")
    assert res.budgets == (8, 8, 8)  # all at the mean already: nothing moves
    plan = one_slot([16, 4, 16, 16], [[0, 1], [2], [3]])  # cell 0 = 8 + 4 = 12, others 8: mean 28/3
    res = dst.tune(cost, plan, [linear_curve(16), linear_curve(4), linear_curve(16), linear_curve(16)], base=8,
                   p=1.0, anchor="mean", max_blocks=16, per_document=False, raise_to="anchor")
    T = 28 / 3
    assert res.anchors_ms == (pytest.approx(T),)
    # straggler: one k for its two sequences, the largest with min(k,16) + min(k,4) <= T -> k = 5 (5 + 4)
    assert res.budgets[:2] == (5, 5) and res.cut == 1
    # bubbles raised to the largest k with k <= T: 9
    assert res.budgets[2:] == (9, 9) and res.raised == 2


def test_dst_max_anchor_never_cuts_and_min_anchor_cuts_everyone_above():
    cost = BlockCost()
    plan = one_slot([16, 16, 16], [[0], [1], [2]])
    curves = [linear_curve(16)] * 3
    base_budgets = [8] * 3
    res = dst.tune(cost, plan, curves, base=8, p=1.0, anchor="max", max_blocks=16, raise_to="none")
    assert res.budgets == tuple(base_budgets) and res.cut == 0
    plan2 = one_slot([16, 4, 16], [[0, 1], [2]])  # 12 vs 8
    res = dst.tune(cost, plan2, [linear_curve(16), linear_curve(4), linear_curve(16)], base=8, p=1.0, anchor="min",
                   max_blocks=16, per_document=False, raise_to="none")
    assert res.budgets[:2] == (4, 4) and res.budgets[2] == 8  # 4 + 4 <= 8


def test_dst_empty_feasible_set_falls_back_to_k_min():
    cost = BlockCost()
    # cell 0 has a document whose floor at p = 0.1 is k = 7 (C(8) - C(7) = 1/16 <= 0.1, C(6) drops 2/16)
    plan = one_slot([16, 16, 16], [[0], [1, 2], []])
    curves = [linear_curve(16)] * 3
    res = dst.tune(cost, plan, curves, base=8, p=0.1, anchor="min", max_blocks=16, per_document=False,
                   raise_to="none")
    # anchor = min(8, 16) = 8: cell 1 would need k = 4, below its floor 7 -> falls back to 7
    assert res.budgets == (8, 7, 7) and res.at_floor == 1
    res = dst.tune(cost, plan, curves, base=8, p=0.1, anchor="min", max_blocks=16, per_document=True,
                   raise_to="none")
    assert res.budgets == (8, 7, 7) and res.at_floor == 1
    assert k_min(curves[1], 8, 0.1) == 7


def test_per_document_cut_goes_to_the_document_that_loses_least():
    cost = BlockCost()
    flat = linear_curve(16)  # loses 1/16 per block
    peaked = np.array([0.9] + [0.9 + 0.1 * k / 15 for k in range(1, 16)])  # loses ~0.007 per block
    plan = one_slot([16, 16, 16], [[0, 1], [2], []])  # cell 0 = 16 at base 8 each; cell 1 = 8
    res = dst.tune(cost, plan, [flat, peaked, flat], base=8, p=0.5, anchor="mean", max_blocks=16,
                   per_document=True, raise_to="none")
    assert sum(res.budgets[:2]) == 12  # cut to the anchor (16 + 8) / 2
    assert res.budgets[0] == 8 and res.budgets[1] == 4  # the peaked one gives up its blocks first


def test_free_raise_stays_within_idle_time():
    cost = BlockCost()
    plan = one_slot([16, 16, 16], [[0, 1], [2], []])  # 16 vs 8: the step is 16
    res = dst.tune(cost, plan, [linear_curve(16)] * 3, base=8, p=0.0, anchor="mean", max_blocks=16,
                   per_document=True, raise_to="free")
    # p = 0: no cut; the idle cell rises until it matches the step (16 blocks of 16 max)
    assert res.budgets == (8, 8, 16)
    times = [[cost.group_time_ms(1, [16, 16], budgets=[8, 8]), cost.group_time_ms(1, [16], budgets=[16])]]
    assert cost.combine_ms(times) == 16.0


def test_align_is_monotone_in_the_target():
    cost = load_preset("sparsebalance-h200:qwen2.5-3b", pp=4)
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1000, 40000, 6)]
    plan = one_slot(lengths, [list(range(6))])
    cell = dst.plan_cells(plan)[0]
    curves = synthetic_coverage(lengths, block=256, max_k=64, seed=1)
    start = [5] * 6
    stop = [64] * 6
    lo = dst.predict(cost, lengths, cell, start)
    prev_doc, prev_uni = None, None
    for T in np.linspace(lo * 0.9, lo * 4, 25):
        doc = dst.align_documents(cost, lengths, cell, curves, start, stop, T)
        uni = dst.align_uniform(cost, lengths, cell, start, T, 5, 64)
        assert dst.predict(cost, lengths, cell, doc) <= T or doc == start
        if prev_doc is not None:
            assert all(a >= b for a, b in zip(doc, prev_doc)) and uni >= prev_uni
        prev_doc, prev_uni = doc, uni


# ------------------------------------------------------------ planners on random batches

CASE = dict(preset="sparsebalance-h200:qwen2.5-3b", dp=2, pp=4, mbs=2, gbs=16)


def case_cost():
    return load_preset(CASE["preset"], pp=CASE["pp"])


def case_batches(steps, dist="chatqa2", seed=0):
    src = synthetic_lengths(dist, seed)
    out = []
    for step in range(steps):
        lengths = list(itertools.islice(src, CASE["gbs"]))
        out.append((lengths, synthetic_coverage(lengths, block=256, max_k=64, seed=step)))
    return out


VARIANTS = [dict(batching=b, dst=d) for b in ("none", "sab", "lbb") for d in (False, True)]


def make(kind, **opts):
    cls = JaxsbPipelinePlanner if kind == "jaxsb" else SparseBalancePlanner
    return cls(case_cost(), CASE["dp"], mbs=CASE["mbs"], **opts)


@pytest.mark.parametrize("kind,opts", [("sparsebalance", v) for v in VARIANTS] + [("jaxsb", {})])
def test_budget_planner_properties(kind, opts):
    cost = case_cost()
    planner = make(kind, **opts)
    for lengths, curves in case_batches(4, seed=3):
        plan = planner.solve(lengths, coverage=curves).plan
        assert sorted(i for m in range(len(plan.template.microbatches)) for g in range(CASE["dp"])
                      for i in plan.sequences_of(m, g)[0]) == list(range(len(plan.lengths)))  # each placed once
        assert plan.document_lengths() == tuple(lengths)  # every document whole, or tiled by its parts
        assert all(1 <= k <= 64 for k in plan.budgets)
        part_curves = [curves[plan.document_of(i)] for i in range(len(plan.lengths))]
        assert max(coverage_drop(c, 32, k) for c, k in zip(part_curves, plan.budgets)) <= 0.1 + 1e-12
        base = plan.with_budgets([32] * len(plan.lengths))
        before, after = cost.group_times_ms(base), cost.group_times_ms(plan)
        if kind == "jaxsb" or opts["dst"]:
            # the straggler never gets slower; jaxsb's raises spend idle time only
            assert max(map(max, after)) <= max(map(max, before)) + 1e-9
        if kind == "jaxsb":
            assert cost.plan_time_ms(plan) <= cost.plan_time_ms(base) + 1e-9
        if kind == "sparsebalance":
            assert all(len(plan.sequences_of(m, g)[0]) == CASE["mbs"] for m in range(4) for g in range(2))
        if kind == "sparsebalance" and not opts["dst"]:
            assert plan.budgets == (32,) * len(lengths)


def test_same_input_same_plan():
    for kind, opts in [("sparsebalance", dict(batching="sab", dst=True)), ("jaxsb", {})]:
        runs = []
        for _ in range(2):
            planner = make(kind, **opts)
            runs.append([planner.solve(lengths, coverage=c).plan for lengths, c in case_batches(3)])
        assert runs[0] == runs[1]


def test_jaxsb_never_slower_than_sparsebalance_or_its_base_budget_plan():
    cost = case_cost()
    sb, jx, jx_base = make("sparsebalance"), make("jaxsb"), make("jaxsb", budgets="base")
    for lengths, curves in case_batches(6, seed=7):
        t_sb = cost.plan_time_ms(sb.solve(lengths, coverage=curves).plan)
        sol = jx.solve(lengths, coverage=curves)
        t_jx = cost.plan_time_ms(sol.plan)
        t_base = cost.plan_time_ms(jx_base.solve(lengths, coverage=curves).plan)
        assert t_jx <= t_sb + 1e-9 and t_jx <= t_base + 1e-9
        assert sol.info.lower_bound_ms <= t_jx + 1e-9


def test_balanced_partition_respects_capacity():
    w = [9, 8, 7, 1, 1, 1]
    bins = balanced_partition(w, 3, capacity=2)
    assert sorted(map(len, bins)) == [2, 2, 2] and sorted(i for b in bins for i in b) == list(range(6))
    assert sorted(sum(w[i] for i in b) for b in bins) == [8, 9, 10]


def test_planner_errors_are_clear():
    cost = case_cost()
    with pytest.raises(ValueError, match="must be a multiple of dp 2 x mbs 2"):
        SparseBalancePlanner(cost, 2, mbs=2).solve([1000] * 6, coverage=[linear_curve(4)] * 6)
    with pytest.raises(ValueError, match="needs one coverage curve per sequence"):
        SparseBalancePlanner(cost, 2, mbs=2).solve([1000] * 8)
    with pytest.raises(ValueError, match="batching must be one of"):
        SparseBalancePlanner(cost, 2, batching="random")
    with pytest.raises(ValueError, match="use a sparsebalance-h200 preset"):
        SparseBalancePlanner(load_preset("flexsp-a100:gpt-7b"), 8)
    from jaxsb.planner.registry import make_planner

    with pytest.raises(ValueError, match="plans sequence-parallel groups"):
        make_planner("static", cost, 2)
    assert isinstance(make_planner("jaxsb", cost, 2, mbs=2), JaxsbPipelinePlanner)


def test_flexsp_setting_jaxsb_dst_keeps_floors_and_never_loses_to_itself():
    """jaxsb's SP-group planner with budgets="dst" on a small FlexSP-profile batch."""
    from jaxsb.planner.joint import JaxsbPlanner

    cost = load_preset("flexsp-a100:gpt-7b", num_devices=8, max_len=64000, block=256)
    rng = np.random.default_rng(5)
    lengths = [int(-(-x // 16) * 16) for x in np.minimum(rng.lognormal(math.log(3000), 1.2, 24), 40000)]
    curves = synthetic_coverage(lengths, block=256, max_k=64, seed=2)
    planner = JaxsbPlanner(cost, 8, budgets="dst")
    sol = planner.solve(lengths, coverage=curves)
    plan = sol.plan
    assert all(1 <= k <= 64 for k in plan.budgets)
    assert max(coverage_drop(c, 32, k) for c, k in zip(curves, plan.budgets)) <= 0.1 + 1e-12
    at_base = JaxsbPlanner(cost, 8, budgets="base").solve(lengths).plan
    assert cost.plan_time_ms(plan) <= cost.plan_time_ms(at_base) + 1e-9
    assert sol.info.lower_bound_ms <= cost.plan_time_ms(plan) + 1e-9
    with pytest.raises(ValueError, match="needs one coverage curve"):
        JaxsbPlanner(cost, 8, budgets="dst").solve(lengths)


SP_PLANNERS = [("static", {}), ("batch-adaptive", {}), ("flexsp", dict(time_limit_s=0.5)),
               ("skrull", {}), ("jaxsb", {})]


@pytest.mark.parametrize("kind,opts", SP_PLANNERS, ids=[k for k, _ in SP_PLANNERS])
@pytest.mark.parametrize("scheme", ["ring", "ulysses"])
def test_every_layout_planner_takes_sab_weights_and_dst(kind, opts, scheme, monkeypatch):
    """budgets="dst" for every sequence-parallel planner (jaxsb.planner.budgeting): each layout
    is planned at SAB's estimates (the base budget on the first step, the history's moving
    average after), DST keeps every document within its floor and the budgets in
    [1, max_blocks], each sequence is placed once, the plan is executable, and the first step
    is never slower than the same planner's plan at the base budget (DST only cuts, and raises
    into idle time)."""
    from jaxsb.plan import Runnable
    from jaxsb.planner.registry import make_planner

    cost = load_preset("flexsp-a100:gpt-7b", num_devices=8, max_len=64000, block=256)
    runnable = Runnable(sparse_block=256, kv_heads=8)
    opts = dict(opts, scheme=scheme, runnable=runnable)
    planner = make_planner(kind, cost, 8, budgets="dst", base_budget=16, max_blocks=40, **opts)
    at_base = make_planner(kind, cost, 8, budgets="base", base_budget=16, **opts)
    assert planner.uses_coverage and not at_base.uses_coverage
    laid_out_at = []
    layout = type(planner)._solve
    monkeypatch.setattr(type(planner), "_solve", lambda self, n, b: laid_out_at.append(list(b)) or layout(self, n, b))
    rng = np.random.default_rng(11)
    for step in range(3):
        lengths = [int(-(-x // 256) * 256) for x in np.minimum(rng.lognormal(math.log(3000), 1.2, 24), 40000)]
        curves = synthetic_coverage(lengths, block=256, max_k=64, seed=step)
        laid_out_at.clear()
        want_estimate = [planner.budgeting.history.predict(n) for n in lengths]
        sol = planner.solve(lengths, coverage=curves)
        plan = sol.plan
        assert laid_out_at[0] == want_estimate and len(laid_out_at) == 2  # round 0 at SAB's estimate, round 1
        if step == 0:
            assert want_estimate == [16] * len(lengths)
            t_base = cost.plan_time_ms(at_base.solve(lengths).plan)
            assert cost.plan_time_ms(plan) <= t_base + 1e-9, kind
        else:
            assert want_estimate != [16] * len(lengths), "the history's estimate is not what the layout got"
        placed = sorted(i for m, mb in enumerate(plan.template.microbatches) for g in range(len(mb.groups))
                        for part in (plan.sequences_of(m, g)[0], *plan.sequences_of(m, g)[1].values()) for i in part)
        assert placed == list(range(len(lengths)))
        assert all(1 <= k <= 40 for k in plan.budgets)
        assert max(coverage_drop(c, 16, k) for c, k in zip(curves, plan.budgets)) <= 0.1 + 1e-12
        assert runnable.problem(plan.template) is None
        assert plan.predicted_ms == pytest.approx(cost.plan_time_ms(plan))
        if kind == "jaxsb":  # its bound at the floors holds for any budgets DST may choose
            assert sol.info.lower_bound_ms <= cost.plan_time_ms(plan) + 1e-9
        else:  # a layout's own bound holds for its budgets only: none is reported under DST
            assert sol.info.lower_bound_ms is None
        # One group per micro-batch (static's 8|8|...) has no cell to wait for, so DST may keep
        # every budget: move the history by hand so that the next layout's estimate differs.
        planner.budgeting.history.update(lengths, [max(1, k // 2) for k in plan.budgets])


def test_budget_options_are_checked_for_every_planner():
    from jaxsb.planner.registry import make_planner

    cost = load_preset("flexsp-a100:gpt-7b", num_devices=8, max_len=64000, block=256)
    for kind, _ in SP_PLANNERS:
        with pytest.raises(ValueError, match=f"{kind}: budgets must be"):
            make_planner(kind, cost, 8, budgets="dense")
        with pytest.raises(ValueError, match="coverage_drop 1.0 must lie in"):
            make_planner(kind, cost, 8, budgets="dst", coverage_drop=1.0)
        with pytest.raises(ValueError, match="base budget 50 must lie in"):
            make_planner(kind, cost, 8, budgets="dst", base_budget=50, max_blocks=40)
        with pytest.raises(ValueError, match="needs one coverage curve"):
            make_planner(kind, cost, 8, budgets="dst").solve([1024, 2048])


# ------------------------------------------------------------------------------ the simulator


def test_simulator_table_i_and_json(tmp_path, capsys):
    from jaxsb import simulate as cli

    out = tmp_path / "sb.json"
    rc = cli.main(["--preset", "sparsebalance-h200:qwen2.5-3b", "--dp", "2", "--pp", "4", "--mbs", "2",
                   "--global-batch", "16", "--dist", "chatqa2", "--coverage", "synthetic", "--table-i",
                   "--steps", "3", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for row in ("baseline", "+DST", "+SAB", "+LBB", "+SAB+DST", "+LBB+DST", "jaxsb"):
        assert f"\n{row} " in text
    data = json.loads(out.read_text())
    assert list(data["planners"]) == ["baseline", "+DST", "+SAB", "+LBB", "+SAB+DST", "+LBB+DST", "jaxsb"]
    cost = case_cost()
    for name, r in data["planners"].items():
        assert r["reference"] == "baseline"
        for s in r["steps"]:
            times = [[g["time_ms"] for g in mb["groups"]] for mb in s["microbatches"]]
            assert s["imbalance"] == pytest.approx(imbalance(times), rel=1e-3)
            seqs = s["sequences"]
            assert len(seqs) == 16
            for q in seqs:  # per document; a split one also lists its parts, which tile it
                assert set(q) - {"parts"} == {"length", "base_budget", "budget", "coverage_drop"}
                parts = q.get("parts", [dict(start=0, length=q["length"], coverage_drop=q["coverage_drop"])])
                assert [x["start"] for x in parts] == list(itertools.accumulate([0] + [x["length"] for x in parts[:-1]]))
                assert sum(x["length"] for x in parts) == q["length"]
                assert q["coverage_drop"] == max(x["coverage_drop"] for x in parts)
            assert max(q["coverage_drop"] for q in seqs) <= 0.1 + 1e-9
            assert s["modeled_ms"] == pytest.approx(cost.combine_ms(times), rel=1e-3)
    assert data["planners"]["jaxsb"]["total_ms"] <= data["planners"]["+SAB+DST"]["total_ms"] + 1e-6


def test_simulator_flag_errors(capsys):
    from jaxsb import simulate as cli

    base = ["--preset", "sparsebalance-h200:qwen2.5-3b", "--dist", "chatqa2", "--steps", "1", "--global-batch", "16"]
    assert cli.main(base + ["--cp", "2"]) == 2
    assert "no context parallelism" in capsys.readouterr().err
    assert cli.main(base + ["--table-i"]) == 2
    assert "need --coverage" in capsys.readouterr().err
    assert cli.main(["--preset", "flexsp-a100:gpt-7b", "--pp", "4", "--dist", "long-tail", "--steps", "1"]) == 2
    assert "only the sparsebalance-h200 presets" in capsys.readouterr().err
    assert cli.main(base + ["--planner", "static", "--coverage", "synthetic"]) == 2
    assert "plans sequence-parallel groups" in capsys.readouterr().err


def test_simulator_flexsp_benchmark_with_budgets(capsys):
    from jaxsb import simulate as cli

    rc = cli.main(["--preset", "flexsp-a100:gpt-7b", "--preset-option", "block=256", "--devices", "8",
                   "--global-batch", "32", "--max-len", "64000", "--steps", "2", "--dist", "long-tail",
                   "--planner", "jaxsb", "--planner", "jaxsb-base=jaxsb", "--planner-option", "jaxsb-base.budgets=base",
                   "--planner", "jaxsb-dst=jaxsb", "--planner-option", "jaxsb-dst.budgets=dst", "--coverage", "synthetic"])
    text = capsys.readouterr().out
    assert rc == 0 and "jaxsb-dst" in text and "jaxsb-base" in text


def test_coverage_history_bins_and_unmeasured_lengths():
    from jaxsb.planner.coverage import CoverageHistory

    h = CoverageHistory(base=3, max_k=4)
    sums = np.zeros((24, 4))
    blocks = np.zeros(24)
    sums[10] = [2 * 0.5, 2 * 0.8, 2 * 0.9, 2 * 1.0]  # two blocks of 1024..2047-token documents
    blocks[10] = 2
    h.update(sums, blocks)
    got = h.curves_for([1500, 100])
    np.testing.assert_allclose(got[0], [0.5, 0.8, 0.9, 1.0])
    np.testing.assert_allclose(got[1], [0, 0, 1, 1])  # unmeasured: no cut below the base
    assert k_min(got[1], 3, 0.5) == 3 and h.measured([1500, 100]) == [True, False]
    sums[10] = [2 * 0.3, 2 * 0.6, 2 * 0.9, 2 * 1.0]
    h.update(sums, blocks)
    np.testing.assert_allclose(h.curves_for([2000])[0], [0.4, 0.7, 0.9, 1.0])  # momentum 0.5


def test_length_bin_sums_against_numpy():
    import jax.numpy as jnp

    from jaxsb.models.router import LENGTH_BINS, length_bin_sums

    rng = np.random.default_rng(0)
    curves = np.sort(rng.random((2, 5, 3)), axis=-1)
    tokens = np.array([[5, 5, 300, 300, 0], [1000, 1000, 1000, 7, 7]], np.float32)
    real = tokens > 0
    sums, blocks = length_bin_sums(jnp.asarray(curves), jnp.asarray(tokens), jnp.asarray(real), 4)
    want = np.zeros((LENGTH_BINS, 4))
    want_blocks = np.zeros(LENGTH_BINS)
    for b, n in np.ndindex(2, 5):
        if real[b, n]:
            i = int(np.floor(np.log2(tokens[b, n])))
            want[i] += np.concatenate([curves[b, n], [1.0]])
            want_blocks[i] += 1
    np.testing.assert_allclose(np.asarray(sums), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(blocks), want_blocks)
