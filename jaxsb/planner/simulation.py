"""The cluster simulator's library: batches of sequence lengths planned by each planner and
timed by a cost model, on paper (no device runs anything). `python -m jaxsb.simulate` is its
command line.

Convention (FlexSP's benchmark): each length is padded up to a multiple of 2·N, lengths above
L − 2·N are dropped (counted and reported), and batch i is lengths[B·i : B·(i+1)] of what
remains. `run` returns per planner its per-step plans (`describe_plan`), modelled times,
solve times and lower bounds; `format_table` and `write_plots` present them. The command
line's settings are checked and turned into a cost model and planners here too
(`resolve_sizes`, `preset_options`, `make_planners`); errors are ValueError with the flag.
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable, Sequence

import numpy as np

from jaxsb.planner.cost import group_times_ms, plan_memory_mb

DISTRIBUTIONS = ("long-tail", "bimodal", "long-sft", "chatqa2", "longalign", "bytescale")


# ------------------------------------------------------------------------------- settings


def parse_value(text: str):
    """A KEY=VALUE option's value: JSON where it parses (numbers, lists, booleans), else text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def resolve_sizes(devices: int | None, dp: int | None, cp: int | None, global_batch: int, steps: int,
                  max_len: int) -> int:
    """N from --devices, or --dp x --cp (which must agree with it), else 64; every size >= 1."""
    n = devices
    if dp or cp:
        if not (dp and cp):
            raise ValueError("--dp and --cp go together")
        if n is not None and n != dp * cp:
            raise ValueError(f"--devices {n} != --dp {dp} x --cp {cp}")
        n = dp * cp
    n = 64 if n is None else n
    for flag, v in (("--devices", n), ("--global-batch", global_batch), ("--steps", steps), ("--max-len", max_len)):
        if v < 1:
            raise ValueError(f"{flag} {v} must be >= 1")
    return n


def preset_options(preset: str, num_devices: int, max_len: int, items: Sequence[str], pp: int | None = None) -> dict:
    """The cost model's options: FlexSP's profile scales with N and L; SparseBalance's setting
    takes the pipeline depth (--pp); --preset-option KEY=VALUE."""
    options = dict(num_devices=num_devices, max_len=max_len) if preset.startswith("flexsp-a100:") else {}
    if pp is not None:
        if not is_pipeline_preset(preset):
            raise ValueError(f"--pp {pp}: only the sparsebalance-h200 presets model pipelines")
        options["pp"] = int(pp)
    for item in items:
        key, sep, val = item.partition("=")
        if not sep:
            raise ValueError(f"--preset-option {item!r}: expected KEY=VALUE")
        options[key] = parse_value(val)
    return options


def is_pipeline_preset(preset: str) -> bool:
    return preset.startswith("sparsebalance-h200:")


def make_planners(names: Sequence[str], items: Sequence[str], cost, num_devices: int, time_limit_s=None,
                  dp=None, cp=None, budget_options: dict | None = None, table_i: bool = False) -> tuple[dict, dict]:
    """({name: planner}, {name: its --planner-option NAME.KEY=VALUE options}); the options start
    from the registry's mapping (the same as training's). `budget_options` (mbs, coverage_drop,
    anchor, ...) go to every planner that chooses budgets; a name LABEL=KIND runs planner KIND
    under the name LABEL; `table_i` puts SparseBalance's
    ablation rows (TABLE_I) before `names`."""
    from jaxsb.planner.registry import make_planner, planner_options

    own = {}
    for n in names:  # "LABEL=KIND": planner KIND under its own name (two of one kind side by side)
        label, _, kind = n.partition("=")
        own[label] = (kind or label, {})
    rows = {**TABLE_I, **{k: v for k, v in own.items() if k not in TABLE_I}} if table_i else own
    names = list(rows)
    per_planner: dict[str, dict] = {name: {} for name in names}
    for item in items:
        key, sep, val = item.partition("=")
        pname, dot, opt = key.partition(".")
        if not sep or not dot:
            raise ValueError(f"--planner-option {item!r}: expected NAME.KEY=VALUE")
        if pname not in per_planner:
            raise ValueError(f"--planner-option {item!r}: planner {pname!r} is not among --planner {list(names)}")
        per_planner[pname][opt] = parse_value(val)
    pipeline = getattr(cost, "setting", "") == "pipeline"
    planners = {}
    for name, (kind, row) in rows.items():
        if pipeline:
            opts = dict(budget_options or {})
        else:
            opts = planner_options(kind, num_devices, time_limit_s=time_limit_s, degree=cp, dp=dp, cp=cp)
            if budget_options and per_planner[name].get("budgets") == "dst":
                opts |= {k: v for k, v in budget_options.items() if k != "mbs"}
        planners[name] = make_planner(kind, cost, num_devices, **(opts | row | per_planner[name]))
    return planners, per_planner


