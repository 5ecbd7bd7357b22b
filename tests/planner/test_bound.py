"""jaxsb.planner.bound: the python-mip lower bound against the optimum found by exhaustive search
on tiny instances (never above it, equal where the relaxation is exact), against the simple
bound (never below, strictly above on a real step), and as the jaxsb planner reports it."""

from __future__ import annotations

import functools
import math
import os
import types

import numpy as np
import pytest

pytest.importorskip("mip")

from jaxsb.planner.bound import BoundOptions, CountBounds, count_bound, lower_bound  # noqa: E402
from jaxsb.planner.cost import load_preset  # noqa: E402
from jaxsb.planner.joint import JaxsbPlanner  # noqa: E402
from jaxsb.planner.linear import LinearCost, simple_lower_bound  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIKIPEDIA = os.path.join(REPO, "..", "shared", "data", "wikipedia_lens.txt")
RTOL, ATOL = TOLERANCES[("mip_bound", "float64")]


def optimum(T, Mm, fits, lin) -> float:
    """The best plan's time under the additive model, by exact subset dynamic programmes: a plan
    splits the sequences into micro-batches, each into groups of allowed degrees summing to at
    most N; a group fits when every sequence fits its degree and base_mem + its memory <= limit;
    time = sum over micro-batches of the slowest group (base_time + its sequences' times)."""
    n, degrees = len(T), lin.degrees
    members = [[i for i in range(n) if S >> i & 1] for S in range(1 << n)]

    def group_time(S, j):
        ids = members[S]
        if not all(fits[i, j] for i in ids) or lin.base_mem[j] + sum(Mm[i, j] for i in ids) > lin.limit:
            return math.inf
        return lin.base_time[j] + sum(T[i, j] for i in ids)

    def subsets_with_lowest(S):
        low, sub = S & -S, S
        while sub:
            if sub & low:
                yield sub
            sub = (sub - 1) & S

    @functools.lru_cache(maxsize=None)
    def one_microbatch(S, devices):  # least slowest-group time of S on `devices` devices
        if S == 0:
            return 0.0
        return min((max(group_time(sub, j), one_microbatch(S & ~sub, devices - d))
                    for sub in subsets_with_lowest(S) for j, d in enumerate(degrees) if d <= devices),
                   default=math.inf)

    @functools.lru_cache(maxsize=None)
    def best_plan(S):
        if S == 0:
            return 0.0
        return min((one_microbatch(sub, lin.num_devices) + best_plan(S & ~sub) for sub in subsets_with_lowest(S)),
                   default=math.inf)

    return best_plan((1 << n) - 1)


def random_instance(rng, num_devices, degrees=None):
    """Additive tables of up to 6 sequences: time falls with the degree (less than linearly),
    memory per device ~ length / degree, overheads and base memory per degree, a limit that
    forces groups. `degrees`: the allowed ones (powers of 2 up to N by default)."""
    degrees = degrees or tuple(2 ** k for k in range(int(math.log2(num_devices)) + 1))
    n, nd = int(rng.integers(1, 7)), len(degrees)
    length = rng.integers(1, 40, size=n).astype(float)
    speed = 0.7 ** np.arange(nd) * rng.uniform(0.8, 1.2, size=nd)
    T = length[:, None] * speed[None, :] * rng.uniform(0.9, 1.1, size=(n, nd))
    Mm = length[:, None] / np.array(degrees, float)[None, :] * rng.uniform(0.9, 1.1, size=(n, nd))
    lin = types.SimpleNamespace(num_devices=num_devices, degrees=degrees, base_time=rng.uniform(0.5, 5, size=nd),
                                base_mem=rng.uniform(0, 3, size=nd), limit=float(rng.uniform(15, 60)))
    return T, Mm, lin.base_mem[None, :] + Mm <= lin.limit, lin


