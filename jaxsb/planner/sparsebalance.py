"""Planners for SparseBalance's setting (DP x PP pipelines, MoBA budgets): the paper's method
and jaxsb's, which chooses the layout and the budgets together.

Both plan for a `PipelineCost` (jaxsb.planner.pipeline_cost): the Plan's devices are the DP
ranks, micro-batch slot m holds one degree-1 group per rank. Both are stateful across steps:
they keep, per length bin (log2 of the sequence's block count), a moving average of the
budgets finally chosen (`BudgetHistory`, SAB's k~(L); momentum 0.5, our choice: the paper does
not give one) and update it after each plan. Budgets are planned from coverage curves
(`solve(lengths, coverage=curves)`), one per sequence.

`SparseBalancePlanner` (the paper, `../shared/notes/sparsebalance.md`): the global batch of
gbs sequences is split into dp ranks x gbs / (mbs * dp) micro-batches of exactly mbs
sequences:

* batching `none` (the baseline): in data order, rank-major;
* `sab`: a balanced partition by W = predict(L, k~(L)), first across the ranks, then into each
  rank's micro-batches (largest W first, to the lightest bin with room);
* `lbb` (length-based batching): the same partition by length;

then DST (`dst=True`, jaxsb.planner.dst.tune with one k per micro-batch, the anchor over all
micro-batches, stragglers cut within the floor, the others raised to the anchor).

`JaxsbPipelinePlanner`: the same number of micro-batches per rank (the same 1F1B schedule),
but any number of sequences per micro-batch within the memory of the in-flight micro-batches,
budgets per document, raises only into idle time. It alternates layout and budgets: the
layout balances the predicted times at a budget estimate (longest first to the lightest
micro-batch, then moves and swaps that shorten the slowest one; micro-batches go to ranks
largest first to the rank with the least work), DST (per document, raises into idle time
only) re-chooses budgets for that layout, and the next round lays out again at those budgets.
Round 0 lays out at the base budget, round 1 at the history's estimate, later rounds at the
previous round's budgets. The fastest plan (then the most coverage) among its rounds and
SparseBalance's own SAB + DST plan (a SparseBalancePlanner with its own history, run beside
it) wins, so jaxsb is never slower than sparsebalance or than its own layout at the base
budget. Its lower bound: `pp_lower_bound_ms` at every sequence's floor.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxsb.plan import GroupSpec, Part, PlanError, build_plan
from jaxsb.planner.base import PlannerBase, check_options
from jaxsb.planner.budgeting import BudgetHistory, check_budget_settings
from jaxsb.planner.coverage import coverage_at
from jaxsb.planner.dst import floors, raise_into_idle, tune
from jaxsb.planner.pipeline_cost import check_pipeline_sizes, pp_lower_bound_ms

BATCHINGS = ("none", "sab", "lbb")


def balanced_partition(weights: Sequence[float], bins: int, capacity: int | None = None,
                       items: Sequence[int] | None = None) -> list[list[int]]:
    """Largest weight first to the lightest bin with room (at most `capacity` items)."""
    items = list(range(len(weights))) if items is None else list(items)
    out: list[list[int]] = [[] for _ in range(bins)]
    load = [0.0] * bins
    for i in sorted(items, key=lambda i: (-weights[i], i)):
        open_bins = [b for b in range(bins) if capacity is None or len(out[b]) < capacity]
        b = min(open_bins, key=lambda b: (load[b], b))
        out[b].append(i)
        load[b] += weights[i]
    return out


def _pipeline_plan(dp: int, ranks: Sequence[Sequence[Sequence[int]]], lengths, budgets, name: str, parts=None):
    """ranks[r][m] = sequence ids of rank r's m-th micro-batch -> Plan (slot m, group r)."""
    n_mb = max(len(r) for r in ranks)
    mbs = [[GroupSpec(1, "local", tuple(ranks[r][m]) if m < len(ranks[r]) else ()) for r in range(dp)]
           for m in range(n_mb)]
    return build_plan(dp, mbs, lengths, budgets=budgets, planner=name, parts=parts)