# ------------------------------------------------------------------------------- lengths


def read_lengths(path: str) -> Iterable[int]:
    """Lengths from a text file, one positive integer per line (blank lines skipped)."""
    try:
        f = open(path)
    except OSError as e:
        raise ValueError(f"cannot read lengths file {path}: {e}") from e
    with f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text:
                continue
            try:
                n = int(text)
            except ValueError:
                raise ValueError(f"{path}:{lineno}: expected one integer length per line, got {text!r}") from None
            if n < 1:
                raise ValueError(f"{path}:{lineno}: length {n} must be >= 1")
            yield n


def synthetic_lengths(name: str, seed: int = 0, chunk: int = 4096) -> Iterable[int]:
    """Endless seeded lengths from a parametric mix.

    * long-tail: lognormal with Wikipedia's median (347) and mean (1014): sigma 1.465, p99 ~10.5K;
    * bimodal: 85% around 1K tokens (lognormal, sigma 0.5), 15% around 32K (sigma 0.3);
    * long-sft: Skrull's long-SFT shape: 0.1% of sequences at ~38K tokens (±5%), the rest around
      850 (lognormal, sigma 0.5);
    * chatqa2: ChatQA2-Long-SFT as SparseBalance describes it, bimodal, "mostly < 4K or > 16K":
      40% lognormal around 1.5K (sigma 0.6, kept below 4K), 60% log-uniform in [16K, 32K]
      (Qwen2.5-3B's context). The paper gives no histogram: the spreads are our reading and
      the 60% long share was chosen so the case study's baseline imbalance (~1.9 here) is
      near the paper's 1.81;
    * longalign: LongAlign-10k, "8K-72K, most between 8K and 16K": lognormal around 12K
      (sigma 0.45), kept within [8K, 72K].
    * bytescale: ByteScale's production mix as its paper states it (arXiv 2502.21231): 80% of
      sequences <= 4K tokens and 0.05% >= 2M. Between them the paper gives no shape; ours: 80%
      lognormal around 1K (sigma 0.8, kept <= 4K), 19.95% log-uniform in (4K, 2M), 0.05%
      log-uniform in [2M, 4M].
    Samples outside a mix's stated range are drawn again (the mix is the stated shape)."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {name!r}; known: {', '.join(DISTRIBUTIONS)}")
    rng = np.random.default_rng(seed)
    while True:
        if name == "long-tail":
            x = rng.lognormal(math.log(347), 1.465, chunk)
        elif name == "bimodal":
            long = rng.random(chunk) < 0.15
            x = np.where(long, rng.lognormal(math.log(32768), 0.3, chunk), rng.lognormal(math.log(1024), 0.5, chunk))
        elif name == "long-sft":
            long = rng.random(chunk) < 0.001
            x = np.where(long, rng.normal(38000, 1900, chunk), rng.lognormal(math.log(850), 0.5, chunk))
        elif name == "chatqa2":
            long = rng.random(chunk) < 0.60
            short = rng.lognormal(math.log(1536), 0.6, chunk)
            x = np.where(long, np.exp(rng.uniform(math.log(16384), math.log(32768), chunk)), short)
            x = x[long | (short < 4096)]
        elif name == "bytescale":
            u = rng.random(chunk)
            short = np.empty(0)
            while len(short) < chunk:  # the short share stays 80%: its draws above 4K are redrawn
                more = rng.lognormal(math.log(1024), 0.8, chunk)
                short = np.concatenate([short, more[more <= 4096]])
            mid = np.exp(rng.uniform(math.log(4097), math.log(2 * 2**20), chunk))
            huge = np.exp(rng.uniform(math.log(2 * 2**20), math.log(4 * 2**20), chunk))
            x = np.where(u < 0.8, short[:chunk], np.where(u < 0.9995, mid, huge))
        else:
            x = rng.lognormal(math.log(12288), 0.45, chunk)
            x = x[(x >= 8192) & (x <= 73728)]
        yield from np.maximum(1, np.rint(x)).astype(np.int64).tolist()


def make_batches(source: Iterable[int], num_devices: int, global_batch: int, max_len: int,
                 steps: int, align: int | None = None) -> tuple[list[list[int]], int, int]:
    """(batches, dropped, scanned): lengths padded to multiples of `align` (2 * num_devices by
    default), cut into `steps` batches of `global_batch`."""
    align = 2 * num_devices if align is None else int(align)
    limit = max_len - align
    kept, dropped, scanned = [], 0, 0
    need = global_batch * steps
    for n in source:
        scanned += 1
        padded = -(-n // align) * align
        if padded > limit:
            dropped += 1
            continue
        kept.append(padded)
        if len(kept) == need:
            break
    full = len(kept) // global_batch
    return [kept[i * global_batch:(i + 1) * global_batch] for i in range(full)], dropped, scanned


# ------------------------------------------------------------------------------ planning


def describe_plan(cost, plan) -> list[dict]:
    """JSON-able micro-batches of a plan: time and groups (degree, scheme, lengths; Skrull groups
    also `sharded` and per-rank `local` lengths). Empty degree-1 groups (idle devices) are left
    out and counted in `idle_devices`."""
    times = group_times_ms(cost, plan)
    out = []
    for m, mb in enumerate(plan.template.microbatches):
        groups, idle = [], 0
        for g, group in enumerate(mb.groups):
            sharded, local = plan.sequences_of(m, g)
            if not sharded and not local and group.degree == 1:
                idle += 1
                continue
            entry = dict(degree=group.degree, scheme=group.scheme,
                         lengths=[plan.lengths[i] for i in sharded] + [plan.lengths[i] for r in sorted(local)
                                                                       for i in local[r]],
                         time_ms=round(times[m][g], 3))
            if local:
                entry["sharded"] = [plan.lengths[i] for i in sharded]
                entry["local"] = {str(r): [plan.lengths[i] for i in ids] for r, ids in sorted(local.items())}
            if plan.parts is not None:  # split documents: which document, from which token
                ids = sharded + [i for r in sorted(local) for i in local[r]]
                entry["documents"] = [plan.document_of(i) for i in ids]
                entry["starts"] = [plan.span_of(i)[0] for i in ids]
            if plan.budgets is not None:
                entry["budgets"] = [plan.budgets[i] for i in sharded] + [plan.budgets[i] for r in sorted(local)
                                                                         for i in local[r]]
            groups.append(entry)
        out.append(dict(time_ms=round(max(times[m], default=0.0), 3), idle_devices=idle, groups=groups))
    return out


def coverage_source(spec: str | None, *, block: int, max_k: int, seed: int = 0):
    """Per step its sequences' coverage curves: `(batch, step) -> [curve]`, or None.
    spec "synthetic" (jaxsb.planner.coverage.synthetic_coverage, seeded by seed and step) or a
    file of curves jaxsb measured (MeasuredCoverage)."""
    from jaxsb.planner.coverage import MeasuredCoverage, synthetic_coverage

    if spec is None:
        return None
    if spec == "synthetic":
        return lambda batch, step: synthetic_coverage(batch, block=block, max_k=max_k, seed=seed * 100003 + step)
    measured = MeasuredCoverage.load(spec)
    return lambda batch, step: measured.curves_for(batch, max_k, seed=seed * 100003 + step)


TABLE_I = {  # SparseBalance's Table I rows: name -> (planner, options)
    "baseline": ("sparsebalance", dict(batching="none", dst=False)),
    "+DST": ("sparsebalance", dict(batching="none", dst=True)),
    "+SAB": ("sparsebalance", dict(batching="sab", dst=False)),
    "+LBB": ("sparsebalance", dict(batching="lbb", dst=False)),
    "+SAB+DST": ("sparsebalance", dict(batching="sab", dst=True)),
    "+LBB+DST": ("sparsebalance", dict(batching="lbb", dst=True)),
    "jaxsb": ("jaxsb", {}),
}


def _budget_records(rec: dict, plan, curves, base: int) -> None:
    """Per document its length, base budget, budget and coverage drop (and a split document's
    parts); and their summary."""
    from jaxsb.planner.dst import coverage_report

    rec["sequences"], rec["budgets"] = coverage_report(plan, curves, base)


def run(cost, planners: dict, batches: Sequence[Sequence[int]], log=print, coverage=None,
        reference: str = "static") -> dict:
    """Plans every batch with every planner; returns per planner its steps and totals.
    `coverage` (from `coverage_source`): curves handed to the planners that choose budgets;
    speed-ups are against planner `reference` when it runs."""
    from jaxsb.planner.pipeline_cost import imbalance

    curves_of = [coverage(batch, step) if coverage else None for step, batch in enumerate(batches)]
    pipeline = getattr(cost, "setting", "") == "pipeline"
    results = {}
    for name, planner in planners.items():
        steps = []
        for step, batch in enumerate(batches):
            solution = planner.solve(batch, coverage=curves_of[step])
            plan, info = solution.plan, solution.info
            ms = cost.plan_time_ms(plan)
            mem = cost.plan_memory_mb(plan) if pipeline else plan_memory_mb(cost, plan)
            rec = dict(step=step, solve_seconds=info.solve_seconds, modeled_ms=ms,
                       fell_back=info.fell_back, message=info.message,
                       template=plan.summary(), peak_memory_mb=round(mem, 1),
                       feasible=bool(mem <= cost.memory_limit_mb + 1e-6),
                       microbatches=describe_plan(cost, plan))
            if info.lower_bound_ms is not None:
                rec["lower_bound_ms"] = float(info.lower_bound_ms)
            if "time_limit_hit" in info.details:  # the planner's time limit cut its search
                rec["time_limit_hit"] = bool(info.details["time_limit_hit"])
            if pipeline:
                rec["imbalance"] = imbalance([[t for t in row if t > 0] for row in cost.group_times_ms(plan)])
            if getattr(planner, "uses_coverage", False):
                rec["details"] = json.loads(json.dumps(dict(info.details), default=str))
            if plan.budgets is not None and curves_of[step] is not None:
                base = getattr(planner, "base", None) or planner.budgeting.base
                _budget_records(rec, plan, curves_of[step], base)
            if not rec["feasible"]:
                log(f"warning: {name} step {step}: plan needs {mem:.0f} MB per device, "
                    f"limit {cost.memory_limit_mb:.0f} MB")
            steps.append(rec)
        total = sum(s["modeled_ms"] for s in steps)
        lbs = [s.get("lower_bound_ms") for s in steps]
        lb = sum(lbs) if steps and all(v is not None for v in lbs) else None
        results[name] = dict(total_ms=total, mean_solve_seconds=float(np.mean([s["solve_seconds"] for s in steps])),
                             max_solve_seconds=float(max(s["solve_seconds"] for s in steps)),
                             fell_back_steps=sum(s["fell_back"] for s in steps),
                             lower_bound_ms=lb, steps=steps)
        if pipeline:
            results[name]["mean_imbalance"] = float(np.mean([s["imbalance"] for s in steps]))
        if all("budgets" in s for s in steps):
            results[name]["max_coverage_drop"] = max(s["budgets"]["max_drop"] for s in steps)
            results[name]["mean_coverage"] = float(np.mean([s["budgets"]["coverage_mean"] for s in steps]))
    ref = results.get(reference)
    for r in results.values():
        r["speedup_vs_static"] = (ref["total_ms"] / r["total_ms"]) if ref and r["total_ms"] > 0 else None
        r["reference"] = reference if ref else None
        r["lower_bound_gap"] = ((r["total_ms"] - r["lower_bound_ms"]) / r["lower_bound_ms"]
                                if r["lower_bound_ms"] else None)
    return results


def format_table_i(results: dict) -> str:
    """SparseBalance's Table I analogue: imbalance (Eq. 11), iteration time, planning time,
    speed-up over the reference row, and the coverage the budgets keep."""
    head = (f"{'config':<10} {'imbalance':>9} {'iteration ms':>12} {'planning ms':>11} {'speed-up':>8} "
            f"{'mean C(k)':>9} {'max drop':>8} {'LB gap':>7}")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        n = len(r["steps"])
        sp = f"{r['speedup_vs_static']:.2f}x" if r["speedup_vs_static"] else "-"
        gap = f"{100 * r['lower_bound_gap']:.1f}%" if r["lower_bound_gap"] is not None else "-"
        cov = f"{r['mean_coverage']:.3f}" if "mean_coverage" in r else "-"
        drop = f"{r['max_coverage_drop']:.3f}" if "max_coverage_drop" in r else "-"
        lines.append(f"{name:<10} {r.get('mean_imbalance', float('nan')):>9.2f} {r['total_ms'] / n:>12.1f} "
                     f"{1000 * r['mean_solve_seconds']:>11.1f} {sp:>8} {cov:>9} {drop:>8} {gap:>7}")
    return "\n".join(lines)


def format_table(results: dict) -> str:
    head = f"{'planner':<16} {'total (s)':>10} {'vs static':>9} {'solve/step (s)':>14} {'max solve':>9} " \
           f"{'LB gap':>7} {'fell back':>9}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        sp = f"{r['speedup_vs_static']:.2f}x" if r["speedup_vs_static"] else "-"
        gap = f"{100 * r['lower_bound_gap']:.1f}%" if r["lower_bound_gap"] is not None else "-"
        lines.append(f"{name:<16} {r['total_ms'] / 1000:>10.2f} {sp:>9} {r['mean_solve_seconds']:>14.3f} "
                     f"{r['max_solve_seconds']:>9.3f} {gap:>7} {r['fell_back_steps']:>9}")
    return "\n".join(lines)


def describe_run(cost, num_devices: int, batches: Sequence[Sequence[int]]) -> str:
    return (f"cost model {cost.name}, {num_devices} devices, memory limit {cost.memory_limit_mb / 1024:.1f} GB, "
            f"{len(batches)} steps of {len(batches[0])} sequences "
            f"({sum(map(sum, batches)) / len(batches) / 1e6:.2f}M tokens per step)")


def write_report(path: str, config: dict, dropped: int, scanned: int, results: dict) -> str:
    """The run's settings, its dropped/scanned counts and every planner's per-step results, as JSON."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(config=config, dropped=dropped, scanned=scanned, planners=results), f, indent=1)
    return path


