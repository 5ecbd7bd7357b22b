"""Static baselines: one sequence-parallel degree for the whole step (DeepSpeed-Ulysses /
Megatron style), and the best such degree chosen per batch.

Both follow the homogeneous-SP baselines of FlexSP's public solver (PKU-DAIR/Hetu-Galvatron,
branch flexsp, `solve_homo_sp_ffd_bfd_globalbatch`), so their modeled times are the published
baseline numbers:

1. sequences sorted by decreasing length (ties keep input order) are packed best-fit-decreasing
   into as many bins as needed, each bin holding at most `fill` (0.9) of what a group of d
   devices holds in memory (or the longest sequence, if that is more);
2. consecutive bins become the groups of consecutive micro-batches, N // d groups each;
3. if the last micro-batch has empty groups, each takes the first (lowest-id) sequence of the
   nearest earlier group that holds more than one sequence;
4. for d >= `even_min_degree` (16) in that case, tokens of the last micro-batch are moved from
   groups above the mean to groups below it, in id order, within the bin capacity.

A step's time is the cost model's: sum over micro-batches of the slowest group.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

from jaxsb.plan import GroupSpec, Plan, PlanError, Runnable, build_plan
from jaxsb.planner.base import (PlannerBase, check_degrees, check_longest_fits, check_options, check_scheme,
                                check_ulysses_degree, pow2_degrees, resolve_align)
from jaxsb.planner.cost import CostModel, token_capacity


def best_fit_decreasing(lengths: Sequence[int], capacity: float) -> list[list[int]]:
    """Bins of sequence ids; each sequence goes to the open bin it fills best (the least room
    left, the lowest bin of equal ones), else a new bin. Open bins are kept sorted by their room."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties in input order
    bins: list[list[int]] = []
    rooms: list[tuple[float, int]] = []  # (room left, bin), sorted
    for i in order:
        s = lengths[i]
        k = bisect.bisect_left(rooms, (s, -1))  # the least room >= s, the lowest bin first
        if k < len(rooms):
            room, b = rooms.pop(k)
            bisect.insort(rooms, (room - s, b))
            bins[b].append(i)
        else:
            if s > capacity:
                raise PlanError(f"sequence {i} of length {s} exceeds the bin capacity {capacity:.0f}")
            bisect.insort(rooms, (float(capacity) - s, len(bins)))
            bins.append([i])
    return bins


