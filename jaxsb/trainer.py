"""The training loop: state from abstract shapes, sharded init or pretrained load, one
compiled program per batch-shape bucket, asynchronous dispatch, metrics, checkpoints, resume.

State is a plain pytree `{"params", "opt_state", "step", "rng"}`; the NNX graph definition
is static and closed over by the step function. The loss is the mean over every target token
of the global batch, whatever the packing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxsb import mesh as mesh_lib
from jaxsb.checkpoint import Checkpointer, abstract_with_shardings
from jaxsb.config import Config, ConfigError, ModelConfig, config_from_json, default_workdir
from jaxsb.data import Batch, DataError, DataIterator, Tokenizer, build_tokenizer
from jaxsb.devices import forget, global_array, is_main_process, process_index, share_from_main
from jaxsb.metrics import MetricsWriter, Progress, peak_flops_per_device, useful_train_flops
from jaxsb.models import Llama
from jaxsb.models.loss import next_token_loss
from jaxsb.models.stats import pop_layer_stats
from jaxsb.optim import learning_rate_schedule, make_optimizer
from jaxsb.programs import ProgramCache

BATCH_FIELDS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
# Sections that must match when a run resumes in an existing workdir (train.* may change,
# e.g. to extend a run).
_FROZEN_SECTIONS = ("model", "tokenizer", "data", "parallel")
# How this launch joined its processes: a resumed run may be launched differently.
_LAUNCH_FIELDS = ("parallel.coordinator", "parallel.num_processes", "parallel.process_id")


@dataclasses.dataclass
class RunResult:
    workdir: str
    first_step: int
    last_step: int
    final_loss: float | None
    tokens: int
    seconds: float
    compiles: int
    data_summary: str


# --------------------------------------------------------------------------- setup pieces


def prepare_workdir(cfg: Config) -> tuple[Config, str]:
    """Chooses the workdir, checks a resumed run's config agrees, writes config.json."""
    workdir = cfg.train.workdir or default_workdir(cfg)
    os.makedirs(workdir, exist_ok=True)
    saved_path = os.path.join(workdir, "config.json")
    if os.path.exists(saved_path):
        with open(saved_path) as f:
            saved = config_from_json(f.read())
        diffs = [
            f"{section}.{k}: saved {v!r}, now {getattr(getattr(cfg, section), k)!r}"
            for section in _FROZEN_SECTIONS
            for k, v in dataclasses.asdict(getattr(saved, section)).items()
            if _normalise(v) != _normalise(dataclasses.asdict(getattr(cfg, section))[k])
            and f"{section}.{k}" not in _LAUNCH_FIELDS
        ]
        if diffs:
            raise ConfigError(
                f"{workdir} holds a run with a different config; resume with the same settings "
                "or choose another --workdir. Differences:\n  " + "\n  ".join(diffs)
            )
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, workdir=workdir))
    with open(saved_path, "w") as f:
        f.write(cfg.to_json())
    return cfg, workdir


def _normalise(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def load_model_and_tokenizer(cfg: Config, workdir: str | None):
    """(ModelConfig with vocab filled in, Tokenizer, pretrained numpy params or None)."""
    if cfg.model.init != "scratch":
        from jaxsb.models.pretrained import load_pretrained

        pre = load_pretrained(cfg.model.init)
        model_cfg = dataclasses.replace(cfg.model, **pre.config)
        tokenizer = Tokenizer(pre.tokenizer, bos_id=pre.bos_id if pre.bos_id is not None else pre.eos_id,
                              eos_id=pre.eos_id, name=cfg.model.init)
        model_cfg.validate()
        return model_cfg, tokenizer, pre.params
    # Process 0 trains (or reloads) the BPE; the others get the very same one.
    tokenizer = share_from_main("jaxsb/tokenizer", lambda: build_tokenizer(cfg.tokenizer, cfg.data, workdir))
    vocab = cfg.model.vocab_size or tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer.vocab_size}")
    return dataclasses.replace(cfg.model, vocab_size=vocab), tokenizer, None


