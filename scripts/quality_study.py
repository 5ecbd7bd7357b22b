"""The quality study of docs/quality.md: long-range accuracy and perplexity against attention work.

    .venv/bin/python scripts/quality_study.py [--lengths 1024,2048,4096,8192] [--samples 4]
        [--long-docs 2 --max-doc-tokens 8192] [--only NAME ...] [--out docs/quality]
    .venv/bin/python scripts/quality_study.py --part mqar [--seeds 0,1,2] [--steps N] [--out docs/quality]
    .venv/bin/python scripts/quality_study.py --part finetune [--ft-steps 24] [--out docs/quality]

Part "pretrained, sparse without retraining": SmolLM2-135M-Instruct (`--init`, default
smollm2-135m) under every setting of SETTINGS — dense; sparse at fixed budgets (block size,
top-k); the runtime coverage floor alone (`model.sparse.policy=floor`: every document starts at
budget 1 and the floor raises it to k_min(p) against a base budget of every block, so the
budget is the least that keeps coverage within p of dense) — each through `python -m jaxsb.eval`
(passkey, then long-document perplexity), a process per run. Writes OUT/pretrained.json (every
run's summary), OUT/pretrained.md (the table) and OUT/pretrained.png (accuracy and perplexity vs
attention work). Attention work is the prefill's (query block, key block) pairs as a fraction of
dense causal, counted from the kernels' tables; the floor's base is `--floor-base` blocks.

Part "mqar", small models trained here: `configs/mqar.toml` trained (`python -m jaxsb.train`, a
process per run) under every setting of MQAR_SETTINGS — dense; sparse at fixed budgets
(`--fixed`, the runtime floor off); sparse with per-document budgets tuned by the planner
(`parallel.budgets=dst`, base budget `--base`, coverage threshold `--dst-drop`) — for every seed
of `--seeds` (train.seed = data.seed = the seed, so a seed's settings see the same examples),
then `python -m jaxsb.eval --task mqar` on each run under every evaluation attention of
MQAR_EVALS. A run's training attention work is the block pairs its steps computed over dense
causal's (summary.json's attention_fraction; dense: 1). A tuned run is compared with the fixed
budgets of the same seed at its own work, interpolated between the two fixed budgets around it.
Writes OUT/mqar.json (kept after every run; a rerun with the same settings skips the runs it
holds), OUT/mqar.md and OUT/mqar.png.

Part "finetune", continued training of the pretrained model with sparse attention (MoBA's
recipe, shortened to what 2 cores do in an hour): `--ft-config` (configs/smollm2_finetune.toml:
SmolLM2 on the standard library's source, the `--long-docs` files the perplexity scores held out
by data.holdout_largest) trained `--ft-steps` steps with sparse attention in `--ft-block`-token
blocks, on `--ft-devices` simulated devices, twice: first with budgets tuned by the planner (DST
around `--base` at p = `--dst-drop`), then at the fixed budget of the same mean cost (the tuned
run's mean budget, rounded). The pretrained model and both fine-tuned ones are evaluated dense
and sparse at the base budget: passkey at `--ft-lengths`, long-document perplexity. Writes
OUT/finetune.json (a rerun with the same settings skips the models it holds), OUT/finetune.md
and OUT/finetune.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sparse(block: int, top_k: int, policy: str = "fixed", p: float = 1.0) -> list[str]:
    return ["model.attention=sparse", f"model.sparse.block_size={block}", f"model.sparse.top_k={top_k}",
            f"model.sparse.policy={policy}", f"model.sparse.coverage_drop={p}"]


def settings(floor_base: int) -> dict[str, list[str]]:
    """{name: eval --set overrides}."""
    return {
        "dense": [],
        "fixed b128 k8": sparse(128, 8),
        "fixed b128 k16": sparse(128, 16),
        "fixed b64 k32": sparse(64, 32),
        **{f"floor p={p}": sparse(128, floor_base, "floor", p) for p in (0.05, 0.1, 0.2)},
    }


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _check_run(cmd: list[str], devices: int = 0) -> None:
    """Runs `cmd` in the repository; `devices` > 0 simulates that many CPU devices (XLA_FLAGS)."""
    env = dict(os.environ)
    if devices:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def run_eval(source: list[str], overrides: list[str], task_args: list[str]) -> dict:
    """One `python -m jaxsb.eval` process on a model (`source`: --set model.init=... or
    --workdir RUN); its --summary JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        summary = os.path.join(tmp, "summary.json")
        _check_run([sys.executable, "-m", "jaxsb.eval", *source, *_sets(overrides), *task_args, "--summary", summary])
        with open(summary) as f:
            return json.load(f)


