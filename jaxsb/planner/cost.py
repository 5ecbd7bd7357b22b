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
jaxsb.planner.skrull), and calibrated JSON files (`CalibratedCost`, fitted by `fit_calibrated` on
the executor's real work counts — what `python -m jaxsb.calibrate` does, see CalibratedCost).
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
            spans = {}
            if plan.parts is not None:  # split documents: only the pipeline setting's cost model takes them
                ids, by_rank = plan.sequences_of(m, g)
                spans = {"spans": [plan.span_of(i) for i in ids + [i for r in range(degree) for i in by_rank.get(r, [])]]}
            row.append(cost.group_time_ms(degree, sharded, local, scheme=group.scheme, budgets=budgets, **spans))
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


# ----------------------------------------------------------------------------- calibrated


@dataclasses.dataclass
class CalibratedCost(FormulaCost):
    """Constants fitted on this machine by `python -m jaxsb.calibrate`; saved and loaded as JSON.

    Plans are priced on the work the executor makes the devices do (`jaxsb.planner.work`):

        step_ms = sum over micro-batches of  coef . (1, buffer tokens, attention pairs,
                                                     ring rounds, ring tokens, ulysses tokens)

    with the counts summed over all devices, padding and idle devices included — the model of a
    host whose N devices share its cores (`serial_devices`, the CPU machine with simulated
    devices): they take turns on the same cores, so the step is the sum of their work, not the
    slowest group's, and a group of degree d is not d times faster. The counts follow the
    kernels' block skipping, so a 384-token buffer in 256-token blocks costs as 512, documents
    packed in one buffer cost their own triangles, and padding costs what the kernels spend on it.

    The planners' additive per-group view (`group_time_ms`) is FlexSP's formula with
    a1 = coef["pairs"] / 2 (a causal sequence of s tokens has about s^2 / 2 pairs), a2 =
    coef["tokens"], b1 = coef["microbatches"] and the ring / Ulysses coefficients as its
    communication; with `serial_devices` the 1 / d of parallel devices is dropped (sharding
    speeds nothing up on one host)."""

    source: str = ""  # what was measured: machine, model, date
    coef: dict = dataclasses.field(default_factory=dict)  # work.FEATURES name -> ms per unit
    num_devices: int = 0
    serial_devices: bool = True
    attention_block: int = 256  # the dense kernels' block (model.attention_block)
    sparse_block: int = 0  # > 0: the model attends block-sparse in blocks of this many tokens
    align: int = 1  # sequences start on multiples of this in the buffers (executor.alignment)
    measurements: list = dataclasses.field(default_factory=list)  # what calibrate measured

    def __post_init__(self):
        super().__post_init__()
        from jaxsb.planner.work import FEATURES

        unknown = sorted(set(self.coef) - set(FEATURES))
        if unknown:
            raise ValueError(f"coef has unknown terms {unknown} (expected some of {list(FEATURES)})")
        self.coef = {f: float(self.coef.get(f, 0.0)) for f in FEATURES}
        bad = {f: v for f, v in self.coef.items() if not (v >= 0 and np.isfinite(v))}
        if bad:
            raise ValueError(f"coef must be finite and >= 0, got {bad}")
        self.a1, self.a2, self.b1 = self.coef["pairs"] / 2, self.coef["tokens"], self.coef["microbatches"]

    # ------------------------------------------------------------ the planners' group view
    def compute_ms(self, length: int, degree: int = 1, budget: int | None = None) -> float:
        t = super().compute_ms(length, 1, budget)
        return t if self.serial_devices else t / degree

    def comm_ms(self, degree: int, tokens: float, scheme: str = "ulysses") -> float:
        if degree == 1 or tokens == 0 or scheme == "local":
            return 0.0
        per_device = tokens / degree
        if scheme == "ring":
            return (self.coef["ring_rounds"] + self.coef["ring_tokens"] * per_device) * degree
        if scheme == "ulysses":
            return self.coef["ulysses_tokens"] * per_device
        raise ValueError(f"scheme {scheme!r} is not one of ('local', 'ulysses', 'ring')")

    # --------------------------------------------------------------------- whole plans
    def work(self, plan) -> np.ndarray:
        """The plan's [work.FEATURES] counts."""
        from jaxsb.planner.work import plan_work

        return plan_work(plan, attention_block=self.attention_block, sparse_block=self.sparse_block,
                         align=self.align)

    def plan_time_ms(self, plan) -> float:
        from jaxsb.planner.work import FEATURES

        return float(np.dot(self.work(plan), [self.coef[f] for f in FEATURES]))

    def combine_ms(self, times) -> float:
        """The step from per-group times (the budget pass's view): with `serial_devices` every
        group's work adds up (no device idles while another works), else the slowest group of
        each micro-batch."""
        if self.serial_devices:
            return float(sum(sum(row) for row in times))
        return float(sum(max(row, default=0.0) for row in times))

    # ------------------------------------------------------------------------- files
    def save(self, path: str) -> None:
        d = dataclasses.asdict(self)
        d["kind"] = "calibrated"
        for f in ("ulysses_ms_per_token", "ring_ms_per_token"):
            d[f] = {str(k): v for k, v in d[f].items()}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(d, f, indent=1, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "CalibratedCost":
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read calibrated cost model {path}: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(d).__name__}")
        d.pop("kind", None)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"{path}: unknown fields {unknown} (expected some of {sorted(fields)})")
        required = ("name", "coef", "memory_limit_mb", "states_mb", "act_per_token_mb")
        missing = [f for f in required if f not in d]
        if missing:
            raise ValueError(f"{path}: missing fields {missing}")
        d.setdefault("a1", 0.0), d.setdefault("a2", 0.0), d.setdefault("b1", 0.0)  # derived from coef
        try:
            return cls(**d)
        except (TypeError, ValueError, AttributeError) as e:  # e.g. a coef that is not a number
            raise ValueError(f"{path}: malformed calibrated cost model: {e}") from e


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active set on column-scaled features (a negative
    coefficient is clamped to 0 and the rest refitted)."""
    scale = np.maximum(np.abs(X).max(axis=0), 1e-30)
    active = [i for i in range(X.shape[1]) if np.abs(X[:, i]).max() > 0]
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active] / scale[active], y, rcond=None)
        sol = sol / scale[active]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [a for a, c in zip(active, sol) if c >= 0] if (sol >= 0).any() else []
    return coef


def fit_calibrated(samples: Sequence[tuple[Any, float]], *, name: str = "calibrated",
                   attention_block: int = 256, sparse_block: int = 0, align: int = 1,
                   relative: bool = True, **fields: Any) -> CalibratedCost:
    """Fits CalibratedCost.coef to measured (plan, ms) samples by non-negative least squares.

    `relative`: minimise relative errors (each sample weighted by 1 / ms), so that short steps
    count as much as long ones. `fields`: the other CalibratedCost fields (memory, source, ...)."""
    if not samples:
        raise ValueError("fit_calibrated needs at least one (plan, measured_ms) sample")
    from jaxsb.planner.work import FEATURES, plan_work

    X = np.asarray([plan_work(plan, attention_block=attention_block, sparse_block=sparse_block, align=align)
                    for plan, _ in samples])
    y = np.asarray([float(ms) for _, ms in samples])
    w = 1.0 / y if relative else np.ones_like(y)
    c = _nnls(X * w[:, None], y * w)
    fields.setdefault("memory_limit_mb", float("inf"))
    fields.setdefault("states_mb", 0.0)
    fields.setdefault("act_per_token_mb", 0.0)
    return CalibratedCost(name=name, a1=0.0, a2=0.0, b1=0.0, coef=dict(zip(FEATURES, map(float, c))),
                          attention_block=attention_block, sparse_block=sparse_block, align=align, **fields)



# -------------------------------------------------------------------------------- presets


PRESET_NAMES = tuple(f"flexsp-a100:{m}" for m in FLEXSP_A100_MODELS) + (
    "skrull-h100:qwen2.5-0.5b", "skrull-h100:qwen2.5-7b",
    "sparsebalance-h200:qwen2.5-0.5b", "sparsebalance-h200:qwen2.5-3b")


def load_preset(name: str, **options: Any) -> CostModel:
    """A cost model by name: "flexsp-a100:gpt-7b|gpt-13b|gpt-30b" (options: num_devices,
    max_len, memory_limit_gb, params_key, bandwidth_gbs, block), "skrull-h100:<model>"
    (jaxsb.planner.skrull_cost.SkrullCost), "sparsebalance-h200:qwen2.5-0.5b|qwen2.5-3b"
    (jaxsb.planner.pipeline_cost.PipelineCost; options pp, tp, block, base_budget, ...), or a
    calibrated JSON file ("calibrated:PATH" or a path
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
    if family == "sparsebalance-h200":
        from jaxsb.planner.pipeline_cost import PipelineCost

        return PipelineCost.preset(model, **options)
    if family == "skrull-h100":
        from jaxsb.planner.skrull_cost import SkrullCost

        return SkrullCost.from_preset(name, **options)
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}, "
                     "calibrated:PATH or a .json file")