def split_model(model: nnx.Module):
    """(graphdef, params as a pure dict, the rest of the model's state)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), rest


def build_model_fns(model_cfg: ModelConfig, train_cfg, mesh, fsdp: bool, pretrained_params=None):
    """Returns (graphdef, rest, tx, state, state_shardings): state created sharded from its
    abstract shape, either freshly initialised or from pretrained weights."""
    tx = make_optimizer(train_cfg)

    def init_state(key):
        model = Llama(model_cfg, rngs=nnx.Rngs(params=key))
        _, params, _ = split_model(model)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(key)}

    key = jax.random.PRNGKey(train_cfg.seed)
    abstract = jax.eval_shape(init_state, key)
    shardings = mesh_lib.state_shardings(mesh, abstract, fsdp)
    graphdef, _, rest = split_model(nnx.eval_shape(lambda: Llama(model_cfg, rngs=nnx.Rngs(0))))
    if pretrained_params is None:
        state = jax.jit(init_state, out_shardings=shardings)(key)
    else:
        params = jax.device_put(_cast_like(pretrained_params, abstract["params"]), shardings["params"])
        opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])(params)
        state = {"params": params, "opt_state": opt_state,
                 "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"]),
                 "rng": jax.device_put(jax.random.key_data(key), shardings["rng"])}
    return graphdef, rest, tx, state, shardings


def _cast_like(numpy_tree, abstract_tree):
    def one(x, a):
        x = np.asarray(x)
        if x.shape != a.shape:
            raise ValueError(f"pretrained tensor has shape {x.shape}, model expects {a.shape}")
        return x.astype(a.dtype)

    return jax.tree.map(one, numpy_tree, abstract_tree)


def make_loss_fn(graphdef, rest) -> Callable:
    """(params, batch arrays) -> (mean loss over target tokens, (target count, layer stats))."""

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params, rest)
        logits = model(batch["tokens"], batch["segment_ids"], batch["positions"])
        loss_sum, count = next_token_loss(logits, batch["targets"], batch["loss_mask"])
        return loss_sum / jnp.maximum(count, 1.0), (count, pop_layer_stats(model))

    return loss_fn


def make_train_step(graphdef, rest, tx) -> Callable:
    loss_fn = make_loss_fn(graphdef, rest)

    def train_step(state, batch):
        (loss, (count, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "targets": count, **stats}

    return train_step


class StepCompiler(ProgramCache):
    """Compiles the train step once per batch shape (ahead of time) and counts programs."""

    def __init__(self, step_fn, state_shardings):
        super().__init__()
        self._jitted = jax.jit(step_fn, donate_argnums=(0,), out_shardings=(state_shardings, None))

    def get(self, state, batch_arrays) -> tuple[Any, bool]:
        key = tuple((k, v.shape, str(v.dtype)) for k, v in sorted(batch_arrays.items()))
        return self.get_or_compile(key, lambda: self._jitted, state, batch_arrays)


def batch_to_device(batch: Batch, sharding) -> dict[str, jax.Array]:
    return {name: global_array(np.asarray(getattr(batch, name)), sharding) for name in BATCH_FIELDS}


def batch_digest(batch: Batch) -> str:
    """A fingerprint of a step's data, to check that every process drew the same batch."""
    import hashlib

    h = hashlib.sha256()
    for name in BATCH_FIELDS:
        h.update(np.ascontiguousarray(getattr(batch, name)).tobytes())
    return h.hexdigest()


@dataclasses.dataclass
class PreparedStep:
    """One step ready to dispatch: the compiled program, its arguments and what to log."""

    batch: Batch
    compiled: Any
    args: tuple
    is_new: bool
    compile_s: float
    data_state: dict
    record: dict  # extra metrics (the plan's summary, solve time, ...)


class RowSteps:
    """parallel.planner=none: packed rows split over the devices (plain data parallelism)."""

    def __init__(self, data: DataIterator, state_shardings, graphdef, rest, tx, mesh):
        self.data = data
        self.sharding = mesh_lib.batch_sharding(mesh)
        self.compiler = StepCompiler(make_train_step(graphdef, rest, tx), state_shardings)

    def prepare(self, state, more: bool = True) -> PreparedStep:
        batch = self.data.next()
        arrays = batch_to_device(batch, self.sharding)
        c0 = self.compiler.compile_seconds
        compiled, is_new = self.compiler.get(state, arrays)
        return PreparedStep(batch, compiled, (arrays,), is_new, self.compiler.compile_seconds - c0,
                            self.data.state(), {})

    def close(self) -> None:
        pass


