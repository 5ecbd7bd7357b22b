"""Budgets as a pass over a layout: prediction, alignment, SparseBalance's DST and jaxsb's.

A layout *cell* is one group of one micro-batch (`plan_cells`): its degree, scheme and
sequences. For any cost model (`group_time_ms` with budgets):

* `predict(cost, lengths, cell, budgets)`: the cell's time with sequence i at budgets[i];
* `align_uniform(..., T, lo, hi)`: the largest single budget in [lo, hi] for all the cell's
  sequences whose predicted time is <= T (lo when none is) — SparseBalance's `align`;
* `align_documents(..., T, start, stop)`: per-document budgets. From `start`, budgets rise one
  block at a time along a fixed path that always takes the step with the most coverage per
  millisecond (query-block-weighted gain C_i(k+1) - C_i(k) over the step's predicted time),
  up to `stop`; the result is the longest prefix of that path whose cell time is <= T (start
  when even that is over T). The path does not depend on T, so the budgets are monotone in T.

The cells that wait for each other (`waiting_sets`): the groups of one micro-batch for the
SP-group cost models; every micro-batch of the global batch for the pipeline setting
(SparseBalance's anchor is taken over all N micro-batches).

DST (`tune`), per waiting set, from the base budget k_base and each sequence's floor
k_min(p) (jaxsb.planner.coverage):

* anchor T = phi({predict(cell, k_base)}) over the set's non-empty cells, phi in {min, mean, max};
* a straggler (predicted > T) is cut towards T, never below any of its documents' floors:
  `per_document=False` (SparseBalance: one k per micro-batch) takes the largest k <= k_base
  with predict <= T, or the cell's floor (the largest of its documents' k_min) when that is
  higher; `per_document=True` (jaxsb) walks the path above from the floors to k_base;
* the others are raised towards T (bidirectional): `raise_to="anchor"` (the paper) raises them
  up to predict <= T; `raise_to="free"` (jaxsb) raises each only as far as the cost model's
  whole-step time (`combine_ms`: 1F1B, or the sum over micro-batches of the slowest group)
  does not grow and the cell does not become slower than the set's slowest cell — idle time
  only, past the anchor when a straggler could not reach it; `raise_to="none"` keeps k_base.

Budgets stay within [1, max_blocks]. `coverage_report` gives per document its base budget,
budget and coverage drop.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Sequence

import numpy as np

from jaxsb.planner.cost import group_times_ms
from jaxsb.planner.coverage import coverage_at, coverage_drop, k_min

ANCHORS = ("min", "mean", "max")
RAISES = ("anchor", "free", "none")


@dataclasses.dataclass(frozen=True)
class Cell:
    microbatch: int
    group: int
    degree: int
    scheme: str
    sharded: tuple[int, ...]
    local: tuple[tuple[int, ...], ...]  # per rank, whole sequences (Skrull's mix); () otherwise
    spans: tuple[tuple[int, int], ...] | None = None  # split plans: per sequence (start, document length)

    @property
    def sequences(self) -> tuple[int, ...]:
        return self.sharded + tuple(i for ids in self.local for i in ids)

    def span_args(self, ids: Sequence[int] | None = None) -> dict:
        """The cost model's `spans` for these of the cell's sequences (all by default), when split."""
        if self.spans is None:
            return {}
        if ids is None:
            return {"spans": list(self.spans)}
        return {"spans": [self._span_of[i] for i in ids]}

    @functools.cached_property
    def _span_of(self) -> dict[int, tuple[int, int]]:
        return dict(zip(self.sequences, self.spans))


def plan_cells(plan) -> list[Cell]:
    out = []
    for m, mb in enumerate(plan.template.microbatches):
        for g, group in enumerate(mb.groups):
            sharded, local = plan.sequences_of(m, g)
            loc = tuple(tuple(local.get(r, ())) for r in range(group.degree)) if local else ()
            ids = tuple(sharded) + tuple(i for r in loc for i in r)
            spans = None if plan.parts is None else tuple(plan.span_of(i) for i in ids)
            out.append(Cell(m, g, group.degree, group.scheme, tuple(sharded), loc, spans))
    return out


def predict(cost, lengths: Sequence[int], cell: Cell, budgets: Sequence[int] | None) -> float:
    ks = None if budgets is None else [int(budgets[i]) for i in cell.sequences]
    return cost.group_time_ms(cell.degree, [lengths[i] for i in cell.sharded],
                              [[lengths[i] for i in ids] for ids in cell.local], scheme=cell.scheme, budgets=ks,
                              **cell.span_args())


def combine_ms(cost, times: Sequence[Sequence[float]]) -> float:
    """The whole step from per-cell times: the cost model's own rule, else the sum over
    micro-batches of the slowest group."""
    own = getattr(cost, "combine_ms", None)
    if own is not None:
        return own(times)
    return float(sum(max(row, default=0.0) for row in times))


def waiting_sets(cost, cells: Sequence[Cell]) -> list[list[int]]:
    """Indices into `cells` of the cells that wait for each other."""
    if getattr(cost, "setting", "") == "pipeline":
        return [list(range(len(cells)))]
    out: dict[int, list[int]] = {}
    for j, c in enumerate(cells):
        out.setdefault(c.microbatch, []).append(j)
    return list(out.values())


def _with(budgets: Sequence[int], ids: Sequence[int], k: int) -> list[int]:
    out = list(budgets)
    for i in ids:
        out[i] = k
    return out


def align_uniform(cost, lengths, cell: Cell, budgets: Sequence[int], T: float, lo: int, hi: int) -> int:
    """The largest k in [lo, hi] with predict(cell at k) <= T, else lo (module docstring)."""
    lo, hi = int(lo), int(hi)
    if hi <= lo or predict(cost, lengths, cell, _with(budgets, cell.sequences, lo)) > T:
        return lo
    while lo < hi:  # invariant: lo fits
        mid = (lo + hi + 1) // 2
        if predict(cost, lengths, cell, _with(budgets, cell.sequences, mid)) <= T:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _step_ms(cost, lengths, cell: Cell, i: int, k: int) -> float:
    """Predicted time added by raising sequence i of the cell from k to k + 1 blocks."""
    n = lengths[i]
    if i in cell.sharded:
        args = dict(sharded_lengths=[n], local_lengths=())
    else:
        args = dict(sharded_lengths=[], local_lengths=[[n]] + [[] for _ in range(cell.degree - 1)])
    args.update(cell.span_args([i]))
    a = cost.group_time_ms(cell.degree, scheme=cell.scheme, budgets=[k], **args)
    b = cost.group_time_ms(cell.degree, scheme=cell.scheme, budgets=[k + 1], **args)
    return max(b - a, 0.0)


def raise_path(cost, lengths, cell: Cell, curves, start: Sequence[int], stop: Sequence[int]) -> list[tuple[int, int]]:
    """The steps (sequence, new budget) from `start` to `stop`, best coverage per ms first."""
    block = getattr(cost, "block", 128)
    heap = []

    def push(i, k):
        nb = -(-lengths[i] // block)  # its query blocks; they see up to `seen` key blocks
        seen = nb if cell.spans is None else -(-(cell._span_of[i][0] + lengths[i]) // block)
        if k < min(stop[i], seen):
            gain = nb * (coverage_at(curves[i], k + 1) - coverage_at(curves[i], k))
            if gain <= 0:  # sorted masses: a step that gains nothing is followed by no gain
                return
            ms = _step_ms(cost, lengths, cell, i, k)
            heapq.heappush(heap, (-(gain / ms) if ms > 0 else -np.inf, i, k + 1))

    for i in cell.sequences:
        push(i, start[i])
    path = []
    while heap:
        _, i, k = heapq.heappop(heap)
        path.append((i, k))
        push(i, k)
    return path


def align_documents(cost, lengths, cell: Cell, curves, start: Sequence[int], stop: Sequence[int],
                    T: float) -> list[int]:
    """Per-document budgets: the longest prefix of `raise_path` with predict <= T (module docstring)."""
    budgets = list(start)
    if predict(cost, lengths, cell, budgets) > T:
        return budgets
    path = raise_path(cost, lengths, cell, curves, start, stop)

    def after(n):
        b = list(start)
        for i, k in path[:n]:
            b[i] = k
        return b

    lo, hi = 0, len(path)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if predict(cost, lengths, cell, after(mid)) <= T:
            lo = mid
        else:
            hi = mid - 1
    return after(lo)


def floors(curves, base: int, p: float) -> list[int]:
    return [k_min(c, base, p) for c in curves]


def anchor_of(times: Sequence[float], anchor: str) -> float:
    if anchor not in ANCHORS:
        raise ValueError(f"anchor must be one of {ANCHORS}, got {anchor!r}")
    return float({"min": np.min, "mean": np.mean, "max": np.max}[anchor](times))


@dataclasses.dataclass(frozen=True)
class TuneResult:
    budgets: tuple[int, ...]
    anchors_ms: tuple[float, ...]  # per waiting set
    cut: int  # cells cut towards the anchor
    raised: int  # cells whose budgets rose
    at_floor: int  # straggler cells that could not reach the anchor (kept at their floor)


def tune(cost, plan, curves, *, base: int, p: float = 0.1, anchor: str = "mean", max_blocks: int | None = None,
         per_document: bool = True, raise_to: str = "free") -> TuneResult:
    """DST over `plan`'s cells (module docstring); returns the budgets per sequence."""
    if raise_to not in RAISES:
        raise ValueError(f"raise_to must be one of {RAISES}, got {raise_to!r}")
    lengths = plan.lengths
    if len(curves) != len(lengths):
        raise ValueError(f"{len(lengths)} sequences but {len(curves)} coverage curves")
    max_blocks = int(max_blocks or 2 * base)
    if not 1 <= base <= max_blocks:
        raise ValueError(f"base budget {base} must lie in [1, max_blocks={max_blocks}]")
    floor = floors(curves, base, p)
    budgets = [base] * len(lengths)
    cells = plan_cells(plan)
    base_times = [predict(cost, lengths, c, budgets) for c in cells]
    anchors, cut, raised, at_floor, others, members_of = [], 0, 0, 0, [], {}
    for members in waiting_sets(cost, cells):
        members_of.update({j: members for j in members})
        busy = [j for j in members if cells[j].sequences]
        if not busy:
            anchors.append(0.0)
            continue
        T = anchor_of([base_times[j] for j in busy], anchor)
        anchors.append(T)
        for j in busy:
            c = cells[j]
            if base_times[j] > T:
                cut += 1
                if per_document:
                    new = align_documents(cost, lengths, c, curves, _floor_start(budgets, c, floor), budgets, T)
                else:
                    cell_floor = max(floor[i] for i in c.sequences)
                    k = align_uniform(cost, lengths, c, budgets, T, 1, base)
                    new = _with(budgets, c.sequences, max(k, cell_floor))
                at_floor += predict(cost, lengths, c, new) > T
                for i in c.sequences:
                    budgets[i] = new[i]
            else:
                others.append((j, T))
    others.sort(key=lambda jt: base_times[jt[0]])  # the most idle first
    if raise_to == "anchor":
        stop = [max_blocks] * len(lengths)
        for j, T in others:
            c, before = cells[j], list(budgets)
            if per_document:
                new = align_documents(cost, lengths, c, curves, budgets, stop, T)
            else:
                new = _with(budgets, c.sequences, align_uniform(cost, lengths, c, budgets, T, base, max_blocks))
            for i in c.sequences:
                budgets[i] = new[i]
            raised += budgets != before
    elif raise_to == "free":
        budgets, raised = _raise_into_idle(cost, plan, cells, [j for j, _ in others], members_of, curves, budgets,
                                           max_blocks, per_document)
    return TuneResult(tuple(budgets), tuple(anchors), cut, raised, at_floor)