# --------------------------------------------------------------------------------- plots


def write_plots(results: dict, num_devices: int, out_dir: str) -> list[str]:
    """Per planner: per-step bars, one segment per micro-batch, split into the device-weighted
    mean group time (busy) and the wait for the slowest group (straggler); and speed-ups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, r in results.items():
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(r["steps"]) + 2), 4))
        for s in r["steps"]:
            bottom = 0.0
            for k, mb in enumerate(s["microbatches"]):
                busy = sum(g["degree"] * g["time_ms"] for g in mb["groups"]) / num_devices / 1000
                top = mb["time_ms"] / 1000
                ax.bar(s["step"], busy, bottom=bottom, color="tab:blue", edgecolor="white", linewidth=0.5,
                       label="mean group time" if (s["step"], k) == (0, 0) else None)
                ax.bar(s["step"], top - busy, bottom=bottom + busy, color="tab:orange", edgecolor="white",
                       linewidth=0.5, label="waiting for the slowest group" if (s["step"], k) == (0, 0) else None)
                bottom += top
            if s.get("lower_bound_ms") is not None:
                ax.plot([s["step"] - 0.4, s["step"] + 0.4], [s["lower_bound_ms"] / 1000] * 2, color="black",
                        label="lower bound" if s["step"] == 0 else None)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel("modeled time (s); one segment per micro-batch")
        ax.set_title(f"{name}: {r['total_ms'] / 1000:.2f} s total")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"group_times_{name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    if "static" in results:
        ref = [s["modeled_ms"] for s in results["static"]["steps"]]
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, r in results.items():
            if name == "static":
                continue
            sp = [a / s["modeled_ms"] for a, s in zip(ref, r["steps"])]
            ax.plot(range(len(sp)), sp, marker="o", label=f"{name} ({r['speedup_vs_static']:.2f}x total)")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel("speed-up over static")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, "speedup.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------- main
