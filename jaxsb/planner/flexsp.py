"""FlexSP's planner: heterogeneous sequence-parallel groups chosen by a MILP per micro-batch.

Method of "FlexSP: Data-Centric and Heterogeneity-Adaptive Sequence Parallelism" (ASPLOS'25,
arXiv 2412.01523), as its authors' public solver does it (PKU-DAIR/Hetu-Galvatron, branch
flexsp, galvatron/flexsp_solver/); this is our own code, with python-mip (CBC) for the MILP:

1. the global batch is sorted by length (longest first) and cut into contiguous micro-batches
   whose token sums are balanced (the min-max linear partition); the smallest count whose
   chunks fit the cluster's token capacity, and the next few counts (`mb_options`), are tried
   and the fastest is kept;
2. within a micro-batch, lengths are bucketed by the padding-minimising dynamic programme
   (B boundaries minimising the padded token total, B = `buckets` raised until the padded
   total is at most half-way between the real total and the cluster's capacity);
3. per micro-batch, one MILP: how many groups of each power-of-2 degree (degrees summing to at
   most N), how many sequences of each bucket each group gets, minimising the slowest group's
   time (per-group overhead + per-sequence compute and communication, linear in the counts
   because a bucket's length is fixed), subject to every device's memory; the MILP is seeded
   with the best homogeneous-degree assignment, as the authors do;
4. each bucket's real sequences are dealt to the groups that got that bucket (longest first,
   to the least loaded), so real times and memory are at most the MILP's.

A solve that hits `time_limit_s` keeps the best solution CBC has; one that ends without any
solution falls back to the seed (or, if no micro-batch count works, to the batch-adaptive
plan) and says so in its SolveInfo. `lower_bound_ms` is the sum of CBC's bounds (the LP
relaxation, tightened by branching) for the chosen split and bucketing.

The cost model is used through the CostModel protocol only: `LinearCost` reads per-sequence
time and memory off `group_time_ms` / `group_memory_mb` (group cost = base(d) + sum of
per-sequence costs), and the final plan is priced by `plan_time_ms`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from jaxsb.plan import Plan, PlanError, Runnable
from jaxsb.planner.base import PlannerBase, check_degrees, check_options, check_scheme, pow2_degrees, resolve_align
from jaxsb.planner.joint import JaxsbPlanner
from jaxsb.planner.linear import LinearCost, finish_plan, linear_span, simple_lower_bound, specs_from_groups
from jaxsb.planner.static import BatchAdaptivePlanner

# ------------------------------------------------------------------ bucketing and chunking


def bucket_boundaries(lengths: Sequence[int], num_buckets: int) -> list[int]:
    """The padding-minimising bucketing: at most `num_buckets` boundaries (each a length of the
    batch; a sequence is padded up to the smallest boundary >= its length) minimising the total
    padded tokens. Exact DP over the distinct lengths, O(B * u^2) vectorised."""
    vals, counts = np.unique(np.asarray(lengths, dtype=np.float64), return_counts=True)
    u = len(vals)
    if u <= num_buckets:
        return [int(v) for v in vals]
    c = np.concatenate([[0.0], np.cumsum(counts)])  # C[j]: sequences among the first j values
    s = np.concatenate([[0.0], np.cumsum(vals * counts)])
    inf = np.inf
    dp = np.full(u + 1, inf)
    dp[0] = 0.0
    choice = []
    jj = np.arange(u + 1)
    for _ in range(num_buckets):
        # new[i] = min_{j < i} dp[j] + vals[i-1] * (C[i] - C[j]) - (S[i] - S[j])
        cand = (dp + s)[None, :] - np.outer(vals, c)  # row i-1, column j
        cand[jj[None, :] >= jj[1:, None]] = inf
        arg = np.argmin(cand, axis=1)
        new = np.full(u + 1, inf)
        new[1:] = cand[np.arange(u), arg] + vals * c[1:] - s[1:]
        choice.append(np.concatenate([[0], arg]))
        dp = new
    bounds, i = [], u
    for b in range(num_buckets - 1, -1, -1):
        if i == 0:
            break
        bounds.append(int(vals[i - 1]))
        i = int(choice[b][i])
    return sorted(bounds)


def bucketize(lengths: Sequence[int], fit_tokens: float, num_buckets: int = 16) -> list[int]:
    """FlexSP's rule: start from `num_buckets` and add buckets until the padded total is at most
    half-way between the real total and `fit_tokens` (the cluster's token capacity). Returns
    each sequence's bucket length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = float(lengths.sum())
    threshold = (total + fit_tokens) / 2
    b = max(1, min(num_buckets, len(lengths)))
    while True:
        bounds = np.asarray(bucket_boundaries(lengths, b))
        padded = bounds[np.searchsorted(bounds, lengths)]
        if padded.sum() <= threshold or b >= len(np.unique(lengths)):
            return [int(x) for x in padded]
        b += 1


def chunk_sorted(order: Sequence[int], lengths: Sequence[int], num_chunks: int) -> list[list[int]]:
    """Cuts `order` (ids, longest first) into `num_chunks` non-empty contiguous pieces minimising
    the largest token sum (the min-max linear partition): bisection on the largest sum with a
    greedy check (exact for integer lengths), then the greedy cut at that sum."""
    n = len(order)
    k = max(1, min(num_chunks, n))
    sizes = [int(lengths[i]) for i in order]

    def cut(limit: int) -> list[list[int]] | None:
        out, cur, total = [], [], 0
        for idx, s in enumerate(sizes):
            # close the piece when this item would overflow it, or when every later piece needs
            # one of the remaining items
            if cur and (total + s > limit or n - idx <= k - len(out) - 1):
                out.append(cur)
                cur, total = [], 0
            if s > limit:
                return None
            cur.append(order[idx])
            total += s
        out.append(cur)
        return out if len(out) <= k else None

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return cut(lo)


# --------------------------------------------------------------------------- the MILP


@dataclasses.dataclass
class MilpResult:
    groups: list | None  # [(degree index, [ids])] or None
    bound: float  # CBC's lower bound on the bucketed micro-batch time (nan if unknown)
    status: str
    seed_used: bool
    objective: float  # the MILP's (bucketed) objective, nan if no solution


def _lpt(items: Sequence[int], t, m, groups: int, cap: float):
    """Longest first onto the least loaded of `groups` groups with memory left (t, m: per-item
    time and memory); None if an item fits nowhere."""
    loads, mems = [0.0] * groups, [0.0] * groups
    out = [[] for _ in range(groups)]
    for i in sorted(items, key=lambda x: (-t[x], x)):
        best = None
        for g in range(groups):
            if mems[g] + m[i] <= cap and (best is None or loads[g] < loads[best]):
                best = g
        if best is None:
            return None
        out[best].append(i)
        loads[best] += t[i]
        mems[best] += m[i]
    return out


def solve_microbatch_milp(ids: Sequence[int], padded: Sequence[int], real_t: np.ndarray, lin: LinearCost,
                          degrees_idx: Sequence[int], time_limit_s: float, budgets=None,
                          warm_start: bool = True) -> MilpResult:
    """FlexSP's MILP for one micro-batch (sequences `ids`, bucket lengths `padded[i]`)."""
    import mip

    n_dev = lin.num_devices
    # buckets: (length, budget) -> ids
    buckets: dict = {}
    for i in ids:
        buckets.setdefault((padded[i], None if budgets is None else budgets[i]), []).append(i)
    keys = sorted(buckets, key=lambda k: (-k[0], -1 if k[1] is None else k[1]))
    bt = np.empty((len(keys), len(lin.degrees)))
    bm = np.empty_like(bt)
    for k, key in enumerate(keys):
        bt[k], bm[k] = lin.row(*key)
    bfit = lin.fits(bm)
    count = [len(buckets[key]) for key in keys]
    usable = [j for j in degrees_idx if bfit[:, j].any()]
    # slots per degree: no more groups than devices allow or sequences could fill
    slots = {j: min(n_dev // lin.degrees[j], sum(count[k] for k in range(len(keys)) if bfit[k, j])) for j in usable}

    # seed: best homogeneous assignment of the bucketed sequences (bucket k as items)
    bid = {i: k for k, key in enumerate(keys) for i in buckets[key]}
    items = sorted(ids, key=lambda i: (bid[i], i))
    tt = {j: {i: bt[bid[i], j] for i in items} for j in usable}
    seed, seed_time = None, math.inf
    for j in usable:
        d = lin.degrees[j]
        if not all(bfit[bid[i], j] for i in items):
            continue
        g = min(n_dev // d, slots[j])
        assign = _lpt(items, tt[j], {i: bm[bid[i], j] for i in items}, g, lin.limit - lin.base_mem[j])
        if assign is None:
            continue
        span = max(lin.base_time[j] + sum(tt[j][i] for i in a) for a in assign if a)
        if span < seed_time:
            seed, seed_time = (j, [a for a in assign if a]), span

    model = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    model.verbose = 0
    model.threads = 1
    model.seed = 0
    model.max_mip_gap = 1e-3
    model.preprocess = 0  # CBC's preprocessing post-step has crashed (SIGSEGV) after time-limited solves
    z = model.add_var(name="z", lb=0.0)
    model.objective = mip.minimize(z)
    u, x = {}, {}
    for j in usable:
        d = lin.degrees[j]
        cap = lin.limit - lin.base_mem[j]
        for g in range(slots[j]):
            u[j, g] = model.add_var(var_type=mip.BINARY, name=f"u_{d}_{g}")
            terms_t, terms_m = [], []
            for k in range(len(keys)):
                if bfit[k, j]:
                    x[k, j, g] = v = model.add_var(var_type=mip.INTEGER, lb=0, ub=count[k], name=f"x_{k}_{d}_{g}")
                    terms_t.append(bt[k, j] * v)
                    terms_m.append(bm[k, j] * v)
            model += mip.xsum(terms_m) <= cap * u[j, g]  # memory, and nothing in an unused group
            model += lin.base_time[j] * u[j, g] + mip.xsum(terms_t) <= z
            if g:  # symmetry: used groups first, loads non-increasing
                model += u[j, g] <= u[j, g - 1]
                model += (mip.xsum(bt[k, j] * x[k, j, g] for k in range(len(keys)) if bfit[k, j])
                          <= mip.xsum(bt[k, j] * x[k, j, g - 1] for k in range(len(keys)) if bfit[k, j]))
    for k in range(len(keys)):
        model += mip.xsum(x[k, j, g] for j in usable for g in range(slots[j]) if (k, j, g) in x) == count[k]
    model += mip.xsum(lin.degrees[j] * u[j, g] for j in usable for g in range(slots[j])) <= n_dev
    # valid cuts (same optimum, a much tighter LP bound): the device-time of all groups fits in
    # N devices x z (each used group's d devices are busy for its time <= z), and z is at least
    # any bucket's fastest single-sequence group
    model += n_dev * z >= mip.xsum(lin.degrees[j] * (lin.base_time[j] * u[j, g] + mip.xsum(
        bt[k, j] * x[k, j, g] for k in range(len(keys)) if (k, j, g) in x))
        for j in usable for g in range(slots[j]))
    z.lb = float(max(min(lin.base_time[j] + bt[k, j] for j in usable if bfit[k, j]) for k in range(len(keys))))

    if seed is not None and warm_start:
        j0, assign = seed
        assign = sorted(assign, key=lambda a: -sum(tt[j0][i] for i in a))
        start = [(z, seed_time)]
        for j in usable:
            for g in range(slots[j]):
                used = j == j0 and g < len(assign)
                start.append((u[j, g], 1.0 if used else 0.0))
                for k in range(len(keys)):
                    if (k, j, g) in x:
                        c = sum(1 for i in assign[g] if bid[i] == k) if used else 0
                        start.append((x[k, j, g], float(c)))
        model.start = start

    status = model.optimize(max_seconds=max(time_limit_s, 1e-3))
    bound = model.objective_bound
    valid = bound is not None and math.isfinite(bound) and abs(bound) < 1e30
    bound = max(float(bound), z.lb) if valid else float(z.lb)  # z.lb: a valid bound on its own
    has_solution = status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) and model.num_solutions
    if has_solution:
        counts = {}
        for (k, j, g), v in x.items():
            c = int(round(v.x or 0.0))
            if c:
                counts.setdefault((j, g), {})[k] = c
        objective = float(model.objective_value)
        seed_used = False
    elif seed is not None:
        j0, assign = seed
        counts = {}
        for g, a in enumerate(assign):
            for i in a:
                counts.setdefault((j0, g), {}).setdefault(bid[i], 0)
                counts[j0, g][bid[i]] += 1
        objective = seed_time
        seed_used = True
    else:
        return MilpResult(None, bound, status.name, False, float("nan"))
    # deal the real sequences of each bucket to the groups that got it, longest to the least loaded
    group_keys = sorted(counts)
    loads = {gk: lin.base_time[gk[0]] for gk in group_keys}
    members = {gk: [] for gk in group_keys}
    for k, key in enumerate(keys):
        takers = [gk for gk in group_keys if counts[gk].get(k)]
        left = {gk: counts[gk][k] for gk in takers}
        for i in sorted(buckets[key], key=lambda i: (-real_t[i, 0], i)):
            gk = min((g for g in takers if left[g] > 0), key=lambda g: (loads[g], g))
            members[gk].append(i)
            left[gk] -= 1
            loads[gk] += real_t[i, gk[0]]
    groups = [(gk[0], members[gk]) for gk in group_keys if members[gk]]
    return MilpResult(groups, bound, status.name, seed_used, objective)


# ---------------------------------------------------------------------------- the planner


class FlexSPPlanner(PlannerBase):
    """FlexSP's MILP planner (see the module docstring).

    Options: `time_limit_s` per MILP solve (default 2 s); `scheme` "ulysses" (FlexSP's
    heterogeneous all-to-all groups, for the simulator) or "ring" (what jaxsb's executor runs
    for groups of different sizes); `buckets` (16, FlexSP's default); `mb_options` (5 micro-
    batch counts tried); `degrees` (allowed group degrees; default 2, 4, ... N as the authors'
    solver, which leaves out degree 1 — `degrees=(1, 2, 4, ...)` allows it); `warm_start` (seed CBC
    with the best homogeneous assignment, default True); `runnable` (what the executor runs:
    its alignment; ulysses groups it cannot run become ring groups) or `align` (buffer alignment
    for build_plan, for the simulator)."""

    name = "flexsp"

    def __init__(self, cost, num_devices: int, *, time_limit_s: float = 2.0, scheme: str = "ulysses",
                 buckets: int = 16, mb_options: int = 5, degrees: Sequence[int] | None = None,
                 warm_start: bool = True, align: int = 1, runnable: Runnable | None = None, **options):
        check_scheme(self.name, scheme)
        self.cost = cost
        self.init_budgeting(options)
        check_options(self.name, options)
        self.runnable = runnable
        self.num_devices = int(num_devices)
        self.time_limit_s = float(time_limit_s)
        self.scheme = scheme
        self.buckets = int(buckets)
        self.mb_options = max(1, int(mb_options))
        self.warm_start = bool(warm_start)
        self.align = resolve_align(runnable, align)
        # the authors' solver: power-of-2 degrees from 2 (1 only on a single device)
        degs = degrees or pow2_degrees(self.num_devices, smallest=2) or (1,)
        degs = check_degrees(self.name, degs, self.num_devices)
        self.lin = LinearCost(cost, self.num_devices, scheme, degs)

    def _solve(self, lengths: list[int], budgets) -> tuple[Plan, dict]:
        lin = self.lin
        n = len(lengths)
        if n == 0:
            raise PlanError("flexsp: empty batch")
        T, Mm = lin.tables(lengths, budgets)
        fits = lin.fits(Mm)
        lin.check_fits(lengths, fits)
        all_j = list(range(len(lin.degrees)))
        order = sorted(range(n), key=lambda i: (-lengths[i], i))
        cluster_tokens = lin.token_capacity(0) * (self.num_devices // lin.degrees[0])
        m = max(1, int(math.ceil(sum(lengths) / cluster_tokens)))
        while m < n and any(sum(lengths[i] for i in c) >= cluster_tokens for c in chunk_sorted(order, lengths, m)):
            m += 1
        best = None
        tried, notes = [], []
        work = simple_lower_bound(T, Mm, fits, lin, lengths, parts=True)[1]
        for mb in range(m, min(n, m + self.mb_options - 1) + 1):
            if best is not None and mb * float(lin.base_time.min()) + work >= best[0]:
                tried.append((mb, "pruned: bound above the best"))  # more micro-batches cannot win
                break
            chunks = chunk_sorted(order, lengths, mb)
            mb_groups, bounds, seeded, ok = [], [], 0, True
            for c in chunks:
                padded = dict(zip(c, bucketize([lengths[i] for i in c], cluster_tokens, self.buckets)))
                res = solve_microbatch_milp(c, padded, T, lin, all_j, self.time_limit_s, budgets, self.warm_start)
                if res.groups is None:
                    ok = False
                    notes.append(f"{mb} micro-batches: MILP {res.status} for a micro-batch of {len(c)} sequences")
                    break
                mb_groups.append(res.groups)
                bounds.append(res.bound)
                seeded += res.seed_used
            if not ok:
                tried.append((mb, None))
                continue
            total = float(sum(linear_span(g, T, lin) for g in mb_groups))
            tried.append((mb, round(total, 1)))
            if best is None or total < best[0] - 1e-9:
                best = (total, mb, mb_groups, bounds, seeded)
        info = {"microbatch_counts_tried": tried, "global_lower_bound_ms": simple_lower_bound(T, Mm, fits, lin, lengths)}
        if best is None:
            plan = self._fallback(lengths, budgets)
            info.update(fell_back=True, message="flexsp: no micro-batch count gave a MILP solution within "
                        f"{self.time_limit_s:g} s per solve ({'; '.join(notes)}); fell back to {plan.planner}",
                        lower_bound_ms=info["global_lower_bound_ms"])
            plan = dataclasses.replace(plan, planner=f"{self.name}(fallback:{plan.planner})")
        else:
            total, mb, mb_groups, bounds, seeded = best
            specs = [specs_from_groups(g, lin, self.scheme) for g in mb_groups]
            plan = finish_plan(self.cost, self.num_devices, specs, lengths, budgets, self.align, self.name,
                               self.runnable)
            fell = seeded > 0
            msg = (f"flexsp: {mb} micro-batches (tried {tried})"
                   + (f"; {seeded} micro-batch MILP(s) found no solution within {self.time_limit_s:g} s and fell "
                      "back to the homogeneous seed" if fell else ""))
            info.update(fell_back=fell, message=msg, microbatches=mb,
                        lower_bound_ms=float(np.nansum(bounds)) if bounds else float("nan"),
                        lower_bound_scope="MILP bound for the chosen micro-batch split and bucketed lengths")
        info["predicted_ms"] = plan.predicted_ms
        return plan, info

    def _fallback(self, lengths, budgets) -> Plan:
        try:
            return BatchAdaptivePlanner(self.cost, self.num_devices, scheme=self.scheme, align=self.align,
                                        runnable=self.runnable).plan(lengths, budgets)
        except ValueError:  # PlanError included: no single degree fits
            return JaxsbPlanner(self.cost, self.num_devices, scheme=self.scheme, align=self.align,
                                runnable=self.runnable).plan(lengths, budgets)
