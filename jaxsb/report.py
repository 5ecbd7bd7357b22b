"""`python -m jaxsb.report --workdir DIR`: pictures of a run, written into DIR as PNGs (also at
the end of `python -m jaxsb.train`, unless `train.report=false`):

* `training.png` — loss and tokens/s over the steps (`metrics.jsonl`);
* `plans.png` — a few steps' plans (`plans.jsonl`) drawn as devices × modelled time: every group
  is a box over its devices for the time the planner's cost model gives it, labelled with its
  sequences; in each micro-batch the straggler (the group the others wait for) is outlined.
  Steps shown: the first, the one with the most different group sizes side by side, the most
  imbalanced, and the last;
* `imbalance.png` — per step, the modelled load imbalance (max / mean busy time per device),
  and with sparse attention the executed one (block pairs per device, counted by the kernels);
* `budgets.png` — sparse attention: the sparse budgets and the coverage they kept, per step.

Times in the plan picture are modelled (the planner's cost model), not measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from jaxsb.training.metrics import read_metrics


@dataclasses.dataclass(frozen=True)
class Box:
    """One group of one micro-batch in the devices × time picture."""

    microbatch: int
    group: int
    first_device: int
    degree: int
    t0_ms: float
    t1_ms: float
    label: str
    straggler: bool  # the micro-batch's longest group


def _tokens(n: int) -> str:
    return f"{n / 1000:.1f}K" if n >= 1000 else str(n)


def plan_boxes(plan: dict, group_ms: list[list[float]]) -> list[Box]:
    """The boxes of one step (`plan`: jaxsb.wire.plan_to_json; `group_ms`: per micro-batch,
    per group, its modelled ms). Micro-batches run one after another: micro-batch m starts
    when the slowest group of m-1 ends. Groups with nothing to do get no box."""
    seqs: dict[tuple[int, int], list[int]] = {}
    for i, (m, g, _rank) in enumerate(plan["placements"]):
        seqs.setdefault((m, g), []).append(plan["lengths"][i])
    boxes, t = [], 0.0
    for m, (mb, times) in enumerate(zip(plan["microbatches"], group_ms)):
        longest = max(times, default=0.0)
        for g, ((start, degree, scheme), ms) in enumerate(zip(mb["groups"], times)):
            lengths = seqs.get((m, g), [])
            if not lengths:
                continue
            kind = "whole" if degree == 1 else scheme
            label = f"{kind} ×{degree}\n{len(lengths)} seq, {_tokens(sum(lengths))}"
            boxes.append(Box(m, g, start, degree, t, t + ms, label, ms == longest and ms > 0))
        t += longest
    return boxes


def pick_steps(records: list[dict], layouts: dict[int, dict], count: int = 4) -> list[int]:
    """The steps `plans.png` shows: first, most mixed (the most distinct sizes among the groups
    that hold sequences, then the most such groups), most imbalanced, last."""
    steps = [r["step"] for r in records if r["step"] in layouts]
    if not steps:
        return []
    imbalance = {r["step"]: r.get("load_imbalance") or 1.0 for r in records}

    def mix(step):
        plan = layouts[step]["plan"]
        used = {(m, g) for m, g, _rank in plan["placements"]}
        degrees = [{mb["groups"][g][1] for m2, g in used if m2 == m} for m, mb in enumerate(plan["microbatches"])]
        return max(len(d) for d in degrees), len(used)

    chosen = [steps[0], max(steps, key=mix), max(steps, key=imbalance.get), steps[-1]]
    return list(dict.fromkeys(chosen))[:count]


def _plot_plans(ax_list, records, layouts, steps) -> None:
    import matplotlib.patches as patches

    by_step = {r["step"]: r for r in records}
    for ax, step in zip(ax_list, steps):
        layout = layouts[step]
        boxes = plan_boxes(layout["plan"], layout["group_ms"])
        colours = {"whole": "#9ecae1", "ring": "#fdae6b", "ulysses": "#a1d99b"}
        end = max((b.t1_ms for b in boxes), default=1.0) or 1.0
        for b in boxes:
            kind = b.label.split()[0]
            ax.add_patch(patches.Rectangle((b.t0_ms, b.first_device), b.t1_ms - b.t0_ms, b.degree,
                                           facecolor=colours.get(kind, "#dddddd"),
                                           edgecolor="#d62728" if b.straggler else "#444444",
                                           linewidth=2.2 if b.straggler else 0.6))
            if (b.t1_ms - b.t0_ms) > 0.09 * end:
                ax.text((b.t0_ms + b.t1_ms) / 2, b.first_device + b.degree / 2, b.label, ha="center",
                        va="center", fontsize=6.5 if b.degree == 1 else 7.5)
        num_devices = layout["plan"]["num_devices"]
        ax.set_xlim(0, end * 1.02)
        ax.set_ylim(num_devices, 0)
        ax.set_yticks([d + 0.5 for d in range(num_devices)], [str(d) for d in range(num_devices)], fontsize=7)
        r = by_step.get(step, {})
        ax.set_title(f"step {step}: plan {r.get('plan', '?')}, modelled imbalance "
                     f"{r.get('load_imbalance', float('nan')):.2f}", fontsize=9)
        ax.set_ylabel("device")
    ax_list[-1].set_xlabel("modelled time (ms); red outline: the micro-batch's straggler")


def write_report(workdir: str, log=print) -> list[str]:
    """Writes the run's PNGs into `workdir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (is {workdir} a jaxsb run's workdir?)")
    records = read_metrics(path)
    if not records:
        raise ValueError(f"{path}: no steps recorded yet")
    steps = [r["step"] for r in records]
    written = []

    def save(fig, name):
        out = os.path.join(workdir, name)
        fig.savefig(out, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(out)

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax1.plot(steps, [r["loss"] for r in records], color="#1f77b4")
    ax1.set_ylabel("loss")
    ax1.set_title(f"{os.path.basename(os.path.abspath(workdir))}: {len(records)} steps", fontsize=10)
    ax2.plot(steps, [r["tokens_per_s"] for r in records], color="#2ca02c")
    ax2.set_ylabel("tokens / s (measured)")
    ax2.set_xlabel("step")
    save(fig, "training.png")

    plans_path = os.path.join(workdir, "plans.jsonl")
    layouts = {r["step"]: r for r in read_metrics(plans_path)} if os.path.exists(plans_path) else {}
    shown = pick_steps(records, layouts)
    if shown:
        fig, axes = plt.subplots(len(shown), 1, figsize=(9, 1.0 + 0.42 * layouts[shown[0]]["plan"]["num_devices"]
                                                          * len(shown)), squeeze=False)
        _plot_plans([a[0] for a in axes], records, layouts, shown)
        fig.tight_layout()
        save(fig, "plans.png")

    if any("load_imbalance" in r or "executed_imbalance" in r for r in records):
        fig, ax = plt.subplots(figsize=(7, 3))
        for key, label in (("load_imbalance", "modelled (cost model, per device busy ms)"),
                           ("executed_imbalance", "executed (attention block pairs per device)")):
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=label)
        ax.axhline(1.0, color="#888888", linewidth=0.8)
        ax.set_ylabel("max / mean")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.set_title("load imbalance per step", fontsize=10)
        save(fig, "imbalance.png")

    if any("sparse_coverage" in r for r in records):
        fig, ax = plt.subplots(figsize=(7, 3))
        for key, label in (("budget_mean", "mean budget (key blocks)"), ("sparse_blocks", "selected blocks / query block"),
                           ("sparse_budget", "configured budget")):
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=label)
        ax.set_ylabel("key blocks")
        ax.set_xlabel("step")
        cov = ax.twinx()
        cov.plot(steps, [r.get("sparse_coverage", float("nan")) for r in records], color="#d62728", label="coverage")
        cov.set_ylabel("coverage kept", color="#d62728")
        cov.set_ylim(0, 1.02)
        ax.legend(fontsize=8, loc="lower left")
        ax.set_title("sparse budgets and the attention mass they keep", fontsize=10)
        save(fig, "budgets.png")
    log(f"report: {', '.join(os.path.basename(p) for p in written)} in {workdir}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw a jaxsb run's pictures (PNG) into its workdir.")
    parser.add_argument("--workdir", required=True, help="the run's output directory")
    args = parser.parse_args(argv)
    try:
        write_report(args.workdir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
