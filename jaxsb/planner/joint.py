"""jaxsb's planner: joint micro-batch and group assignment, fast and deterministic.

FlexSP cuts the sorted batch into contiguous micro-batches (all the long sequences land in the
first ones) and then solves a MILP per micro-batch. Here the micro-batches are chosen jointly
with the groups: long sequences are spread over micro-batches and short ones fill around them.

For each micro-batch count M (from the fewest memory allows, a few more, stopping when the
lower bound for M is already worse than the best plan found):

1. a search over per-micro-batch time targets: bisection on one target T for all micro-batches,
   then "one heavy micro-batch" targets (the longest sequence's time at each degree, and
   1.1 / 1.25 / 1.5 / 2 x T) with the other targets bisected, and one "short heavy" target:
   the longest sequence pinned, at the smallest degree whose group ends before T, to a
   micro-batch of exactly its length (its group holds all the devices it needs at once). For
   given targets, `_Context.pack` places sequences longest first: a sequence that cannot run
   alone on one device within the smallest target (time or memory) goes to the smallest
   power-of-2 degree that holds it within a target — into an existing group of that degree
   with room (best fit), else into the slack of a bigger group where its device-time (time x
   degree) is within SAME_WORK (2%) of its own degree's, else into a new group in the
   micro-batch with the highest target, then the most free devices (when memory is so tight
   that this fails, existing groups of any degree are tried before new ones, and two groups of
   degree d may merge into one of 2d to make room);
   every device left becomes a degree-1 group, and the other sequences go longest first into
   the big groups' slack (best fit, largest degree first), else onto the least used degree-1
   group (time or memory, whichever binds) across all micro-batches. Which sequences fill the
   big groups' slack matters at cluster scale: in a group spanning nodes each token also pays
   its all-to-all over InfiniBand, a cost linear in length beside attention's quadratic one, so
   the longest of the short sequences lose the least device-time there;
2. the batch-adaptive plan (best single degree, static.py) is a candidate too, so jaxsb is never
   worse than it (unless `time_limit_s` ran out first: then it is skipped, and the SolveInfo
   says so);
3. local search on the best packing, on the additive model: the slowest group of the slowest
   micro-batch gives its longest movable sequence to the group with the most room, in any
   micro-batch, that takes it without raising that micro-batch's time (in its own micro-batch:
   staying below the giver), or else swaps it with a shorter one there, until no micro-batch
   improves or the move budget is spent.

No step depends on the wall clock until `time_limit_s` runs out (a safety net: past it every
search keeps the best packing it has, and the SolveInfo says so), so the same input gives the
same plan whenever the limit is not reached.

The result's time is the cost model's `plan_time_ms`. `lower_bound_ms` is a valid lower bound
on any plan's time under the additive model, from a small MILP per micro-batch count solved
by python-mip's CBC (jaxsb.planner.bound: the longest sequences placed exactly, the others as
memory-carrying fluid), solved after the search in at most min(time_limit_s, 2 s), so the gap
to optimal is visible. (Pruning the micro-batch counts with it was tried: a packing of M
targets may leave a micro-batch empty, so a valid prune needs the bound for up to M
micro-batches, which only reaches the best plan when that plan is already optimal.)
`bound="simple"` uses the closed-form bound of linear.simple_lower_bound instead (no MILP).

Scheme: "ulysses" (default; heterogeneous all-to-all groups, as FlexSP, for the simulator) or
"ring" (what jaxsb's executor runs for groups of different degrees); with "ring", a micro-batch
whose groups all have one degree > 1 uses ulysses when the cost model says it is faster (the
executor runs ulysses for equal groups).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import time
from typing import Sequence

import numpy as np

from jaxsb.planner.base import PlannerBase, check_degrees, check_options, check_scheme, pow2_degrees, resolve_align
from jaxsb.planner.bound import CountBounds
from jaxsb.planner.linear import LinearCost, finish_plan, specs_from_groups
from jaxsb.planner.static import BatchAdaptivePlanner
from jaxsb.plan import GroupSpec, Plan, PlanError, Runnable, ulysses_runs


class _Packing:
    """Micro-batches of groups on the additive model: groups[g] = [mb, j, load, mem, ids]."""

    __slots__ = ("M", "groups", "bt")

    def __init__(self, M, groups, bt):
        self.M, self.groups, self.bt = M, groups, bt

    def spans(self) -> list[float]:
        out = [0.0] * self.M
        for mb, j, load, mem, ids in self.groups:
            if ids and load > out[mb]:
                out[mb] = load
        return out

    def total(self) -> float:
        return sum(self.spans())

    def as_groups(self):
        """Per micro-batch [(degree index, ids)], empty groups dropped, empty micro-batches dropped."""
        out = [[] for _ in range(self.M)]
        for mb, j, load, mem, ids in self.groups:
            if ids:
                out[mb].append((j, list(ids)))
        return [g for g in out if g]


BOUND_RESERVE = 0.1  # the share of time_limit_s a cut search leaves to the bound (0.2 s at 4,096 devices)


class JaxsbPlanner(PlannerBase):
    """jaxsb's joint planner (see the module docstring).

    Options: `time_limit_s` (the whole solve's limit, default 5 s: the search has fixed,
    deterministic budgets, ~0.1-0.3 s for 512 sequences on 64 devices on 2 cores; it stops
    improving BOUND_RESERVE of the limit before it, leaving the rest to the bound, and says so
    in its SolveInfo), `scheme` "ulysses" | "ring", `mb_options`
    (micro-batch counts tried, 4), `degrees` (allowed group degrees, powers of two up to N by
    default), `search_steps` (bisection steps per target, 14), `moves` (local-search move
    budget, 4000), `portfolio` (also consider the batch-adaptive plan, True), `runnable` (what
    the executor runs: its alignment; ulysses groups it cannot run become ring groups) or `align` (buffer
    alignment for build_plan, for the simulator), `bound` "mip" (default) | "simple" (the lower
    bound reported, jaxsb.planner.bound).

    Budgets: the options of jaxsb.planner.budgeting (`budgets="fixed"|"base"|"dst"`, ...), as
    for every planner; under "dst" the lower bound is taken at every sequence's floor k_min(p)
    (`lower_bound_at`)."""

    name = "jaxsb"

    def __init__(self, cost, num_devices: int, *, time_limit_s: float = 5.0, scheme: str = "ulysses",
                 mb_options: int = 4, degrees: Sequence[int] | None = None, search_steps: int = 14,
                 moves: int = 4000, portfolio: bool = True, align: int = 1, runnable: Runnable | None = None,
                 bound: str = "mip", **options):
        check_scheme(self.name, scheme)
        if bound not in ("mip", "simple"):
            raise ValueError(f"jaxsb: option bound={bound!r} must be 'mip' or 'simple'")
        self.bound = bound
        self.cost = cost
        self.init_budgeting(options)
        check_options(self.name, options)
        self.runnable = runnable
        self.num_devices = int(num_devices)
        self.time_limit_s = float(time_limit_s)
        self.scheme = scheme
        self.mb_options = max(1, int(mb_options))
        self.search_steps = int(search_steps)
        self.moves = int(moves)
        self.align = resolve_align(runnable, align)
        self.portfolio = bool(portfolio)
        degs = degrees or pow2_degrees(self.num_devices)
        self.lin = LinearCost(cost, self.num_devices, scheme, check_degrees(self.name, degs, self.num_devices))

    def lower_bound_at(self, lengths: list[int], budgets) -> float:
        """A bound on any plan with sequence i at budgets[i] or more (jaxsb.planner.bound)."""
        T, Mm = self.lin.tables(lengths, budgets)
        return self._bounds(T, Mm, self.lin.fits(Mm)).overall()

    def _bounds(self, T, Mm, fits) -> CountBounds:
        return CountBounds(T, Mm, fits, self.lin, use_mip=self.bound == "mip")

    def _solve(self, lengths: list[int], budgets) -> tuple[Plan, dict]:
        # time_limit_s bounds the whole solve: the search stops BOUND_RESERVE of it early, and
        # the bound (reported, not planned with) has what is left, at most 2 s of MILPs
        end = time.perf_counter() + self.time_limit_s
        deadline = end - BOUND_RESERVE * self.time_limit_s
        n = len(lengths)
        if n == 0:
            raise PlanError("jaxsb: empty batch")
        lin = self.lin
        T, Mm = lin.tables(lengths, budgets)
        fits = lin.fits(Mm)
        lin.check_fits(lengths, fits)
        bounds = self._bounds(T, Mm, fits)
        m_min = bounds.m_min

        ctx = _Context(lin, T, Mm, fits, deadline)
        best, tried, stopped = None, [], False
        for M in range(m_min, min(n, m_min + self.mb_options - 1) + 1):
            if best is not None and bounds.simple_at(M) >= best.total() - 1e-9:
                tried.append((M, "pruned: bound above the best"))
                break
            if time.perf_counter() > deadline and best is not None:
                stopped = True
                break
            pk = ctx.search(M, self.search_steps, beat=math.inf if best is None else best.total())
            stopped = stopped or ctx.expired()
            if pk is None:
                tried.append((M, "infeasible"))
                continue
            tried.append((M, round(pk.total(), 1)))
            if best is None or pk.total() < best.total() - 1e-9:
                best = pk
            else:
                break  # one more micro-batch made it worse: more would not help (overheads add up)
        if best is None:  # memory or device count too tight for the greedy at every count tried
            M = m_min + self.mb_options
            while best is None and M <= n:
                best = ctx.search(M, self.search_steps)
                M += 1
            if best is None:
                raise PlanError(f"jaxsb: no packing of the {n} sequences found on {self.num_devices} devices")
        baseline = None
        if self.portfolio and ctx.expired():
            tried.append(("batch-adaptive", "skipped: time limit"))
            stopped = True
        elif self.portfolio:
            baseline, degrees = self._baseline(ctx, lengths, budgets, beat=best.total())
            if len(degrees) < len(self.lin.degrees):
                tried.append(("batch-adaptive", f"degrees {degrees} only: the others cannot beat {best.total():.1f}"))
        if baseline is not None:
            tried.append(("batch-adaptive", round(baseline.total(), 1)))
            if baseline.total() < best.total() - 1e-9:
                best = baseline
        before = best.total()
        moves_done, stopped_ls = ctx.local_search(best, self.moves, deadline)
        stopped = stopped or stopped_ls
        bounds.deadline = min(time.perf_counter() + 2.0, end)
        bound = bounds.overall(upper=best.total())
        specs = [self._specs(g, lengths, budgets) for g in best.as_groups()]
        plan = finish_plan(self.cost, self.num_devices, specs, lengths, budgets, self.align, self.name,
                               self.runnable)
        return plan, dict(
            message=(f"jaxsb: {len(specs)} micro-batches (tried {tried}); local search {moves_done} moves, "
                     f"{before:.1f} -> {best.total():.1f} ms (additive model); bound {bound:.1f} ms, "
                     f"{bounds.describe()}" + ("; time limit reached, search cut short" if stopped else "")),
            lower_bound_ms=bound, microbatches=len(specs), predicted_ms=plan.predicted_ms,
            time_limit_hit=stopped)

    def _baseline(self, ctx: "_Context", lengths, budgets, beat: float = math.inf
                  ) -> tuple[_Packing | None, list[int]]:
        """The batch-adaptive plan (best single degree, static.py) as a packing, and the degrees
        it tried: a candidate, so jaxsb is never worse than it; None if it is unavailable or uses
        other degrees. Degrees whose plans cannot come below `beat` (the best packing found,
        `_Context.least_single_degree`) are not tried."""
        degrees = [d for j, d in enumerate(self.lin.degrees) if ctx.least_single_degree(j) < beat]
        if not degrees:
            return None, degrees
        try:
            plan = BatchAdaptivePlanner(self.cost, self.num_devices, scheme=self.scheme, degrees=degrees,
                                        align=self.align, runnable=self.runnable).plan(lengths, budgets)
        except ValueError:  # PlanError included: no single degree fits
            return None, degrees
        return ctx.packing_of(plan), degrees

    def _specs(self, groups, lengths, budgets) -> list[GroupSpec]:
        specs = specs_from_groups(groups, self.lin, self.scheme)
        d = max(s.degree for s in specs)
        if self.scheme == "ring" and d > 1 and ulysses_runs([s.degree for s in specs], self.runnable,
                                                             self.num_devices):
            # equal groups over all devices: the executor can run ulysses; take it if faster
            def slowest(scheme):
                return max(self.cost.group_time_ms(d, [lengths[i] for i in s.sharded], scheme=scheme,
                                                   budgets=None if budgets is None else
                                                   [int(budgets[i]) for i in s.sharded]) for s in specs)
            if slowest("ulysses") < slowest("ring"):
                specs = [dataclasses.replace(s, scheme="ulysses") for s in specs]
        return specs


class _Rooms:
    """A packing's groups per degree, sorted by the room left under their micro-batch's target,
    for `pack`'s best fit: the group with the least room left after the sequence (>= 0) that
    also has the memory, the earliest entered of equal ones (as a scan of the degree's groups in
    the order they joined it would choose). A group keeps its place in that order while it
    grows; a merged group enters anew."""

    def __init__(self, degrees: int):
        self.sorted: list[list[tuple[float, int, int]]] = [[] for _ in range(degrees)]  # (room, order, g)
        self.entry: dict[int, tuple[int, tuple[float, int, int]]] = {}  # g -> (degree index, its entry)
        self.count = 0

    def add(self, g: int, j: int, room: float) -> None:
        e = (room, self.count, g)
        self.count += 1
        self.entry[g] = (j, e)
        bisect.insort(self.sorted[j], e)

    def drop(self, g: int) -> tuple[int, tuple[float, int, int]]:
        j, e = self.entry.pop(g)
        row = self.sorted[j]
        del row[bisect.bisect_left(row, e)]
        return j, e

    def move(self, g: int, room: float) -> None:
        j, (_, order, _) = self.drop(g)
        e = (room, order, g)
        self.entry[g] = (j, e)
        bisect.insort(self.sorted[j], e)

    def best_fit(self, j: int, need: float, has_memory) -> int | None:
        row = self.sorted[j]
        best = best_slack = None
        for k in range(bisect.bisect_left(row, (need, -1, -1)), len(row)):
            room, order, g = row[k]
            slack = room - need
            if best is not None and slack > best_slack:
                break  # rooms only grow from here
            if has_memory(g) and (best is None or order < best[0]):
                best, best_slack = (order, g), slack
        return None if best is None else best[1]


class _Doubled:
    """Per group of a packing, its sequences at the next degree (twice its own): summed time and
    memory, added in the order the sequences joined, and whether all of them fit there — what
    `_merge_for` compares, kept up to date as groups grow so a merge reads arrays."""

    def __init__(self, ctx: "_Context", size: int):
        self.ctx = ctx
        self.time = np.zeros(size)
        self.mem = np.zeros(size)
        self.ok = np.zeros(size, dtype=bool)  # non-empty, every sequence fits at the next degree
        self.mb = np.zeros(size, dtype=np.intp)
        self.degree = np.full(size, -1, dtype=np.intp)  # its degree index; -1: no group (yet)
        self.joined = np.zeros(size, dtype=np.int64)  # when it joined that degree (by_deg's order)
        self.count = 0

    def start(self, g: int, mb: int, j: int, ids) -> None:
        """Group g joins degree index j in micro-batch mb with these sequences."""
        self.time[g] = self.mem[g] = 0.0
        self.ok[g] = j + 1 < self.ctx.nd and bool(ids)
        self.mb[g], self.degree[g], self.joined[g] = mb, j, self.count
        self.count += 1
        for x in ids:
            self.add(g, j, x)

    def members(self, j: int) -> np.ndarray:
        """The groups of degree index j whose sequences all fit at the next degree, in the order
        they joined it."""
        sel = np.flatnonzero((self.degree == j) & self.ok)
        return sel[np.argsort(self.joined[sel], kind="stable")]

    def add(self, g: int, j: int, x: int) -> None:
        k = j + 1
        if k < self.ctx.nd:
            self.time[g] += self.ctx.t[x][k]
            self.mem[g] += self.ctx.m[x][k]
            self.ok[g] = self.ok[g] and self.ctx.fit[x][k]

    def retire(self, g: int) -> None:
        self.ok[g] = False
        self.degree[g] = -1


class _Context:
    """Per-batch tables as Python lists (fast scalar access) and the search routines."""

    LIGHTEST = 64  # a merge among more groups than this pairs the lightest first (_best_pair)
    SAME_WORK = 0.02  # a bigger group's slack is as good as a new group within this much device-time

    def __init__(self, lin: LinearCost, T: np.ndarray, Mm: np.ndarray, fits: np.ndarray,
                 deadline: float = math.inf):
        self.lin = lin
        self.deadline = deadline  # past it, searches keep the best packing found so far
        self.N = lin.num_devices
        self.deg = list(lin.degrees)
        self.nd = len(self.deg)
        self.bt = [float(x) for x in lin.base_time]
        self.cap = [float(lin.limit - x) for x in lin.base_mem]
        self.t = T.tolist()
        self.m = Mm.tolist()
        self.fit = fits.tolist()
        n = len(self.t)
        self.n = n
        # longest first: by time alone on one device where it fits, else at its smallest degree
        key = [next((T[i, j] * lin.degrees[j] for j in range(self.nd) if fits[i, j]), 0.0) for i in range(n)]
        self.order = sorted(range(n), key=lambda i: (-key[i], i))
        self.grid = (1.1, 1.25, 1.5, 2.0)
        self.tol = 1e-3
        # least device-time of every sequence, and of the per-group overheads, for quick rejections
        degs = np.asarray(lin.degrees, dtype=np.float64)
        self.work = float(np.where(fits, T * degs[None, :], np.inf).min(axis=1).sum()) if n else 0.0
        self.bt_min = float(min(self.bt))
        self.best_single = [min((self.bt[j] + self.t[i][j] for j in range(self.nd) if self.fit[i][j]))
                            for i in range(n)]
        # per position p of `order`: the least time at each degree of order[p + 1:] (pack stops
        # looking at a degree whose groups have less room than that: no later sequence fits)
        self.position = {i: p for p, i in enumerate(self.order)}
        self.after_t = self._suffix_min(np.where(fits, T, np.inf))
        # per sequence and degree index j, the bigger degrees k whose device-time is within
        # SAME_WORK of j's (pack tries their groups' slack before a new group of degree j)
        W = np.where(fits, T * degs[None, :], np.inf)
        near = (W[:, None, :] <= (1 + self.SAME_WORK) * W[:, :, None]) & np.isfinite(W[:, :, None])
        near &= np.triu(np.ones((self.nd, self.nd), dtype=bool), 1)[None]  # [i, j, k]: k > j only
        masks = (near * (1 << np.arange(self.nd, dtype=np.int64))[None, None, :]).sum(axis=2)
        ks = {}  # bit mask -> the degree indices it holds (a few distinct masks per batch)
        self.alike = [[ks[c] if c in ks else ks.setdefault(c, tuple(k for k in range(self.nd) if c >> k & 1))
                       for c in row] for row in masks.tolist()]

    def _suffix_min(self, X: np.ndarray) -> list[list[float]]:
        if not self.n:
            return []
        ordered = X[self.order]
        mins = np.minimum.accumulate(ordered[::-1], axis=0)[::-1]
        return np.vstack([mins[1:], np.full((1, X.shape[1]), np.inf)]).tolist()

    def least_single_degree(self, j: int) -> float:
        """A floor on the total of any packing whose groups all have degree index j: its
        per-group time once per micro-batch (at least as many micro-batches as its N / d groups
        need for the sequences' memory) plus their time spread evenly over the groups."""
        groups = self.N // self.deg[j]
        if self.cap[j] <= 0:
            return math.inf
        mbs = max(1, math.ceil(sum(self.m[i][j] for i in range(self.n)) / (groups * self.cap[j])))
        return mbs * self.bt[j] + sum(self.t[i][j] for i in range(self.n)) / groups

    def packing_of(self, plan) -> _Packing | None:
        """A plan of whole-group sequences (no Skrull-local ones) as a packing under the additive
        model; None when it uses a degree the tables lack or a group over their memory."""
        index = {d: j for j, d in enumerate(self.deg)}
        groups = []
        for m, mb in enumerate(plan.template.microbatches):
            for g, grp in enumerate(mb.groups):
                sharded, local = plan.sequences_of(m, g)
                if local or grp.degree not in index:
                    return None
                j = index[grp.degree]
                if sharded:
                    load = self.bt[j] + sum(self.t[i][j] for i in sharded)
                    mem = sum(self.m[i][j] for i in sharded)
                    if mem > self.cap[j] or not all(self.fit[i][j] for i in sharded):
                        return None
                else:
                    load, mem = self.bt[j], 0.0
                groups.append([m, j, load, mem, list(sharded)])
        return _Packing(len(plan.template.microbatches), groups, self.bt)

    # ------------------------------------------------------------------------- packing
    def pack(self, caps: Sequence[float], reuse: bool = False, pin: tuple[int, int, int] | None = None
             ) -> _Packing | None:
        """Places every sequence so that each group of micro-batch b ends by caps[b] (additive
        model), or None when the greedy finds no room (see the module docstring). `reuse`: a long
        sequence prefers any existing group with room over a new group (tighter in memory).
        `pin` = (i, j, b): sequence i starts a group of degree index j in micro-batch b first."""
        passes = ((True, False), (False, True)) if reuse else ((True, True),)
        M = len(caps)
        N, deg, bt, cap, t, m, fit, alike = self.N, self.deg, self.bt, self.cap, self.t, self.m, self.fit, self.alike
        top, low = max(caps), min(caps)
        if (sum(caps) - M * self.bt_min) * N < self.work:  # not enough device-time: skip the greedy
            return None
        free = [N] * M
        groups = []
        doubled = _Doubled(self, self.n + 1)  # a group per sequence at most, and the pinned one
        by_deg = [[] for _ in range(self.nd)]
        rooms = _Rooms(self.nd)  # the same groups, by the room left under their micro-batch's target
        rest = []
        single = deg[0] == 1

        def join(g: int, i: int) -> None:  # sequence i into group g (at g's degree)
            G = groups[g]
            j = G[1]
            G[2] += t[i][j]
            G[3] += m[i][j]
            G[4].append(i)
            rooms.move(g, caps[G[0]] - G[2])
            doubled.add(g, j, i)

        def best_join(i: int, j: int) -> bool:  # sequence i into the best-fitting group of degree index j
            row, tij = rooms.sorted[j], t[i][j]
            if not row or row[-1][0] < tij:
                return False  # no group of this degree has the room (the common case: no call below)
            mij, cj = m[i][j], cap[j]
            g = rooms.best_fit(j, tij, lambda g: groups[g][3] + mij <= cj)
            if g is not None:
                join(g, i)
            return g is not None

        if pin is not None:
            i, j, b = pin
            if not fit[i][j] or bt[j] + t[i][j] > caps[b] or m[i][j] > cap[j]:
                return None
            free[b] -= deg[j]
            by_deg[j].append(0)
            groups.append([b, j, bt[j] + t[i][j], m[i][j], [i]])
            rooms.add(0, j, caps[b] - groups[0][2])
            doubled.start(0, b, j, [i])
        for i in self.order:
            if pin is not None and i == pin[0]:
                continue
            ti, mi, fi = t[i], m[i], fit[i]
            if single and fi[0] and bt[0] + ti[0] <= low:
                rest.append(i)
                continue
            placed = False
            for use_old, use_new in passes:
                for j in range(self.nd):
                    if not fi[j] or bt[j] + ti[j] > top:
                        continue
                    tij, mij = ti[j], mi[j]
                    # best fit into an existing group of this degree, or into a bigger group's slack
                    # where its device-time is about the same (degrees on one link price a token alike)
                    bigger = alike[i][j]
                    if use_old and (best_join(i, j) or (bigger and any(best_join(i, k) for k in bigger))):
                        placed = True
                        break
                    if use_new:  # a new group where most room is left under its target, then most devices
                        need, d = bt[j] + tij, deg[j]
                        mb, most = -1, None
                        for b in range(M):
                            if free[b] >= d and need <= caps[b]:
                                key = (caps[b], free[b])
                                if mb < 0 or key > most:
                                    mb, most = b, key
                        if mb >= 0:
                            free[mb] -= d
                            by_deg[j].append(len(groups))
                            rooms.add(len(groups), j, caps[mb] - need)
                            doubled.start(len(groups), mb, j, [i])
                            groups.append([mb, j, need, mij, [i]])
                            placed = True
                            break
                if placed:
                    break
            if not placed and self._merge_for(i, caps, groups, by_deg, doubled, rooms) is None:
                return None
        if rest:
            if not single:
                return None
            for mb in range(M):
                for _ in range(free[mb]):
                    by_deg[0].append(len(groups))
                    groups.append([mb, 0, bt[0], 0.0, []])
                free[mb] = 0
            # least used first, in its binding resource: key = max(time used / time allowed,
            # memory used / memory) — longest-processing-time first across micro-batches
            c0, b0 = cap[0], bt[0]
            span = [max(x - b0, 1e-9) for x in caps]
            heap = [(max((groups[g][2] - b0) / span[groups[g][0]], groups[g][3] / c0), g) for g in by_deg[0]]
            heapq.heapify(heap)
            position, after_t = self.position, self.after_t
            heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
            open_j = [j for j in range(self.nd - 1, 0, -1) if rooms.sorted[j]]
            for i in rest:
                ti, mi = t[i], m[i]
                t0, m0 = ti[0], mi[0]
                done = False
                # the slack of the big groups first, largest degree first: taken longest first,
                # it goes to the sequences that cost least device-time beyond their own there
                shut = False
                for j in open_j:
                    row = rooms.sorted[j]
                    if not row or row[-1][0] < after_t[position[i]][j]:
                        shut = True  # no group of this degree has room for any later sequence
                    if fit[i][j] and best_join(i, j):
                        done = True
                        break
                if shut:
                    open_j = [j for j in open_j if rooms.sorted[j] and
                              rooms.sorted[j][-1][0] >= after_t[position[i]][j]]
                if done:
                    continue
                popped = []  # then the least used degree-1 group (its rooms and doubled entries are
                while heap:  # not kept up to date here: nothing reads degree 1's after this point)
                    G = groups[heap[0][1]]
                    if G[2] + t0 <= caps[G[0]] and G[3] + m0 <= c0:
                        G[2] += t0
                        G[3] += m0
                        G[4].append(i)
                        heapreplace(heap, (max((G[2] - b0) / span[G[0]], G[3] / c0), heap[0][1]))
                        done = True
                        break
                    popped.append(heappop(heap))
                    if len(popped) == 4:
                        break
                for p in popped:
                    heappush(heap, p)
                if not done:
                    return None  # no group of any degree has the time and memory for it
        return _Packing(M, [G for G in groups if G[0] >= 0], bt)  # merged-away groups dropped

    def _merge_for(self, i, caps, groups, by_deg, doubled: _Doubled, rooms: _Rooms) -> tuple[int, int] | None:
        """Makes room for sequence i when no group takes it and no devices are free: two groups
        of degree d in one micro-batch become one group of degree 2d (half the memory per device
        for their sequences) that also takes i. The merge leaving the most room under the
        micro-batch's target wins (the first micro-batch, in the order its groups joined the
        degree, of equal ones); returns (the merged group, the retired one), None if none fits.
        `doubled` (each group's sequences at degree 2d) and `rooms` follow the merge."""
        t, m, cap, fit, bt, deg = self.t, self.m, self.cap, self.fit, self.bt, self.deg
        best = None
        for j in range(self.nd - 1):
            k = j + 1
            if deg[k] != 2 * deg[j] or not fit[i][k] or len(by_deg[j]) < 2:
                continue
            need_t, need_m = bt[k] + t[i][k], m[i][k]
            members = doubled.members(j)
            mbs = doubled.mb[members]
            _, first = np.unique(mbs, return_index=True)
            for mb in mbs[np.sort(first)].tolist():
                gs = members[mbs == mb]
                if len(gs) < 2:
                    continue
                pair = self._best_pair(doubled.time[gs], doubled.mem[gs], need_t, need_m, cap[k], caps[mb])
                if pair is None:
                    continue
                pa, pb, load, mem = pair
                if best is None or load < best[0]:
                    a, b = int(gs[pa]), int(gs[pb])
                    best = (load, mem, a, b, k, groups[a][4] + groups[b][4])
            if best is not None:
                break
        if best is None:
            return None
        load, mem, a, b, k, ids = best
        for g in (a, b):  # the two groups become one: a holds it, b is emptied and retired
            by_deg[groups[g][1]].remove(g)
        groups[a][1:] = [k, load, mem, ids + [i]]
        by_deg[k].append(a)
        groups[b][4] = []
        groups[b][2], groups[b][3] = bt[groups[b][1]], 0.0
        groups[b][0] = -1  # no longer on any device
        rooms.drop(a)
        rooms.drop(b)
        rooms.add(a, k, caps[groups[a][0]] - load)
        doubled.start(a, groups[a][0], k, groups[a][4])
        doubled.retire(b)
        return a, b

    def _best_pair(self, ts: np.ndarray, ms: np.ndarray, need_t: float, need_m: float, mem_cap: float,
                   time_cap: float):
        """(a, b, load, memory) of the pair a < b minimising need_t + ts[a] + ts[b] within both caps
        (sums associated in that order, the first of equal loads in (a, b) order), or None. Only
        groups that could be in some pair within the caps (against the lightest other) are
        paired, in their order. When more than LIGHTEST remain (hundreds of devices), the best
        pair among the LIGHTEST lightest is taken if they have one (an n x n table of thousands
        of groups per merge cost ~50 ms), else every pair is tried."""
        if len(ts) < 2:
            return None
        slack = 1 + 1e-12  # a pair's sum associates in its own order: keep what rounding could admit
        t1, t2 = np.partition(ts, 1)[:2]
        m1, m2 = np.partition(ms, 1)[:2]
        if need_t + t1 + t2 > time_cap * slack or need_m + m1 + m2 > mem_cap * slack:
            return None
        keep = np.flatnonzero((need_t + t1 + ts <= time_cap * slack) & (need_m + m1 + ms <= mem_cap * slack))
        if len(keep) < 2:
            return None
        ts, ms = ts[keep], ms[keep]
        if len(ts) > self.LIGHTEST + 1:  # many groups: the best pair of the lightest, if they have one
            part = np.argpartition(ts, self.LIGHTEST)
            sub = np.sort(part[:self.LIGHTEST])
            found = self._pair_of(ts[sub], ms[sub], need_t, need_m, mem_cap, time_cap)
            if found is not None:
                return int(keep[sub[found[0]]]), int(keep[sub[found[1]]]), found[2], found[3]
        found = self._pair_of(ts, ms, need_t, need_m, mem_cap, time_cap)
        return None if found is None else (int(keep[found[0]]), int(keep[found[1]]), found[2], found[3])

    @staticmethod
    def _pair_of(ts, ms, need_t, need_m, mem_cap, time_cap):
        """_best_pair over every pair of these groups, as n x n tables."""
        load = (need_t + ts)[:, None] + ts[None, :]
        mem = (need_m + ms)[:, None] + ms[None, :]
        n = len(ts)
        ok = (np.arange(n)[:, None] < np.arange(n)[None, :]) & (mem <= mem_cap) & (load <= time_cap)
        if not ok.any():
            return None
        a, b = divmod(int(np.argmin(np.where(ok, load, np.inf))), n)
        return a, b, float(load[a, b]), float(mem[a, b])

    def expired(self) -> bool:
        return time.perf_counter() > self.deadline

    def _bisect(self, make_caps, lo: float, hi: float, steps: int, best, reuse: bool = False, pin=None):
        """Smallest feasible x in [lo, hi] for caps = make_caps(x) (hi assumed feasible or found by
        growing it), to within `tol` of the targets' sum (a heavy micro-batch's fixed target
        counts: what is bisected is the step's time, not x alone); returns the best packing seen
        (by its sum of spans) and the x reached."""
        found = None
        for _ in range(40):
            if best is not None and self.expired():
                return best, None
            pk = self.pack(make_caps(hi), reuse, pin)
            if pk is not None:
                found = pk
                break
            lo, hi = hi, hi * 1.5 + 1.0
        if found is None:
            return best, None
        if best is None or found.total() < best.total():
            best = found
        for _ in range(steps):
            top = make_caps(hi)
            varied = sum(a != b for a, b in zip(top, make_caps(lo)))  # the targets x sets
            if (hi - lo) * varied <= self.tol * sum(top) or self.expired():
                break
            mid = 0.5 * (lo + hi)
            pk = self.pack(make_caps(mid), reuse, pin)
            if pk is None:
                lo = mid
            else:
                hi = mid
                if pk.total() < best.total():
                    best = pk
        return best, hi

    def search(self, M: int, steps: int, beat: float = math.inf) -> _Packing | None:
        """Uniform target first; then one "heavy" micro-batch whose target is set by the longest
        sequence at each degree (its group can then be smaller and cheaper), the others bisected.
        A heavy target is skipped when its targets already sum past this search's best packing
        or past `beat` (the best packing of another micro-batch count)."""
        if self.n == 0:
            return None
        b0 = min(self.bt)
        lo = max(max(self.best_single), b0 + self.work / (self.N * M))
        best, tu = self._bisect(lambda x: [x] * M, lo, lo * 1.1, steps, None)
        if best is None:  # memory-tight: long sequences share existing groups first
            best, tu = self._bisect(lambda x: [x] * M, lo, lo * 1.1, steps, None, reuse=True)
        if best is None or M == 1:
            return best
        i0 = self.order[0]

        def others_low(th):  # the least target the other micro-batches need beside one of th
            return max(b0, b0 + (self.work / self.N - (th - b0)) / (M - 1))

        heavy = sorted({self.bt[j] + self.t[i0][j] for j in range(self.nd) if self.fit[i0][j]}
                       | {tu * f for f in self.grid})
        for th in heavy:
            if self.expired():
                return best
            if th <= tu * 1.0001:
                continue
            x_lo = others_low(th)
            if x_lo >= tu or th + (M - 1) * x_lo >= min(best.total(), beat):
                continue  # cannot beat the best packing
            if not self._may_beat(th, M, tu, min(best.total(), beat)):
                continue
            best, _ = self._bisect(lambda x: [th] + [x] * (M - 1), x_lo, tu, steps, best)
        # the longest sequence at the smallest degree whose group ends before the uniform target,
        # pinned to a micro-batch of its own length; the others share the rest (one more bisection)
        j = next((j for j in range(self.nd) if self.fit[i0][j] and self.bt[j] + self.t[i0][j] < tu), None)
        if j is not None and not self.expired():
            th = self.bt[j] + self.t[i0][j]
            x_lo = others_low(th)
            hi = max(x_lo, tu) * 1.1
            if th + (M - 1) * x_lo < min(best.total(), beat) and \
                    self._may_beat(th, M, hi, min(best.total(), beat), pin=(i0, j, 0)):
                best, _ = self._bisect(lambda x: [th] + [x] * (M - 1), x_lo, hi, steps, best, pin=(i0, j, 0))
        return best

    def _may_beat(self, th: float, M: int, hi: float, target: float, pin=None) -> bool:
        """Whether a heavy target th is worth its bisection of the other micro-batches' target x
        (up to hi): False when the x whose targets [th, x, ..., x] sum to `target` (the best
        packing so far) is below hi and has no packing — the bisection would end above it, with
        targets summing past the best packing."""
        x = (target - th) / (M - 1)
        return x >= hi or (x > 0 and self.pack([th] + [x] * (M - 1), pin=pin) is not None)

    # ---------------------------------------------------------------------- local search
    def local_search(self, pk: _Packing, budget: int, deadline: float) -> tuple[int, bool]:
        """Drains each micro-batch's slowest group: moves one of its sequences to the group, in
        any micro-batch, with the most room (without raising that micro-batch's time, and
        ending below the drained group's time), the longest such sequence first; when none
        moves, swaps one of its longest with a shorter sequence of such a group (largest gain).
        Stops when no micro-batch can be improved or after `budget` moves."""
        groups, t, m, cap, fit, bt = pk.groups, self.t, self.m, self.cap, self.fit, self.bt
        M = pk.M
        members = [[] for _ in range(M)]
        for g, G in enumerate(groups):
            members[G[0]].append(g)
        span = pk.spans()
        nonempty = [any(groups[g][4] for g in members[b]) for b in range(M)]
        stuck = [not x for x in nonempty]  # an empty micro-batch has nothing to drain
        done = 0
        while done < budget:
            if done % 64 == 0 and time.perf_counter() > deadline:
                return done, True
            a = -1
            for b in range(M):
                if not stuck[b] and (a < 0 or span[b] > span[a]):
                    a = b
            if a < 0:
                break
            g0 = max((g for g in members[a] if groups[g][4]), key=lambda g: (groups[g][2], -g))
            G0 = groups[g0]
            j0, load0 = G0[1], G0[2]
            # destinations by room left under their micro-batch's time (own micro-batch: under load0)
            room = []
            for g, G in enumerate(groups):
                if g == g0:
                    continue
                top = load0 if G[0] == a else span[G[0]]
                base = G[2] if G[4] else bt[G[1]]
                if top - base > 0:
                    room.append((top - base, g))
            room.sort(key=lambda x: (-x[0], x[1]))
            room = room[:12]
            move = None
            for i in sorted(G0[4], key=lambda i: (-t[i][j0], i)):
                for r, g in room:
                    G = groups[g]
                    j = G[1]
                    if not fit[i][j] or t[i][j] > r or G[3] + m[i][j] > cap[j]:
                        continue
                    if G[0] == a and (G[2] if G[4] else bt[j]) + t[i][j] >= load0 - 1e-9:
                        continue
                    move = (i, g)
                    break
                if move:
                    break
            swap = None
            if move is None:  # swap one of g0's longest with a shorter one of a group with room
                best_gain = 1e-9
                for i in sorted(G0[4], key=lambda i: (-t[i][j0], i))[:8]:
                    for r, g in room:
                        G = groups[g]
                        j = G[1]
                        if not fit[i][j]:
                            continue
                        for k in G[4]:
                            gain = t[i][j0] - t[k][j0]
                            if gain <= best_gain or not fit[k][j0]:
                                continue
                            delta = t[i][j] - t[k][j]
                            if delta > r or (G[0] == a and G[2] + delta >= load0 - 1e-9):
                                continue
                            if G[3] - m[k][j] + m[i][j] > cap[j] or G0[3] - m[i][j0] + m[k][j0] > cap[j0]:
                                continue
                            best_gain, swap = gain, (i, g, k)
                if swap is None:
                    stuck[a] = True
                    continue
            if swap is not None:
                i, g, k = swap
                G = groups[g]
                j = G[1]
                G0[4].remove(i)
                G0[4].append(k)
                G[4].remove(k)
                G[4].append(i)
                G0[2] += t[k][j0] - t[i][j0]
                G0[3] += m[k][j0] - m[i][j0]
                G[2] += t[i][j] - t[k][j]
                G[3] += m[i][j] - m[k][j]
            else:
                i, g = move
                G = groups[g]
                j = G[1]
                G0[4].remove(i)
                G0[2] -= t[i][j0]
                G0[3] -= m[i][j0]
                if not G0[4]:
                    G0[2], G0[3] = bt[j0], 0.0
                if not G[4]:
                    G[2] = bt[j]
                G[4].append(i)
                G[2] += t[i][j]
                G[3] += m[i][j]
            done += 1
            new = max((groups[h][2] for h in members[a] if groups[h][4]), default=0.0)
            if new < span[a] - 1e-9:
                span[a] = new
                stuck = [not any(groups[g][4] for g in members[b]) for b in range(M)]
        return done, False
