"""The quality study of docs/quality.md: long-range accuracy and perplexity against attention work.

    .venv/bin/python scripts/quality_study.py [--lengths 1024,2048,4096,8192] [--samples 4]
        [--long-docs 2 --max-doc-tokens 8192] [--only NAME ...] [--out docs/quality]

Part "pretrained, sparse without retraining": SmolLM2-135M-Instruct (`--init`, default
smollm2-135m) under every setting of SETTINGS — dense; sparse at fixed budgets (block size,
top-k); the runtime coverage floor alone (`model.sparse.policy=floor`: every document starts at
budget 1 and the floor raises it to k_min(p) against a base budget of every block, so the
budget is the least that keeps coverage within p of dense) — each through `python -m jaxsb.eval`
(passkey, then long-document perplexity), a process per run. Writes OUT/pretrained.json (every
run's summary), OUT/pretrained.md (the table) and OUT/pretrained.png (accuracy and perplexity vs
attention work). Attention work is the prefill's (query block, key block) pairs as a fraction of
dense causal, counted from the kernels' tables; the floor's base is `--floor-base` blocks.
"""

from __future__ import annotations

import argparse
import json
import os
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


def run_eval(init: str, overrides: list[str], task_args: list[str]) -> dict:
    """One `python -m jaxsb.eval` process; its --summary JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        summary = os.path.join(tmp, "summary.json")
        cmd = [sys.executable, "-m", "jaxsb.eval", "--set", f"model.init={init}",
               *[a for o in overrides for a in ("--set", o)], *task_args, "--summary", summary]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        with open(summary) as f:
            return json.load(f)


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

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in results.items():
        x, y = r["passkey"]["work"]["attention_fraction"], r["passkey"]["accuracy"]
        ax1.scatter(x, y)
        ax1.annotate(name, (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
        if r.get("perplexity"):
            x2, y2 = r["perplexity"]["work"]["attention_fraction"], r["perplexity"]["perplexity"]
            ax2.scatter(x2, y2)
            ax2.annotate(name, (x2, y2), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax1.set(xlabel="attention work (fraction of dense causal block pairs)", ylabel="passkey accuracy",
            ylim=(-0.05, 1.05), xlim=(0, 1.05), title=f"{title}: passkey")
    ax2.set(xlabel="attention work (fraction of dense causal block pairs)", ylabel="perplexity",
            xlim=(0, 1.05), title=f"{title}: long-document perplexity")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more eval overrides, every run")
    ap.add_argument("--out", default="docs/quality")
    args = ap.parse_args(argv)
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
    passkey_args = ["--task", "passkey", "--lengths", args.lengths, "--samples", str(args.samples),
                    "--seed", str(args.seed), "--batch-size", str(args.batch_size)]
    ppl_args = ["--long-docs", str(args.long_docs), "--max-doc-tokens", str(args.max_doc_tokens)]
    for name, overrides in chosen.items():
        if args.only and name not in args.only:
            continue
        overrides = overrides + args.extra
        r = {"overrides": overrides, "passkey": run_eval(args.init, overrides, passkey_args)}
        if args.long_docs:
            r["perplexity"] = run_eval(args.init, overrides, ppl_args)
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
