"""Per-step planning for the training loop: the step's pieces -> sequences -> Plan -> admitted template.

`StepPlanner.plan(step)` turns the data iterator's pieces (`StepPieces`, never packed into
rows) into sequences, asks the configured planner (`parallel.planner`, on the cost model
`parallel.preset`) for a Plan and times it. It is pure host work (numpy / python-mip), so the
trainer runs it for step t+1 in a background thread while step t runs.

`admit(plan)` then decides which compiled program runs it (main thread, it owns the compile
cache), keeping the number of programs at most `parallel.max_programs`:
  1. a template already compiled runs as is, and so does a plan that a compiled template with
     the same groups holds with buffers at most WIDEN_FIRST_GROWTH times its own (a little
     padding costs less than a compile);
  2. while there is room (one slot is kept for the fallback), a new template is compiled;
  3. otherwise the plan is *widened* into a compiled template with the same groups and
     micro-batch count and buffers at least as large (only padding changes);
  4. otherwise the step runs the fallback plan — every sequence sharded over one group of all
     devices in one micro-batch — itself widened into the fallback program compiled earlier.
Planners are told what the executor runs (`jaxsb.plan.Runnable`), so every plan they return is
executable; the fallback is only for the program bound. Every decision is counted and logged.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

import numpy as np

from jaxsb.config import Config, ConfigError, ModelConfig
from jaxsb.data import Piece, StepPieces
from jaxsb.plan.layout import SeqData
from jaxsb.plan import GroupSpec, Plan, Runnable, Template, build_plan
from jaxsb.planner.base import SolveInfo


def sequence_of_piece(piece: Piece) -> SeqData:
    """A piece as the executor's sequence: token j's target is token j+1 of the same piece,
    trained where the piece's flags say; the last token has no target (masked)."""
    n = len(piece)
    targets = np.zeros(n, np.int32)
    targets[:-1] = piece.ids[1:]
    loss_mask = np.zeros(n, np.float32)
    loss_mask[:-1] = piece.flags[1:]
    return SeqData(np.asarray(piece.ids, np.int32), targets, loss_mask, np.arange(n, dtype=np.int32))


def step_sequences(step: StepPieces) -> list[SeqData]:
    """The step's pieces as the executor's sequences, in the step's order (the plan's indices)."""
    return [sequence_of_piece(p) for p in step.pieces]


@dataclasses.dataclass
class PlannedStep:
    step: StepPieces
    seqs: list[SeqData]
    plan: Plan
    solve_s: float
    info: SolveInfo
    data_state: dict | None = None  # the iterator's state right after this step was drawn
    budget_record: dict = dataclasses.field(default_factory=dict)  # parallel.budgets=dst: see budget_record


SHIPPED_PRESETS = {  # calibrated on this project's CPU machine by `python -m jaxsb.calibrate`
    "cpu": os.path.join(os.path.dirname(os.path.dirname(__file__)), "planner", "presets", "cpu.json"),
}


def resolve_preset(preset: str, device_kind: str) -> str:
    """`parallel.preset=auto`: the data-sheet preset of the devices the run uses (their jax
    `device_kind`, e.g. "TPU v5 lite" -> tpu-v5e), the shipped calibrated "cpu" on CPU devices.
    Any other value is returned unchanged."""
    from jaxsb.planner.hardware import CHIPS, chip_for_device_kind

    if preset != "auto":
        return preset
    if device_kind.lower() == "cpu":
        return "cpu"
    found = chip_for_device_kind(device_kind)
    if found is None:
        raise ConfigError(f"parallel.preset=auto: no data-sheet preset for devices of kind {device_kind!r} "
                          f"(known: {', '.join(CHIPS)}); set parallel.preset to one of them or to a "
                          "calibrated JSON made by `python -m jaxsb.calibrate --out PATH`")
    return found.name


def load_cost_model(preset: str, num_devices: int, max_len: int, model_cfg: ModelConfig | None = None,
                    fsdp: bool = True):
    """`parallel.preset`: a shipped calibrated preset ("cpu"), a calibrated JSON path, a chip's
    data-sheet preset (jaxsb.planner.hardware.CHIPS: tpu-v5p, gpu-h100, ...; needs the model),
    or a published profile (jaxsb.planner.cost.load_preset)."""
    from jaxsb.planner.cost import load_preset
    from jaxsb.planner.hardware import CHIPS, hardware_cost

    if preset in CHIPS:
        if model_cfg is None:
            raise ValueError(f"parallel.preset={preset!r} prices a model: pass its ModelConfig")
        return hardware_cost(CHIPS[preset], model_cfg, num_devices, fsdp=fsdp)
    path = SHIPPED_PRESETS.get(preset, preset)
    if path.endswith(".json"):
        if not os.path.exists(path):
            raise FileNotFoundError(f"parallel.preset={preset!r}: no calibrated preset at {path} "
                                    "(make one with `python -m jaxsb.calibrate --out PATH`)")
        return load_preset(path)
    return load_preset(preset, num_devices=num_devices, max_len=max_len)


