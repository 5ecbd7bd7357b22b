"""Documents split over consecutive micro-batches (Seq1F1B) in SparseBalance's pipeline setting:
the parts' costs against the whole document, the Plan's rules for parts and who refuses
them, the in-flight memory of a split document, the raise into idle time, and the jaxsb
planner's split layouts on the case study (issue 12, Eq. 11 <= 1.10)."""

import itertools

import pytest

from jaxsb.plan import GroupSpec, Part, PlanError, build_plan
from jaxsb.planner import dst
from jaxsb.planner.cost import load_preset
from jaxsb.planner.coverage import coverage_drop, synthetic_coverage
from jaxsb.planner.pipeline_cost import block_pairs, block_pairs_until, imbalance
from jaxsb.planner.simulation import synthetic_lengths
from jaxsb.planner.sparsebalance import JaxsbPipelinePlanner, SparseBalancePlanner, document_budgets


def cost3b(pp=4):
    return load_preset("sparsebalance-h200:qwen2.5-3b", pp=pp)


def one_rank(parts_per_slot, lengths, parts, budgets=None):
    """A 1-rank plan: slot m holds the sequence ids parts_per_slot[m]."""
    return build_plan(1, [[GroupSpec(1, "local", tuple(ids))] for ids in parts_per_slot], lengths,
                      budgets=budgets, parts=parts)


# ---------------------------------------------------------------------------- part costs