class _PipelinePlanner(PlannerBase):
    uses_coverage = True

    def __init__(self, cost, num_devices: int, *, mbs: int = 1, global_batch: int | None = None,
                 coverage_drop: float = 0.1, anchor: str = "mean", base_budget: int | None = None,
                 max_blocks: int | None = None, history_momentum: float = 0.5, **options):
        if getattr(cost, "setting", "") != "pipeline":
            raise ValueError(f"{self.name}: plans DP x PP pipelines; use a sparsebalance-h200 preset "
                             f"(cost model {getattr(cost, 'name', cost)!r} plans sequence-parallel groups)")
        self.cost, self.dp, self.mbs, self.global_batch = cost, int(num_devices), int(mbs), global_batch
        self.p, self.anchor = float(coverage_drop), anchor
        self.base = int(base_budget or cost.base_budget)
        self.max_blocks = int(max_blocks or 2 * self.base)
        check_budget_settings(self.name, self.base, self.max_blocks, self.p, anchor)
        self.history = BudgetHistory(self.base, cost.block, history_momentum)
        self._more_options(options)
        check_options(self.name, options)

    def _more_options(self, options: dict) -> None:
        pass

    def _sizes(self, lengths) -> int:
        gbs = len(lengths)
        if self.global_batch is not None and gbs != self.global_batch:
            raise PlanError(f"{self.name}: planned for a global batch of {self.global_batch}, got {gbs} sequences")
        return check_pipeline_sizes(self.name, gbs, self.dp, self.mbs)

    def _curves(self, lengths, coverage):
        if coverage is None or len(coverage) != len(lengths):
            raise ValueError(f"{self.name}: needs one coverage curve per sequence "
                             f"({len(lengths)} sequences, got {None if coverage is None else len(coverage)})")
        return coverage

    def _weights(self, lengths, budgets) -> list[float]:
        return [self.cost.sequence_ms(n, k) for n, k in zip(lengths, budgets)]

    def _tuned(self, plan, curves, per_document: bool, raise_to: str):
        res = tune(self.cost, plan, curves, base=self.base, p=self.p, anchor=self.anchor,
                   max_blocks=self.max_blocks, per_document=per_document, raise_to=raise_to)
        return plan.with_budgets(res.budgets), res

    def _finish(self, plan, lengths, curves, fields: dict):
        """Updates the history with each document's budget; the lower bound (pp_lower_bound_ms)."""
        self.history.update(lengths, document_budgets(plan))
        floor_ms = [self.cost.sequence_ms(n, k) for n, k in zip(lengths, floors(curves, self.base, self.p))]
        n_mb = len(plan.template.microbatches)
        fields.setdefault("lower_bound_ms", pp_lower_bound_ms(self.cost, floor_ms, self.dp, n_mb))
        return plan, fields


class SparseBalancePlanner(_PipelinePlanner):
    name = "sparsebalance"

    def _more_options(self, options):
        self.batching = options.pop("batching", "sab")
        self.dst = bool(options.pop("dst", True))
        if self.batching not in BATCHINGS:
            raise ValueError(f"{self.name}: batching must be one of {BATCHINGS}, got {self.batching!r}")

    def layout(self, lengths) -> list[list[list[int]]]:
        """ranks[r][m]: sequence ids, mbs per micro-batch (module docstring)."""
        n_mb = self._sizes(lengths)
        per_rank = self.mbs * n_mb
        if self.batching == "none":
            return [[list(range(r * per_rank + m * self.mbs, r * per_rank + (m + 1) * self.mbs))
                     for m in range(n_mb)] for r in range(self.dp)]
        if self.batching == "sab":
            w = self._weights(lengths, [self.history.predict(n) for n in lengths])
        else:
            w = [float(n) for n in lengths]
        ranks = balanced_partition(w, self.dp, per_rank)
        return [balanced_partition(w, n_mb, self.mbs, items=ids) for ids in ranks]

    def _solve(self, lengths, budgets, coverage=None):
        curves = self._curves(lengths, coverage)
        plan = _pipeline_plan(self.dp, self.layout(lengths), lengths, [self.base] * len(lengths), self.name)
        fields = dict(batching=self.batching, dst=self.dst)
        if self.dst:
            plan, res = self._tuned(plan, curves, per_document=False, raise_to="anchor")
            fields.update(anchor_ms=res.anchors_ms[0], cut=res.cut, raised=res.raised, at_floor=res.at_floor)
        return self._finish(plan, lengths, curves, fields)


