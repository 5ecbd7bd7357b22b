"""Cost models: how long a group of devices takes on its sequences, and how much memory it needs.

A cost model answers, for one group of `degree` devices in one micro-batch:

* `group_time_ms(degree, sharded_lengths, local_lengths=(), scheme, budgets)`: compute +
  communication + a per-group overhead;
* `group_memory_mb(degree, sharded_lengths, local_lengths=())`: peak memory per device;

and, for a whole Plan, `plan_time_ms` (a micro-batch takes as long as its slowest group; a step
is the sum over micro-batches) and `group_times_ms` (per micro-batch, per group: for plots).

The formula family (`FormulaCost`) is FlexSP's (ASPLOS'25, from the authors' public solver):

    compute_ms   = sum_s (a1 * s^2 * attn(s, k) + a2 * s) / d  [+ local whole sequences] + b1
    ulysses_ms   = ulysses_ms_per_token[d] * sum_s s / d                  (0 when d == 1)
    ring_ms      = ring_ms_per_token[d] * (d - 1) * sum_s s / d           (0 when d == 1)
    memory_mb    = states_mb + act_per_token_mb * (sum_s s / d + max_r sum(local on rank r))

* `attn(s, k)` is 1 for dense causal attention. With a sparse budget of k key blocks of `block`
  tokens per query block (MoBA / block top-k, the diagonal block always kept), query block i
  of nb = ceil(s / block) attends to min(i + 1, k) blocks instead of i + 1, so
  attn = (k (k + 1) / 2 + (nb - k) k) / (nb (nb + 1) / 2) when k < nb (exact block count of
  the causal block triangle kept; 1 otherwise). Only the quadratic (attention) term scales.
* FlexSP's all-to-all (Ulysses): 4 all-to-alls (q, k, v, out) per layer, forward and backward,
  of the device's s/d tokens x hidden x 2 bytes: 4 * 2 * L * E * s * 2 / 2^20 / d MB, over the
  profiled per-degree bandwidth bw[d] in GB/s; MB / (GB/s) is taken as ms, exactly as the
  published solver does (its numbers are reproduced with this). So
  ulysses_ms_per_token[d] = 4 * 2 * L * E * 2 / 2^20 / bw[d].
* Ring (our addition, not in FlexSP): each device's K and V shards (s/d tokens x kv width)
  travel d - 1 hops forward; backward sends K, V and dK, dV: 6 tensors x (d - 1) hops x
  L layers x E_kv x 2 bytes per token-per-device, over the same bandwidth table. Not overlapped
  with compute here (a pessimistic bound; real ring attention hides part of it).
* Skrull's local sequences (whole on one rank of the group, no communication) add the slowest
  rank's own compute and memory on top of the sharded part.
* A group with no sequences costs 0 ms (FlexSP's solver charges b1 to an empty group; a micro-batch
  always has a non-empty group, so the step time is the same).

Presets: `load_preset("flexsp-a100:gpt-7b", num_devices=64, max_len=192000, memory_limit_gb=30)`
(also gpt-13b, gpt-30b), `load_preset("skrull-h100:qwen2.5-0.5b")` (Skrull's model, from
jaxsb.planner.skrull), and calibrated JSON files (`CalibratedCost`, fitted by `fit_constants`, or per
degree and on the executor's padded buffers by `fit_per_degree` — what `python -m jaxsb.calibrate`
does, see CalibratedCost for why).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

# FlexSP's A100-40GB profile, as in the authors' public solver (PKU-DAIR/Hetu-Galvatron, branch
# flexsp, galvatron/flexsp_solver/solver.py); the same facts are in shared/data/cost_presets.json.
FLEXSP_A100_BW_GBS = {1: 1e10, 2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}
FLEXSP_A100_MODELS = {
    "gpt-7b": dict(act_per_token_mb=4.480441895, a1=5.128e-6, a2=0.1839576, b1=629.3563, hidden=4096,
                   layers=32, params_b={4: 6.51, 192: 7.1174468994140625, 384: 7.8498687744140625}),
    "gpt-13b": dict(act_per_token_mb=4.220439453, a1=9.2852e-6, a2=0.3060189, b1=1132.5632, hidden=5120,
                    layers=40, params_b={4: 12.3568, 192: 13.11605453491211, 384: 14.03158187866211}),
    "gpt-30b": dict(act_per_token_mb=3.417381836, a1=1.54262e-5, a2=0.8035742, b1=2789.3644, hidden=6656,
                    layers=60, params_b={4: 30.538, 192: 31.52513885498047, 384: 32.71532440185547}),
}
FLEXSP_MEMORY_LIMIT_GB = 30


@runtime_checkable
class CostModel(Protocol):
    """What planners and the simulator need from a cost model (see docs/CONTRACTS.md)."""

    name: str
    memory_limit_mb: float

    def group_time_ms(self, degree: int, sharded_lengths: Sequence[int],
                      local_lengths: Sequence[Sequence[int]] = (), scheme: str = "ulysses",
                      budgets: Sequence[int] | None = None) -> float: ...

    def group_memory_mb(self, degree: int, sharded_lengths: Sequence[int],
                        local_lengths: Sequence[Sequence[int]] = ()) -> float: ...

    def plan_time_ms(self, plan) -> float: ...


# ------------------------------------------------------------------------ plan-level helpers


def _group_inputs(plan, m: int, g: int):
    sharded, local = plan.sequences_of(m, g)
    degree = plan.template.microbatches[m].groups[g].degree
    lens = plan.lengths
    sharded_l = [lens[i] for i in sharded]
    local_l = [[lens[i] for i in local.get(r, [])] for r in range(degree)] if local else []
    budgets = None
    if plan.budgets is not None:
        budgets = [plan.budgets[i] for i in sharded]
        for r in range(degree if local else 0):
            budgets += [plan.budgets[i] for i in local.get(r, [])]
    return degree, sharded_l, local_l, budgets


def group_times_ms(cost: CostModel, plan) -> list[list[float]]:
    """Per micro-batch, per group of the plan: the cost model's time (ms) of that group."""
    out = []
    for m, mb in enumerate(plan.template.microbatches):
        row = []
        for g, group in enumerate(mb.groups):
            degree, sharded, local, budgets = _group_inputs(plan, m, g)
            row.append(cost.group_time_ms(degree, sharded, local, scheme=group.scheme, budgets=budgets))
        out.append(row)
    return out