def raise_into_idle(cost, plan, curves, *, max_blocks: int, per_document: bool = True) -> TuneResult:
    """From the plan's own budgets, no cut: every cell, the lightest first, raised into idle time
    only (`raise_to="free"` of `tune`). For a layout whose budgets another pass already chose."""
    cells = plan_cells(plan)
    members_of = {j: members for members in waiting_sets(cost, cells) for j in members}
    times = group_times_ms(cost, plan)
    order = sorted((j for j, c in enumerate(cells) if c.sequences), key=lambda j: times[cells[j].microbatch][cells[j].group])
    budgets, raised = _raise_into_idle(cost, plan, cells, order, members_of, curves, list(plan.budgets), max_blocks,
                                       per_document)
    return TuneResult(tuple(budgets), (), 0, raised, 0)


def _raise_into_idle(cost, plan, cells, order, members_of, curves, budgets, max_blocks, per_document):
    """Raise the cells in `order` one after another, each as far as the step does not grow and
    it does not pass the slowest cell it waits with; (budgets, cells raised)."""
    stop = [max_blocks] * len(budgets)
    times = group_times_ms(cost, plan.with_budgets(budgets))
    raised = 0
    for j in order:
        c, before = cells[j], list(budgets)
        slowest = max(times[cells[i].microbatch][cells[i].group] for i in members_of[j])
        new = _free_raise(cost, plan, cells, j, curves, budgets, stop, slowest, times, per_document)
        for i in c.sequences:
            budgets[i] = new[i]
        raised += budgets != before
        times[c.microbatch][c.group] = predict(cost, plan.lengths, c, budgets)
    return budgets, raised


