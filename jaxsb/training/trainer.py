"""The training loop: workdir, state (training/state.py), the step source (rows or planned,
training/steps.py), asynchronous dispatch, metrics, checkpoints, resume, and the faults of
training/faults.py (a stop request saves and exits; hosts agree on each step before it runs;
a lost peer stops the run).

State is a plain pytree `{"params", "opt_state", "step", "rng"}`; the NNX graph definition
is static and closed over by the step function. The loss is the mean over every target token
of the global batch, whatever the packing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import jax
import numpy as np

from jaxsb import mesh as mesh_lib
from jaxsb.config import Config, ConfigError
from jaxsb.data import DataIterator
from jaxsb.devices import is_main_process
from jaxsb.models.decode import dense_causal_pairs
from jaxsb.training.checkpoint import Checkpointer, abstract_with_shardings
from jaxsb.training.faults import PeerWatchdog, StepAgreement, StopRequest
from jaxsb.training.metrics import MetricsWriter, PlanTally, Progress, peak_flops_per_device, useful_train_flops
from jaxsb.training.optim import learning_rate_schedule
from jaxsb.training.state import build_model_fns, load_model_and_tokenizer
from jaxsb.training.steps import PlannedSteps, PreparedStep, RowSteps
from jaxsb.training.tensorboard import TensorBoardWriter
from jaxsb.training.workdir import check_room, prepare_workdir
from jaxsb.wire import share_from_main


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
    plan_summary: list = dataclasses.field(default_factory=list)  # PlanTally.lines(): layouts, predicted vs measured
    stopped: str | None = None  # why the run stopped before train.steps (e.g. "SIGTERM on process 0")
    checkpoint: str | None = None  # the checkpoint directory, once it holds a checkpoint


# --------------------------------------------------------------------------- the loop


class _NoMetrics:
    """Processes other than 0 write no metrics.jsonl or events (process 0 records the shared step)."""

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
    workdir = share_from_main("jaxsb/workdir", "workdir", lambda: prepare_workdir(cfg)[1])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, workdir=workdir))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.train.keep_checkpoints)
    if ckpt.removed_leftovers:
        log(f"removed what an unfinished checkpoint write left in {ckpt.directory}: "
            f"{', '.join(ckpt.removed_leftovers)}")
    # From here a lost peer stops this process with a line naming it (one process: no-op).
    watchdog = PeerWatchdog(cfg.parallel.peer_timeout_s, lambda: (ckpt.directory, ckpt.last_saved)).start()
    try:
        with StopRequest() as stop:  # SIGTERM / SIGINT from here on: stop at a step boundary, saved
            result = _train(cfg, workdir, ckpt, watchdog, stop, log, main)
    except BaseException:
        watchdog.stop(done=False)  # the others will see this process go silent, and stop
        ckpt.close(quiet=True)  # orbax's threads finish before the interpreter does
        raise
    watchdog.stop(done=True)
    return result


def _train(cfg: Config, workdir: str, ckpt: Checkpointer, watchdog: PeerWatchdog, stop: StopRequest, log,
           main: bool) -> RunResult:
    mesh = mesh_lib.make_mesh(cfg.parallel.devices)
    num_devices = mesh.devices.size
    model_cfg, tokenizer, pretrained = load_model_and_tokenizer(cfg, workdir)
    graphdef, rest, tx, state, shardings = build_model_fns(model_cfg, cfg.train, mesh, cfg.parallel.fsdp, pretrained)
    rows_path = cfg.parallel.planner == "none"
    num_rows = num_devices * cfg.data.rows_per_device if rows_path else None  # planned steps take pieces
    data = DataIterator(cfg.data, tokenizer, num_rows)
    # Before training: an unwritable workdir, or no room for the checkpoints (checked by process 0,
    # which writes the run's files; every process stops with its error).
    share_from_main("jaxsb/room", "workdir", lambda: check_room(
        workdir, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)), cfg.train.keep_checkpoints))

    start = 0
    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(latest, abstract_with_shardings(state, shardings))
        data.restore(meta["data"])
        start = latest
        log(f"resumed from {ckpt.directory} at step {start}")
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    processes = f" on {jax.process_count()} processes" if jax.process_count() > 1 else ""
    layout = f"{num_rows} rows per step" if rows_path else f"planner {cfg.parallel.planner}"
    log(f"jaxsb: {n_params / 1e6:.2f}M parameters, {num_devices} {jax.devices()[0].platform} devices{processes}, "
        f"{layout}, tokenizer vocab {tokenizer.vocab_size}, workdir {workdir}")

    if rows_path:
        steps = RowSteps(data, shardings, graphdef, rest, tx, mesh)
    else:
        steps = PlannedSteps(cfg, model_cfg, data, shardings, graphdef, rest, tx, mesh, log)
    compiler = steps.compiler
    schedule = learning_rate_schedule(cfg.train)
    peak, peak_source = peak_flops_per_device()
    writer = MetricsWriter(os.path.join(workdir, "metrics.jsonl"), resume_from_step=start) if main else _NoMetrics()
    if main and writer.dropped_partial:
        log(f"dropped the last line of {writer.path}: cut short when the run was killed (its step runs again)")
    layouts = (MetricsWriter(os.path.join(workdir, "plans.jsonl"), resume_from_step=start)
               if main and not rows_path else _NoMetrics())  # each step's plan, for jaxsb.report
    board = (TensorBoardWriter(os.path.join(workdir, "tensorboard"), start + 1) if main and cfg.train.tensorboard
             else _NoMetrics())
    progress = Progress(cfg.train.steps, start, cfg.train.progress and main)
    tally = PlanTally()

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
        tokens = int(sum(prepared.doc_lengths))
        sparse_blocks = float(metrics["sparse_blocks"]) if "sparse_blocks" in metrics else None
        flops = useful_train_flops(model_cfg, prepared.doc_lengths, sparse_blocks)
        record = {
            "step": p["step"], "loss": float(metrics["loss"]), "tokens": tokens,
            "targets": int(metrics["targets"]), "step_time_s": step_time,
            "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
            "lr": float(schedule(p["step"] - 1)), "grad_norm": float(metrics["grad_norm"]),
            "docs": len(prepared.doc_lengths),
            "compiles": compiler.count, "compiled_now": prepared.is_new, "compile_s": prepared.compile_s,
            "useful_tflops": flops / 1e12,
            "mfu": flops / (step_time * peak * num_devices) if peak and step_time > 0 else None,
            **prepared.record,
        }
        if "predicted_step_ms" in record:
            record["measured_step_ms"] = step_time * 1e3
        if model_cfg.attention == "sparse":
            record["sparse_budget"] = model_cfg.sparse.start_budget
            record["sparse_blocks"] = sparse_blocks  # mean selected per query block
            record["sparse_coverage"] = float(metrics["sparse_coverage"])
            # the runtime floor (model.sparse.coverage_drop): token-weighted means over the layers,
            # and the largest drop / smallest coverage of any document in any layer (measured)
            for key in ("floor_planned", "floor_final", "floor_overridden", "floor_drop_max", "floor_coverage_min"):
                if key in metrics:
                    record[f"sparse_{key}"] = float(metrics[key])
            if "attn_block_pairs" in metrics:  # counted from the kernels' tables, per device
                pairs = np.asarray(metrics["attn_block_pairs"], np.float64).reshape(-1)
                record["executed_pairs_max"] = float(pairs.max())
                record["executed_pairs_mean"] = float(pairs.mean())
                record["executed_imbalance"] = float(pairs.max() / pairs.mean()) if pairs.mean() > 0 else 1.0
                # the step's attention work against dense causal attention over the same documents
                dense = dense_causal_pairs(prepared.doc_lengths, model_cfg.sparse.block_size,
                                           model_cfg.kv_heads, model_cfg.layers)
                record["executed_pairs_total"] = total = float(pairs.sum())
                record["dense_causal_pairs"] = dense
                record["attention_fraction"] = total / dense if dense else 1.0
            history = getattr(getattr(steps, "planner", None), "history", None)
            if history is not None and "coverage_bin_sums" in metrics:  # later steps plan from these curves
                history.update(metrics["coverage_bin_sums"], metrics["coverage_bin_blocks"])
        writer.write(record)
        board.write(record)
        if prepared.layout is not None:
            layouts.write({"step": p["step"], **prepared.layout})
        progress.update(p["step"], record["loss"], record["tokens_per_s"], record.get("plan"))
        tally.add(record)
        tokens_total += tokens
        final_loss = record["loss"]

    def save(step: int, data_state: dict) -> None:
        nonlocal paused_s
        jax.block_until_ready(state)  # the step's own compute is step time
        t0 = time.perf_counter()
        ckpt.save(step, state, {"data": data_state, "step": step}, log)
        paused_s += time.perf_counter() - t0

    agreement, stopped = StepAgreement(), None
    try:
        for step in range(start + 1, cfg.train.steps + 1):
            drawn = steps.draw(more=step < cfg.train.steps)
            # every process: the same step (digests), and whether any was asked to stop
            stopped = agreement.check(step, drawn.digest, stop.reason)
            if stopped:
                break
            if pending is not None and steps.will_compile(drawn):
                finish(pending)  # the step in flight ends before the compile: neither is timed with the other
                pending = None
            c0 = compiler.compile_seconds
            prepared = steps.build(drawn, state)
            paused_s += compiler.compile_seconds - c0
            state, metrics = prepared.compiled(state, *prepared.args)
            if pending is not None:
                finish(pending)
            pending = {"step": step, "metrics": metrics, "prepared": prepared}
            if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                save(step, prepared.data_state)
        if pending is not None:
            finish(pending)
        if stopped and pending is not None and ckpt.last_saved != pending["step"]:
            save(pending["step"], pending["prepared"].data_state)
    except (jax.errors.JaxRuntimeError, TimeoutError):
        watchdog.await_verdict()  # a failed collective may be a lost peer: the watchdog names it
        raise
    finally:
        steps.close()
    progress.close()
    writer.close()
    board.close()
    layouts.close()
    ckpt.close()
    seconds = time.perf_counter() - t_start
    last_step = pending["step"] if stopped and pending is not None else (start if stopped else cfg.train.steps)
    result = RunResult(workdir, start, last_step, final_loss, tokens_total, seconds, compiler.count,
                       data.stats.summary(), tally.lines(), stopped,
                       ckpt.directory if ckpt.last_saved is not None else None)
    if stopped:
        log(f"jaxsb: stopped ({stopped}) after step {last_step}: "
            + (f"checkpoint of step {ckpt.last_saved} in {ckpt.directory}; the same command resumes from it"
               if ckpt.last_saved is not None else "no step was run, nothing to save"))
    summary = dataclasses.asdict(result) | {"peak_flops_source": peak_source}
    if isinstance(steps, PlannedSteps):
        summary["plan_admissions"] = steps.budget.counts
        summary["plans"] = tally.as_dict()
    if tally.attention_fraction is not None:  # a sparse run: the attention it computed against dense causal
        summary["attention_fraction"] = tally.attention_fraction
    if main:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if cfg.train.report and result.last_step > 0:
            from jaxsb.report import write_report

            write_report(workdir, log)
    return result