def plan_time_ms(cost: CostModel, plan) -> float:
    """Sum over micro-batches of the slowest group."""
    return float(sum(max(row, default=0.0) for row in group_times_ms(cost, plan)))


def plan_memory_mb(cost: CostModel, plan) -> float:
    """Peak predicted memory per device over the plan's groups."""
    peak = 0.0
    for m, mb in enumerate(plan.template.microbatches):
        for g, _ in enumerate(mb.groups):
            degree, sharded, local, _ = _group_inputs(plan, m, g)
            peak = max(peak, cost.group_memory_mb(degree, sharded, local))
    return peak


def token_capacity(cost: CostModel, degree: int) -> int:
    """Most tokens a group of `degree` devices can hold sharded, under the memory limit.

    Uses the model's own `token_capacity(degree)` method when it has one, else bisects
    `group_memory_mb` (monotone in the tokens)."""
    own = getattr(cost, "token_capacity", None)
    if callable(own):
        return int(own(degree))
    if cost.group_memory_mb(degree, [1]) > cost.memory_limit_mb:
        return 0
    lo, hi = 1, 2
    while cost.group_memory_mb(degree, [hi]) <= cost.memory_limit_mb:
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost.group_memory_mb(degree, [mid]) <= cost.memory_limit_mb:
            lo = mid
        else:
            hi = mid
    return lo


