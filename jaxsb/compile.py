"""`python -m jaxsb.compile --target tpu-v5p:2x2x2`: compile a training run for a TPU slice or GPU
node this host does not have, with the real compilers (libtpu; XLA's GPU compiler with Triton),
and check that every program fits the target's memory. Nothing runs.

It takes `train`'s `--config/--set`, draws `--steps` real steps from the configured data, plans
them with the configured planner for the target's device count and cost preset (parallel.preset
=auto: the chip's data-sheet preset, jaxsb.planner.hardware), admits them as training would
(parallel.max_programs), and compiles every distinct program: the planned train step with its
groups under shard_map and the attention kernels inside it (Mosaic on TPU, Triton on GPU when
model.attention asks for the Pallas kernels), or the packed-rows step with parallel.planner=none.
Per program it prints the template, the compile time and the compiler's memory analysis per
device next to the planner's predicted memory and the target's HBM. Exit status: 0 when every
program compiles and fits, 1 otherwise (the failing program and its numbers are printed), 2 on
bad arguments or configuration.

Needs the compilers: `bash scripts/setup.sh --targets`, then `.venv-targets/bin/python -m jaxsb.compile`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from jaxsb.cli import base_parser, parse_config


@dataclasses.dataclass
class ProgramReport:
    """One compiled program of the run and its memory on one device of the target."""

    name: str  # "plan 1", "rows 8x1024"
    template: str  # groups per micro-batch (planned) or the batch shape (rows)
    steps: list[int]  # the drawn steps that run it
    compile_s: float = 0.0  # lowering included
    memory: dict = dataclasses.field(default_factory=dict)  # the compiler's analysis, bytes
    predicted_mb: float | None = None  # the planner's cost model
    limit_mb: float = 0.0  # what a program may use on one device (the preset's memory limit)
    hbm_mb: float = 0.0
    error: str | None = None

    @property
    def peak_mb(self) -> float:
        """Arguments + outputs - donated (aliased) + temporaries, per device."""
        m = self.memory
        if not m:
            return float("nan")
        return (m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]) / 2**20

    @property
    def fits(self) -> bool:
        return self.error is None and self.peak_mb <= self.limit_mb

    def row(self) -> str:
        pred = "-" if self.predicted_mb is None else f"{self.predicted_mb:,.0f}"
        if self.error is not None:
            return f"{self.name:10s} {self.template:40s} FAILED: {self.error}"
        return (f"{self.name:10s} {self.template:40s} {self.compile_s:8.1f} {self.peak_mb:12,.0f} {pred:>12s} "
                f"{self.limit_mb:10,.0f} {self.hbm_mb:10,.0f}  {'ok' if self.fits else 'DOES NOT FIT'}")


HEADER = (f"{'program':10s} {'template (groups per micro-batch)':40s} {'compile s':>8s} {'compiler MB':>12s} "
          f"{'planner MB':>12s} {'limit MB':>10s} {'HBM MB':>10s}")


def _memory(compiled) -> dict:
    a = compiled.memory_analysis()
    if a is None:
        return {}
    return {"argument_bytes": int(a.argument_size_in_bytes), "output_bytes": int(a.output_size_in_bytes),
            "alias_bytes": int(a.alias_size_in_bytes), "temp_bytes": int(a.temp_size_in_bytes),
            "code_bytes": int(a.generated_code_size_in_bytes)}


def _short_error(e: Exception) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def _compile(report: ProgramReport, platform: str, compiler, *args) -> None:
    """`compiler.get(*args)` — the trainer's own compile cache (training/steps.py), so this is
    the very program training would run — for the target's platform; fills the report."""
    from kernels_pallas import compile_platform

    try:
        c0 = compiler.compile_seconds
        with compile_platform(platform):
            compiled, _ = compiler.get(*args)
        report.compile_s = compiler.compile_seconds - c0
        report.memory = _memory(compiled)
    except Exception as e:  # a program the target's compiler refuses: reported, the others go on
        report.error = _short_error(e)