def with_memory_limit(cost, memory_mb: float):
    """The cost model planning for devices of `memory_mb` MB each (parallel.cpu_device_memory_mb)."""
    if not (dataclasses.is_dataclass(cost) and hasattr(cost, "memory_limit_mb")):
        raise ConfigError(f"parallel.cpu_device_memory_mb: cost model {getattr(cost, 'name', cost)!r} has its "
                          "own memory model (a token capacity); leave cpu_device_memory_mb at 0")
    states = getattr(cost, "states_mb", 0.0)
    if memory_mb <= states:
        raise ConfigError(f"parallel.cpu_device_memory_mb={memory_mb:g}: the model states alone take "
                          f"{states:.1f} MB per device under cost model {cost.name}")
    return dataclasses.replace(cost, memory_limit_mb=float(memory_mb))


def priced_in_blocks(cost, block: int):
    """The cost model with sparse budgets counted in the model's routing blocks (`block` of the
    group view, `sparse_block` of a calibrated model's work counts)."""
    changes = {f: int(block) for f in ("block", "sparse_block") if hasattr(cost, f)}
    return dataclasses.replace(cost, **changes) if changes and dataclasses.is_dataclass(cost) else cost


class StepPlanner:
    """The configured planner applied to each step's sequences."""

    def __init__(self, cfg: Config, model_cfg: ModelConfig, num_devices: int, device_kind: str = "cpu"):
        """`device_kind`: jax's name for the devices planned for (parallel.preset=auto)."""
        from jaxsb.planner.registry import make_planner, planner_options

        self.cfg, self.model_cfg, self.num_devices = cfg, model_cfg, num_devices
        self.runnable = Runnable.for_model(model_cfg)
        self.align = self.runnable.align
        self.preset = resolve_preset(cfg.parallel.preset, device_kind)
        self.cost = load_cost_model(self.preset, num_devices, cfg.data.max_len, model_cfg, cfg.parallel.fsdp)
        if cfg.parallel.cpu_device_memory_mb and device_kind.lower() == "cpu":
            self.cost = with_memory_limit(self.cost, cfg.parallel.cpu_device_memory_mb)
        if model_cfg.attention == "sparse":
            self.cost = priced_in_blocks(self.cost, model_cfg.sparse.block_size)
        p = cfg.parallel
        self.scheme = p.scheme
        options = planner_options(p.planner, num_devices, time_limit_s=p.plan_time_limit_s, scheme=p.scheme,
                                  degree=p.sp_degree or num_devices, cp=p.cp or num_devices,
                                  runnable=self.runnable)
        self.history = None
        sp = model_cfg.sparse
        if p.budgets == "dst":  # budgets chosen per document from the measured curves
            from jaxsb.planner.coverage import CoverageHistory

            options |= dict(budgets="dst", base_budget=sp.top_k, max_blocks=sp.max_blocks,
                            coverage_drop=sp.coverage_drop)
            self.history = CoverageHistory(sp.top_k, sp.max_blocks)
        self.planner = make_planner(p.planner, self.cost, num_devices, **options)

    def plan(self, step: StepPieces) -> PlannedStep:
        seqs = step_sequences(step)
        lengths = [len(s) for s in seqs]
        budgets = [self.model_cfg.sparse.start_budget] * len(seqs)
        coverage = None if self.history is None else self.history.curves_for(lengths)
        t0 = time.perf_counter()
        solution = self.planner.solve(lengths, None if coverage else budgets, coverage=coverage)
        solve_s = time.perf_counter() - t0
        record = {}
        if coverage is not None:
            record = budget_record(solution.plan, self.cost, coverage, self.model_cfg.sparse.top_k,
                                   self.history.measured(lengths))
        return PlannedStep(step, seqs, solution.plan, solve_s, solution.info, budget_record=record)

    def fallback(self, plan: Plan) -> Plan:
        """Every sequence sharded over one ring of all devices, one micro-batch: any lengths fit
        and the zigzag layout keeps it balanced (dense and block-sparse alike)."""
        n, N = len(plan.lengths), self.num_devices
        return build_plan(N, [[GroupSpec(N, "ring", tuple(range(n)))]], plan.lengths,
                          budgets=plan.budgets, align=self.align, planner="fallback")


WIDEN_FIRST_GROWTH = 1.5  # buffer tokens a compiled template may add to a plan before a new compile is preferred