def sparse_attention_fraction(length: int, budget: int | None, block: int) -> float:
    """Fraction of the dense causal block triangle kept by a top-`budget` block-sparse pattern."""
    if budget is None or budget <= 0:
        return 1.0
    nb = -(-int(length) // block)
    k = int(budget)
    if k >= nb:
        return 1.0
    return (k * (k + 1) / 2 + (nb - k) * k) / (nb * (nb + 1) / 2)


# ---------------------------------------------------------------------------- the formula


@dataclasses.dataclass
class FormulaCost:
    """FlexSP's formula family with explicit constants (see the module docstring).

    `ulysses_ms_per_token[d]` / `ring_ms_per_token[d]`: communication ms per token held per device
    (ring: per hop). An empty table means that communication is not modeled separately (a fit
    that absorbed it into a2); degrees missing from a non-empty table cannot be costed."""

    name: str
    a1: float  # ms per token^2 (attention), whole model, one device
    a2: float  # ms per token (linear part), whole model, one device
    b1: float  # ms per group per micro-batch
    memory_limit_mb: float
    states_mb: float  # model states (params, grads, optimizer) per device
    act_per_token_mb: float
    ulysses_ms_per_token: dict = dataclasses.field(default_factory=dict)
    ring_ms_per_token: dict = dataclasses.field(default_factory=dict)
    block: int = 128  # sparse-attention block size, tokens

    def __post_init__(self):
        self.ulysses_ms_per_token = {int(k): float(v) for k, v in self.ulysses_ms_per_token.items()}
        self.ring_ms_per_token = {int(k): float(v) for k, v in self.ring_ms_per_token.items()}

    # -------------------------------------------------------------------- per sequence / group
    def compute_ms(self, length: int, degree: int = 1, budget: int | None = None) -> float:
        """One sequence's compute time sharded over `degree` devices (no overhead, no comm)."""
        s = float(length)
        frac = sparse_attention_fraction(length, budget, self.block)
        return (self.a1 * s * s * frac + self.a2 * s) / degree

    def comm_ms(self, degree: int, tokens: float, scheme: str = "ulysses") -> float:
        """Communication of a group whose sharded sequences total `tokens`."""
        if degree == 1 or tokens == 0 or scheme == "local":
            return 0.0
        if scheme not in ("ulysses", "ring"):
            raise ValueError(f"scheme {scheme!r} is not one of ('local', 'ulysses', 'ring')")
        table = self.ring_ms_per_token if scheme == "ring" else self.ulysses_ms_per_token
        if not table:  # not modeled separately (a calibration that folded it into a2)
            return 0.0
        if degree not in table:
            raise ValueError(f"cost model {self.name}: no {scheme} bandwidth for degree {degree} "
                             f"(known degrees {sorted(table)})")
        per_device = tokens / degree
        hops = (degree - 1) if scheme == "ring" else 1
        return table[degree] * per_device * hops

    def group_time_ms(self, degree: int, sharded_lengths: Sequence[int],
                      local_lengths: Sequence[Sequence[int]] = (), scheme: str = "ulysses",
                      budgets: Sequence[int] | None = None) -> float:
        """One group's time for one micro-batch (ms).

        `budgets`: None (dense), or one per sharded length, or one per sharded length followed by
        one per local length (rank 0's, then rank 1's, ...); missing ones are dense."""
        sharded = [int(n) for n in sharded_lengths]
        local = [[int(n) for n in ids] for ids in local_lengths]
        if not sharded and not any(local):
            return 0.0
        bud = list(budgets) if budgets is not None else []
        bud += [None] * (len(sharded) + sum(len(r) for r in local) - len(bud))
        if degree == 1:  # everything whole on one device, no communication
            flat = sharded + [n for r in local for n in r]
            return sum(self.compute_ms(n, 1, b) for n, b in zip(flat, bud)) + self.b1
        t = sum(self.compute_ms(n, degree, b) for n, b in zip(sharded, bud))
        t += self.comm_ms(degree, sum(sharded), scheme)
        i, slowest = len(sharded), 0.0
        for r in local:
            slowest = max(slowest, sum(self.compute_ms(n, 1, b) for n, b in zip(r, bud[i:i + len(r)])))
            i += len(r)
        return t + slowest + self.b1

    def group_memory_mb(self, degree: int, sharded_lengths: Sequence[int],
                        local_lengths: Sequence[Sequence[int]] = ()) -> float:
        """Peak memory per device of a group: model states + activations of the busiest rank."""
        tokens = sum(int(n) for n in sharded_lengths) / degree
        tokens += max((sum(int(n) for n in r) for r in local_lengths), default=0)
        return self.states_mb + self.act_per_token_mb * tokens

    def device_token_capacity(self) -> int:
        """Tokens of activations one device holds next to its model states (FlexSP's floor)."""
        return max(0, int((self.memory_limit_mb - self.states_mb) / self.act_per_token_mb))

    def token_capacity(self, degree: int) -> int:
        """Tokens a group of `degree` devices holds sharded (the per-device floor times degree)."""
        return self.device_token_capacity() * degree

    # ------------------------------------------------------------------------------ plans
    def group_times_ms(self, plan) -> list[list[float]]:
        return group_times_ms(self, plan)

    def plan_time_ms(self, plan) -> float:
        return plan_time_ms(self, plan)

    def plan_memory_mb(self, plan) -> float:
        return plan_memory_mb(self, plan)

    def describe(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------- FlexSP


def flexsp_params_b(model: str, max_len: int) -> float:
    """The parameter count (billions) FlexSP's solver uses for a max sequence length: its table
    entry for 4K/192K/384K, otherwise linear through the 192K and 384K entries (as the solver)."""
    table = FLEXSP_A100_MODELS[model]["params_b"]
    k = max_len / 1000
    if k in table:
        return table[k]
    return (table[384] - table[192]) / 192 * (k - 192) + table[192]


@dataclasses.dataclass
class FlexSPCost(FormulaCost):
    """FlexSP's A100-40GB profile for one GPT model (ZeRO-3 model states over all devices)."""

    model: str = ""
    num_devices: int = 64
    max_len: int = 192000
    params_b: float = 0.0

    @classmethod
    def preset(cls, model: str, *, num_devices: int = 64, max_len: int = 192000,
               memory_limit_gb: float = FLEXSP_MEMORY_LIMIT_GB, params_key: str | None = None,
               bandwidth_gbs: Mapping[int, float] | None = None, block: int = 128) -> "FlexSPCost":
        """`params_key` ("4k", "192k", "384k") overrides the choice of parameter count by max_len."""
        if model not in FLEXSP_A100_MODELS:
            raise ValueError(f"unknown FlexSP model {model!r}; known: {sorted(FLEXSP_A100_MODELS)}")
        if num_devices < 1:
            raise ValueError(f"num_devices={num_devices} must be >= 1")
        p = FLEXSP_A100_MODELS[model]
        if params_key is not None:
            key = int(str(params_key).lower().rstrip("k"))
            if key not in p["params_b"]:
                raise ValueError(f"params_key={params_key!r} must be one of 4k, 192k, 384k")
            params_b = p["params_b"][key]
        else:
            params_b = flexsp_params_b(model, max_len)
        bw = {int(k): float(v) for k, v in (bandwidth_gbs or FLEXSP_A100_BW_GBS).items()}
        layers, hidden = p["layers"], p["hidden"]
        ulysses = {d: 4 * 2 * layers * hidden * 2 / 2**20 / v for d, v in bw.items()}
        ring = {d: 6 * layers * hidden * 2 / 2**20 / v for d, v in bw.items()}  # GPT: kv width = E
        return cls(name=f"flexsp-a100:{model}", a1=p["a1"], a2=p["a2"], b1=p["b1"],
                   memory_limit_mb=memory_limit_gb * 1024, states_mb=params_b * 16 * 1024 / num_devices,
                   act_per_token_mb=p["act_per_token_mb"], ulysses_ms_per_token=ulysses,
                   ring_ms_per_token=ring, block=block, model=model, num_devices=num_devices,
                   max_len=max_len, params_b=params_b)

    def alltoall_ms(self, lengths: Sequence[int], degree: int) -> float:
        """FlexSP's all-to-all time of a group holding `lengths` (its solver's alltoall_time)."""
        return self.comm_ms(degree, sum(lengths), "ulysses")


# ----------------------------------------------------------------------------- calibrated


@dataclasses.dataclass
class CalibratedCost(FormulaCost):
    """Constants fitted on this machine (by jaxsb.calibrate); saved and loaded as JSON."""

    source: str = ""  # what was measured: machine, model, date
    # Optional per-degree constants (jaxsb.calibrate fills them): where a degree is present they
    # override the scalar a1 / a2 / b1 for groups of that degree; the scalars stay the fallback.
    # Why: on a host whose N "devices" are simulated on a few cores, a group of degree d does not
    # run d times faster (every device's work is serialised on the same cores, idle devices
    # included), so one (a1, a2, b1) cannot fit all degrees of FlexSP's a / d formula.
    a1_by_degree: dict = dataclasses.field(default_factory=dict)
    a2_by_degree: dict = dataclasses.field(default_factory=dict)
    b1_by_degree: dict = dataclasses.field(default_factory=dict)
    # Price plans (plan_time_ms / group_times_ms) on the executor's padded buffers: each group's
    # sharded stream is padded to degree x the micro-batch's bucketed shard_len, the padding
    # counted as one more sequence (it is its own segment). group_time_ms (the planners'
    # additive per-group view) is unchanged. With `num_devices` > 0 (a host that serialises all
    # devices), a group's price also counts the padding that the other num_devices - degree
    # devices compute meanwhile: (a1 S^2 + a2 S) each, S = the micro-batch's shard_len.
    # The attention kernels pad a buffer to whole blocks of `attention_block` tokens (0: none):
    # with block 256, a 384-token buffer computes as 512 (block = min(block, buffer), so a buffer
    # shorter than one block is not padded).
    pad_to_buffers: bool = False
    num_devices: int = 0
    attention_block: int = 0

    def kernel_len(self, shard_len: int) -> int:
        """The per-device tokens the kernels compute for a buffer of `shard_len`."""
        return kernel_len(shard_len, self.attention_block)

    def __post_init__(self):
        super().__post_init__()
        for f in ("a1_by_degree", "a2_by_degree", "b1_by_degree"):
            setattr(self, f, {int(k): float(v) for k, v in getattr(self, f).items()})

    def constants(self, degree: int) -> tuple[float, float, float]:
        """(a1, a2, b1) for a group of `degree` devices."""
        d = int(degree)
        return (self.a1_by_degree.get(d, self.a1), self.a2_by_degree.get(d, self.a2),
                self.b1_by_degree.get(d, self.b1))

    def compute_ms(self, length: int, degree: int = 1, budget: int | None = None) -> float:
        a1, a2, _ = self.constants(degree)
        s = float(length)
        return (a1 * s * s * sparse_attention_fraction(length, budget, self.block) + a2 * s) / degree

    def group_time_ms(self, degree: int, sharded_lengths: Sequence[int],
                      local_lengths: Sequence[Sequence[int]] = (), scheme: str = "ulysses",
                      budgets: Sequence[int] | None = None) -> float:
        if not list(sharded_lengths) and not any(local_lengths):
            return 0.0  # an empty group costs nothing (as FormulaCost)
        t = super().group_time_ms(degree, sharded_lengths, local_lengths, scheme, budgets)
        return t - self.b1 + self.constants(degree)[2]

    def group_times_ms(self, plan) -> list[list[float]]:
        if not self.pad_to_buffers:
            return group_times_ms(self, plan)
        out = []
        for m, mb in enumerate(plan.template.microbatches):
            row = []
            for g, group in enumerate(mb.groups):
                degree, sharded, local, budgets = _group_inputs(plan, m, g)
                S = self.kernel_len(mb.shard_len)
                pad = degree * S - sum(sharded)
                if sharded and pad > 0:
                    if budgets is not None:
                        budgets = budgets[:len(sharded)] + [None] + budgets[len(sharded):]
                    sharded = sharded + [pad]
                t = self.group_time_ms(degree, sharded, local, scheme=group.scheme, budgets=budgets)
                if t and self.num_devices > degree:
                    a1, a2, _ = self.constants(degree)
                    t += (self.num_devices - degree) * (a1 * S * S + a2 * S)
                row.append(t)
            out.append(row)
        return out

    def plan_time_ms(self, plan) -> float:
        return float(sum(max(row, default=0.0) for row in self.group_times_ms(plan)))

    def save(self, path: str) -> None:
        d = dataclasses.asdict(self)
        d["kind"] = "calibrated"
        d["ulysses_ms_per_token"] = {str(k): v for k, v in self.ulysses_ms_per_token.items()}
        d["ring_ms_per_token"] = {str(k): v for k, v in self.ring_ms_per_token.items()}
        for f in ("a1_by_degree", "a2_by_degree", "b1_by_degree"):
            d[f] = {str(k): v for k, v in getattr(self, f).items()}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(d, f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "CalibratedCost":
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read calibrated cost model {path}: {e}") from e
        d.pop("kind", None)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"{path}: unknown fields {unknown} (expected some of {sorted(fields)})")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                         and f.name not in d)
        if missing:
            raise ValueError(f"{path}: missing fields {missing}")
        try:
            return cls(**d)
        except (TypeError, ValueError, AttributeError) as e:  # e.g. a table that is not a {degree: number}
            raise ValueError(f"{path}: malformed calibrated cost model: {e}") from e


def fit_constants(samples: Sequence[tuple[int, Sequence[int], float]], *, name: str = "calibrated",
                  memory_limit_mb: float = float("inf"), states_mb: float = 0.0,
                  act_per_token_mb: float = 0.0, ulysses_ms_per_token: Mapping | None = None,
                  ring_ms_per_token: Mapping | None = None, block: int = 128,
                  source: str = "") -> CalibratedCost:
    """Least-squares fit of a1, a2, b1 from measured group times.

    `samples`: (degree, lengths, measured_ms) — one group's measured time for sequences `lengths`
    sharded over `degree` devices. Features (sum s^2 / d, sum s / d, 1); negative coefficients
    are clamped to 0 and the rest refitted (non-negative least squares by active set). Measured
    communication, if any, is absorbed into a2 unless `ulysses_ms_per_token` is given, in which
    case its modeled time is subtracted first."""
    if not samples:
        raise ValueError("fit_constants needs at least one (degree, lengths, measured_ms) sample")
    rows, y = [], []
    uly = {int(k): float(v) for k, v in (ulysses_ms_per_token or {}).items()}
    for degree, lengths, ms in samples:
        s = np.asarray(list(lengths), dtype=np.float64)
        comm = uly.get(int(degree), 0.0) * s.sum() / degree if degree > 1 else 0.0
        rows.append([float((s * s).sum()) / degree, float(s.sum()) / degree, 1.0])
        y.append(float(ms) - comm)
    X, y = np.asarray(rows), np.asarray(y)
    # Scale columns so lstsq is well conditioned (s^2 terms are ~1e8 times the constant term).
    scale = np.maximum(np.abs(X).max(axis=0), 1e-30)
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active] / scale[active], y, rcond=None)
        sol = sol / scale[active]
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active = [a for a, c in zip(active, sol) if c >= 0] if (sol >= 0).any() else []
    return CalibratedCost(name=name, a1=float(coef[0]), a2=float(coef[1]), b1=float(coef[2]),
                          memory_limit_mb=memory_limit_mb, states_mb=states_mb,
                          act_per_token_mb=act_per_token_mb, ulysses_ms_per_token=dict(uly),
                          ring_ms_per_token=dict(ring_ms_per_token or {}), block=block, source=source)


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active set on column-scaled features (as fit_constants)."""
    scale = np.maximum(np.abs(X).max(axis=0), 1e-30)
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active] / scale[active], y, rcond=None)
        sol = sol / scale[active]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [a for a, c in zip(active, sol) if c >= 0] if (sol >= 0).any() else []
    return coef


def kernel_len(shard_len: int, block: int) -> int:
    """Tokens the attention kernels compute for a buffer: padded to whole blocks of
    min(block, buffer) (as kernels_pallas/flash_attention/xla.py and jaxsb/parallel/ring.py)."""
    S, b = int(shard_len), min(int(block), int(shard_len))
    return -(-S // b) * b if b > 0 else S


def calibration_features(degree: int, lengths: Sequence[int], budgets: Sequence[int | None] | None = None,
                         shard_len: int = 0, block: int = 128, num_devices: int = 0) -> list[float]:
    """(sum s^2 attn(s, k) / d, sum s / d, 1) of one group, its padding to `shard_len` tokens per
    device (when > 0) counted as one more dense sequence, plus (num_devices - d) idle devices'
    padding (S^2, S) each — the features `fit_per_degree` fits (CalibratedCost.group_times_ms)."""
    lens = [int(n) for n in lengths]
    bud = list(budgets) if budgets is not None else [None] * len(lens)
    pad = int(degree) * int(shard_len) - sum(lens)
    if shard_len and pad > 0:
        lens, bud = lens + [pad], bud + [None]
    quad = sum(float(n) * n * sparse_attention_fraction(n, b, block) for n, b in zip(lens, bud))
    idle = max(0, int(num_devices) - int(degree)) if shard_len else 0
    S = float(shard_len)
    return [quad / degree + idle * S * S, float(sum(lens)) / degree + idle * S, 1.0]


def fit_per_degree(samples: Sequence[tuple[int, Sequence[int], Sequence[int | None] | None, int, float]], *,
                   name: str = "calibrated", block: int = 128, pad_to_buffers: bool = True,
                   memory_limit_mb: float = float("inf"), states_mb: float = 0.0,
                   act_per_token_mb: float = 0.0, source: str = "", num_devices: int = 0,
                   attention_block: int = 0) -> CalibratedCost:
    """Fits a1, a2, b1 per degree (non-negative least squares) from measured group times.

    `samples`: (degree, lengths, budgets or None, shard_len, measured_ms) — one group of
    `degree` devices holding `lengths` sharded, in buffers of `shard_len` tokens per device (0:
    unpadded), measured at `measured_ms`. Features: `calibration_features` (padding included
    when `pad_to_buffers`, and with `num_devices` the idle devices' padding). Communication is folded into the per-degree constants. The scalar
    a1, a2, b1 are one fit over all samples, the fallback for degrees that were not measured."""
    if not samples:
        raise ValueError("fit_per_degree needs at least one (degree, lengths, budgets, shard_len, ms) sample")
    by_degree: dict[int, tuple[list, list]] = {}
    ab = int(attention_block) if pad_to_buffers else 0
    for degree, lengths, budgets, shard_len, ms in samples:
        shard_len = kernel_len(shard_len, ab)
        x = calibration_features(degree, lengths, budgets, shard_len if pad_to_buffers else 0, block,
                                 num_devices if pad_to_buffers else 0)
        rows, ys = by_degree.setdefault(int(degree), ([], []))
        rows.append(x)
        ys.append(float(ms))
    tables: dict[str, dict[int, float]] = {"a1": {}, "a2": {}, "b1": {}}
    for d, (rows, ys) in sorted(by_degree.items()):
        c = _nnls(np.asarray(rows), np.asarray(ys))
        for key, v in zip(("a1", "a2", "b1"), c):
            tables[key][d] = float(v)
    all_rows = np.asarray([r for rows, _ in by_degree.values() for r in rows])
    all_y = np.asarray([y for _, ys in by_degree.values() for y in ys])
    c = _nnls(all_rows, all_y)
    return CalibratedCost(name=name, a1=float(c[0]), a2=float(c[1]), b1=float(c[2]),
                          memory_limit_mb=memory_limit_mb, states_mb=states_mb,
                          act_per_token_mb=act_per_token_mb, block=block, source=source,
                          a1_by_degree=tables["a1"], a2_by_degree=tables["a2"], b1_by_degree=tables["b1"],
                          pad_to_buffers=pad_to_buffers, num_devices=num_devices if pad_to_buffers else 0,
                          attention_block=ab)


# -------------------------------------------------------------------------------- presets


PRESET_NAMES = tuple(f"flexsp-a100:{m}" for m in FLEXSP_A100_MODELS) + (
    "skrull-h100:qwen2.5-0.5b", "skrull-h100:qwen2.5-7b")


def load_preset(name: str, **options: Any) -> CostModel:
    """A cost model by name: "flexsp-a100:gpt-7b|gpt-13b|gpt-30b" (options: num_devices,
    max_len, memory_limit_gb, params_key, bandwidth_gbs, block), "skrull-h100:<model>"
    (jaxsb.planner.skrull.SkrullCost), or a calibrated JSON file ("calibrated:PATH" or a path
    ending in .json)."""
    if name.startswith("calibrated:") or name.endswith(".json"):
        path = name.split(":", 1)[1] if name.startswith("calibrated:") else name
        if options:
            raise ValueError(f"calibrated preset {path}: options {sorted(options)} are not supported")
        return CalibratedCost.load(path)
    family, _, model = name.partition(":")
    if family == "flexsp-a100":
        if model not in FLEXSP_A100_MODELS:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}")
        return FlexSPCost.preset(model, **options)
    if family == "skrull-h100":
        try:
            from jaxsb.planner.skrull import SkrullCost
        except ImportError as e:
            raise ValueError(f"preset {name!r} needs jaxsb.planner.skrull.SkrullCost: {e}") from e
        if hasattr(SkrullCost, "from_preset"):
            return SkrullCost.from_preset(name, **options)
        return SkrullCost(model, **options)
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}, "
                     "calibrated:PATH or a .json file")