def train(config: str, workdir: str, overrides: list[str], steps: int = 0, devices: int = 0) -> dict:
    """One `python -m jaxsb.train` process (`steps` > 0 replaces the config's, with one checkpoint
    at the end); its summary.json, with the run's training attention work (dense: 1)."""
    cmd = [sys.executable, "-m", "jaxsb.train", "--config", config, "--workdir", workdir,
           "--set", "train.progress=false", "--set", "train.report=false",
           *(["--set", f"train.steps={steps}", "--set", f"train.checkpoint_every={steps}"] if steps else []),
           *_sets(overrides)]
    _check_run(cmd, devices)
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    return {"final_loss": summary["final_loss"], "seconds": summary["seconds"],
            "train_work": summary.get("attention_fraction", 1.0),
            "sparse_blocks_mean": summary.get("plans", {}).get("sparse_blocks_mean")}


def evaluate(source: list[str], overrides: list[str], args, lengths: str) -> dict:
    """Passkey at `lengths` and, with --long-docs, long-document perplexity: {passkey, perplexity}."""
    r = {"passkey": run_eval(source, overrides, ["--task", "passkey", "--lengths", lengths, "--samples",
                                                 str(args.samples), "--seed", str(args.seed),
                                                 "--batch-size", str(args.batch_size)])}
    if args.long_docs:
        r["perplexity"] = run_eval(source, overrides, ["--long-docs", str(args.long_docs),
                                                       "--max-doc-tokens", str(args.max_doc_tokens)])
    return r