class PlannedSteps:
    """A planner lays each step's sequences out over the devices (jaxsb/parallel/steps.py);
    the plan for step t+1 is made in a background thread while step t runs.

    With several processes, every process draws the same batch but only process 0 plans (a
    time-limited solver need not give the same plan twice); the others receive its plan."""

    def __init__(self, cfg: Config, model_cfg: ModelConfig, data: DataIterator, state_shardings, graphdef,
                 rest, tx, mesh, log):
        from concurrent.futures import ThreadPoolExecutor

        from jaxsb.parallel.executor import PlanCompiler
        from jaxsb.parallel.steps import ProgramBudget, StepPlanner

        self.data, self.mesh, self.model_cfg, self.log = data, mesh, model_cfg, log
        self.planner = StepPlanner(cfg, model_cfg, mesh.devices.size)
        self.budget = ProgramBudget(cfg.parallel.max_programs, model_cfg)
        self.compiler = PlanCompiler(graphdef, rest, tx, model_cfg, mesh, state_shardings)
        self.pool = ThreadPoolExecutor(1) if cfg.parallel.background_planning else None
        self.pending = None
        self.drawn = 0  # batches drawn: the same count on every process

    def _draw_and_plan(self):
        batch = self.data.next()
        data_state = self.data.state()
        self.drawn += 1
        planned = self.planner.plan(batch) if jax.process_count() == 1 else self._shared_plan(batch, self.drawn)
        planned.data_state = data_state
        return planned

    def _shared_plan(self, batch: Batch, n: int):
        from jaxsb.parallel.layout import sequences_from_rows
        from jaxsb.parallel.steps import PlannedBatch

        digest, mine = batch_digest(batch), {}

        def plan_on_main():
            mine["planned"] = self.planner.plan(batch)
            p = mine["planned"]
            return digest, p.plan, p.solve_s, p.info

        key = f"jaxsb/plan/{n}"
        main_digest, plan, solve_s, info = share_from_main(key, plan_on_main)
        # Process 0 has the results of the launch's step n-3 by now: every process took part
        # in it, so every process has read plan n-3.
        if n > 3:
            forget(f"jaxsb/plan/{n - 3}")
        if main_digest != digest:
            raise DataError(f"process {process_index()} drew a different batch than process 0 for step "
                            f"{n} of this launch: every process must read the same data (same files, same "
                            "data.* and tokenizer settings)")
        if "planned" in mine:
            return mine["planned"]
        seqs = sequences_from_rows(batch.tokens, batch.targets, batch.loss_mask, batch.segment_ids,
                                   batch.positions)
        return PlannedBatch(batch, seqs, plan, solve_s, info)

    def prepare(self, state, more: bool = True) -> PreparedStep:
        """`more`: another step follows (so its plan is started in the background)."""
        from jaxsb.parallel.executor import layout_plan
        from jaxsb.parallel.steps import load_balance

        t0 = time.perf_counter()
        planned = self.pending.result() if self.pending is not None else self._draw_and_plan()
        wait_s = time.perf_counter() - t0
        if self.pool is not None and more:  # plan the next step while this one runs
            self.pending = self.pool.submit(self._draw_and_plan)
        adm = self.budget.admit(planned.plan, self.planner.fallback)
        if adm.how == "over-bound":
            self.log(f"warning: plan {adm.plan.summary()} needs a program beyond parallel.max_programs="
                     f"{self.budget.max_programs}")
        plan = adm.plan
        arrays = layout_plan(plan, planned.seqs, self.model_cfg, self.mesh)
        num_targets = jnp.asarray(float(planned.batch.num_targets), jnp.float32)
        c0 = self.compiler.compile_seconds
        compiled, is_new = self.compiler.get(plan.template, state, arrays, num_targets)
        load_max, load_mean = load_balance(plan, self.planner.cost)
        record = {
            "plan": plan.summary(), "planner": plan.planner or self.planner.cfg.parallel.planner,
            "plan_admission": adm.how, "microbatches": len(plan.template.microbatches),
            "tokens_per_device": [mb.tokens_per_device for mb in plan.template.microbatches],
            "predicted_step_ms": None if plan.predicted_ms != plan.predicted_ms else plan.predicted_ms,
            "load_max_ms": load_max, "load_mean_ms": load_mean,
            "load_imbalance": load_max / load_mean if load_mean > 0 else 1.0,
            "plan_solve_s": planned.solve_s, "plan_wait_s": wait_s,
            "plan_fell_back": bool(planned.info.get("fell_back", False)),
        }
        return PreparedStep(planned.batch, compiled, (arrays, num_targets), is_new,
                            self.compiler.compile_seconds - c0, planned.data_state, record)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- the loop