def _floor_start(budgets, cell: Cell, floor) -> list[int]:
    out = list(budgets)
    for i in cell.sequences:
        out[i] = floor[i]
    return out


def _free_raise(cost, plan, cells, j, curves, budgets, stop, T, times, per_document) -> list[int]:
    """Raise cell j up to time T as far as the whole step's time does not grow."""
    c = cells[j]
    total = combine_ms(cost, times)

    def fits(b):
        t = predict(cost, plan.lengths, c, b)
        if t > T + 1e-9:
            return False
        trial = [row[:] for row in times]
        trial[c.microbatch][c.group] = t
        return combine_ms(cost, trial) <= total + 1e-9

    if per_document:
        path = raise_path(cost, plan.lengths, c, curves, budgets, stop)
        lo, hi = 0, len(path)
        after = lambda n: _apply(budgets, path[:n])  # noqa: E731
    else:
        base = max(budgets[i] for i in c.sequences)
        lo, hi = 0, max(stop[i] for i in c.sequences) - base
        after = lambda n: _with(budgets, c.sequences, base + n)  # noqa: E731
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(after(mid)):
            lo = mid
        else:
            hi = mid - 1
    return after(lo)


def _apply(budgets, steps) -> list[int]:
    out = list(budgets)
    for i, k in steps:
        out[i] = k
    return out