@pytest.mark.parametrize("num_devices,seed,degrees", [(4, 0, None), (4, 1, None), (8, 2, None), (4, 3, (1, 2))])
def test_bound_never_exceeds_the_optimum(num_devices, seed, degrees):
    """Random tiny instances, also with base memory differing by degree and with no group of
    all N devices allowed (degrees 1, 2 on 4 devices)."""
    rng = np.random.default_rng(seed)
    checked = tighter = exact = 0
    while checked < 60:
        T, Mm, fits, lin = random_instance(rng, num_devices, degrees)
        if not fits.any(axis=1).all():
            continue
        opt = optimum(T, Mm, fits, lin)
        options = BoundOptions(longest=int(rng.integers(1, 5)), classes=int(rng.integers(1, 4)),
                               long_factor=float(rng.choice([0.0, 4.0])))
        bound = lower_bound(T, Mm, fits, lin, options=options)
        simple = simple_lower_bound(T, Mm, fits, lin, None)
        assert bound <= opt * (1 + RTOL) + ATOL, (T, Mm, lin, options, bound, opt)
        bounds = CountBounds(T, Mm, fits, lin, options)  # each count's MILP: never weaker than the closed form
        for M in range(bounds.m_min, bounds.m_min + 2):
            assert count_bound(T, Mm, fits, lin, M, options)[0] >= bounds.simple_at(M) * (1 - RTOL) - ATOL
        tighter += bound > simple * (1 + 1e-9)
        exact += bound >= opt * (1 - RTOL) - ATOL
        checked += 1
    # it must also be worth having: tighter than the simple bound on most instances
    assert tighter >= checked // 2 and exact >= checked // 4, (tighter, exact)


def test_bound_is_exact_when_every_sequence_needs_all_devices():
    """Sequences that fit only at degree N run one group per micro-batch: the relaxation is exact."""
    lin = types.SimpleNamespace(num_devices=4, degrees=(1, 2, 4), base_time=np.array([1.0, 1.5, 2.0]),
                                base_mem=np.zeros(3), limit=10.0)
    T = np.array([[9.0, 6.0, 4.0], [7.0, 5.0, 3.0], [5.0, 4.0, 2.5], [3.0, 2.0, 1.5]])
    Mm = np.array([[30.0, 15.0, 6.0], [30.0, 15.0, 5.0], [30.0, 15.0, 4.0], [30.0, 15.0, 3.0]])
    fits = lin.base_mem[None, :] + Mm <= lin.limit
    assert fits[:, 2].all() and not fits[:, :2].any()
    opt = optimum(T, Mm, fits, lin)  # memory: two micro-batches of one group of 4
    bound = lower_bound(T, Mm, fits, lin, options=BoundOptions(longest=4, long_factor=0.0))
    assert bound == pytest.approx(opt, rel=RTOL, abs=ATOL), (bound, opt)
    # two of them fluid: still valid, and still above the simple bound
    fluid = lower_bound(T, Mm, fits, lin, options=BoundOptions(longest=2, classes=2, long_factor=0.0))
    assert simple_lower_bound(T, Mm, fits, lin, None) < fluid <= opt * (1 + RTOL) + ATOL, (fluid, opt)
    # and a single sequence: its best degree alone
    one = lower_bound(T[:1], Mm[:1], fits[:1], lin)
    assert one == pytest.approx(optimum(T[:1], Mm[:1], fits[:1], lin), rel=RTOL, abs=ATOL)


def test_count_bound_is_infeasible_when_memory_needs_more_microbatches():
    lin = types.SimpleNamespace(num_devices=2, degrees=(1, 2), base_time=np.array([1.0, 1.0]),
                                base_mem=np.zeros(2), limit=10.0)
    T, Mm = np.array([[4.0, 3.0]] * 3), np.array([[8.0, 4.0]] * 3)  # each fills most of one device
    fits = Mm <= lin.limit
    assert count_bound(T, Mm, fits, lin, 1)[0] == math.inf  # 3 x 8 units > 2 x 10
    assert math.isfinite(count_bound(T, Mm, fits, lin, 2)[0])
    assert lower_bound(T, Mm, fits, lin) <= optimum(T, Mm, fits, lin) * (1 + RTOL) + ATOL


