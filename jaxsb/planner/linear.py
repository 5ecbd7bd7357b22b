"""The cost model seen as additive per sequence, and the plan building the MILP and joint
planners share.

`LinearCost` reads per-sequence time and memory off a CostModel's `group_time_ms` /
`group_memory_mb` for each allowed degree (group cost = base(d) + sum of per-sequence costs);
`simple_lower_bound` is a valid bound on any plan under that model; `specs_from_groups` and
`finish_plan` turn (degree, sequence ids) groups into a priced Plan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from jaxsb.plan import GroupSpec, Plan, PlanError, build_plan, ulysses_runs
from jaxsb.planner.base import pow2_degrees

_EPS_MB = 1e-6  # memory slack kept below the limit against float round-off


# --------------------------------------------------------------------- linearised cost model


class LinearCost:
    """A CostModel seen as additive per sequence, for one device count and scheme.

    group time(d, seqs) = base_time[d] + sum_i time(s_i, d), group memory(d, seqs) =
    base_mem[d] + sum_i mem(s_i, d), read off the cost model with small groups. Exact for
    FlexSP's and any additive model. For others (Skrull's piecewise-linear collectives, say) a
    sequence's time is its marginal cost next to a background sequence B_d of half what a group
    of degree d holds — the slope at realistic group sizes — and its memory its cost alone
    (conservative when memory rounds up per group); the final `plan_time_ms` is exact."""

    REF = 128

    def __init__(self, cost, num_devices: int, scheme: str = "ulysses", degrees: Sequence[int] | None = None):
        self.cost = cost
        self.num_devices = int(num_devices)
        self.scheme = scheme
        self.degrees = tuple(degrees) if degrees else pow2_degrees(num_devices)
        self.limit = float(cost.memory_limit_mb) - _EPS_MB
        r = self.REF
        self.base_mem = np.array([2 * self._gm(d, [r]) - self._gm(d, [r, r]) for d in self.degrees])
        self.background = []
        for j, d in enumerate(self.degrees):
            per_token = (self._gm(d, [r]) - self.base_mem[j]) / r
            room = (self.limit - self.base_mem[j]) / per_token if per_token > 0 else 4096.0 * d
            self.background.append(int(max(r, room / 2) // r * r))
        bg = [self._gt(d, [b]) for d, b in zip(self.degrees, self.background)]
        self._bg_time = np.array(bg)
        self.base_time = np.array([2 * t - self._gt(d, [b, b]) for d, b, t in zip(self.degrees, self.background, bg)])
        self._cache: dict = {}

    def scheme_of(self, d: int) -> str:
        return "local" if d == 1 else self.scheme

    def _gt(self, d, lengths, budgets=None):
        return float(self.cost.group_time_ms(d, list(lengths), scheme=self.scheme_of(d), budgets=budgets))

    def _gm(self, d, lengths):
        return float(self.cost.group_memory_mb(d, list(lengths)))

    def _marginal(self, d, bg, length, budget):
        """Time `length` adds to a group of degree d holding the background sequence bg."""
        if budget is None:
            return self._gt(d, [bg, length]) - self._bg_time[self.degrees.index(d)]
        k = int(budget)  # the background with the same budget: its part cancels for additive models
        return self._gt(d, [bg, length], [k, k]) - self._gt(d, [bg], [k])

    def row(self, length: int, budget=None) -> tuple[np.ndarray, np.ndarray]:
        """(time, memory) of one sequence at each degree."""
        key = (int(length), None if budget is None else int(budget))
        hit = self._cache.get(key)
        if hit is None:
            t = np.array([self._marginal(d, bg, length, budget) for d, bg in zip(self.degrees, self.background)])
            m = np.array([self._gm(d, [length]) for d in self.degrees]) - self.base_mem
            if len(self._cache) > 200_000:
                self._cache.clear()
            hit = self._cache[key] = (t, m)
        return hit

    def tables(self, lengths: Sequence[int], budgets=None) -> tuple[np.ndarray, np.ndarray]:
        """[n, degrees] per-sequence time and memory."""
        n = len(lengths)
        t = np.empty((n, len(self.degrees)))
        m = np.empty((n, len(self.degrees)))
        for i, s in enumerate(lengths):
            t[i], m[i] = self.row(s, None if budgets is None else budgets[i])
        return t, m

    def fits(self, mem: np.ndarray) -> np.ndarray:
        """[n, degrees] bool: the sequence alone fits a group of that degree."""
        return self.base_mem[None, :] + mem <= self.limit

    def token_capacity(self, j: int) -> float:
        """Tokens a group of degree index j holds (memory), from the reference sequence."""
        per_token = self.row(self.REF)[1][j] / self.REF
        return (self.limit - self.base_mem[j]) / per_token if per_token > 0 else math.inf

    def check_fits(self, lengths: Sequence[int], fits: np.ndarray) -> None:
        """PlanError naming the first sequence that fits no group, even one of all devices."""
        bad = np.flatnonzero(~fits.any(axis=1))
        if len(bad):
            i = int(bad[0])
            j = len(self.degrees) - 1
            d = self.degrees[j]
            raise PlanError(
                f"sequence {i} of length {lengths[i]} does not fit in memory even sharded over {d} devices "
                f"(the largest group of {self.num_devices}): capacity {int(self.token_capacity(j))} tokens "
                f"per sequence at degree {d} (memory limit {self.cost.memory_limit_mb:.0f} MB per device, "
                f"{self._gm(d, [lengths[i]]):.0f} MB needed)"
                + (f"; {len(bad) - 1} more sequences too long" if len(bad) > 1 else ""))


# ------------------------------------------------------------------------ plan building


def specs_from_groups(groups, lin: LinearCost, scheme: str) -> list[GroupSpec]:
    """Groups [(degree index, ids)] -> GroupSpecs, largest degree first (power-of-2 groups then
    start at multiples of their size), ids in input order."""
    groups = sorted(groups, key=lambda g: (-lin.degrees[g[0]], min(g[1])))
    return [GroupSpec(lin.degrees[j], "local" if lin.degrees[j] == 1 else scheme, tuple(sorted(ids)))
            for j, ids in groups]


def linear_span(groups, T: np.ndarray, lin: LinearCost) -> float:
    return max((lin.base_time[j] + T[ids, j].sum() for j, ids in groups if ids), default=0.0)


def executable_specs(specs: list[GroupSpec], runnable, num_devices: int) -> list[GroupSpec]:
    """One micro-batch's groups as the executor runs them (`runnable` None: as planned, for the
    simulator): ulysses groups it cannot run (`ulysses_runs`, over the groups and the idle
    degree-1 groups build_plan adds) become ring groups, the executor's scheme for uneven groups."""
    if runnable is None or not any(s.scheme == "ulysses" and s.degree > 1 for s in specs):
        return specs
    if ulysses_runs([s.degree for s in specs], runnable, num_devices):
        return specs
    return [dataclasses.replace(s, scheme="ring") if s.degree > 1 else s for s in specs]


