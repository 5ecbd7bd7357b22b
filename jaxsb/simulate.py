"""`python -m jaxsb.simulate`: what per-step planning is worth at cluster scale, on paper.

Batches of real or synthetic sequence lengths are planned by each requested planner and timed
by a cost model (a preset such as FlexSP's A100 profile, or a calibrated JSON file); no device
runs anything. Convention (FlexSP's benchmark): each length is padded up to a multiple of
2·N, lengths above L − 2·N are dropped (counted and reported), and batch i is
lengths[B·i : B·(i+1)] of what remains.

Prints one row per planner (total modeled time, speed-up over `static`, solve time, gap to a
reported lower bound); writes per-step plans as JSON (`--out`) and PNG plots (`--plots`).
The library behind it is jaxsb/planner/simulation.py.

    python -m jaxsb.simulate --preset flexsp-a100:gpt-7b --devices 64 --global-batch 512 \\
        --max-len 192000 --steps 10 --lengths ../shared/data/wikipedia_lens.txt \\
        --planner static --planner batch-adaptive

SparseBalance's setting (Megatron DP x PP, MoBA budgets; jaxsb/planner/pipeline_cost.py) with
its Table I ablation and jaxsb's joint layout-and-budget planner:

    python -m jaxsb.simulate --preset sparsebalance-h200:qwen2.5-3b --dp 2 --pp 4 --mbs 2 \
        --global-batch 16 --dist chatqa2 --coverage synthetic --table-i --steps 20
"""

from __future__ import annotations

import argparse
import sys

from jaxsb.planner.simulation import (DISTRIBUTIONS, coverage_source, describe_run, format_table, format_table_i,
                                      is_pipeline_preset, make_batches, make_planners, preset_options, read_lengths,
                                      resolve_sizes, run, synthetic_lengths, write_plots, write_report)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxsb.simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", metavar="PATH", help="text file, one sequence length per line")
    src.add_argument("--dist", choices=DISTRIBUTIONS, help="synthetic length mix (seeded)")
    p.add_argument("--seed", type=int, default=0, help="seed of --dist")
    p.add_argument("--devices", type=int, default=None, help="number of devices N (default dp*cp, else 64)")
    p.add_argument("--preset", default="flexsp-a100:gpt-7b",
                   help="cost model: flexsp-a100:gpt-7b|gpt-13b|gpt-30b, skrull-h100:qwen2.5-0.5b|qwen2.5-7b, "
                        "sparsebalance-h200:qwen2.5-0.5b|qwen2.5-3b (DP x PP pipelines), or a calibrated .json")
    p.add_argument("--model", default=None, metavar="CONFIG",
                   help="with a chip preset (tpu-v5p, tpu-v5e, tpu-v6e, gpu-h100, gpu-h200, gpu-a100: data-sheet "
                        "figures, jaxsb.planner.hardware): the jaxsb config whose model is priced (default: default)")
    p.add_argument("--preset-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra preset option, e.g. memory_limit_gb=28 (repeatable)")
    p.add_argument("--global-batch", type=int, default=512, help="sequences per step, all DP ranks together")
    p.add_argument("--max-len", type=int, default=192000, help="max sequence length L")
    p.add_argument("--planner", action="append", default=[], help="planner name (repeatable); default static")
    p.add_argument("--planner-option", action="append", default=[], metavar="NAME.KEY=VALUE",
                   help="option of one planner, e.g. static.degree=32 (repeatable)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks (CP-group planners; the pipeline "
                                                        "replicas of a sparsebalance-h200 preset, default 4)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (sparsebalance-h200 presets, default 4)")
    p.add_argument("--mbs", type=int, default=1, help="sequences per micro-batch (SparseBalance's planners; "
                                                      "jaxsb keeps the micro-batch count gbs / (mbs x dp))")
    p.add_argument("--coverage", metavar="synthetic|FILE", default=None,
                   help="coverage curves for the planners that choose budgets: synthetic (seeded, like "
                        "SparseBalance's Fig. 4) or a JSON file from scripts/measure_coverage.py")
    p.add_argument("--coverage-drop", type=float, default=0.1, help="p: the largest coverage drop a budget cut "
                                                                    "may cost a sequence (default 0.1)")
    p.add_argument("--anchor", choices=("min", "mean", "max"), default="mean", help="DST's anchor (default mean)")
    p.add_argument("--table-i", action="store_true", help="add SparseBalance's Table I rows (baseline, +DST, "
                                                          "+SAB, +LBB, +SAB+DST, +LBB+DST, jaxsb)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel group size (CP-group planners; "
                                                        "also static's default degree)")
    p.add_argument("--time-limit", type=float, default=None, help="solver time limit per step (s)")
    p.add_argument("--out", metavar="FILE.json", help="write per-step plans and times as JSON")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots there")
    return p