def compile_for_target(cfg, target, steps: int = 3, log=print) -> list[ProgramReport]:
    """Compiles every distinct program of `steps` drawn steps of the run `cfg` for `target`."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxsb.config import ConfigError
    from jaxsb.data import DataIterator
    from jaxsb.mesh import AXIS, batch_sharding
    from jaxsb.targets import target_devices
    from jaxsb.training.state import abstract_model_fns, load_model_and_tokenizer

    devices = target_devices(target)
    n = cfg.parallel.devices or len(devices)
    if n > len(devices):
        raise ConfigError(f"parallel.devices={n} but {target.name} has {len(devices)} devices")
    mesh = Mesh(np.array(devices[:n]), (AXIS,))
    model_cfg, tokenizer, _ = load_model_and_tokenizer(cfg, cfg.train.workdir or None)
    graphdef, rest, tx, state, shardings = abstract_model_fns(model_cfg, cfg.train, mesh, cfg.parallel.fsdp)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    hbm_mb = target.hbm_bytes / 2**20
    log(f"jaxsb.compile: {target.name} ({n} x {devices[0].device_kind}, HBM {target.chip.hbm_gb:g} GB each), "
        f"{n_params / 1e6:.2f}M parameters, model.attention={model_cfg.attention}, "
        f"parallel.planner={cfg.parallel.planner}, {steps} drawn steps")
    reports: list[ProgramReport] = []

    if cfg.parallel.planner == "none":
        from jaxsb.training.planning import load_cost_model, resolve_preset
        from jaxsb.training.step import make_train_step
        from jaxsb.training.steps import BATCH_FIELDS, StepCompiler

        preset = resolve_preset(cfg.parallel.preset, devices[0].device_kind)
        compiler = StepCompiler(make_train_step(graphdef, rest, tx), shardings)
        data = DataIterator(cfg.data, tokenizer, n * cfg.data.rows_per_device)
        cost = load_cost_model(preset, n, cfg.data.max_len, model_cfg, cfg.parallel.fsdp)
        limit_mb = cost.memory_limit_mb
        log(f"cost model {cost.name} (parallel.preset={cfg.parallel.preset} -> {preset})")
        by_shape: dict[tuple, ProgramReport] = {}
        for s in range(1, steps + 1):
            batch = data.next()
            shape = tuple(batch.tokens.shape)
            if shape in by_shape:
                by_shape[shape].steps.append(s)
                continue
            # the cost model's memory of one device holding its rows whole (model states + activations)
            predicted = cost.group_memory_mb(1, [shape[0] * shape[1] // n])
            report = ProgramReport(f"rows {len(by_shape) + 1}", f"{shape[0]} rows x {shape[1]} tokens", [s],
                                   predicted_mb=predicted, limit_mb=limit_mb, hbm_mb=hbm_mb)
            by_shape[shape] = report
            arrays = {f: np.asarray(getattr(batch, f)) for f in BATCH_FIELDS}
            sharding = batch_sharding(mesh)
            structs = {f: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for f, a in arrays.items()}
            _compile(report, target.platform, compiler, state, structs)
            log(report.row())
            reports.append(report)
        return reports

    from jaxsb.parallel.executor import microbatch_sharding, plan_host_buffers
    from jaxsb.plan import PlanError
    from jaxsb.training.planning import ProgramBudget, StepPlanner
    from jaxsb.training.steps import PlanCompiler

    compiler = PlanCompiler(graphdef, rest, tx, model_cfg, mesh, shardings)
    data = DataIterator(cfg.data, tokenizer, None)
    planner = StepPlanner(cfg, model_cfg, n, devices[0].device_kind)
    log(f"cost model {planner.cost.name} (parallel.preset={cfg.parallel.preset} -> {planner.preset})")
    budget = ProgramBudget(cfg.parallel.max_programs)
    by_template: dict = {}
    mb_sharding = microbatch_sharding(mesh)
    num_targets = jax.ShapeDtypeStruct((), np.float32, sharding=NamedSharding(mesh, P()))
    limit_mb = planner.cost.memory_limit_mb
    log(HEADER)
    for s in range(1, steps + 1):
        try:
            planned = planner.plan(data.next_pieces())
        except PlanError as e:  # no layout fits the target's memory: reported like a program that does not
            report = ProgramReport(f"step {s}", "no plan", [s], limit_mb=limit_mb, hbm_mb=hbm_mb,
                                   error=f"the planner finds no layout that fits: {e}")
            log(report.row())
            reports.append(report)
            continue
        plan = budget.admit(planned.plan, planner.fallback).plan
        predicted = float(planner.cost.plan_memory_mb(plan))
        if plan.template in by_template:
            report = by_template[plan.template]
            report.steps.append(s)
            report.predicted_mb = max(report.predicted_mb, predicted)
            continue
        report = ProgramReport(f"plan {len(by_template) + 1}", plan.summary(), [s], predicted_mb=predicted,
                               limit_mb=limit_mb, hbm_mb=hbm_mb)
        by_template[plan.template] = report
        mb_structs = [{f: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=mb_sharding) for f, a in host.items()}
                      for host in plan_host_buffers(plan, planned.seqs, model_cfg)]
        _compile(report, target.platform, compiler, plan.template, state, mb_structs, num_targets)
        log(report.row())
        reports.append(report)
    return reports


def main(argv: list[str] | None = None) -> int:
    from jaxsb.targets import EXAMPLES

    parser = base_parser(__doc__.splitlines()[0].strip("`"))
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--target", required=True, action="append",
                        help=f"CHIP:SHAPE, e.g. {', '.join(EXAMPLES)} (repeatable)")
    parser.add_argument("--steps", type=int, default=3, help="drawn steps to plan and compile (default 3)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the reports as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only: the host's own backend is the CPU
    from jaxsb.config import ConfigError
    from jaxsb.data import DataError
    from jaxsb.targets import TargetError, parse_target

    try:
        targets = [parse_target(t) for t in args.target]
    except TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = parse_config(args)
    out, status = {}, 0
    for target in targets:
        try:
            reports = compile_for_target(cfg, target, args.steps)
        except (TargetError, ConfigError, DataError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for r in reports:
            if r.error is not None:
                what = "cannot be planned" if r.template == "no plan" else "does not compile"
                print(f"error: {target.name} {r.name} ({r.template}) {what}: {r.error}", file=sys.stderr)
                status = 1
            elif not r.fits:
                print(f"error: {target.name} {r.name} ({r.template}) needs {r.peak_mb:,.0f} MB per device, "
                      f"over the {r.limit_mb:,.0f} MB a program may use of {r.hbm_mb:,.0f} MB HBM", file=sys.stderr)
                status = 1
        out[target.name] = [dataclasses.asdict(r) | {"peak_mb": r.peak_mb, "fits": r.fits} for r in reports]
        total = sum(r.compile_s for r in reports)
        print(f"{target.name}: {len(reports)} programs, {sum(r.fits for r in reports)} fit, "
              f"compiled in {total:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
