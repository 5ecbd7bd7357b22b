"""Sparse budgets around any layout planner: SAB's weights, then DST, in rounds.

A sequence-parallel planner (static, batch-adaptive, flexsp, skrull, jaxsb) lays out a step at
given per-sequence budgets: its cost model prices each sequence at its budget, so the layout
balances sparsity-aware times. `Budgeting` makes the budgets a decision for any of them:

* `budgets="base"`: every sequence at the base budget (MoBA at one fixed top-k);
* `budgets="dst"` (then `solve` takes one coverage curve per sequence): SAB + DST in rounds.
  Round 0 lays out at each sequence's budget estimate — the moving average, per length bin, of
  the budgets finally chosen on earlier steps (`BudgetHistory`, SparseBalance's k~(L); the
  base budget before any step) — so the layout balances by SAB's weights. DST
  (`jaxsb.planner.dst.tune`: per document, the anchor over each micro-batch's groups, cuts
  within every document's floor k_min(p), raises into idle time only) then chooses the
  budgets for that layout; the next round lays out again at those budgets and tunes again.
  The fastest plan of the rounds wins and its budgets update the history.

`budgets="fixed"` (the default) leaves the planner as it is: it plans at the budgets `solve`
is given. A planner's own lower bound holds for the budgets it was given, not for tuned ones:
under DST it reports the bound of `lower_bound_at(lengths, floors)` when it has that method
(jaxsb's planner), else none.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from jaxsb.planner.dst import ANCHORS, floors, tune

BUDGET_MODES = ("fixed", "base", "dst")


def check_budget_settings(name: str, base: int, max_blocks: int, p: float, anchor: str) -> None:
    """ValueError naming planner `name` and the setting when a budget setting is out of range."""
    if not 1 <= base <= max_blocks:
        raise ValueError(f"{name}: base budget {base} must lie in [1, max_blocks={max_blocks}]")
    if not 0 <= p < 1:
        raise ValueError(f"{name}: coverage_drop {p} must lie in [0, 1)")
    if anchor not in ANCHORS:
        raise ValueError(f"{name}: anchor must be one of {ANCHORS}, got {anchor!r}")


class BudgetHistory:
    """Moving average of chosen budgets per log2 block-count bin (SAB's k~(L))."""

    def __init__(self, base: int, block: int, momentum: float = 0.5):
        self.base, self.block, self.momentum = int(base), int(block), float(momentum)
        self.mean: dict[int, float] = {}

    def bin(self, length: int) -> int:
        return int(math.ceil(math.log2(max(1, -(-int(length) // self.block)))))

    def predict(self, length: int) -> int:
        return max(1, int(round(self.mean.get(self.bin(length), self.base))))

    def update(self, lengths: Sequence[int], budgets: Sequence[int]) -> None:
        seen: dict[int, list[int]] = {}
        for n, k in zip(lengths, budgets):
            seen.setdefault(self.bin(n), []).append(min(int(k), -(-int(n) // self.block)) if k > self.base else int(k))
        for b, ks in seen.items():
            old = self.mean.get(b, float(self.base))
            self.mean[b] = self.momentum * old + (1 - self.momentum) * float(np.mean(ks))


@dataclasses.dataclass
class Budgeting:
    """How a layout planner's budgets are chosen (module docstring); None means "fixed"."""

    mode: str
    base: int
    max_blocks: int
    p: float
    anchor: str
    rounds: int
    history: BudgetHistory

    @classmethod
    def from_options(cls, name: str, options: dict, cost) -> "Budgeting | None":
        """Pops the budget options (budgets, base_budget, max_blocks, coverage_drop, anchor,
        budget_rounds) from a planner's `options`; None for budgets="fixed". ValueError naming
        the planner and the option for a bad value."""
        mode = options.pop("budgets", "fixed")
        base = int(options.pop("base_budget", 32))
        max_blocks = int(options.pop("max_blocks", None) or 2 * base)
        p = float(options.pop("coverage_drop", 0.1))
        anchor = options.pop("anchor", "mean")
        rounds = int(options.pop("budget_rounds", 2))
        if mode not in BUDGET_MODES:
            raise ValueError(f"{name}: budgets must be 'fixed' (as given), 'base' or 'dst', got {mode!r}")
        if mode == "fixed":
            return None
        check_budget_settings(name, base, max_blocks, p, anchor)
        if rounds < 1:
            raise ValueError(f"{name}: budget_rounds {rounds} must be >= 1")
        return cls(mode, base, max_blocks, p, anchor, rounds, BudgetHistory(base, getattr(cost, "block", 128)))

    @property
    def uses_coverage(self) -> bool:
        return self.mode == "dst"

    def solve(self, planner, lengths: list[int], coverage) -> tuple:
        """(plan, info fields) of `planner` (its `_solve(lengths, budgets)` lays out) with the
        budgets chosen here."""
        if self.mode == "base":
            return planner._solve(lengths, [self.base] * len(lengths))
        if coverage is None or len(coverage) != len(lengths):
            raise ValueError(f"{planner.name}: budgets='dst' needs one coverage curve per sequence "
                             f"({len(lengths)} sequences, got {None if coverage is None else len(coverage)})")
        cost = planner.cost
        estimate = [self.history.predict(n) for n in lengths]
        best = None
        for r in range(self.rounds):
            plan, fields = planner._solve(lengths, estimate)
            res = tune(cost, plan, coverage, base=self.base, p=self.p, anchor=self.anchor,
                       max_blocks=self.max_blocks, per_document=True, raise_to="free")
            plan = plan.with_budgets(res.budgets)
            plan = dataclasses.replace(plan, predicted_ms=cost.plan_time_ms(plan))
            if best is None or plan.predicted_ms < best[0].predicted_ms - 1e-9:
                best = (plan, fields, r)
            estimate = list(res.budgets)
        plan, fields, r = best
        self.history.update(lengths, plan.budgets)
        fields = dict(fields, predicted_ms=plan.predicted_ms, budget_round=r)
        fields.pop("lower_bound_ms", None)  # the layout's bound holds for its own budgets only
        bound = getattr(planner, "lower_bound_at", None)
        if bound is not None:  # no budget goes below its floor
            fields["lower_bound_ms"] = bound(lengths, floors(coverage, self.base, self.p))
        return plan, fields