def chip_cost(chip: str, config: str | None, num_devices: int, options: dict):
    """A chip's data-sheet cost model for the model of a jaxsb config (`--model`); options:
    devices_per_node, block (the sparse routing block, default the config's)."""
    import dataclasses

    from jaxsb.config import load_config
    from jaxsb.planner.hardware import CHIPS, hardware_cost

    cfg = load_config(config or "default", [])
    model = cfg.model
    if model.init != "scratch":  # the checkpoint's shape (smollm2-135m, hf:DIR)
        from jaxsb.models.pretrained import load_pretrained

        model = dataclasses.replace(model, **load_pretrained(model.init).config)
    if not model.vocab_size:  # a model trained from scratch gets its tokenizer's vocabulary
        model = dataclasses.replace(model, vocab_size=cfg.tokenizer.vocab_size)
    unknown = set(options) - {"devices_per_node", "block"}
    if unknown:
        raise ValueError(f"--preset {chip}: options {sorted(unknown)} are not supported (devices_per_node, block)")
    return hardware_cost(CHIPS[chip], model, num_devices, fsdp=cfg.parallel.fsdp,
                         block=int(options.get("block", model.sparse.block_size)),
                         devices_per_node=options.get("devices_per_node"))


def simulator_cost(preset: str, config: str | None, num_devices: int, options: dict):
    """The cost model `--preset` names: a chip's data-sheet model (chip_cost) or a published /
    calibrated preset (jaxsb.planner.cost.load_preset)."""
    from jaxsb.planner.cost import load_preset
    from jaxsb.planner.hardware import CHIPS

    if preset in CHIPS:
        return chip_cost(preset, config, num_devices, options)
    return load_preset(preset, **options)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxsb.config import ConfigError
    from jaxsb.plan import PlanError

    pipeline = is_pipeline_preset(args.preset)
    try:
        if pipeline:
            if args.cp or args.devices:
                raise ValueError("SparseBalance's setting has no context parallelism: give --dp (and --pp), "
                                 "not --cp or --devices")
            n = resolve_sizes(args.dp or 4, None, None, args.global_batch, args.steps, args.max_len)
        else:
            n = resolve_sizes(args.devices, args.dp, args.cp, args.global_batch, args.steps, args.max_len)
        preset_opts = preset_options(args.preset, n, args.max_len, args.preset_option, pp=args.pp)
        cost = simulator_cost(args.preset, args.model, n, preset_opts)
        names = list(dict.fromkeys(args.planner or ([] if args.table_i else ["jaxsb" if pipeline else "static"])))
        budget_opts = dict(coverage_drop=args.coverage_drop, anchor=args.anchor) | (dict(mbs=args.mbs) if pipeline else {})
        planners, per_planner = make_planners(names, args.planner_option, cost, n, args.time_limit, args.dp, args.cp,
                                              budget_options=budget_opts, table_i=args.table_i)
        if args.coverage is None and any(getattr(p, "uses_coverage", False) for p in planners.values()):
            raise ValueError("the planners that choose budgets need --coverage synthetic|FILE")
        block = getattr(cost, "block", 128)
        max_k = max([getattr(p, "max_blocks", 0) or p.budgeting.max_blocks for p in planners.values()
                     if getattr(p, "uses_coverage", False)] or [1])
        coverage = coverage_source(args.coverage, block=block, max_k=max_k, seed=args.seed)
        source = read_lengths(args.lengths) if args.lengths else synthetic_lengths(args.dist, args.seed)
        align = 1 if pipeline else 2 * n
        batches, dropped, scanned = make_batches(source, n, args.global_batch, args.max_len, args.steps, align=align)
    except (ValueError, TypeError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = args.lengths or f"--dist {args.dist} (seed {args.seed})"
    print(f"{what}: lengths padded to multiples of {align}; dropped {dropped} of {scanned} read "
          f"(longer than {args.max_len - align} after padding)")
    if not batches:
        print(f"error: not one full batch of {args.global_batch} sequences", file=sys.stderr)
        return 2
    if len(batches) < args.steps:
        print(f"warning: only {len(batches)} full batches, not {args.steps}")
    print(describe_run(cost, n, batches))
    reference = "baseline" if args.table_i else "static"
    try:
        results = run(cost, planners, batches, coverage=coverage, reference=reference)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table_i(results) if pipeline else format_table(results))
    if args.out:
        config = dict(vars(args), devices=n, preset_options=preset_opts, cost_model=cost.name,
                      memory_limit_mb=cost.memory_limit_mb, steps=len(batches), planners=list(planners),
                      planner_options=per_planner, reference=reference)
        print(f"wrote {write_report(args.out, config, dropped, scanned, results)}")
    if args.plots:
        for path in write_plots(results, n, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