@pytest.mark.parametrize("budget", [None, 4, 32, 200])
def test_parts_add_up_to_the_document(budget):
    cost = cost3b()
    doc = 30000
    for cuts in ([], [256], [4096, 8192], [512 * 7, 256 * 61, 256 * 100]):
        bounds = [0] + cuts + [doc]
        total = sum(cost.part_ms(doc, a, b - a, budget) for a, b in zip(bounds, bounds[1:]))
        assert total == pytest.approx(cost.sequence_ms(doc, budget), rel=1e-12)
    # the pairs of the first nb query blocks, brute force
    for nb, k in itertools.product(range(0, 40, 3), (None, 1, 5, 64)):
        assert block_pairs_until(nb, k) == sum(i + 1 if k is None else min(i + 1, k) for i in range(nb))
    assert block_pairs(doc, budget, 256) == block_pairs_until(-(-doc // 256), budget)


def test_a_later_part_sees_the_earlier_keys():
    cost = cost3b()
    first, second = cost.part_ms(16384, 0, 8192, None), cost.part_ms(16384, 8192, 8192, None)
    assert second > first  # dense: its queries attend to all 16K keys
    # at a budget of k blocks every query block past the k-th costs the same
    assert cost.part_ms(32768, 16384, 8192, 8) == pytest.approx(cost.part_ms(32768, 24576, 8192, 8), rel=1e-12)
    with pytest.raises(ValueError, match="must start on a 256-token block"):
        cost.part_ms(16384, 100, 8000, None)
    with pytest.raises(ValueError, match="lie inside it"):
        cost.part_ms(16384, 8192, 9000, None)
    # a group's time with spans is its parts' times plus the send of their tokens
    t = cost.group_time_ms(1, [8192, 1000], budgets=[8, 8], spans=[(8192, 16384), (0, 1000)])
    send = 2 * 9192 * cost.hidden * 2 / (cost.nvlink_gbs * 1e9 / 1e3)
    assert t == pytest.approx(cost.part_ms(16384, 8192, 8192, 8) + cost.sequence_ms(1000, 8) + send, rel=1e-12)


# ---------------------------------------------------------------------------- plan rules


def test_a_split_plan_and_its_rules():
    # document 0 (10000 tokens) in slots 0 and 1, document 1 whole in slot 1
    plan = one_rank([[0], [1, 2]], [4096, 5904, 700], [Part(0, 0), Part(0, 4096), Part(1, 0)])
    assert plan.document_lengths() == (10000, 700)
    assert [plan.document_of(i) for i in range(3)] == [0, 0, 1]
    assert plan.span_of(1) == (4096, 10000) and plan.span_of(2) == (0, 700)
    bad = {
        "starts at token 4000, expected 4096": ([[0], [1, 2]], [4096, 5904, 700], [Part(0, 0), Part(0, 4000), Part(1, 0)]),
        "expected micro-batch 1 on device 0": ([[0], [2], [1]], [4096, 5904, 700], [Part(0, 0), Part(0, 4096), Part(1, 0)]),
        "document 1 has no part": ([[0], [1, 2]], [4096, 5904, 700], [Part(0, 0), Part(0, 4096), Part(2, 0)]),
        "3 sequences but 2 parts": ([[0], [1, 2]], [4096, 5904, 700], [Part(0, 0), Part(0, 4096)]),
    }
    for message, args in bad.items():
        with pytest.raises(PlanError, match=message):
            one_rank(*args)
    with pytest.raises(PlanError, match="expected micro-batch 1 on device 0"):  # the next part on another rank
        build_plan(2, [[GroupSpec(1, "local", (0,)), GroupSpec(1, "local", (2,))],
                       [GroupSpec(1, "local", ()), GroupSpec(1, "local", (1,))]], [4096, 5904, 700],
                   parts=[Part(0, 0), Part(0, 4096), Part(1, 0)])
    with pytest.raises(PlanError, match="expected micro-batch 1 on device 2"):  # same group index, other device
        build_plan(3, [[GroupSpec(2, "ring", ()), GroupSpec(1, "local", (0,))],
                       [GroupSpec(1, "local", ()), GroupSpec(1, "local", (1,)), GroupSpec(1, "local", ())]],
                   [4096, 5904], parts=[Part(0, 0), Part(0, 4096)])
    with pytest.raises(PlanError, match="part of document -1"):
        one_rank([[0], [1]], [4096, 700], [Part(0, 0), Part(-1, 0)])
    with pytest.raises(PlanError, match="degree-1 groups"):
        build_plan(2, [[GroupSpec(2, "ring", (0, 1))]], [4096, 5904], parts=[Part(0, 0), Part(0, 4096)])


def test_the_executor_and_the_wire_refuse_split_plans():
    from jaxsb.plan.layout import layout_microbatch
    from jaxsb.wire import plan_to_json, plan_to_wire

    plan = one_rank([[0], [1]], [4096, 5904], [Part(0, 0), Part(0, 4096)])
    with pytest.raises(PlanError, match="whole documents only"):
        layout_microbatch(plan, 0, [])
    with pytest.raises(PlanError, match="no wire form"):
        plan_to_wire(plan)
    assert plan_to_json(plan)["parts"] == [[0, 0], [0, 4096]]


def test_a_split_document_counts_whole_in_every_window_that_holds_a_part():
    cost = load_preset("sparsebalance-h200:qwen2.5-0.5b", pp=2)
    act = 34 * 896 * 12 / 2**20  # per token: 24 layers / 2 stages
    # slots: [A0], [A1, B], [C], [D]: windows of 2 slots hold A+B (11000), B+C... A is 10000 tokens
    plan = one_rank([[0], [1, 2], [3], [4]], [4096, 5904, 1000, 3000, 500],
                    [Part(0, 0), Part(0, 4096), Part(1, 0), Part(2, 0), Part(3, 0)])
    windows = [10000 + 1000, 10000 + 1000 + 3000, 3000 + 500]
    assert cost.plan_memory_mb(plan) == pytest.approx(cost.stage_states_mb() + max(windows) * act, rel=1e-12)
    # its time: the 1F1B formula over the parts' micro-batches, each part at its own cost
    times = cost.group_times_ms(plan)
    assert times[0][0] == pytest.approx(cost.group_time_ms(1, [4096], spans=[(0, 10000)]), rel=1e-12)
    assert cost.plan_time_ms(plan) == pytest.approx(sum(t[0] for t in times) + max(t[0] for t in times), rel=1e-12)


def test_chains_of_split_documents_longer_than_the_pipeline_are_refused_and_held_in_memory():
    cost = load_preset("sparsebalance-h200:qwen2.5-0.5b", pp=2)
    act = 34 * 896 * 12 / 2**20
    # document 0 in slots 0-1, document 1 in slots 1-2: one chain of 3 > pp = 2
    plan = one_rank([[0], [1, 2], [3], [4]], [2048, 2048, 1024, 1024, 700],
                    [Part(0, 0), Part(0, 2048), Part(1, 0), Part(1, 1024), Part(2, 0)])
    assert cost.chains(plan) == [[0, 0, 0, 3]] and cost.longest_chain(plan) == 3
    with pytest.raises(ValueError, match="link 3 micro-batches of one rank, more than pp=2"):
        cost.plan_time_ms(plan)
    with pytest.raises(ValueError, match="more than pp=2"):
        cost.plan_memory_mb(plan)
    # chains within pp: a window holds every micro-batch of the chains it touches
    plan = one_rank([[0], [1, 2], [3], [4]], [2048, 2048, 1000, 3000, 500],
                    [Part(0, 0), Part(0, 2048), Part(1, 0), Part(2, 0), Part(2, 3000)])
    assert cost.chains(plan) == [[0, 0, 2, 2]]
    # windows [0,1] -> slots 0-1 (4096 + 1000), [1,2] -> all four (4096 + 1000 + 3500), [2,3] -> 2-3 (3500)
    assert cost.plan_memory_mb(plan) == pytest.approx(cost.stage_states_mb() + 8596 * act, rel=1e-12)
    assert one_rank([[0], [1]], [100, 200], None) and cost.longest_chain(one_rank([[0], [1]], [100, 200], None)) == 1


def random_batch(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    dp, mbs, n_mb = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(1, 7))
    return dp, mbs, [int(x) for x in np.exp(rng.uniform(np.log(10), np.log(40000), dp * mbs * n_mb))]


# a rank with less than a block of work per micro-batch: a document's next part once skipped one
TINY = [(2, 1, [1024] + [30] * 15), (4, 1, [1000] * 2 + [10] * 30)]


@pytest.mark.parametrize("dp,mbs,lengths", TINY + [random_batch(seed) for seed in range(12)])
def test_split_layouts_are_valid_plans_on_any_batch(dp, mbs, lengths):
    """Random batches, ranks and micro-batch counts, and tiny ones where a block costs more
    than a micro-batch's share: the split layout is a valid plan whose parts tile every document
    on block boundaries, and the planner returns a plan the cost model prices (chains within pp)."""
    n_mb, gbs = len(lengths) // (dp * mbs), len(lengths)
    cost = cost3b()
    curves = synthetic_coverage(lengths, block=256, max_k=64, seed=gbs)
    planner = JaxsbPipelinePlanner(cost, dp, mbs=mbs)
    ranks, part_lengths, parts = planner.split_layout(lengths, [32] * gbs)
    plan = build_plan(dp, [[GroupSpec(1, "local", tuple(ranks[r][m])) for r in range(dp)] for m in range(n_mb)],
                      part_lengths, parts=parts)  # validates: consecutive, tiled, one device
    assert plan.document_lengths() == tuple(lengths)
    assert all(p.start % 256 == 0 for p in parts)
    sol = planner.solve(lengths, coverage=curves)
    assert sol.plan.document_lengths() == tuple(lengths)
    assert cost.longest_chain(sol.plan) <= cost.pp
    assert sol.info.lower_bound_ms <= cost.plan_time_ms(sol.plan) + 1e-9
    assert cost.plan_memory_mb(sol.plan) <= cost.memory_limit_mb


# ---------------------------------------------------------------------------- raise into idle


def test_raise_into_idle_spends_only_idle_time():
    cost = cost3b()
    lengths = [24576, 8192, 4096]
    plan = build_plan(2, [[GroupSpec(1, "local", (0,)), GroupSpec(1, "local", (1, 2))]], lengths, budgets=[8, 8, 8])
    curves = synthetic_coverage(lengths, block=256, max_k=64, seed=1)
    res = dst.raise_into_idle(cost, plan, curves, max_blocks=64)
    after = plan.with_budgets(res.budgets)
    assert cost.plan_time_ms(after) <= cost.plan_time_ms(plan) + 1e-9
    assert res.budgets[0] == 8  # the slowest cell is never raised
    assert res.budgets[1] > 8 and res.raised == 1  # the idle rank buys coverage


def test_raise_into_idle_lets_a_later_part_see_its_document():
    """The 2-block tail of an 8704-token document sees 34 key blocks: raising it (on the idle
    rank) is capped by what it sees, not by its own 2 blocks."""
    cost = cost3b()
    plan = build_plan(2, [[GroupSpec(1, "local", (0,)), GroupSpec(1, "local", (2,))],
                          [GroupSpec(1, "local", (1,)), GroupSpec(1, "local", (3,))]],
                      [32768, 32768, 8192, 512], budgets=[32, 32, 4, 4],
                      parts=[Part(0, 0), Part(1, 0), Part(2, 0), Part(2, 8192)])
    curves = synthetic_coverage([32768, 32768, 8704], block=256, max_k=64, seed=3)
    res = dst.raise_into_idle(cost, plan, [curves[plan.document_of(i)] for i in range(4)], max_blocks=64)
    assert res.budgets[:2] == (32, 32)  # the busy rank is not raised
    assert 4 < res.budgets[3] <= 34  # the tail passed its own 2 blocks, up to what it sees
    assert cost.plan_time_ms(plan.with_budgets(res.budgets)) <= cost.plan_time_ms(plan) + 1e-9


# ---------------------------------------------------------------------------- the planner

CASE = dict(dp=2, mbs=2, gbs=16)


def case_batch(step, seed=0):
    src = synthetic_lengths("chatqa2", seed)
    batches = [list(itertools.islice(src, CASE["gbs"])) for _ in range(step + 1)]
    return batches[step], synthetic_coverage(batches[step], block=256, max_k=64, seed=step)


def test_split_layouts_balance_what_whole_documents_cannot():
    """Step 0 of the case study holds 7 long documents for 8 micro-batches: whole, one micro-batch
    holds only short ones (Eq. 11 ~1.38); split, every micro-batch is within 10% of the mean."""
    cost = cost3b()
    lengths, curves = case_batch(0)
    assert sum(n > 16384 for n in lengths) == 7
    whole = JaxsbPipelinePlanner(cost, CASE["dp"], mbs=CASE["mbs"], split=False).solve(lengths, coverage=curves)
    split = JaxsbPipelinePlanner(cost, CASE["dp"], mbs=CASE["mbs"]).solve(lengths, coverage=curves)
    sb = SparseBalancePlanner(cost, CASE["dp"], mbs=CASE["mbs"]).solve(lengths, coverage=curves).plan
    assert whole.plan.parts is None and split.plan.parts is not None
    t_whole, t_split = cost.plan_time_ms(whole.plan), cost.plan_time_ms(split.plan)
    assert t_split < 0.95 * t_whole and t_split < cost.plan_time_ms(sb)
    assert imbalance(cost.group_times_ms(whole.plan)) > 1.25
    assert imbalance(cost.group_times_ms(split.plan)) <= 1.10
    assert split.info.lower_bound_ms <= t_split
    plan = split.plan
    assert plan.document_lengths() == tuple(lengths)
    assert all(plan.span_of(i)[0] % 256 == 0 for i in range(len(plan.lengths)))  # cut on block boundaries
    for i, k in enumerate(plan.budgets):  # every part keeps its document's floor
        assert coverage_drop(curves[plan.document_of(i)], 32, k) <= 0.1 + 1e-12
    assert cost.plan_memory_mb(plan) <= cost.memory_limit_mb
    assert len(document_budgets(plan)) == len(lengths)


def test_split_planner_is_deterministic_and_never_slower_than_sparsebalance():
    cost = cost3b()
    runs = []
    for _ in range(2):
        planner = JaxsbPipelinePlanner(cost, CASE["dp"], mbs=CASE["mbs"])
        sb = SparseBalancePlanner(cost, CASE["dp"], mbs=CASE["mbs"])
        plans = []
        for step in range(4):
            lengths, curves = case_batch(step, seed=5)
            plan = planner.solve(lengths, coverage=curves).plan
            assert cost.plan_time_ms(plan) <= cost.plan_time_ms(sb.solve(lengths, coverage=curves).plan) + 1e-9
            plans.append(plan)
        runs.append(plans)
    assert runs[0] == runs[1]
    assert any(p.parts is not None for p in runs[0])
