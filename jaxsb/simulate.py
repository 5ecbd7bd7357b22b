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
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxsb.planner.simulation import (DISTRIBUTIONS, format_table, make_batches, read_lengths, run,
                                      synthetic_lengths, write_plots)

def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


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
                        "or a calibrated .json")
    p.add_argument("--preset-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra preset option, e.g. memory_limit_gb=28 (repeatable)")
    p.add_argument("--global-batch", type=int, default=512, help="sequences per step, all DP ranks together")
    p.add_argument("--max-len", type=int, default=192000, help="max sequence length L")
    p.add_argument("--planner", action="append", default=[], help="planner name (repeatable); default static")
    p.add_argument("--planner-option", action="append", default=[], metavar="NAME.KEY=VALUE",
                   help="option of one planner, e.g. static.degree=32 (repeatable)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks (CP-group planners)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel group size (CP-group planners; "
                                                        "also static's default degree)")
    p.add_argument("--time-limit", type=float, default=None, help="solver time limit per step (s)")
    p.add_argument("--out", metavar="FILE.json", help="write per-step plans and times as JSON")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots there")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxsb.planner.cost import load_preset
    from jaxsb.plan import PlanError
    from jaxsb.planner.registry import make_planner, planner_options

    try:
        n = args.devices
        if args.dp or args.cp:
            if not (args.dp and args.cp):
                raise ValueError("--dp and --cp go together")
            if n is not None and n != args.dp * args.cp:
                raise ValueError(f"--devices {n} != --dp {args.dp} x --cp {args.cp}")
            n = args.dp * args.cp
        n = 64 if n is None else n
        for flag, v in (("--devices", n), ("--global-batch", args.global_batch), ("--steps", args.steps),
                        ("--max-len", args.max_len)):
            if v < 1:
                raise ValueError(f"{flag} {v} must be >= 1")
        preset_opts = {}
        if args.preset.startswith("flexsp-a100:"):
            preset_opts = dict(num_devices=n, max_len=args.max_len)
        for item in args.preset_option:
            key, sep, val = item.partition("=")
            if not sep:
                raise ValueError(f"--preset-option {item!r}: expected KEY=VALUE")
            preset_opts[key] = parse_value(val)
        cost = load_preset(args.preset, **preset_opts)

        names = list(dict.fromkeys(args.planner or ["static"]))
        per_planner: dict[str, dict] = {name: {} for name in names}
        for item in args.planner_option:
            key, sep, val = item.partition("=")
            pname, dot, opt = key.partition(".")
            if not sep or not dot:
                raise ValueError(f"--planner-option {item!r}: expected NAME.KEY=VALUE")
            if pname not in per_planner:
                raise ValueError(f"--planner-option {item!r}: planner {pname!r} is not among --planner {names}")
            per_planner[pname][opt] = parse_value(val)
        planners = {}
        for name in names:
            opts = planner_options(name, n, time_limit_s=args.time_limit, degree=args.cp, dp=args.dp, cp=args.cp)
            opts.update(per_planner[name])
            planners[name] = make_planner(name, cost, n, **opts)

        source = read_lengths(args.lengths) if args.lengths else synthetic_lengths(args.dist, args.seed)
        batches, dropped, scanned = make_batches(source, n, args.global_batch, args.max_len, args.steps)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = args.lengths or f"--dist {args.dist} (seed {args.seed})"
    print(f"{what}: lengths padded to multiples of {2 * n}; dropped {dropped} of {scanned} read "
          f"(longer than {args.max_len - 2 * n} after padding)")
    if not batches:
        print(f"error: not one full batch of {args.global_batch} sequences", file=sys.stderr)
        return 2
    if len(batches) < args.steps:
        print(f"warning: only {len(batches)} full batches, not {args.steps}")
    print(f"cost model {cost.name}, {n} devices, memory limit {cost.memory_limit_mb / 1024:.1f} GB, "
          f"{len(batches)} steps of {args.global_batch} sequences "
          f"({sum(map(sum, batches)) / len(batches) / 1e6:.2f}M tokens per step)")
    try:
        results = run(cost, planners, batches)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(results))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        doc = dict(config=dict(lengths=args.lengths, dist=args.dist, seed=args.seed, devices=n,
                               preset=args.preset, preset_options=preset_opts, cost_model=cost.name,
                               memory_limit_mb=cost.memory_limit_mb, global_batch=args.global_batch,
                               max_len=args.max_len, steps=len(batches), dp=args.dp, cp=args.cp,
                               time_limit_s=args.time_limit, planners=names,
                               planner_options=per_planner),
                   dropped=dropped, scanned=scanned, planners=results)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")
    if args.plots:
        for path in write_plots(results, n, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