class JaxsbPipelinePlanner(_PipelinePlanner):
    name = "jaxsb"

    def _more_options(self, options):
        self.rounds = max(1, int(options.pop("rounds", 3)))
        self.split = bool(options.pop("split", True))
        self.budgets_mode = options.pop("budgets", "dst")
        if self.budgets_mode not in ("dst", "base"):
            raise ValueError(f"{self.name}: budgets must be 'dst' or 'base', got {self.budgets_mode!r}")
        self._sparsebalance = SparseBalancePlanner(self.cost, self.dp, mbs=self.mbs, coverage_drop=self.p,
                                                   anchor=self.anchor, base_budget=self.base,
                                                   max_blocks=self.max_blocks)

    def layout(self, lengths, budgets) -> list[list[list[int]]]:
        """Balanced micro-batches of any size at these budgets, then micro-batches to ranks."""
        n_mb = self._sizes(lengths)
        cells = self.dp * n_mb
        w = self._weights(lengths, budgets)
        cap = self.cost.micro_batch_token_capacity(in_flight=min(self.cost.pp, n_mb))
        groups = _balance(w, lengths, cells, cap)
        load = [sum(w[i] for i in g) for g in groups]
        order = balanced_partition(load, self.dp, n_mb)
        return [[groups[j] for j in sorted(order[r], key=lambda j: -load[j])] for r in range(self.dp)]

    def split_layout(self, lengths, budgets) -> tuple[list[list[list[int]]], list[int], list[Part]]:
        """Seq1F1B-style: documents to ranks by predicted time (largest first to the lightest
        rank), then each rank's documents, longest first, as one stream cut into its micro-batches
        at equal predicted time — a cut inside a document splits it at a block boundary, so a
        document's parts follow each other on its rank. Returns (ranks[r][m] = part ids, part
        lengths, parts)."""
        n_mb = self._sizes(lengths)
        w = self._weights(lengths, budgets)
        ranks, part_lengths, parts = [], [], []
        for docs in balanced_partition(w, self.dp):
            docs = sorted(docs, key=lambda d: (-w[d], d))
            slots: list[list[int]] = [[] for _ in range(n_mb)]
            target, done, m = sum(w[d] for d in docs) / n_mb, 0.0, 0
            for d in docs:
                start = 0
                while start < lengths[d]:
                    cut = lengths[d]
                    if m < n_mb - 1:  # where this slot's share of the stream ends inside the document
                        cut = self._cut(lengths[d], budgets[d], start, (m + 1) * target - done, target)
                    if start and cut == start:  # a document's next part takes at least a block: no gap
                        cut = min(start + self.cost.block, lengths[d])
                    if cut > start:
                        slots[m].append(len(parts))
                        parts.append(Part(d, start))
                        part_lengths.append(cut - start)
                        done += self.cost.part_ms(lengths[d], start, cut - start, budgets[d])
                    if cut < lengths[d] or (m < n_mb - 1 and done >= (m + 1) * target - 0.02 * target):
                        m = min(m + 1, n_mb - 1)
                    start = cut
            ranks.append(slots)
        return ranks, part_lengths, parts

    def _cut(self, doc_length: int, budget: int, start: int, room_ms: float, target: float) -> int:
        """The block boundary in (start, doc_length] where the part from `start` best fills
        `room_ms`; the document's end when the rest fits, or is within 2% of a slot of it."""
        cost, block = self.cost, self.cost.block
        rest = cost.part_ms(doc_length, start, doc_length - start, budget)
        if rest <= room_ms + 0.02 * target:
            return doc_length
        if room_ms <= 0.02 * target:
            return start
        lo, hi = start // block, -(-doc_length // block)  # blocks; the part [start, b * block)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if cost.part_ms(doc_length, start, mid * block - start, budget) < room_ms:
                lo = mid
            else:
                hi = mid
        under = cost.part_ms(doc_length, start, lo * block - start, budget) if lo * block > start else 0.0
        over = cost.part_ms(doc_length, start, min(hi * block, doc_length) - start, budget)
        b = lo if room_ms - under <= over - room_ms else hi
        return min(b * block, doc_length) if b * block > start else start

    def _solve(self, lengths, budgets, coverage=None):
        curves = self._curves(lengths, coverage)
        base = [self.base] * len(lengths)
        estimate = [self.history.predict(n) for n in lengths]
        if self.budgets_mode == "base":
            plan = _pipeline_plan(self.dp, self.layout(lengths, base), lengths, base, self.name)
            return self._finish(plan, lengths, curves, dict(rounds=0))
        candidates = []

        def consider(label, plan):
            candidates.append((self.cost.plan_time_ms(plan), -_mean_coverage(curves, plan), len(candidates),
                               label, dataclasses.replace(plan, planner=self.name)))

        def whole(at):  # documents whole, laid out at budgets `at`, DST from the base budget
            plan = _pipeline_plan(self.dp, self.layout(lengths, at), lengths, base, self.name)
            return self._tuned(plan, curves, per_document=True, raise_to="free")[0]

        def split(at):
            """Documents split (Seq1F1B) and laid out at budgets `at`, which the parts keep, raised
            only into idle time; None when split documents link more micro-batches than there are
            stages, or its in-flight activations exceed the memory."""
            ranks, part_lengths, parts = self.split_layout(lengths, at)
            plan = _pipeline_plan(self.dp, ranks, part_lengths, [at[p.document] for p in parts], self.name, parts)
            if self.cost.longest_chain(plan) > self.cost.pp:
                return None  # more linked micro-batches than stages: Seq1F1B's schedule is not modelled
            raised = raise_into_idle(self.cost, plan, [curves[p.document] for p in parts], max_blocks=self.max_blocks)
            plan = plan.with_budgets(raised.budgets)
            return plan if self.cost.plan_memory_mb(plan) <= self.cost.memory_limit_mb else None

        layouts = [("base", base)]  # its own plan at the base budget, tuned: never worse than that
        for r in range(self.rounds):
            label, at = layouts.pop() if layouts else (f"round {r}", estimate)
            made = [(label, whole(at))]
            if self.split:  # the whole layout's DST budgets, split: its cuts buy a shorter step
                made.append((f"{label} split", split(document_budgets(made[0][1]))))
            made = [(name, plan) for name, plan in made if plan is not None]
            for name, plan in made:
                consider(name, plan)
            estimate = document_budgets(min(candidates[-len(made):])[4])  # the next round: this round's best
        # SparseBalance's own plan (SAB + DST, with its own history): jaxsb is never slower
        consider("sparsebalance", self._sparsebalance.solve(lengths, coverage=curves).plan)
        ms, _, _, label, plan = min(candidates)
        return self._finish(plan, lengths, curves, dict(rounds=self.rounds, split=self.split, chosen=label,
                                                         candidates_ms={c[3]: round(c[0], 3) for c in candidates}))


