"""What every planner shares: the protocol, the typed result, degrees, schemes and fit checks.

A planner is built as `Planner(cost, num_devices, **options)` and answers
`solve(lengths, budgets) -> Solution`: the Plan and a `SolveInfo` (solve time, whether it fell
back, a message, a lower bound where it has one, and its own figures in `details`).
`plan(...)` is `solve(...).plan`.

Every sequence-parallel planner takes the budget options of `jaxsb.planner.budgeting`
(`budgets="fixed"|"base"|"dst"`, `base_budget`, `max_blocks`, `coverage_drop`, `anchor`,
`budget_rounds`): with "dst" its layouts are planned at SAB's budget estimates and DST chooses
the budgets (`Budgeting.solve`), the same for every planner.

Planners used for training are told what the executor can run (`runnable`, a
`jaxsb.plan.Runnable`): they plan within it (alignment, allowed ulysses degrees) and
`PlannerBase.solve` checks every plan against it, so a plan that reaches the trainer is one
the executor runs; a planner that cannot comply raises PlanError, never a silent swap.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Protocol, Sequence

from jaxsb.plan import Plan, PlanError, Runnable
from jaxsb.planner.budgeting import Budgeting
from jaxsb.planner.cost import token_capacity

GROUP_SCHEMES = ("ulysses", "ring")  # how a planner's multi-device groups attend


@dataclasses.dataclass(frozen=True)
class SolveInfo:
    """How a plan was found. `lower_bound_ms`: a valid bound on any plan's modelled time, or
    None; `details`: the planner's own figures (micro-batch counts tried, degrees, ...)."""

    solve_seconds: float
    message: str = ""
    fell_back: bool = False
    lower_bound_ms: float | None = None
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        """info["x"]: a field, else a detail (KeyError when neither)."""
        if key in SolveInfo.__dataclass_fields__ and key != "details":
            return getattr(self, key)
        return self.details[key]


@dataclasses.dataclass(frozen=True)
class Solution:
    plan: Plan
    info: SolveInfo


class Planner(Protocol):
    name: str

    def solve(self, lengths: Sequence[int], budgets: Sequence[int] | None = None, coverage=None) -> Solution: ...

    def plan(self, lengths: Sequence[int], budgets: Sequence[int] | None = None) -> Plan: ...


class PlannerBase:
    """Subclasses set `name` and implement `_solve(lengths, budgets) -> (plan, info fields)`;
    `solve` times it and checks the plan against `self.runnable`."""

    name = ""
    runnable: Runnable | None = None
    budgeting: Budgeting | None = None  # budgets="base"|"dst" (init_budgeting); None: as given

    def init_budgeting(self, options: dict) -> None:
        """Takes the budget options out of a constructor's `options` (jaxsb.planner.budgeting);
        call before check_options. Needs self.cost."""
        self.budgeting = Budgeting.from_options(self.name, options, self.cost)

    @property
    def uses_coverage(self) -> bool:
        """Planners that choose budgets take coverage curves (one per sequence)."""
        return self.budgeting is not None and self.budgeting.uses_coverage

    def _solve(self, lengths: list[int], budgets) -> tuple[Plan, dict]:
        raise NotImplementedError

    def solve(self, lengths: Sequence[int], budgets: Sequence[int] | None = None, coverage=None) -> Solution:
        """`coverage`: per sequence its coverage curve C(1..K) (jaxsb.planner.coverage), for the
        planners that choose budgets (`uses_coverage`); the others ignore it."""
        t0 = time.perf_counter()
        lengths = [int(n) for n in lengths]
        if self.budgeting is not None:
            plan, fields = self.budgeting.solve(self, lengths, coverage)
        elif self.uses_coverage:  # a planner that chooses budgets itself (SparseBalance's setting)
            plan, fields = self._solve(lengths, budgets, coverage)
        else:
            plan, fields = self._solve(lengths, budgets)
        if self.runnable is not None:
            problem = self.runnable.problem(plan.template) or (
                "it splits documents into parts, and the executor runs whole documents" if plan.parts else None)
            if problem is not None:
                raise PlanError(f"{self.name}: planned {plan.template.summary()!r}, which the executor cannot "
                                f"run: {problem}")
        fields = dict(fields)
        known = {f: fields.pop(f) for f in ("message", "fell_back", "lower_bound_ms") if f in fields}
        info = SolveInfo(time.perf_counter() - t0, details=fields, **known)
        return Solution(plan, info)

    def plan(self, lengths: Sequence[int], budgets: Sequence[int] | None = None) -> Plan:
        return self.solve(lengths, budgets).plan


def resolve_align(runnable: Runnable | None, align: int) -> int:
    """The buffer alignment: the executor's when planning for it, else the `align` option."""
    if runnable is None:
        return int(align)
    if int(align) not in (1, runnable.align):
        raise ValueError(f"align={align} contradicts the executor's alignment {runnable.align}")
    return runnable.align


def pow2_degrees(num_devices: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from `smallest` up to num_devices."""
    out, d = [], 1
    while d <= num_devices:
        if d >= smallest:
            out.append(d)
        d *= 2
    return tuple(out)


def check_degrees(name: str, degrees: Sequence[int], num_devices: int) -> tuple[int, ...]:
    degs = tuple(sorted(set(int(d) for d in degrees)))
    if not degs or any(d < 1 or d > num_devices for d in degs):
        raise ValueError(f"{name}: degrees {degs} must be non-empty and lie in 1..{num_devices}")
    return degs


def check_scheme(name: str, scheme: str) -> str:
    if scheme not in GROUP_SCHEMES:
        raise ValueError(f"{name}: scheme must be one of {GROUP_SCHEMES}, got {scheme!r}")
    return scheme


def check_ulysses_degree(name: str, scheme: str, degree: int, runnable: Runnable | None) -> None:
    """ValueError when a planner of one fixed degree would plan ulysses groups the executor
    cannot run with this model."""
    if scheme == "ulysses" and degree > 1 and runnable is not None and not runnable.ulysses_degree_ok(degree):
        raise ValueError(f"{name}: the executor cannot run ulysses groups of degree {degree} with this model "
                         f"(sparse routing needs degrees dividing kv_heads={runnable.kv_heads}); use "
                         "scheme='ring' or another degree")


def check_options(name: str, options: Mapping[str, Any]) -> None:
    if options:
        raise TypeError(f"{name}: unknown options {sorted(options)}")


def check_longest_fits(cost, num_devices: int, lengths: Sequence[int]) -> None:
    """PlanError for the longest sequence when it does not fit even on all devices."""
    if not len(lengths):
        return
    cap = token_capacity(cost, num_devices)
    longest = max(lengths)
    if longest > cap:
        i = list(lengths).index(longest)
        raise PlanError(f"sequence {i} of length {longest} does not fit even on all {num_devices} devices: "
                        f"their memory ({cost.memory_limit_mb:.0f} MB each, cost model {cost.name}) holds "
                        f"{cap} tokens")