def finish_plan(cost, num_devices, mbs_specs, lengths, budgets, align, name, runnable=None) -> Plan:
    """The priced Plan of per-micro-batch GroupSpecs, in schemes the executor runs (`runnable`)."""
    mbs_specs = [executable_specs(list(specs), runnable, num_devices) for specs in mbs_specs]
    plan = build_plan(num_devices, mbs_specs, lengths, budgets=budgets, align=align, planner=name)
    return dataclasses.replace(plan, predicted_ms=float(cost.plan_time_ms(plan)))


def least_per_sequence(T: np.ndarray, Mm: np.ndarray, fits: np.ndarray, lin: LinearCost):
    """Per sequence, over the degrees it fits: least device-time (time x degree), least memory
    units (memory per device x degree) and least time alone in a group (its overhead in)."""
    deg = np.asarray(lin.degrees, dtype=np.float64)
    work = np.where(fits, T * deg[None, :], np.inf).min(axis=1)
    units = np.where(fits, Mm * deg[None, :], np.inf).min(axis=1)
    alone = np.where(fits, T + lin.base_time[None, :], np.inf).min(axis=1)
    return work, units, alone


def simple_lower_bound(T: np.ndarray, Mm: np.ndarray, fits: np.ndarray, lin: LinearCost, lengths,
                       parts: bool = False):
    """A valid lower bound on any plan's time (under the additive model): with M micro-batches,
    each costs at least the smallest per-group overhead, and all of them together at least the
    least device-time of every sequence spread over N devices, or the longest sequence's least
    time; M is at least what memory allows."""
    n_dev = lin.num_devices
    if len(T) == 0:
        return 0.0
    least_work, least_units, _ = least_per_sequence(T, Mm, fits, lin)
    work = least_work.sum()
    longest = np.where(fits, T, np.inf).min(axis=1).max()
    mem_units = least_units.sum()
    per_mb = float((lin.limit - lin.base_mem.min()) * n_dev)  # memory units one micro-batch holds
    m_min = max(1, int(math.ceil(mem_units / per_mb - 1e-9))) if per_mb > 0 else 1
    overhead = float(lin.base_time.min())
    if parts:  # (fewest micro-batches, time beyond the per-micro-batch overheads)
        return m_min, float(max(work / n_dev, longest))
    return float(m_min * overhead + max(work / n_dev, longest))