def document_budgets(plan) -> list[int]:
    """Per document its budget: a split document's parts' budgets weighted by their tokens."""
    if plan.parts is None:
        return list(plan.budgets)
    return [max(1, int(round(sum(plan.budgets[i] * plan.lengths[i] for i in plan.parts_of(d)) / n)))
            for d, n in enumerate(plan.document_lengths())]


def _mean_coverage(curves, plan) -> float:
    """The coverage the plan's budgets keep, per document (curves: per document), weighted by tokens."""
    kept = [coverage_at(curves[plan.document_of(i)], k) * n for i, (n, k) in enumerate(zip(plan.lengths, plan.budgets))]
    return float(sum(kept) / sum(plan.lengths))


def _balance(w: Sequence[float], lengths: Sequence[int], cells: int, cap: int, max_moves: int = 200) -> list[list[int]]:
    """Sequences into `cells` groups of at most `cap` tokens, minimising the heaviest group:
    longest-processing-time first, then moves and swaps out of the heaviest group."""
    groups: list[list[int]] = [[] for _ in range(cells)]
    load, tokens = [0.0] * cells, [0] * cells

    def move(i, src, dst):
        groups[src].remove(i)
        groups[dst].append(i)
        load[src] -= w[i]
        load[dst] += w[i]
        tokens[src] -= lengths[i]
        tokens[dst] += lengths[i]
    for i in sorted(range(len(w)), key=lambda i: (-w[i], i)):
        fits = [g for g in range(cells) if tokens[g] + lengths[i] <= cap] or list(range(cells))
        g = min(fits, key=lambda g: (load[g], g))
        groups[g].append(i)
        load[g] += w[i]
        tokens[g] += lengths[i]
    for _ in range(max_moves):
        h = max(range(cells), key=lambda g: (load[g], -g))
        best = None  # (new max of the pair, h item, other group, other item or None)
        for i in groups[h]:
            for g in range(cells):
                if g == h:
                    continue
                if tokens[g] + lengths[i] <= cap:
                    pair = max(load[h] - w[i], load[g] + w[i])
                    if pair < load[h] - 1e-9 and (best is None or pair < best[0]):
                        best = (pair, i, g, None)
                for j in groups[g]:
                    if w[j] >= w[i] or tokens[g] - lengths[j] + lengths[i] > cap:
                        continue
                    if tokens[h] - lengths[i] + lengths[j] > cap:
                        continue
                    pair = max(load[h] - w[i] + w[j], load[g] + w[i] - w[j])
                    if pair < load[h] - 1e-9 and (best is None or pair < best[0]):
                        best = (pair, i, g, j)
        if best is None:
            break
        _, i, g, j = best
        move(i, h, g)
        if j is not None:
            move(j, g, h)
    return groups
