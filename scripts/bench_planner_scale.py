"""How the jaxsb planner's solve time grows with the cluster and the batch, on a log-log plot.

    .venv/bin/python scripts/bench_planner_scale.py --lengths ../shared/data/wikipedia_lens.txt \
        --sizes 64x512,256x1024,1024x4096,4096x16384 --out runs/planner_scale

Each size DEVICESxSEQUENCES plans `--steps` full batches of that many sequences (the
simulator's convention: lengths padded to multiples of 2 x devices, the longer ones dropped)
for that many devices of `--preset` (a chip's data-sheet model, default gpu-h100), one size
after the other in one run. Prints per size the median and largest solve time, the modelled
step time against the planner's lower bound (its gap), the micro-batches, whether the
time limit cut the search and whether each plan is feasible (memory, devices, every sequence
placed once), then the log-log slope of solve time against devices (least squares over the
sizes: 1 = linear; a tiny problem is planned first, untimed, so imports and the MILP solver's
first load are not counted). Writes `scale.json` and `scale.png` into `--out`. Planning times are
measured on this machine (2 cores, other jobs may share it); step times are modelled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        try:
            devices, seqs = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"error: --sizes item {item!r} must be DEVICESxSEQUENCES, e.g. 1024x4096") from None
        if devices < 1 or seqs < 1:
            raise SystemExit(f"error: --sizes item {item!r}: devices and sequences must be >= 1")
        sizes.append((devices, seqs))
    return sizes


def measure(preset: str, devices: int, seqs: int, args) -> dict:
    """Plans `args.steps` batches for one size with the simulator's loop (jaxsb.planner.simulation.run:
    plans are built and validated, their memory checked against the limit); the size's row."""
    from jaxsb.planner.simulation import make_batches, make_planners, preset_options, read_lengths, run, synthetic_lengths
    from jaxsb.simulate import simulator_cost

    cost = simulator_cost(preset, None, devices, preset_options(preset, devices, args.max_len, []))
    planners = make_planners(["jaxsb"], [], cost, devices, args.time_limit, None, None)[0]
    source = read_lengths(args.lengths) if args.lengths else synthetic_lengths(args.dist, 0)
    batches, _, _ = make_batches(source, devices, seqs, args.max_len, args.steps, align=2 * devices)
    if len(batches) < args.steps:
        raise SystemExit(f"error: {devices}x{seqs}: only {len(batches)} full batches of {seqs} sequences")
    steps = run(cost, planners, batches, log=print)["jaxsb"]["steps"]
    rows = [dict(seconds=s["solve_seconds"], modeled_ms=s["modeled_ms"], bound_ms=s["lower_bound_ms"],
                 microbatches=len(s["microbatches"]), feasible=s["feasible"],
                 time_limit_hit=s.get("time_limit_hit", False)) for s in steps]
    modeled, bound = sum(r["modeled_ms"] for r in rows), sum(r["bound_ms"] for r in rows)
    return dict(devices=devices, sequences=seqs, steps=rows,
                median_s=statistics.median(r["seconds"] for r in rows), max_s=max(r["seconds"] for r in rows),
                gap=modeled / bound - 1 if bound > 0 else float("nan"),
                feasible=all(r["feasible"] for r in rows), time_limit_hit=sum(r["time_limit_hit"] for r in rows))


def loglog_slope(xs, ys) -> float:
    """Least-squares slope of log(y) against log(x) (nan with fewer than two sizes)."""
    import numpy as np

    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["devices"] for r in results]
    ax.loglog(xs, [r["median_s"] for r in results], "o-", label="jaxsb planner, median solve")
    ax.loglog(xs, [r["max_s"] for r in results], "x--", label="largest solve")
    ref = results[0]["median_s"] / xs[0]
    ax.loglog(xs, [ref * x for x in xs], ":", color="grey", label="linear in devices")
    for r in results:
        ax.annotate(f"{r['sequences']} seqs", (r["devices"], r["median_s"]), textcoords="offset points",
                    xytext=(4, -12), fontsize=8)
    ax.set_xlabel("devices")
    ax.set_ylabel("solve time per step (s, this machine)")
    ax.set_title("jaxsb planner: solve time against cluster size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="text file, one sequence length per line")
    src.add_argument("--dist", help="a synthetic mix of jaxsb.simulate (long-tail, bytescale, ...)")
    p.add_argument("--sizes", default="64x512,256x1024,1024x4096,4096x16384", help="DEVICESxSEQUENCES,...")
    p.add_argument("--preset", default="gpu-h100", help="cost preset (a chip's data-sheet model by default)")
    p.add_argument("--max-len", type=int, default=192000)
    p.add_argument("--steps", type=int, default=1, help="batches planned per size")
    p.add_argument("--time-limit", type=float, default=None, help="the planner's time_limit_s (default its own)")
    p.add_argument("--out", default=None, help="directory for scale.json and scale.png")
    args = p.parse_args(argv)
    warm = argparse.Namespace(**{**vars(args), "steps": 1, "max_len": 16384, "lengths": None, "dist": "long-tail"})
    measure(args.preset, 8, 16, warm)  # untimed: imports, the solver library's first load
    results = []
    print(f"{'devices':>8} {'seqs':>6} {'median s':>9} {'max s':>7} {'gap':>6} {'mbs':>4} {'cut':>4} feasible")
    for devices, seqs in parse_sizes(args.sizes):
        r = measure(args.preset, devices, seqs, args)
        results.append(r)
        mbs = "/".join(str(s["microbatches"]) for s in r["steps"])
        print(f"{devices:8d} {seqs:6d} {r['median_s']:9.3f} {r['max_s']:7.3f} {r['gap']:6.1%} {mbs:>4} "
              f"{r['time_limit_hit']:4d} {'yes' if r['feasible'] else 'NO'}", flush=True)
    slope = loglog_slope([r["devices"] for r in results], [r["median_s"] for r in results])
    print(f"log-log slope of solve time against devices: {slope:.2f} (1 = linear)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "scale.json"), "w") as f:
            json.dump(dict(preset=args.preset, source=args.lengths or args.dist, results=results, slope=slope), f,
                      indent=1)
        plot(results, os.path.join(args.out, "scale.png"))
        print(f"wrote {args.out}/scale.json and scale.png")
    return 0 if all(r["feasible"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