def test_bound_options_are_checked():
    for bad in (dict(longest=0), dict(classes=0), dict(counts=0), dict(max_nodes=0), dict(max_seconds=0),
                dict(long_factor=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BoundOptions(**bad)
    with pytest.raises(ValueError, match="bound='lp'"):
        JaxsbPlanner(load_preset("flexsp-a100:gpt-7b", num_devices=4), 4, bound="lp")


def test_jaxsb_reports_the_mip_bound_and_simple_on_request():
    cost = load_preset("flexsp-a100:gpt-7b", num_devices=8, memory_limit_gb=30)
    rng = np.random.default_rng(3)
    lengths = [int(x) for x in 128 * np.minimum(rng.lognormal(2.0, 1.4, 96).astype(int) + 1, 200)]
    mip_sol = JaxsbPlanner(cost, 8).solve(lengths)
    simple_sol = JaxsbPlanner(cost, 8, bound="simple").solve(lengths)
    lin = LinearCost(cost, 8, "ulysses")
    T, Mm = lin.tables(lengths)
    fits = lin.fits(Mm)
    simple = simple_lower_bound(T, Mm, fits, lin, lengths)
    assert simple_sol.info["lower_bound_ms"] == pytest.approx(simple)
    assert simple <= mip_sol.info["lower_bound_ms"] <= mip_sol.plan.predicted_ms * (1 + RTOL)
    assert "python-mip bound" in mip_sol.info["message"]
    # the bound is reported, it does not steer the search
    assert mip_sol.plan == simple_sol.plan
    again = JaxsbPlanner(cost, 8).solve(lengths)
    assert again.plan == mip_sol.plan and again.info["lower_bound_ms"] == mip_sol.info["lower_bound_ms"]


def test_count_bounds_memoise_and_stop_at_the_upper_bound():
    T, Mm, fits, lin = random_instance(np.random.default_rng(5), 4)
    while not fits.any(axis=1).all() or len(T) < 4:
        T, Mm, fits, lin = random_instance(np.random.default_rng(len(T) + 11), 4)
    bounds = CountBounds(T, Mm, fits, lin)
    first = bounds.at(bounds.m_min)
    assert bounds.at(bounds.m_min) == first and list(bounds.solved) == [bounds.m_min]
    low = bounds.overall(upper=bounds.simple_at(bounds.m_min))  # nothing can beat that count's simple bound
    assert low == pytest.approx(bounds.simple_at(bounds.m_min))
    assert CountBounds(T, Mm, fits, lin, use_mip=False).overall() == pytest.approx(
        simple_lower_bound(T, Mm, fits, lin, None))


@pytest.mark.skipif(not os.path.exists(WIKIPEDIA), reason=f"FlexSP's Wikipedia lengths not found at {WIKIPEDIA}")
def test_tighter_than_the_simple_bound_on_flexsps_benchmark():
    """Step 2 of FlexSP's benchmark (one 93K-token sequence beside 511 shorter ones, 64 A100s):
    memory keeps the others from all fitting beside it, which the simple bound cannot see."""
    from jaxsb.planner import simulation

    cost = load_preset("flexsp-a100:gpt-7b", **simulation.preset_options("flexsp-a100:gpt-7b", 64, 192000, []))
    batches, _, _ = simulation.make_batches(simulation.read_lengths(WIKIPEDIA), 64, 512, 192000, 2)
    lin = LinearCost(cost, 64, "ulysses")
    T, Mm = lin.tables(batches[1])
    fits = lin.fits(Mm)
    simple = simple_lower_bound(T, Mm, fits, lin, None)
    bound = lower_bound(T, Mm, fits, lin)
    plan_ms = JaxsbPlanner(cost, 64).solve(batches[1]).plan.predicted_ms
    assert simple * 1.05 < bound <= plan_ms, (simple, bound, plan_ms)