def widen(plan: Plan, templates: Sequence[Template], max_growth: float = float("inf")) -> Plan | None:
    """The plan moved onto the smallest compiled template with the same groups and buffers at
    least as large (and at most `max_growth` times its tokens per device), or None."""
    own = sum(mb.tokens_per_device for mb in plan.template.microbatches)
    best = None
    for t in templates:
        if t.num_devices != plan.template.num_devices or len(t.microbatches) != len(plan.template.microbatches):
            continue
        if all(a.groups == b.groups and a.shard_len >= b.shard_len and a.local_len >= b.local_len
               for a, b in zip(t.microbatches, plan.template.microbatches)):
            size = sum(mb.tokens_per_device for mb in t.microbatches)
            if size <= max_growth * own and (best is None or size < best[0]):
                best = (size, t)
    return None if best is None else dataclasses.replace(plan, template=best[1])


@dataclasses.dataclass
class Admission:
    plan: Plan
    how: str  # compiled | new | widened | fallback | fallback-new | over-bound


class ProgramBudget:
    """Chooses, per step, the program that runs the plan (module docstring, steps 1-4)."""

    def __init__(self, max_programs: int):
        self.max_programs = max_programs
        self.templates: list[Template] = []
        self.counts: dict[str, int] = {}

    def admit(self, plan: Plan, fallback) -> Admission:
        adm = self._choose(plan, fallback)
        if adm.plan.template not in self.templates:
            self.templates.append(adm.plan.template)
        self.counts[adm.how] = self.counts.get(adm.how, 0) + 1
        return adm

    def _choose(self, plan: Plan, fallback) -> Admission:
        if plan.template in self.templates:
            return Admission(plan, "compiled")
        near = widen(plan, self.templates, WIDEN_FIRST_GROWTH)
        if near is not None:
            return Admission(near, "widened")
        if len(self.templates) < self.max_programs - 1:
            return Admission(plan, "new")
        widened = widen(plan, self.templates)
        if widened is not None:
            return Admission(widened, "widened")
        fb = fallback(plan)
        if fb.template in self.templates:
            return Admission(fb, "fallback")
        widened = widen(fb, self.templates)
        if widened is not None:
            return Admission(widened, "fallback")
        return Admission(fb, "fallback-new" if len(self.templates) < self.max_programs else "over-bound")


def predicted_imbalance(plan: Plan, cost, budgets) -> float:
    """max / mean over devices of the modelled busy time with these per-sequence budgets."""
    from jaxsb.planner.cost import group_times_ms

    loads = np.zeros(plan.template.num_devices)
    times = group_times_ms(cost, plan.with_budgets(budgets))
    for m, mb in enumerate(plan.template.microbatches):
        for g, group in enumerate(mb.groups):
            loads[group.start:group.start + group.degree] += times[m][g]
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def budget_record(plan: Plan, cost, curves, base: int, measured: Sequence[bool]) -> dict:
    """metrics.jsonl fields of a DST plan: budgets min/mean/max, the coverage its budgets keep
    by the planning curves of the sequences whose length bin was measured (mean/min,
    predicted; None before any), how many were not, and the modelled device imbalance at the
    base budget and after DST."""
    from jaxsb.planner.coverage import coverage_at

    ks = list(plan.budgets)
    cov = [coverage_at(c, k) for c, k, seen in zip(curves, ks, measured) if seen]
    return {"budget_min": int(min(ks)), "budget_mean": float(np.mean(ks)), "budget_max": int(max(ks)),
            "planned_coverage_mean": float(np.mean(cov)) if cov else None,
            "planned_coverage_min": float(np.min(cov)) if cov else None,
            "budgets_unmeasured": int(len(ks) - sum(measured)),
            "predicted_imbalance_base": predicted_imbalance(plan, cost, [base] * len(ks)),
            "predicted_imbalance_dst": predicted_imbalance(plan, cost, ks)}


def group_times(plan: Plan, cost) -> list[list[float]]:
    """Modelled busy ms of every group of every micro-batch (0 for a group with nothing to do);
    a group's devices are all busy for its time."""
    out = []
    for m, mb in enumerate(plan.template.microbatches):
        row = []
        for g, group in enumerate(mb.groups):
            sharded, local = plan.sequences_of(m, g)
            if not sharded and not local:
                row.append(0.0)
                continue
            scheme = "ulysses" if group.degree == 1 else group.scheme  # degree 1: no communication
            row.append(float(cost.group_time_ms(group.degree, [plan.lengths[i] for i in sharded],
                                                [[plan.lengths[i] for i in local.get(r, [])]
                                                 for r in range(group.degree)], scheme=scheme)))
        out.append(row)
    return out


def load_balance(plan: Plan, cost, times: list[list[float]] | None = None) -> tuple[float, float]:
    """(max, mean) modelled busy ms per device over the step (`times`: group_times, if made)."""
    times = group_times(plan, cost) if times is None else times
    loads = np.zeros(plan.template.num_devices)
    for mb, row in zip(plan.template.microbatches, times):
        for group, ms in zip(mb.groups, row):
            loads[group.start:group.start + group.degree] += ms
    return float(np.max(loads)), float(np.mean(loads))