def table(results: dict[str, dict], lengths: list[int]) -> list[str]:
    head = ["setting", *(f"passkey {L}" for L in lengths), "passkey all", "work (passkey)", "coverage",
            "floor budget", "perplexity", "work (ppl)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        pk, ppl = r["passkey"], r.get("perplexity")
        cov = pk["work"].get("sparse_coverage")
        floor = pk["work"].get("floor_final")
        cells = [name, *(f"{pk['by_length'][str(L)]:.2f}" for L in lengths), f"{pk['accuracy']:.3f}",
                 f"{pk['work']['attention_fraction']:.3f}", "-" if cov is None else f"{cov:.3f}",
                 "-" if floor is None else f"{floor:.2f}",
                 "-" if ppl is None else f"{ppl['perplexity']:.3f}",
                 "-" if ppl is None else f"{ppl['work']['attention_fraction']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(results: dict[str, dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    markers = "osD^vP*X"  # settings at the same point stay visible: a legend, not labels on the points
    for i, (name, r) in enumerate(results.items()):
        style = dict(color=f"C{i}", marker=markers[i % len(markers)], s=60 - 5 * i, label=name)
        ax1.scatter(r["passkey"]["work"]["attention_fraction"], r["passkey"]["accuracy"], **style)
        if r.get("perplexity"):
            ax2.scatter(r["perplexity"]["work"]["attention_fraction"], r["perplexity"]["perplexity"], **style)
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set(xlabel="attention work (fraction of dense causal block pairs)", ylabel="passkey accuracy",
            ylim=(-0.05, 1.05), xlim=(0, 1.05), title=f"{title}: passkey")
    ax2.set(xlabel="attention work (fraction of dense causal block pairs)", ylabel="perplexity",
            xlim=(0, 1.05), title=f"{title}: long-document perplexity")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- part "mqar": small models trained here ----

def mqar_settings(fixed: list[int], base: int, drop: float) -> dict[str, list[str]]:
    """{name: train --set overrides}: dense, fixed budgets (floor off), DST around a base budget."""
    def sparse_at(k: int, p: float) -> list[str]:
        return ["model.attention=sparse", f"model.sparse.top_k={k}", f"model.sparse.coverage_drop={p}"]

    return {"dense": [], **{f"fixed k{k}": sparse_at(k, 1.0) for k in fixed},
            f"dst k{base} p={drop}": sparse_at(base, drop) + ["parallel.budgets=dst"]}


def mqar_evals(base: int) -> dict[str, list[str]]:
    """{name: eval --set overrides}: every trained model under the same attentions, and its own."""
    return {"dense": ["model.attention=xla", "parallel.budgets=fixed"],
            f"sparse k{base}": ["model.attention=sparse", f"model.sparse.top_k={base}",
                                "model.sparse.coverage_drop=1.0", "model.sparse.policy=fixed", "parallel.budgets=fixed"],
            "own": []}


def train_and_eval(args, seed: int, overrides: list[str], evals: dict[str, list[str]]) -> dict:
    """One training run of the MQAR config and its evaluations; the workdir is removed after."""
    workdir = tempfile.mkdtemp(prefix=f"mqar-s{seed}-", dir=args.runs_dir)
    try:
        run = train(args.config, workdir, [f"train.seed={seed}", f"data.seed={seed}", *overrides, *args.extra],
                    args.steps)
        task = ["--task", "mqar", "--samples", str(args.mqar_samples), "--batch-size", "16"]
        return {"overrides": overrides, **run,
                "eval": {name: run_eval(["--workdir", workdir], o, task) for name, o in evals.items()}}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def fixed_at(runs: dict[str, dict], work: float, evaluation: str) -> tuple[float, str] | None:
    """The fixed budgets' accuracy at `work`, linear between the two fixed runs whose training work
    is around it (same seed); None when no two fixed runs bracket it."""
    points = sorted((r["train_work"], r["eval"][evaluation]["accuracy"], n) for n, r in runs.items()
                    if n.startswith("fixed"))
    for (w0, a0, n0), (w1, a1, n1) in zip(points, points[1:]):
        if w0 <= work <= w1:
            t = (work - w0) / (w1 - w0) if w1 > w0 else 0.0
            return a0 + t * (a1 - a0), f"{n0} .. {n1}"
    return None


def _cell(values: list[float], fmt: str = "{:.3f}") -> str:
    """Per-seed values, and their mean when there are several."""
    mean = f" (mean {fmt.format(sum(values) / len(values))})" if len(values) > 1 else ""
    return " / ".join(fmt.format(v) for v in values) + mean


def _setting_names(results: dict) -> list[str]:
    return list(next(iter(results.values())).keys()) if results else []


def mqar_tables(results: dict, seeds: list[int], evals: list[str]) -> list[str]:
    names = _setting_names(results)
    head = ["setting", "training work", *(f"recall, {e} eval" for e in evals), "final loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        runs = [results[str(s)][name] for s in seeds if name in results.get(str(s), {})]
        if not runs:
            continue
        lines.append("| " + " | ".join([name, _cell([r["train_work"] for r in runs]),
                                         *(_cell([r["eval"][e]["accuracy"] for r in runs]) for e in evals),
                                         _cell([r["final_loss"] for r in runs])]) + " |")
    lines += ["", "Tuned budgets against the fixed budgets of the same seed at the same training work "
              "(linear between the two fixed runs around it):", "",
              "| seed | setting | evaluation | training work | recall | fixed at that work | difference |",
              "|---|---|---|---|---|---|---|"]
    for s in seeds:
        runs = results.get(str(s), {})
        for name, r in runs.items():
            if not name.startswith("dst"):
                continue
            for e in evals:
                ref = fixed_at(runs, r["train_work"], e)
                acc = r["eval"][e]["accuracy"]
                if ref is None:
                    lines.append(f"| {s} | {name} | {e} | {r['train_work']:.3f} | {acc:.3f} | "
                                 "no two fixed runs around it | - |")
                else:
                    lines.append(f"| {s} | {name} | {e} | {r['train_work']:.3f} | {acc:.3f} | "
                                 f"{ref[0]:.3f} ({ref[1]}) | {acc - ref[0]:+.3f} |")
    return lines


def mqar_plot(results: dict, seeds: list[int], evals: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(evals), figsize=(5.2 * len(evals), 4.2), squeeze=False)
    names = _setting_names(results)
    for ax, e in zip(axes[0], evals):
        for i, name in enumerate(names):
            pts = [(results[str(s)][name]["train_work"], results[str(s)][name]["eval"][e]["accuracy"])
                   for s in seeds if name in results.get(str(s), {})]
            ax.scatter([x for x, _ in pts], [y for _, y in pts], label=name, color=f"C{i}")
        ax.set(xlabel="training attention work (fraction of dense causal block pairs)", ylabel="MQAR recall",
               ylim=(-0.05, 1.05), xlim=(0, 1.05), title=f"MQAR, {e} evaluation ({len(seeds)} seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def mqar_study(args) -> int:
    seeds = [int(x) for x in args.seeds.split(",")]
    chosen = mqar_settings([int(k) for k in args.fixed.split(",")], args.base, args.dst_drop)
    evals = mqar_evals(args.base)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "mqar.json")
    same = {"config": args.config, "steps": args.steps, "samples": args.mqar_samples, "extra": args.extra,
            "settings": chosen, "evals": evals}
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        if {k: earlier.get(k) for k in same} == same:
            results = earlier["results"]  # resume: the runs it holds are not run again
    for seed in seeds:
        for name, overrides in chosen.items():
            if name in results.get(str(seed), {}):
                continue
            r = train_and_eval(args, seed, overrides, evals)
            results.setdefault(str(seed), {})[name] = r
            with open(path, "w") as f:
                json.dump({**same, "seeds": seeds, "results": results}, f, indent=2)
            print(f"seed {seed} {name}: training work {r['train_work']:.3f}, "
                  + ", ".join(f"recall ({e}) {v['accuracy']:.3f}" for e, v in r["eval"].items()), flush=True)
    lines = mqar_tables(results, seeds, list(evals))
    with open(os.path.join(args.out, "mqar.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    mqar_plot(results, seeds, list(evals), os.path.join(args.out, "mqar.png"))
    print("\n".join(lines))
    return 0


# ---- part "finetune": continued training of the pretrained model with sparse attention ----

PRETRAINED = "pretrained (not trained)"


def finetune_overrides(args) -> list[str]:
    """The fine-tune's training overrides every run shares: the model, the length and batch, the
    held-out evaluation documents, sparse attention at block size --ft-block."""
    L, B = args.ft_max_len, args.ft_block
    buckets = sorted({max(B, L // 4), max(B, L // 2), L})
    return [f"model.init={args.init}", f"data.max_len={L}", f"data.tokens_per_step={args.ft_tokens}",
            f"data.row_buckets=[{','.join(map(str, buckets))}]", f"data.holdout_largest={args.long_docs}",
            "model.attention=sparse", f"model.sparse.block_size={B}",
            f"model.sparse.max_blocks={max_blocks(args)}", *args.extra]


def finetune_evals(args) -> dict[str, list[str]]:
    """{name: eval --set overrides}: every model dense and at the base budget (floor off)."""
    return {"dense": ["model.attention=xla", "parallel.budgets=fixed"],
            f"sparse b{args.ft_block} k{args.base}": sparse(args.ft_block, args.base) + ["parallel.budgets=fixed"]}


def max_blocks(args) -> int:
    """The fine-tune's static bound on budgets: twice the base, at most a training row's blocks."""
    return min(2 * args.base, args.ft_max_len // args.ft_block)


def equal_work_budget(dst_run: dict, bound: int) -> int:
    """The fixed budget of the same mean cost as the tuned run: its mean budget, rounded, in [1, bound]."""
    return max(1, min(bound, round(dst_run["sparse_blocks_mean"])))


def finetune_study(args) -> int:
    lengths = args.ft_lengths
    evals = finetune_evals(args)
    common = finetune_overrides(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "finetune.json")
    same = {"config": args.ft_config, "steps": args.ft_steps, "devices": args.ft_devices, "common": common,
            "base": args.base, "drop": args.dst_drop, "lengths": lengths, "samples": args.samples,
            "seed": args.seed, "long_docs": args.long_docs, "max_doc_tokens": args.max_doc_tokens, "evals": evals}
    models = {}
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        if {k: earlier.get(k) for k in same} == same:
            models = earlier["models"]  # resume: the models it holds are not trained or evaluated again

    def keep(name: str, model: dict) -> None:
        models[name] = model
        with open(path, "w") as f:
            json.dump({**same, "models": models}, f, indent=2)
        print(f"{name}: " + ("" if model["train"] is None else
                             f"training work {model['train']['train_work']:.3f}, loss {model['train']['final_loss']:.3f}; ")
              + "; ".join(f"{e}: passkey {v['passkey']['accuracy']:.3f}"
                          + (f", perplexity {v['perplexity']['perplexity']:.3f}" if "perplexity" in v else "")
                          for e, v in model["eval"].items()), flush=True)

    def fine_tune(name: str, overrides: list[str]) -> dict:
        workdir = tempfile.mkdtemp(prefix="finetune-", dir=args.runs_dir)
        try:
            run = train(args.ft_config, workdir, common + overrides, args.ft_steps, args.ft_devices)
            return {"overrides": overrides, "train": run,
                    "eval": {e: evaluate(["--workdir", workdir], o, args, lengths) for e, o in evals.items()}}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    if PRETRAINED not in models:
        keep(PRETRAINED, {"overrides": [], "train": None,
                          "eval": {e: evaluate(["--set", f"model.init={args.init}"], o, args, lengths)
                                   for e, o in evals.items()}})
    tuned = f"dst k{args.base} p={args.dst_drop}"
    if tuned not in models:
        keep(tuned, fine_tune(tuned, [f"model.sparse.top_k={args.base}", f"model.sparse.coverage_drop={args.dst_drop}",
                                      "parallel.budgets=dst"]))
    k = equal_work_budget(models[tuned]["train"], max_blocks(args))
    fixed = f"fixed k{k}"
    if fixed not in models:
        keep(fixed, fine_tune(fixed, [f"model.sparse.top_k={k}", "model.sparse.coverage_drop=1.0"]))
    lines = finetune_tables({n: models[n] for n in (PRETRAINED, tuned, fixed)}, [int(x) for x in lengths.split(",")])
    with open(os.path.join(args.out, "finetune.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    flat = {f"{n}, {e} eval": v for n, m in models.items() if n in (PRETRAINED, tuned, fixed) for e, v in m["eval"].items()}
    plot(flat, os.path.join(args.out, "finetune.png"), f"{args.init} fine-tuned")
    print("\n".join(lines))
    return 0


def finetune_tables(models: dict[str, dict], lengths: list[int]) -> list[str]:
    """The training runs (work, budgets, loss, time), then every model under every evaluation."""
    lines = ["| model | training work | mean budget (key blocks) | final loss | training seconds |",
             "|---|---|---|---|---|"]
    for name, m in models.items():
        t = m["train"]
        lines.append(f"| {name} | - | - | - | - |" if t is None else
                     f"| {name} | {t['train_work']:.3f} | {t['sparse_blocks_mean']:.2f} | {t['final_loss']:.3f} | "
                     f"{t['seconds']:.0f} |")
    flat = {f"{n}, {e} eval": v for n, m in models.items() for e, v in m["eval"].items()}
    return lines + [""] + table(flat, lengths)


def _save(path: str, args, lengths: list[int], results: dict) -> None:
    with open(path, "w") as f:
        json.dump({"init": args.init, "lengths": lengths, "samples": args.samples, "seed": args.seed,
                   "long_docs": args.long_docs, "max_doc_tokens": args.max_doc_tokens, "results": results}, f, indent=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", default="smollm2-135m", help="the pretrained model (model.init)")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--samples", type=int, default=4, help="passkey prompts per length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-docs", type=int, default=2, help="0 = no perplexity part")
    ap.add_argument("--max-doc-tokens", type=int, default=8192)
    ap.add_argument("--floor-base", type=int, default=64, help="the floor's base budget (64 = dense at 8K)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--only", action="append", default=[], help="run only these settings (repeatable)")
    ap.add_argument("--set", dest="extra", action="append", default=[],
                    help="more overrides, every run (pretrained: eval; mqar: train)")
    ap.add_argument("--out", default="docs/quality")
    ap.add_argument("--part", choices=["pretrained", "mqar", "finetune"], default="pretrained")
    mq = ap.add_argument_group("parts mqar and finetune")
    mq.add_argument("--config", default="mqar", help="the training config")
    mq.add_argument("--seeds", default="0,1,2")
    mq.add_argument("--steps", type=int, default=0, help="training steps (0 = the config's)")
    mq.add_argument("--fixed", default="2,3,4", help="the fixed budgets (key blocks)")
    mq.add_argument("--base", type=int, default=4, help="DST's base budget; also the common sparse evaluation's")
    mq.add_argument("--runs-dir", default=None, help="where the runs' workdirs are made (and removed)")
    mq.add_argument("--dst-drop", type=float, default=0.3, help="DST's coverage threshold p")
    mq.add_argument("--mqar-samples", type=int, default=64, help="evaluation examples per length")
    ft = ap.add_argument_group("part finetune (also --init, --samples, --seed, --long-docs, --max-doc-tokens, --set)")
    ft.add_argument("--ft-config", default="smollm2_finetune", help="the fine-tune's training config")
    ft.add_argument("--ft-steps", type=int, default=24, help="fine-tuning steps per run")
    ft.add_argument("--ft-max-len", type=int, default=2048, help="training documents' longest piece (data.max_len)")
    ft.add_argument("--ft-tokens", type=int, default=4096, help="tokens per step (data.tokens_per_step)")
    ft.add_argument("--ft-block", type=int, default=128, help="sparse block size (model.sparse.block_size)")
    ft.add_argument("--ft-devices", type=int, default=2,
                    help="simulated CPU devices of the training runs (8 do not fit SmolLM2 at 2K in 24 GiB)")
    ft.add_argument("--ft-lengths", default="1024,2048", help="passkey lengths of the fine-tune's evaluations")
    args = ap.parse_args(argv)
    if args.part == "mqar":
        return mqar_study(args)
    if args.part == "finetune":
        return finetune_study(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    chosen = settings(args.floor_base)
    unknown = [n for n in args.only if n not in chosen]
    if unknown:
        raise SystemExit(f"--only {unknown}: not a setting; known: {list(chosen)}")
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "pretrained.json")
    results = {}
    if args.only and os.path.exists(results_path):  # --only adds to / replaces in earlier results
        with open(results_path) as f:
            earlier = json.load(f)
        same = {"init": args.init, "lengths": lengths, "samples": args.samples, "seed": args.seed,
                "long_docs": args.long_docs, "max_doc_tokens": args.max_doc_tokens}
        differ = {k: (earlier.get(k), v) for k, v in same.items() if earlier.get(k) != v}
        if differ:
            raise SystemExit(f"{results_path} was made with other settings {differ} (saved, asked): "
                             "use another --out or the same settings")
        results = earlier["results"]
    for name, overrides in chosen.items():
        if args.only and name not in args.only:
            continue
        overrides = overrides + args.extra
        r = {"overrides": overrides, **evaluate(["--set", f"model.init={args.init}"], overrides, args, args.lengths)}
        results[name] = r
        _save(results_path, args, lengths, results)  # after every setting: a long run keeps what it did
        print(f"{name}: passkey {r['passkey']['accuracy']:.3f} at work {r['passkey']['work']['attention_fraction']:.3f}"
              + (f", perplexity {r['perplexity']['perplexity']:.3f}" if args.long_docs else ""), flush=True)
    results = {n: results[n] for n in chosen if n in results}
    _save(results_path, args, lengths, results)
    lines = table(results, lengths)
    with open(os.path.join(args.out, "pretrained.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(results, os.path.join(args.out, "pretrained.png"), args.init)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
