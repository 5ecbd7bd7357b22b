"""A lower bound on any plan's time by a small MILP (python-mip, CBC), tighter than
`linear.simple_lower_bound`.

The additive model (`linear.LinearCost`): a plan is M micro-batches, each a set of groups of
allowed degrees d_j over at most N devices; a group's time is base_time[j] plus the times
t[i, j] of its sequences, its memory base_mem[j] plus theirs (at most the limit); a
micro-batch lasts as long as its slowest group; the plan as long as its micro-batches
together. The simple bound knows only "every micro-batch costs at least the smallest
overhead" and "all work spread over N devices, or the longest sequence alone". This one also
knows *where* the long sequences go and what memory forces:

For a fixed micro-batch count M, the K longest sequences (by their least time alone: the
longest, and at most `longest` whose own time is at least `long_factor` times the median
sequence's) are placed exactly (binary x[r, j, b]: sequence r at degree j in micro-batch b); the
others are fluid, in `classes` classes sorted by time per memory unit. Micro-batch b's span
s_b obeys

- s_b >= min overhead + (base_time[j] - min overhead + t[r, j]) for each long r placed there
  at degree j (its group lasts at least that);
- N (s_b - min overhead) >= the device-time (t[r, j] d_j) of its long sequences + the
  device-time of its short ones (every group of degree d ends by s_b, so its d devices work at
  most s_b - base_time each);
- its memory units (memory per device x degree, least over the degrees a sequence fits) fit in
  N x (limit - min base memory);
- a micro-batch holding a long sequence at degree N is that one group: its long sequences'
  times add up, and its short ones run at degree N too (their least device-time per memory
  unit there);
- a short class c sends a fraction f[c, b] of its memory units Z_c to micro-batch b and with
  them at least f[c, b] Z_c rho_c of device-time, rho_c the least time per memory unit in the
  class; the class's device-time beyond that is free to go anywhere.

Every real plan gives a feasible point (its placement of the long sequences, each class's
memory shares, each micro-batch's true span), so the MILP's optimum — and CBC's best bound when
it stops early, less CBC's cutoff increment — is a lower bound for plans of M micro-batches.
Over all M: the MILP's for m_min <= M <= M_hi, and for M > M_hi the simple bound at M_hi + 1 (it grows with M), with M_hi
the first count whose simple bound reaches `upper` (a known plan's time) or m_min + `counts`.
CBC runs single-threaded with a node limit, so the same input gives the same bound unless a
time limit (`max_seconds`, or the planner's deadline) stops it first.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from jaxsb.planner.linear import LinearCost, least_per_sequence, simple_lower_bound


CBC_MARGIN_ABS, CBC_MARGIN_REL = 1e-5, 1e-7  # what CBC's cutoff may pass an optimum by (count_bound)


@dataclasses.dataclass(frozen=True)
class BoundOptions:
    """`longest`: sequences placed exactly at most (K), those whose own time is at least
    `long_factor` times the median sequence's (the longest always); `classes`: fluid classes
    of the others; `counts`: micro-batch counts given a MILP at most; `max_nodes` /
    `max_seconds`: CBC's limits per count (seconds a safety net only: the node limit keeps the
    bound deterministic)."""

    longest: int = 12
    long_factor: float = 4.0
    classes: int = 16
    counts: int = 4
    max_nodes: int = 2000
    max_seconds: float = 2.0

    def __post_init__(self):
        for name in ("longest", "classes", "counts", "max_nodes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"bound option {name}={getattr(self, name)!r} must be >= 1")
        if not self.long_factor >= 0:
            raise ValueError(f"bound option long_factor={self.long_factor!r} must be >= 0")
        if not self.max_seconds > 0:
            raise ValueError(f"bound option max_seconds={self.max_seconds!r} must be > 0")


def count_bound(T: np.ndarray, Mm: np.ndarray, fits: np.ndarray, lin: LinearCost, M: int,
                options: BoundOptions = BoundOptions(), max_seconds: float = math.inf) -> tuple[float, str]:
    """(bound on any plan of exactly M micro-batches, CBC's status); inf when none exists.
    CBC stops at options.max_seconds or `max_seconds`, whichever is first (its bound then)."""
    import mip

    N = lin.num_devices
    deg = np.asarray(lin.degrees, dtype=np.float64)
    bt = np.asarray(lin.base_time, dtype=np.float64)
    b0 = float(bt.min())
    per_mb = float((lin.limit - lin.base_mem.min()) * N)
    work, units, alone = least_per_sequence(T, Mm, fits, lin)
    order = np.argsort(-alone, kind="stable")
    # placed exactly: the longest, and up to `longest` of those whose own time (beyond the
    # overhead) is at least `long_factor` times the median's (many near-equal sequences placed
    # exactly only make CBC branch over their symmetric placements)
    own = alone[order] - b0
    k = max(1, min(options.longest, int(np.count_nonzero(own >= options.long_factor * float(np.median(own))))))
    longs, shorts = order[:k], order[k:]
    rho = work / np.maximum(units, 1e-300)  # device-time per memory unit
    by_rho = shorts[np.argsort(rho[shorts], kind="stable")]
    classes = [c for c in np.array_split(by_rho, min(options.classes, len(by_rho))) if len(c)] if len(by_rho) else []
    z_c = [float(units[c].sum()) for c in classes]
    w_c = [z * float(rho[c].min()) for z, c in zip(z_c, classes)]
    w_free = max(0.0, float(work[shorts].sum()) - sum(w_c))
    # a micro-batch with a group of all N devices has only that group: its short sequences run
    # at degree N too (least device-time per memory unit there, per class; inf: they do not fit)
    full = len(deg) - 1 if lin.degrees[-1] == N else None
    if full is not None:
        wide = np.where(fits[:, full], N * T[:, full], np.inf) / np.maximum(units, 1e-300)
        rho_full = [float(wide[c].min()) for c in classes]

    m = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    m.verbose, m.threads, m.seed = 0, 1, 0
    m.preprocess = 0  # as in flexsp.py: CBC's preprocessing has crashed after limited solves
    s = [m.add_var(lb=b0) for _ in range(M)]
    free = [m.add_var(lb=0.0) for _ in range(M)]
    f = [[m.add_var(lb=0.0, ub=1.0) for _ in range(M)] for _ in classes]
    x = {}  # (r, j, b) -> var; long r only in micro-batches b <= r (they are numbered by their first long)
    for r, i in enumerate(longs):
        for j in range(len(deg)):
            if fits[i, j]:
                for b in range(min(M, r + 1)):
                    x[r, j, b] = m.add_var(var_type=mip.BINARY)
        m += mip.xsum(v for (rr, _, _), v in x.items() if rr == r) == 1
    for c in range(len(classes)):
        m += mip.xsum(f[c]) == 1
    m += mip.xsum(free) == w_free
    for b in range(M):
        here = [(r, j, v) for (r, j, bb), v in x.items() if bb == b]
        m += (N * (s[b] - b0) >= free[b] + mip.xsum(w_c[c] * f[c][b] for c in range(len(classes)))
              + mip.xsum(deg[j] * T[longs[r], j] * v for r, j, v in here))
        m += (per_mb >= mip.xsum(z_c[c] * f[c][b] for c in range(len(classes)))
              + mip.xsum(deg[j] * Mm[longs[r], j] * v for r, j, v in here))
        for r in {r for r, _, _ in here}:
            m += s[b] >= b0 + mip.xsum((bt[j] - b0 + T[longs[r], j]) * v for rr, j, v in here if rr == r)
        if full is not None:
            at_full = [v for r, j, v in here if j == full]
            if not at_full:
                continue
            # one group over every device: its long sequences share it, nothing else runs beside it
            alone = m.add_var(var_type=mip.BINARY)
            for v in at_full:
                m += alone >= v
            m += mip.xsum(v for r, j, v in here if j != full) <= len(longs) * (1 - alone)
            m += s[b] >= bt[full] * alone + mip.xsum(T[longs[r], full] * v for r, j, v in here if j == full)
            wide_work = []  # the short sequences' device-time at degree N, when that is the only group
            for c in range(len(classes)):
                if not math.isfinite(rho_full[c]):
                    m += f[c][b] <= 1 - alone
                    continue
                g = m.add_var(lb=0.0, ub=1.0)  # = f[c][b] when the micro-batch is that one group
                m += g >= f[c][b] - (1 - alone)
                wide_work.append(z_c[c] * rho_full[c] * g)
            m += (N * (s[b] - b0 - (bt[full] - b0) * alone) >= mip.xsum(deg[j] * T[longs[r], j] * v for r, j, v in here)
                  + mip.xsum(wide_work))
    m.objective = mip.minimize(mip.xsum(s))
    status = m.optimize(max_seconds=min(options.max_seconds, max_seconds), max_nodes=options.max_nodes)
    name = str(status).rsplit(".", 1)[-1]
    if status == mip.OptimizationStatus.INFEASIBLE:
        return math.inf, name
    value = m.objective_bound
    if value is None or not math.isfinite(value) or abs(value) > 1e30:
        return M * b0, name  # no usable bound from CBC: the overheads alone
    # CBC prunes nodes within its cutoff increment of the incumbent: its bound may pass the
    # optimum by that much, so that much is taken off
    return max(float(value) - CBC_MARGIN_ABS - CBC_MARGIN_REL * abs(float(value)), M * b0), name


class CountBounds:
    """Bounds per micro-batch count for one batch, each MILP solved once (memoised): `at(M)` for
    plans of exactly M micro-batches, `overall(upper)` for any plan. `use_mip=False`: the simple
    bound alone (no MILP). Past `deadline` (a time.perf_counter() value) no MILP starts and a
    running one stops: the bounds fall back to the simple one, and then depend on the wall
    clock."""

    def __init__(self, T: np.ndarray, Mm: np.ndarray, fits: np.ndarray, lin: LinearCost,
                 options: BoundOptions = BoundOptions(), use_mip: bool = True, deadline: float = math.inf):
        self.T, self.Mm, self.fits, self.lin = T, Mm, fits, lin
        self.options, self.use_mip, self.deadline = options, use_mip, deadline
        self.n = len(T)
        self.m_min, self.beyond = simple_lower_bound(T, Mm, fits, lin, None, parts=True) if self.n else (1, 0.0)
        self.overhead = float(lin.base_time.min())
        self.solved: dict = {}  # M -> (MILP bound, CBC status)

    def simple_at(self, M: int) -> float:
        """The simple bound for M micro-batches (grows with M)."""
        return M * self.overhead + self.beyond

    def at(self, M: int) -> float:
        if M > self.n:
            return math.inf
        left = self.deadline - time.perf_counter()
        if self.use_mip and M not in self.solved and left > 0:
            self.solved[M] = count_bound(self.T, self.Mm, self.fits, self.lin, M, self.options, left)
        return max(self.simple_at(M), self.solved[M][0] if M in self.solved else 0.0)

    def overall(self, upper: float = math.inf) -> float:
        """Min over counts: MILPs from m_min while the simple bound is below both `upper` and the
        best so far (at most `counts` of them), then the simple bound of the next count."""
        if self.n == 0:
            return 0.0
        best, M = math.inf, self.m_min
        while (self.use_mip and M < self.m_min + self.options.counts and M <= self.n
               and self.simple_at(M) < min(upper, best)):
            best = min(best, self.at(M))
            M += 1
        tail = self.simple_at(M) if M <= self.n else math.inf
        return float(max(min(best, tail), self.simple_at(self.m_min)))

    def describe(self) -> str:
        if not self.solved:
            return "simple bound"
        return "python-mip bound (" + ", ".join(f"M={M}: {v:.1f} {st.lower()}" for M, (v, st) in
                                               sorted(self.solved.items())) + ")"


def lower_bound(T: np.ndarray, Mm: np.ndarray, fits: np.ndarray, lin: LinearCost, upper: float = math.inf,
                options: BoundOptions = BoundOptions()) -> float:
    """A valid lower bound on any plan's time (the module docstring), never below the simple one."""
    return CountBounds(T, Mm, fits, lin, options).overall(upper)