class _NoMetrics:
    """Processes other than 0 write no metrics.jsonl (process 0 records the shared step)."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def train(cfg: Config, log: Callable[[str], None] = print) -> RunResult:
    """Runs (or resumes) the configured training. With several processes (parallel.coordinator)
    every process calls this; process 0 alone writes the workdir's files and logs."""
    main = is_main_process()
    if not main:
        log = lambda _message: None  # noqa: E731
    if jax.process_count() > 1 and cfg.parallel.devices not in (0, jax.device_count()):
        raise ConfigError(f"parallel.devices={cfg.parallel.devices}: a run of {jax.process_count()} processes "
                          f"uses all {jax.device_count()} devices (set 0)")
    # Process 0 checks and writes the workdir (its default name has a timestamp); all use it.
    workdir = share_from_main("jaxsb/workdir", lambda: prepare_workdir(cfg)[1])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, workdir=workdir))
    mesh = mesh_lib.make_mesh(cfg.parallel.devices)
    num_devices = mesh.devices.size
    model_cfg, tokenizer, pretrained = load_model_and_tokenizer(cfg, workdir)
    graphdef, rest, tx, state, shardings = build_model_fns(model_cfg, cfg.train, mesh, cfg.parallel.fsdp, pretrained)
    num_rows = num_devices * cfg.data.rows_per_device
    data = DataIterator(cfg.data, tokenizer, num_rows)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.train.keep_checkpoints)

    start = 0
    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(latest, abstract_with_shardings(state, shardings))
        data.restore(meta["data"])
        start = latest
        log(f"resumed from {ckpt.directory} at step {start}")
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    processes = f" on {jax.process_count()} processes" if jax.process_count() > 1 else ""
    log(f"jaxsb: {n_params / 1e6:.2f}M parameters, {num_devices} {jax.devices()[0].platform} devices{processes}, "
        f"{num_rows} rows per step, tokenizer vocab {tokenizer.vocab_size}, planner {cfg.parallel.planner}, "
        f"workdir {workdir}")

    if cfg.parallel.planner == "none":
        steps = RowSteps(data, shardings, graphdef, rest, tx, mesh)
    else:
        steps = PlannedSteps(cfg, model_cfg, data, shardings, graphdef, rest, tx, mesh, log)
    compiler = steps.compiler
    schedule = learning_rate_schedule(cfg.train)
    peak, peak_source = peak_flops_per_device()
    writer = MetricsWriter(os.path.join(workdir, "metrics.jsonl"), resume_from_step=start) if main else _NoMetrics()
    progress = Progress(cfg.train.steps, start, cfg.train.progress and main)

    t_start = time.perf_counter()
    tokens_total, final_loss, pending = 0, None, None
    last_done = time.perf_counter()
    paused_s = 0.0

    def finish(p) -> None:
        """Blocks on a dispatched step's metrics and logs them."""
        nonlocal last_done, tokens_total, final_loss, paused_s
        metrics = jax.device_get(p["metrics"])
        now = time.perf_counter()
        # Compiling and checkpointing done inside this interval are not step time.
        step_time = now - last_done - paused_s
        last_done, paused_s = now, 0.0
        prepared: PreparedStep = p["prepared"]
        batch = prepared.batch
        tokens = int(sum(batch.doc_lengths))
        sparse_blocks = float(metrics["sparse_blocks"]) if "sparse_blocks" in metrics else None
        flops = useful_train_flops(model_cfg, batch.doc_lengths, sparse_blocks)
        record = {
            "step": p["step"], "loss": float(metrics["loss"]), "tokens": tokens,
            "targets": int(metrics["targets"]), "step_time_s": step_time,
            "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
            "lr": float(schedule(p["step"] - 1)), "grad_norm": float(metrics["grad_norm"]),
            "rows": int(batch.tokens.shape[0]), "row_len": int(batch.tokens.shape[1]),
            "docs": len(batch.doc_lengths),
            "padding_frac": 1.0 - tokens / batch.tokens.size,
            "compiles": compiler.count, "compiled_now": prepared.is_new, "compile_s": prepared.compile_s,
            "useful_tflops": flops / 1e12,
            "mfu": flops / (step_time * peak * num_devices) if peak and step_time > 0 else None,
            **prepared.record,
        }
        if "predicted_step_ms" in record:
            record["measured_step_ms"] = step_time * 1e3
        if model_cfg.attention == "sparse":
            record["sparse_budget"] = model_cfg.sparse.top_k
            record["sparse_blocks"] = sparse_blocks  # mean selected per query block
            record["sparse_coverage"] = float(metrics["sparse_coverage"])
        writer.write(record)
        progress.update(p["step"], record["loss"], record["tokens_per_s"])
        tokens_total += tokens
        final_loss = record["loss"]

    try:
        for step in range(start + 1, cfg.train.steps + 1):
            c0 = compiler.compile_seconds
            prepared = steps.prepare(state, more=step < cfg.train.steps)
            paused_s += compiler.compile_seconds - c0
            state, metrics = prepared.compiled(state, *prepared.args)
            if pending is not None:
                finish(pending)
            pending = {"step": step, "metrics": metrics, "prepared": prepared}
            if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                jax.block_until_ready(state)  # the step's own compute is step time
                t0 = time.perf_counter()
                ckpt.save(step, state, {"data": prepared.data_state, "step": step})
                ckpt.wait()
                paused_s += time.perf_counter() - t0
        if pending is not None:
            finish(pending)
    finally:
        steps.close()
    progress.close()
    writer.close()
    ckpt.close()
    seconds = time.perf_counter() - t_start
    result = RunResult(workdir, start, cfg.train.steps, final_loss, tokens_total, seconds,
                       compiler.count, data.stats.summary())
    summary = dataclasses.asdict(result) | {"peak_flops_source": peak_source}
    if isinstance(steps, PlannedSteps):
        summary["plan_admissions"] = steps.budget.counts
    if main:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return result
