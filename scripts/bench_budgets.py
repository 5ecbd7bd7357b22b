"""Sparse budgets in training, side by side in one process: dense vs sparse at a fixed budget vs
sparse with per-step budgets (DST).

    .venv/bin/python scripts/bench_budgets.py [--config default] [--steps 12] [--set key=value ...]

Three runs of the same config, from the same seed, on the same documents (the data iterator is
deterministic), all planned by the jaxsb planner:

- dense: model.attention=xla;
- sparse: model.attention=sparse, every sequence at model.sparse.top_k;
- sparse+dst: parallel.budgets=dst, budgets per document in [1, model.sparse.max_blocks]
  chosen every step from the coverage curves the sparse layers measured before.

Sparse defaults unless --set says otherwise: block_size 64, top_k 4, max_blocks 8 (the default
config's 1024-token pieces have 16 blocks, so top_k 4 is sparse). Per run: useful tokens/s
(median over the steps that compiled nothing), executed-work imbalance (max / mean over devices
of the attention block pairs the kernels computed, from their tables; sparse runs only), mean
routing coverage, mean budget, floor overrides and the final loss. On a CPU host the simulated
devices share the cores, so wall time is the sum of all devices' work: imbalance shows in the
executed-work column, not in tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxsb.devices import setup_host_devices  # noqa: E402

setup_host_devices()  # 8 simulated devices on a CPU host, before jax is imported

SPARSE_DEFAULTS = ["model.sparse.block_size=64", "model.sparse.top_k=4", "model.sparse.max_blocks=8"]
VARIANTS = {
    "dense": ["model.attention=xla"],
    "sparse": ["model.attention=sparse"],
    "sparse+dst": ["model.attention=sparse", "parallel.budgets=dst"],
}


def summarize(records: list[dict]) -> dict:
    steady = [r for r in records if not r["compiled_now"]] or records
    mean = lambda key: statistics.fmean(r[key] for r in records if r.get(key) is not None) \
        if any(r.get(key) is not None for r in records) else None  # noqa: E731
    return dict(tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
                executed_imbalance=mean("executed_imbalance"), coverage=mean("sparse_coverage"),
                budget=mean("budget_mean") if any("budget_mean" in r for r in records) else mean("sparse_budget"),
                floor_overridden=mean("sparse_floor_overridden"), loss=records[-1]["loss"], steps=len(records),
                steady_steps=len(steady))


def main(argv=None) -> int:
    from jaxsb.config import ConfigError, load_config
    from jaxsb.training.trainer import train

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="default")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, variant in VARIANTS.items():
            workdir = os.path.join(tmp, name)
            try:
                cfg = load_config(args.config, [*SPARSE_DEFAULTS, f"train.steps={args.steps}", "train.progress=false",
                                                "parallel.planner=jaxsb", f"train.workdir={workdir}",
                                                "train.checkpoint_every=100000", *args.overrides, *variant])
            except ConfigError as e:
                print(f"config error: {e}", file=sys.stderr)
                return 2
            train(cfg, log=lambda *_: None)
            with open(os.path.join(workdir, "metrics.jsonl")) as f:
                results[name] = summarize([json.loads(line) for line in f])
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"{'run':<11} {'tokens/s':>9} {'vs dense':>8} {'executed imbalance':>18} {'coverage':>8} "
          f"{'budget':>6} {'floor raised':>12} {'final loss':>10}")
    dense = results["dense"]["tokens_per_s"]
    for name, r in results.items():
        print(f"{name:<11} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / dense:>7.2f}x "
              f"{fmt(r['executed_imbalance'], '.3f'):>18} {fmt(r['coverage'], '.3f'):>8} {fmt(r['budget'], '.2f'):>6} "
              f"{fmt(r['floor_overridden'], '.3f'):>12} {r['loss']:>10.4f}")
    print(f"({args.steps} steps each; tokens/s = median over the {results['dense']['steady_steps']} steps that "
          "compiled nothing; on CPU the devices share the cores, so wall time sums all devices' work)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
