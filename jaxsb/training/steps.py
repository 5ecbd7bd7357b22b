"""How each step's program and arguments are prepared: packed rows (`RowSteps`) or a plan of
the step's pieces (`PlannedSteps`: the planner for step t+1 runs in a background thread while
step t runs), each with its compile cache (one program per batch shape / per plan template)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxsb import mesh as mesh_lib
from jaxsb.config import Config, ModelConfig
from jaxsb.data import Batch, DataIterator, StepPieces
from jaxsb.devices import global_array
from jaxsb.plan import Template
from jaxsb.programs import ProgramCache
from jaxsb.training.step import make_planned_train_step, make_train_step
from jaxsb.wire import forget, plan_to_json, share_from_main

BATCH_FIELDS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


class PlanCompiler(ProgramCache):
    """Compiles the planned train step ahead of time, once per plan template, and counts programs."""

    def __init__(self, graphdef, rest, tx, model_cfg: ModelConfig, mesh: Mesh, state_shardings):
        super().__init__()
        self._args = (graphdef, rest, tx, model_cfg, mesh)
        self._state_shardings = state_shardings

    def get(self, template: Template, state, mb_arrays, num_targets) -> tuple[Any, bool]:
        def make_jitted():
            step = make_planned_train_step(*self._args, template)
            return jax.jit(step, donate_argnums=(0,), out_shardings=(self._state_shardings, None))

        return self.get_or_compile(template, make_jitted, state, mb_arrays, num_targets)


class StepCompiler(ProgramCache):
    """Compiles the train step once per batch shape (ahead of time) and counts programs."""

    def __init__(self, step_fn, state_shardings):
        super().__init__()
        self._jitted = jax.jit(step_fn, donate_argnums=(0,), out_shardings=(state_shardings, None))

    @staticmethod
    def key(batch_arrays) -> tuple:
        """The program's key: the batch's field names, shapes and dtypes."""
        return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(batch_arrays.items()))

    def get(self, state, batch_arrays) -> tuple[Any, bool]:
        return self.get_or_compile(self.key(batch_arrays), lambda: self._jitted, state, batch_arrays)


def batch_to_device(batch: Batch, sharding) -> dict[str, jax.Array]:
    return {name: global_array(np.asarray(getattr(batch, name)), sharding) for name in BATCH_FIELDS}


@dataclasses.dataclass
class PreparedStep:
    """One step ready to dispatch: the compiled program, its arguments and what to log."""

    doc_lengths: list[int]  # the step's pieces
    compiled: Any
    args: tuple
    is_new: bool
    compile_s: float
    data_state: dict
    record: dict  # the layout's metrics (rows and padding, or the plan's summary, solve time, ...)
    layout: dict | None = None  # planned steps: the plan and its modelled group times (plans.jsonl)


@dataclasses.dataclass
class DrawnStep:
    """One step's host data before anything of it runs. `digest` fingerprints what the step
    will run (its tokens, and its plan): every process must hold the same (faults.StepAgreement)."""

    digest: str
    data: Any  # RowSteps: the Batch; PlannedSteps: (PlannedStep, admitted Plan, its JSON, plan wait seconds)
    data_state: dict  # the data iterator's state right after this step was drawn


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]


def batch_digest(batch: Batch) -> str:
    return "data " + _sha(*(np.ascontiguousarray(getattr(batch, name)).tobytes() for name in BATCH_FIELDS))


def plan_digest(plan_json: dict) -> str:
    """Of a plan as jaxsb.wire.plan_to_json gives it."""
    return _sha(json.dumps(plan_json, sort_keys=True).encode())


class RowSteps:
    """parallel.planner=none: packed rows split over the devices (plain data parallelism)."""

    def __init__(self, data: DataIterator, state_shardings, graphdef, rest, tx, mesh):
        self.data = data
        self.sharding = mesh_lib.batch_sharding(mesh)
        self.compiler = StepCompiler(make_train_step(graphdef, rest, tx), state_shardings)

    def draw(self, more: bool = True) -> DrawnStep:
        batch = self.data.next()
        return DrawnStep(batch_digest(batch), batch, self.data.state())

    def will_compile(self, drawn: DrawnStep) -> bool:
        """Whether building this step compiles a program (the trainer lets the step in flight
        finish first, so that neither is timed with the other)."""
        return StepCompiler.key({name: np.asarray(getattr(drawn.data, name)) for name in BATCH_FIELDS}) \
            not in self.compiler

    def build(self, drawn: DrawnStep, state) -> PreparedStep:
        batch = drawn.data
        arrays = batch_to_device(batch, self.sharding)
        c0 = self.compiler.compile_seconds
        compiled, is_new = self.compiler.get(state, arrays)
        record = {"rows": int(batch.tokens.shape[0]), "row_len": int(batch.tokens.shape[1]),
                  "padding_frac": 1.0 - batch.num_tokens / batch.tokens.size}
        return PreparedStep(batch.doc_lengths, compiled, (arrays,), is_new, self.compiler.compile_seconds - c0,
                            drawn.data_state, record)

    def close(self) -> None:
        pass


class PlannedSteps:
    """A planner lays each step's pieces out over the devices (jaxsb/training/planning.py);
    the plan for step t+1 is made in a background thread while step t runs.

    With several processes, every process draws the same pieces but only process 0 plans (a
    time-limited solver need not give the same plan twice); the others receive its plan."""

    def __init__(self, cfg: Config, model_cfg: ModelConfig, data: DataIterator, state_shardings, graphdef,
                 rest, tx, mesh, log):
        from concurrent.futures import ThreadPoolExecutor

        from jaxsb.training.planning import ProgramBudget, StepPlanner

        self.data, self.mesh, self.model_cfg, self.log = data, mesh, model_cfg, log
        self.planner = StepPlanner(cfg, model_cfg, mesh.devices.size, mesh.devices.flat[0].device_kind)
        self.budget = ProgramBudget(cfg.parallel.max_programs)
        self.compiler = PlanCompiler(graphdef, rest, tx, model_cfg, mesh, state_shardings)
        self.pool = ThreadPoolExecutor(1) if cfg.parallel.background_planning else None
        self.pending = None
        self.drawn = 0  # steps drawn: the same count on every process

    def _draw_and_plan(self):
        step = self.data.next_pieces()
        data_state = self.data.state()
        self.drawn += 1
        planned = self.planner.plan(step) if jax.process_count() == 1 else self._shared_plan(step, self.drawn)
        planned.data_state = data_state
        return planned

    def _shared_plan(self, step: StepPieces, n: int):
        """Process 0's plan of this launch's n-th step. A process that drew other data than
        process 0 keeps its own pieces: the step's digests then differ, and every process
        stops before the step runs (faults.StepAgreement)."""
        from jaxsb.training.planning import PlannedStep, step_sequences

        mine = {}

        def plan_on_main():
            mine["planned"] = self.planner.plan(step)
            p = mine["planned"]
            return p.plan, p.solve_s, p.info

        key = f"jaxsb/plan/{n}"
        plan, solve_s, info = share_from_main(key, "plan", plan_on_main)
        # Process 0 has the results of the launch's step n-3 by now: every process took part
        # in it, so every process has read plan n-3.
        if n > 3:
            forget(f"jaxsb/plan/{n - 3}")
        if "planned" in mine:
            return mine["planned"]
        return PlannedStep(step, step_sequences(step), plan, solve_s, info)

    def draw(self, more: bool = True) -> DrawnStep:
        """`more`: another step follows (so its plan is started in the background)."""
        t0 = time.perf_counter()
        planned = self.pending.result() if self.pending is not None else self._draw_and_plan()
        wait_s = time.perf_counter() - t0
        self.pending = None
        if self.pool is not None and more:  # plan the next step while this one runs
            self.pending = self.pool.submit(self._draw_and_plan)
        adm = self.budget.admit(planned.plan, self.planner.fallback)
        if adm.how == "over-bound":
            self.log(f"warning: plan {adm.plan.summary()} needs a program beyond parallel.max_programs="
                     f"{self.budget.max_programs}")
        plan_json = plan_to_json(adm.plan)
        digest = f"data {planned.step.digest()[:16]} plan {plan_digest(plan_json)}"
        return DrawnStep(digest, (planned, adm, plan_json, wait_s), planned.data_state)

    def will_compile(self, drawn: DrawnStep) -> bool:
        """Whether building this step compiles a program (as RowSteps.will_compile)."""
        return drawn.data[1].plan.template not in self.compiler

    def build(self, drawn: DrawnStep, state) -> PreparedStep:
        from jaxsb.parallel.executor import layout_plan
        from jaxsb.training.planning import group_times, load_balance

        planned, adm, plan_json, wait_s = drawn.data
        plan = adm.plan
        arrays = layout_plan(plan, planned.seqs, self.model_cfg, self.mesh)
        num_targets = jnp.asarray(float(planned.step.num_targets), jnp.float32)
        c0 = self.compiler.compile_seconds
        compiled, is_new = self.compiler.get(plan.template, state, arrays, num_targets)
        times = group_times(plan, self.planner.cost)
        load_max, load_mean = load_balance(plan, self.planner.cost, times)
        slots = self.mesh.devices.size * sum(mb.tokens_per_device for mb in plan.template.microbatches)
        record = {
            "padding_frac": 1.0 - planned.step.num_tokens / slots,
            "plan": plan.summary(), "planner": plan.planner or self.planner.cfg.parallel.planner,
            "plan_admission": adm.how, "microbatches": len(plan.template.microbatches),
            "tokens_per_device": [mb.tokens_per_device for mb in plan.template.microbatches],
            # the program that runs (widened or fallback plans included), priced by the cost model
            "predicted_step_ms": float(self.planner.cost.plan_time_ms(plan)),
            "load_max_ms": load_max, "load_mean_ms": load_mean,
            "load_imbalance": load_max / load_mean if load_mean > 0 else 1.0,
            "plan_solve_s": planned.solve_s, "plan_wait_s": wait_s,
            "plan_fell_back": planned.info.fell_back,
            **planned.budget_record,
        }
        return PreparedStep(planned.step.doc_lengths, compiled, (arrays, num_targets), is_new,
                            self.compiler.compile_seconds - c0, drawn.data_state, record,
                            {"plan": plan_json, "group_ms": times})

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
