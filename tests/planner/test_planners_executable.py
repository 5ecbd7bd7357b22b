"""Planners told what the executor runs return only plans it runs: every planner x scheme x
dense / sparse attention on random batches, with the shipped CPU cost model the trainer uses."""

import numpy as np
import pytest

from jaxsb.plan import Runnable, executable_problem, validate
from jaxsb.planner.registry import PLANNERS, make_planner, planner_options
from jaxsb.training.planning import load_cost_model

N = 8
RUNNABLE = {"dense": Runnable(0, kv_heads=2), "sparse": Runnable(128, kv_heads=2)}


def _batches(seed: int, count: int = 4) -> list[list[int]]:
    """Long-tailed lengths as the trainer sees them: many short pieces, a few up to max_len."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(4, 40))
        lengths = np.minimum(rng.lognormal(5.5, 1.2, n).astype(int) + 2, 4096)
        out.append([int(x) for x in lengths])
    return out


@pytest.mark.parametrize("attention", sorted(RUNNABLE))
@pytest.mark.parametrize("scheme", ["ring", "ulysses"])
@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_returns_plans_the_executor_runs(name, scheme, attention):
    runnable = RUNNABLE[attention]
    cost = load_cost_model("cpu", N, 4096)
    for cp in ((N, 4) if name == "skrull" else (None,)):
        try:
            planner = make_planner(name, cost, N, **planner_options(
                name, N, time_limit_s=1.0, scheme=scheme, degree=N, cp=cp, runnable=runnable))
        except ValueError as e:  # a setting the executor cannot run is refused up front, by name
            assert scheme == "ulysses" and attention == "sparse" and "kv_heads=2" in str(e), e
            continue
        for lengths in _batches(seed=len(name) + (cp or 0)):
            budgets = [4] * len(lengths)
            solution = planner.solve(lengths, budgets)  # PlanError here = a refused plan, not a fallback
            plan = solution.plan
            validate(plan, runnable.align)
            assert runnable.problem(plan.template) is None, plan.summary()
            assert executable_problem(plan.template) is None
            assert not solution.info.fell_back, solution.info.message


def test_refused_plan_is_an_error_not_a_fallback():
    """A plan the executor cannot run (uneven ulysses groups from a planner that was not told)
    is rejected by PlannerBase.solve with the reason."""
    from jaxsb.plan import GroupSpec, PlanError, build_plan
    from jaxsb.planner.base import PlannerBase

    class Uneven(PlannerBase):
        name = "uneven"
        runnable = RUNNABLE["dense"]

        def _solve(self, lengths, budgets):
            return build_plan(N, [[GroupSpec(4, "ulysses", (0,)), GroupSpec(2, "ulysses", (1,))]], lengths), {}

    with pytest.raises(PlanError, match="uneven: planned .* ulysses needs groups of one degree"):
        Uneven().solve([100, 50])


def test_ulysses_groups_beside_idle_devices_become_ring():
    """A micro-batch of ulysses groups that leaves devices idle gets degree-1 groups beside them:
    not one degree, so the executor runs it as ring (counted with the idle groups)."""
    from jaxsb.plan import GroupSpec
    from jaxsb.planner.linear import finish_plan

    cost = load_cost_model("cpu", N, 4096)
    specs = [[GroupSpec(4, "ulysses", (0,))], [GroupSpec(4, "ulysses", (1,)), GroupSpec(4, "ulysses", (2,))]]
    plan = finish_plan(cost, N, specs, [512, 256, 256], None, 1, "test", RUNNABLE["dense"])
    assert [mb.scheme for mb in plan.template.microbatches] == ["ring", "ulysses"]
    assert RUNNABLE["dense"].problem(plan.template) is None
    as_planned = finish_plan(cost, N, specs, [512, 256, 256], None, 1, "test")  # the simulator: no runnable
    assert [mb.scheme for mb in as_planned.template.microbatches] == ["ulysses", "ulysses"]