def coverage_report(plan, curves, base: int) -> tuple[list[dict], dict]:
    """Per document (`curves`: one per document) its length, base budget, budget and coverage
    drop C(base) - C(budget), and their summary (min / mean / max budget, mean and min coverage,
    the largest drop). A split document's parts each keep the document's curve: its record
    gives the parts' budgets weighted by their tokens, its largest part drop, and `parts`
    (start, length, budget, drop each)."""
    records, ks, cov = [], [], []
    for d, n in enumerate(plan.document_lengths()):
        ids = plan.parts_of(d)
        drops = [coverage_drop(curves[d], base, plan.budgets[i]) for i in ids]
        k = sum(plan.budgets[i] * plan.lengths[i] for i in ids) / n
        ks.append(k)
        cov.append(sum(coverage_at(curves[d], plan.budgets[i]) * plan.lengths[i] for i in ids) / n)
        rec = dict(length=n, base_budget=base, budget=plan.budgets[ids[0]] if len(ids) == 1 else round(k, 3),
                   coverage_drop=round(max(drops), 6))
        if len(ids) > 1:
            rec["parts"] = [dict(start=plan.span_of(i)[0], length=plan.lengths[i], budget=plan.budgets[i],
                                  coverage_drop=round(x, 6)) for i, x in zip(ids, drops)]
        records.append(rec)
    summary = dict(budget_min=int(min(plan.budgets)), budget_mean=float(np.mean(ks)), budget_max=int(max(plan.budgets)),
                   coverage_mean=float(np.mean(cov)), coverage_min=float(np.min(cov)),
                   max_drop=max(coverage_drop(curves[plan.document_of(i)], base, k) for i, k in enumerate(plan.budgets)))
    return records, summary