class StaticPlanner(PlannerBase):
    """One fixed SP degree (`degree`, default all devices) for every micro-batch."""

    name = "static"

    def __init__(self, cost: CostModel, num_devices: int, *, time_limit_s: float | None = None,
                 scheme: str = "ulysses", degree: int | None = None, fill: float = 0.9,
                 even_min_degree: int = 16, align: int = 1, runnable: Runnable | None = None, **options):
        self.cost = cost
        self.init_budgeting(options)
        check_options(self.name, options)
        degree = num_devices if degree is None else int(degree)
        if not 1 <= degree <= num_devices:
            raise ValueError(f"degree={degree} must be in [1, num_devices={num_devices}]")
        check_scheme(self.name, scheme)
        check_ulysses_degree(self.name, scheme, degree, runnable)
        self.runnable = runnable
        if not 0 < fill <= 1:
            raise ValueError(f"fill={fill} must be in (0, 1]")
        self.cost, self.num_devices, self.degree = cost, int(num_devices), degree
        self.scheme, self.fill, self.even_min_degree = scheme, float(fill), int(even_min_degree)
        self.align = resolve_align(runnable, align)  # buffer alignment (the sparse block size)
        self.time_limit_s = time_limit_s  # unused: the heuristic takes milliseconds

    def groups(self, lengths: Sequence[int]) -> list[list[list[int]]]:
        """Per micro-batch, per group (N // degree of them): sequence ids."""
        lengths = [int(n) for n in lengths]
        d, per_mb = self.degree, self.num_devices // self.degree
        cap = token_capacity(self.cost, d)
        if lengths and max(lengths) > cap:
            i = lengths.index(max(lengths))
            raise PlanError(f"sequence {i} of length {lengths[i]} does not fit a group of degree {d}: "
                            f"it holds {cap} tokens (use a larger degree)")
        if not lengths:
            return []
        bin_cap = max(cap * self.fill, max(lengths))
        bins = best_fit_decreasing(lengths, bin_cap)
        n_mb = -(-len(bins) // per_mb)
        empty = n_mb * per_mb - len(bins)
        bins += [[] for _ in range(empty)]
        first_empty, last_mb = len(bins) - empty, (n_mb - 1) * per_mb
        for e in range(first_empty, len(bins)):
            j = next((j for j in range(first_empty - 1, -1, -1) if len(bins[j]) > 1), None)
            if j is None:
                break  # fewer sequences than groups: leave the group empty
            k = min(bins[j])
            bins[j].remove(k)
            bins[e].append(k)
        if empty and d >= self.even_min_degree:
            self._even_out(bins[last_mb:], lengths, bin_cap)
        return [bins[m * per_mb:(m + 1) * per_mb] for m in range(n_mb)]

    @staticmethod
    def _even_out(groups: list[list[int]], lengths: list[int], bin_cap: float) -> None:
        """Moves sequences of one micro-batch from groups above the mean token count to later
        groups below it (FlexSP's even distribution of the last micro-batch)."""
        tok = [sum(lengths[k] for k in g) for g in groups]
        avg = sum(tok) // len(groups)
        for i in range(1, len(groups)):
            if tok[i] > avg:
                continue
            for j in range(i):
                for k in sorted(groups[j]):
                    if not (tok[i] < avg and tok[j] > avg and len(groups[j]) > 1):
                        break
                    if tok[i] + lengths[k] <= bin_cap:
                        groups[j].remove(k)
                        groups[i].append(k)
                        tok[j] -= lengths[k]
                        tok[i] += lengths[k]

    def _solve(self, lengths: list[int], budgets) -> tuple[Plan, dict]:
        check_longest_fits(self.cost, self.num_devices, lengths)
        plan = self._build(self.groups(lengths), lengths, budgets)
        return plan, dict(message=f"degree {self.degree}, {len(plan.template.microbatches)} micro-batches",
                          degree=self.degree, microbatches=len(plan.template.microbatches))

    def _build(self, mbs, lengths, budgets) -> Plan:
        specs = [[GroupSpec(self.degree, self.scheme, tuple(sorted(g))) for g in groups] for groups in mbs]
        plan = build_plan(self.num_devices, specs, lengths, budgets=budgets, align=self.align, planner=self.name)
        return dataclasses.replace(plan, predicted_ms=float(self.cost.plan_time_ms(plan)))


class BatchAdaptivePlanner(PlannerBase):
    """The best single SP degree per batch: every power-of-2 degree (but `skip_degrees`) is
    planned as StaticPlanner does, and the one with the least modeled time is kept (ties: the
    smaller degree)."""

    name = "batch-adaptive"

    def __init__(self, cost: CostModel, num_devices: int, *, time_limit_s: float | None = None,
                 scheme: str = "ulysses", degrees: Sequence[int] | None = None,
                 skip_degrees: Sequence[int] = (), fill: float = 0.9, even_min_degree: int = 16,
                 align: int = 1, runnable: Runnable | None = None, **options):
        self.cost = cost
        self.init_budgeting(options)
        check_options(self.name, options)
        check_scheme(self.name, scheme)
        degrees = pow2_degrees(num_devices) if degrees is None else degrees
        skip = set(int(s) for s in skip_degrees)
        if scheme == "ulysses" and runnable is not None:  # degrees the executor cannot run are no option
            skip |= {d for d in degrees if d > 1 and not runnable.ulysses_degree_ok(d)}
        if not [d for d in degrees if d not in skip]:
            raise ValueError("batch-adaptive: no degree left to try")
        degrees = list(check_degrees(self.name, [d for d in degrees if d not in skip], num_devices))
        self.cost, self.num_devices, self.degrees = cost, int(num_devices), degrees
        self.runnable = runnable
        self.time_limit_s = time_limit_s
        self._static = [StaticPlanner(cost, num_devices, scheme=scheme, degree=d, fill=fill,
                                      even_min_degree=even_min_degree, align=align, runnable=runnable)
                        for d in degrees]

    def _solve(self, lengths: list[int], budgets) -> tuple[Plan, dict]:
        check_longest_fits(self.cost, self.num_devices, lengths)
        best, tried = None, {}
        for planner in self._static:
            try:
                mbs = planner.groups(lengths)
            except PlanError:
                continue
            plan = planner._build(mbs, lengths, budgets)
            tried[planner.degree] = plan.predicted_ms
            if best is None or plan.predicted_ms < best.predicted_ms:
                best = plan
        if best is None:
            raise PlanError(f"batch-adaptive: no degree in {self.degrees} fits the longest sequence "
                            f"({max(lengths)} tokens; a group of {self.degrees[-1]} holds "
                            f"{token_capacity(self.cost, self.degrees[-1])})")
        best = dataclasses.replace(best, planner=self.name)
        degree = best.template.microbatches[0].groups[0].degree
        return best, dict(message=f"degree {degree} of {sorted(tried)}, {len(best.template.microbatches)} micro-batches",
                          degree=degree, microbatches=len(best.template.microbatches), tried_ms=tried)
