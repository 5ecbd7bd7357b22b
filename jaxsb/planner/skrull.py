"""Skrull-style scheduling (Xu et al., NeurIPS'25, arXiv 2505.19609): its planner.

Skrull trains long-SFT data (a few very long sequences among many short ones) with data
parallelism (DP) x context parallelism (CP) and schedules every global batch in two levels:

* **GDS** (global data scheduling): the global batch is spread over the DP ranks so that their
  modelled compute is balanced, and each DP rank's share is cut into micro-batches by a strided
  interleave of its length-sorted list, adding micro-batches until every one of them fits the
  memory and DACP succeeds;
* **DACP** (distributed-aware context parallelism): inside one CP group and micro-batch, every
  sequence is either *sharded* over all cp ranks (ordinary CP, with K/V communication) or kept
  *local*, whole on one rank (no communication, no per-rank fragment overhead). The choice is a
  greedy with roll-back under a per-rank token capacity C ("BucketSize" in the paper).

`SkrullCost` (jaxsb/planner/skrull_cost.py) is the paper's performance model made concrete;
`SkrullPlanner` implements GDS + DACP and,
with `all_sharded=True`, the DeepSpeed-style static baseline of the same DP x CP setting.
`long_sft_lengths` / `bimodal_lengths` generate the length mixes the measurements use.

Dimension letters: S a sequence length in tokens, T a group's sharded stream (sum of S),
h model width, h_kv the width of K (= kv_heads * head_dim), L layers, d (= cp) a group degree.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from jaxsb.plan import SHARDED, GroupSpec, Plan, PlanError, Runnable, build_plan
from jaxsb.planner.base import PlannerBase, check_options, check_scheme, check_ulysses_degree, resolve_align
from jaxsb.planner.cost import token_capacity as cost_token_capacity
from jaxsb.planner.skrull_cost import SkrullCost

# ------------------------------------------------------------------------------- the planner


class SkrullPlanner(PlannerBase):
    """Skrull's GDS + DACP over a DP x CP mesh (``dp * cp <= num_devices``; devices
    [g*cp, (g+1)*cp) form DP rank g's CP group in every micro-batch).

    Options:
      * ``dp``, ``cp``: the mesh (defaults: cp = min(8, num_devices), dp = num_devices // cp);
      * ``seqs_per_dp_rank``: the static split's chunk (DP rank r gets sequences
        [r*n, (r+1)*n) in input order; default ceil(len / dp)); GDS ignores it;
      * ``all_sharded=True``: every sequence sharded over its CP group (DeepSpeed-style static
        baseline). Without GDS (the default for it) the DP split is the static one and each DP rank
        packs its sequences into micro-batches in input order (next fit under the capacity);
      * ``gds``: global data scheduling on/off (default: on for Skrull, off for all_sharded);
      * ``extra_microbatches``: also try that many micro-batch counts above the smallest feasible
        one and keep the fastest modelled (0 = the paper's rule, the smallest feasible count);
      * ``token_capacity``: override the cost model's per-rank capacity C;
      * ``runnable``: what the executor runs (its alignment; a ulysses CP degree it cannot run
        is refused here), or ``align`` (buffer alignment, for the simulator).

    GDS: sequences in decreasing modelled time go to the least-loaded DP rank; every DP rank then
    cuts its length-sorted list into k micro-batches by strided interleave (micro-batch j gets
    sorted[j::k]); k starts at the token lower bound and grows until every micro-batch of every
    DP rank fits (ceil(tokens / cp) <= C, which is exactly when DACP can place it). All DP ranks
    use the same k (one gradient-accumulation count).

    DACP (`dacp`): short sequences local, long ones sharded. For each threshold k the k shortest
    sequences are candidates to stay whole; they are placed longest first on the least-loaded rank
    (by local compute) that can hold them under C, and a candidate no rank can hold is rolled back
    to sharded. The threshold with the fastest modelled group wins; k = 0 (all sharded) is one of
    them, so DACP is never slower than plain CP under the cost model.
    """

    name = "skrull"

    def __init__(self, cost, num_devices: int, *, dp: int | None = None, cp: int | None = None,
                 seqs_per_dp_rank: int | None = None, time_limit_s: float = 1.0, scheme: str = "ring",
                 all_sharded: bool = False, gds: bool | None = None, extra_microbatches: int = 0,
                 token_capacity: int | None = None, align: int = 1, runnable: Runnable | None = None,
                 **options):
        self.cost = cost
        self.init_budgeting(options)
        check_options(self.name, options)
        if num_devices < 1:
            raise ValueError(f"{num_devices=} must be >= 1")
        if cp is None:
            cp = num_devices // dp if dp else min(8, num_devices)
        if dp is None:
            dp = num_devices // cp
        if dp < 1 or cp < 1 or dp * cp > num_devices:
            raise ValueError(f"dp={dp} x cp={cp} must be >= 1 and use at most {num_devices=} devices")
        check_scheme(self.name, scheme)
        check_ulysses_degree(self.name, scheme, cp, runnable)
        self.runnable = runnable
        self.cost = cost
        self.num_devices = int(num_devices)
        self.dp, self.cp = int(dp), int(cp)
        self.seqs_per_dp_rank = seqs_per_dp_rank
        self.time_limit_s = float(time_limit_s)
        self.scheme = scheme
        self.all_sharded = bool(all_sharded)
        self.gds = (not self.all_sharded) if gds is None else bool(gds)
        self.extra_microbatches = int(extra_microbatches)
        if token_capacity is None:  # the cost model's per-rank C (Skrull's), else what one device holds
            own = getattr(cost, "token_capacity", None)
            token_capacity = own if isinstance(own, int) else cost_token_capacity(cost, 1)
            if token_capacity < 1:
                raise PlanError(f"cost model {cost.name}: even 1 token exceeds the memory limit "
                                f"{cost.memory_limit_mb} MB")
        self.capacity = int(token_capacity)
        self.align = resolve_align(runnable, align)
        if self.all_sharded:
            self.name = "skrull-all-sharded" if self.gds else "static-cp"
        self._full_cache: dict[int, float] = {}

    # ------------------------------------------------------------------------------ pieces

    def _full(self, s: int) -> float:
        """Modelled time of a sequence kept whole on one rank (the balancing weight)."""
        t = self._full_cache.get(s)
        if t is None:
            t = self._full_cache[s] = float(self.cost.group_time_ms(1, (s,)))
        return t

    def _time(self, sharded: Sequence[int], local: Sequence[Sequence[int]], lengths) -> float:
        if self.cp == 1:
            return float(self.cost.group_time_ms(1, [lengths[i] for i in sharded]))
        return float(self.cost.group_time_ms(self.cp, [lengths[i] for i in sharded],
                                             [[lengths[i] for i in ids] for ids in local], self.scheme))

    def fits(self, ids: Sequence[int], lengths) -> bool:
        """Whether DACP can place these sequences in one CP group (all-sharded is the most even)."""
        return -(-sum(lengths[i] for i in ids) // self.cp) <= self.capacity

    def _assign_local(self, cand: Sequence[int], ids: Sequence[int], lengths):
        """Places the candidates (given shortest first) longest first, each on the least-loaded
        rank (by local compute; ties: lowest rank) that can hold it whole next to its share of the
        stream, the share counted as if the candidates still to come stay local; a candidate no
        rank can hold stays sharded. When candidates stayed sharded the share grows, and a rank
        over capacity then rolls back local sequences to sharded (the smallest one that clears the
        excess, else its largest) until every rank fits.
        Returns (local ids per rank, local ms per rank, streamed tokens)."""
        cp, cap = self.cp, self.capacity
        streamed = sum(lengths[i] for i in ids) - sum(lengths[i] for i in cand)
        local = [[] for _ in range(cp)]
        tok, ms = [0] * cp, [0.0] * cp
        for i in reversed(cand):
            s = lengths[i]
            room = cap - s - -(-streamed // cp)
            best = -1
            for r in range(cp):
                if tok[r] <= room and (best < 0 or ms[r] < ms[best]):
                    best = r
            if best < 0:
                streamed += s
                continue
            local[best].append(i)
            tok[best] += s
            ms[best] += self._full(s)
        while True:  # roll back local sequences while the grown share breaks a rank's capacity
            share = -(-streamed // cp)
            over = max(range(cp), key=lambda q: (tok[q] + share, -q))
            excess = tok[over] + share - cap
            if excess <= 0:
                break
            # (a rank without local sequences holds ceil(stream / cp) <= C: `fits` was checked)
            # moving s to the stream frees at least s - ceil(s / cp) tokens on this rank
            clears = [i for i in local[over] if lengths[i] - -(-lengths[i] // cp) >= excess]
            i = min(clears, key=lambda j: (lengths[j], j)) if clears else max(
                local[over], key=lambda j: (lengths[j], -j))
            local[over].remove(i)
            tok[over] -= lengths[i]
            ms[over] -= self._full(lengths[i])
            streamed += lengths[i]
        return local, ms, streamed

    def _threshold_times(self, order: Sequence[int], lengths) -> np.ndarray:
        """Modelled group ms of every threshold k = 0..n at once (SkrullCost only): the first pass
        of `_assign_local` vectorised over k (row k places order[k-1], ..., order[0]); rows whose
        grown share breaks a capacity (the roll-back loop) are redone one by one."""
        cost, cp, cap = self.cost, self.cp, self.capacity
        n = len(order)
        ls = np.array([lengths[i] for i in order], dtype=np.int64)
        full = np.array([self._full(int(x)) for x in ls])
        share = np.array([cost.share_ms(int(x), cp) for x in ls])
        streamed = int(ls.sum()) - np.concatenate([[0], np.cumsum(ls)])  # row k: all but k shortest
        tok = np.zeros((n + 1, cp), dtype=np.int64)
        ms = np.zeros((n + 1, cp))
        placed_share = np.zeros(n + 1)
        for j in range(n - 1, -1, -1):  # rows k > j hold candidate j
            rows = np.arange(j + 1, n + 1)
            room = cap - ls[j] - -(-streamed[rows] // cp)
            ok_rank = tok[rows] <= room[:, None]
            rank = np.where(ok_rank, ms[rows], np.inf).argmin(axis=1)
            ok = ok_rank.any(axis=1)
            tok[rows[ok], rank[ok]] += ls[j]
            ms[rows[ok], rank[ok]] += full[j]
            placed_share[rows[ok]] += share[j]
            streamed[rows[~ok]] += ls[j]
        times = np.empty(n + 1)
        over = tok.max(axis=1) + -(-streamed // cp) > cap
        for k in range(n + 1):
            if over[k]:
                local, ms_k, st = self._assign_local(order[:k], order, lengths)
                shard = share.sum() - sum(cost.share_ms(lengths[i], cp) for l in local for i in l)
                times[k] = cost.combine_ms(cp, shard, max(ms_k), st, self.scheme)
            else:
                times[k] = cost.combine_ms(cp, share.sum() - placed_share[k], ms[k].max(),
                                           int(streamed[k]), self.scheme)
        return times

    def dacp(self, ids: Sequence[int], lengths: Sequence[int], all_sharded: bool | None = None):
        """(sharded ids, [ids local on rank r], modelled ms) for one CP group and micro-batch, or
        None when the sequences do not fit (ceil(tokens / cp) > C).

        Short sequences local, long ones sharded: for every threshold k (0 .. n), the k shortest
        sequences are candidates for staying local (`_assign_local`: longest first to the
        least-loaded rank with room, rolled back to sharded when none has room); the threshold
        with the fastest modelled group wins (k = 0, all sharded, is among them).
        `all_sharded` (default: the planner's option) skips the choice: plain CP."""
        ids = sorted(ids)
        cp = self.cp
        if not self.fits(ids, lengths):
            return None
        if (self.all_sharded if all_sharded is None else all_sharded) or cp == 1 or not ids:
            local = [[] for _ in range(cp)]
            return ids, local, self._time(ids, local, lengths)
        order = sorted(ids, key=lambda j: (lengths[j], j))
        if isinstance(self.cost, SkrullCost):
            times = self._threshold_times(order, lengths)
            k = int(np.argmin(times))  # the first of equal times: fewest local candidates
        else:
            times = []
            for k in range(len(order) + 1):
                local, _, _ = self._assign_local(order[:k], ids, lengths)
                local_set = {i for l in local for i in l}
                times.append(self._time([i for i in ids if i not in local_set], local, lengths))
            k = int(np.argmin(times))
        local, _, _ = self._assign_local(order[:k], ids, lengths)
        local_set = {i for l in local for i in l}
        sharded = [i for i in ids if i not in local_set]
        return sharded, [sorted(l) for l in local], self._time(sharded, local, lengths)

    # -------------------------------------------------------------------------------- GDS

    def _balance(self, lengths) -> list[list[int]]:
        """GDS level 1: decreasing modelled time, each to the least-loaded DP rank."""
        ranks, loads = [[] for _ in range(self.dp)], [0.0] * self.dp
        for i in sorted(range(len(lengths)), key=lambda j: (-self._full(lengths[j]), -lengths[j], j)):
            r = min(range(self.dp), key=lambda q: (loads[q], q))
            ranks[r].append(i)
            loads[r] += self._full(lengths[i])
        return ranks

    def _static_split(self, lengths) -> list[list[int]]:
        n = len(lengths)
        chunk = self.seqs_per_dp_rank or -(-n // self.dp)
        if chunk * self.dp < n:
            raise PlanError(f"{n} sequences but dp={self.dp} x seqs_per_dp_rank={chunk} = {chunk * self.dp}")
        return [list(range(r * chunk, min(n, (r + 1) * chunk))) for r in range(self.dp)]

    def _next_fit(self, ids, lengths) -> list[list[int]]:
        """Input-order packing: a new micro-batch when the next sequence would overflow C."""
        mbs, cur = [], []
        for i in ids:
            if cur and not self.fits(cur + [i], lengths):
                mbs.append(cur)
                cur = []
            cur.append(i)
        return mbs + [cur] if cur else mbs

    def _interleave(self, ranks, lengths, k) -> list[list[list[int]]]:
        out = []
        for ids in ranks:
            srt = sorted(ids, key=lambda j: (-lengths[j], j))
            out.append([srt[j::k] for j in range(k)])
        return out

    def _gds_microbatches(self, ranks, lengths, t0):
        """GDS level 2: the smallest common k whose strided interleave fits everywhere (plus
        `extra_microbatches` more tried). Returns per-rank micro-batch lists, or None on time-out."""
        cap_cp = self.capacity * self.cp
        k = max([1] + [-(-sum(lengths[i] for i in ids) // cap_cp) for ids in ranks])
        k_max = max(1, max(len(ids) for ids in ranks))
        while True:
            if time.perf_counter() - t0 > self.time_limit_s:
                return None
            split = self._interleave(ranks, lengths, k)
            if all(self.fits(mb, lengths) for r in split for mb in r):
                return [self._interleave(ranks, lengths, kk)
                        for kk in range(k, min(k_max, k + self.extra_microbatches) + 1)]
            if k >= k_max:  # cannot happen after the per-sequence check; guard against loops
                raise PlanError(f"no micro-batch split fits {self.cp} x {self.capacity} tokens")
            k += 1

    # ------------------------------------------------------------------------------- plan

    def _schedule(self, per_rank_mbs, lengths, all_sharded: bool):
        """DACP on every (DP rank, micro-batch): GroupSpec lists and the modelled ms."""
        n_mb = max(len(m) for m in per_rank_mbs)
        out, total = [], 0.0
        for m in range(n_mb):
            specs, worst = [], 0.0
            for g in range(self.dp):
                ids = per_rank_mbs[g][m] if m < len(per_rank_mbs[g]) else []
                sharded, local, t = self.dacp(ids, lengths, all_sharded)
                worst = max(worst, t)
                if self.cp == 1:
                    specs.append(GroupSpec(1, "local", sharded=tuple(sharded)))
                else:
                    specs.append(GroupSpec(self.cp, self.scheme, sharded=tuple(sharded),
                                           local=tuple(tuple(l) for l in local)))
            out.append(specs)
            total += worst
        return out, total

    def lower_bound_ms(self, lengths) -> float:
        """A bound no DP x CP plan beats (SkrullCost only, else nan): the total of each sequence's
        cheapest work spread over all dp*cp ranks, and any sequence too long to stay whole
        (> C), sharded and communicated, alone."""
        c = self.cost
        if not isinstance(c, SkrullCost):
            return float("nan")
        n_ranks, cp = self.dp * self.cp, self.cp
        work = sum(min(c.full_ms(s), cp * c.share_ms(s, cp)) for s in lengths)
        forced = [c.share_ms(s, cp) + c.comm_ms(cp, s, self.scheme) for s in lengths
                  if s > self.capacity and cp > 1]
        return max([work / n_ranks] + forced)

    def _solve(self, lengths: list[int], budgets) -> tuple[Plan, dict]:
        t0 = time.perf_counter()
        if not lengths:
            raise PlanError("empty batch: nothing to plan")
        for i, s in enumerate(lengths):
            if s < 1:
                raise PlanError(f"sequence {i} has length {s}; lengths must be >= 1")
            if -(-s // self.cp) > self.capacity:
                raise PlanError(f"sequence {i} of length {s} tokens does not fit: a CP group of {self.cp} "
                                f"ranks holds at most {self.cp * self.capacity} tokens "
                                f"(token capacity {self.capacity} per rank, cost {self.cost.name})")
        fell_back, message = False, ""
        if self.gds:
            candidates = self._gds_microbatches(self._balance(lengths), lengths, t0)
            if candidates is None:
                fell_back = True
                message = (f"time limit {self.time_limit_s}s reached in GDS; fell back to the static "
                           "all-sharded plan")
        if not self.gds or fell_back:
            split = self._static_split(lengths)
            candidates = [[self._next_fit(ids, lengths) for ids in split]]
        best = None
        for per_rank in candidates:
            specs, ms = self._schedule(per_rank, lengths, self.all_sharded or fell_back)
            if best is None or ms < best[1] * (1 - 1e-12):
                best = (specs, ms)
        specs, ms = best
        plan = build_plan(self.num_devices, specs, lengths, budgets=budgets, align=self.align,
                          planner=self.name, predicted_ms=ms)
        n_local = sum(p.rank != SHARDED for p in plan.placements) if self.cp > 1 else len(lengths)
        if not message:
            message = (f"{len(specs)} micro-batch(es) x dp={self.dp} CP groups of {self.cp}; "
                       f"{n_local} of {len(lengths)} sequences local")
        return plan, {
            "fell_back": fell_back,
            "message": message,
            "num_microbatches": len(specs),
            "microbatches_tried": len(candidates),
            "predicted_ms": ms,
            "lower_bound_ms": self.lower_bound_ms(lengths),
            "local_sequences": n_local,
            "dp": self.dp,
            "cp": self.cp,
            "token_capacity": self.capacity,
        }


# -------------------------------------------------------------------------- length mixes


def long_sft_lengths(n: int, seed: int = 0, *, long_frac: float = 0.001, short_mean: float = 850.0,
                     long_mean: float = 38000.0) -> np.ndarray:
    """A long-SFT-like mix (Llama-3's SFT data as Skrull describes it: ~0.1% of sequences are long,
    ~37K tokens on average, the rest ~1K): each sequence is long with probability `long_frac`,
    then ~N(long_mean, 5%) clipped to +-20%; short ones are log-normal (sigma 0.6) with mean
    ~`short_mean`, clipped to [32, 8192]. Deterministic in (n, seed)."""
    rng = np.random.default_rng(seed)
    sigma = 0.6
    short = rng.lognormal(math.log(short_mean) - sigma * sigma / 2, sigma, n).clip(32, 8192)
    is_long = rng.random(n) < long_frac
    long = rng.normal(long_mean, 0.05 * long_mean, n).clip(0.8 * long_mean, 1.2 * long_mean)
    return np.where(is_long, long, short).round().astype(np.int64)


def bimodal_lengths(n: int, seed: int = 0, *, long_frac: float = 0.2, short_mean: float = 1000.0,
                    long_range: tuple[int, int] = (8192, 24576)) -> np.ndarray:
    """A bimodal mix (ChatQA2-long-SFT-like: short chat turns plus a large share of long
    documents): long with probability `long_frac`, uniform in `long_range`; short ones log-normal
    (sigma 0.6) with mean ~`short_mean`, clipped to [32, 4096]. Deterministic in (n, seed)."""
    rng = np.random.default_rng(seed)
    sigma = 0.6
    short = rng.lognormal(math.log(short_mean) - sigma * sigma / 2, sigma, n).clip(32, 4096)
    is_long = rng.random(n) < long_frac
    long = rng.uniform(long_range[0], long_range[1], n)
    return np.where(is_long, long, short).round().astype(np.int64)
