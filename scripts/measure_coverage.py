"""Measures routing coverage curves C(k) on a real model, for `python -m jaxsb.simulate --coverage FILE`.

A pretrained model (default SmolLM2-135M-Instruct through `--config smollm2_finetune`, or any
`--config` / `--set model.init=...`) runs forward, dense, over documents of the Python standard
library's source tokenized with the model's own tokenizer. In every layer the router's coverage
curves are taken from that layer's queries and keys (`jaxsb.models.router.coverage_curves`:
per kv head and query block, the softmax mass of the k best causally visible key blocks;
`document_coverage_curves` averages them over kv heads and query blocks) and averaged over
the layers. Documents are picked across log2 length bins from 2 blocks up to `--max-len`
tokens (longer files are cut to `--max-len`, counted in the output), in sorted file order.

Writes {"block_size", "max_k", "model", "truncated", "documents": [{"length", "curve", "source"}]}.

    .venv/bin/python scripts/measure_coverage.py --docs 24 --max-len 8192 --out runs/coverage.json
"""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pick_documents(tokenizer, root: str, count: int, max_len: int, block: int) -> tuple[list, int]:
    """[(relative path, token ids)] spread over log2 length bins; and how many were cut."""
    from jaxsb.data.sources import walk_files

    lo, hi = int(math.log2(2 * block)), int(math.log2(max_len))
    bins = list(range(lo, hi + 1))
    per_bin = max(1, -(-count // len(bins)))
    chosen: dict[int, list] = {b: [] for b in bins}
    truncated = 0
    for path in walk_files(root, (".py",)):
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        ids = tokenizer.encode(text)
        if len(ids) < 2 * block:
            continue
        cut = len(ids) > max_len
        ids = ids[:max_len]
        b = min(hi, int(math.log2(len(ids))))
        if len(chosen[b]) < per_bin:
            chosen[b].append((os.path.relpath(path, root), ids))
            truncated += cut
        if sum(map(len, chosen.values())) >= count:
            break
    docs = [d for b in bins for d in chosen[b]][:count]
    return docs, truncated


def curve_program(model, block: int, max_k: int):
    """A compiled (tokens, segment ids, positions) [1, T] -> per layer coverage curves
    [layers, 1, K, nq, max_k] and the routed documents [1, nq] (compiled once per length)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxsb.models.attention import attend, attention_override
    from jaxsb.models.router import coverage_curves

    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, seg, pos):
        m = nnx.merge(graphdef, state)
        per_layer, routed = [], []

        def dense_with_curves(q, k, v, seg_, _budgets):
            curves, r = coverage_curves(q, k, seg_, block, min(max_k, -(-q.shape[1] // block)))
            per_layer.append(curves)
            routed.append(r)
            return attend(q, k, v, seg_, implementation="xla", block=128), {}

        with attention_override(dense_with_curves):
            m(tokens, seg, pos)
        return jnp.stack(per_layer), routed[0]

    return lambda tokens, seg, pos: run(state, tokens, seg, pos)


def measure(program, ids, block: int, max_k: int):
    """C(1..max_k) of one document, averaged over the layers; the document is padded (segment
    id 0) to the next power-of-two number of blocks, so few lengths compile."""
    import jax.numpy as jnp
    import numpy as np

    from jaxsb.models.router import document_coverage_curves

    n = len(ids)
    padded = block * 2 ** math.ceil(math.log2(-(-n // block)))
    tokens = np.zeros((1, padded), np.int32)
    tokens[0, :n] = ids
    seg = np.zeros((1, padded), np.int32)
    seg[0, :n] = 1
    pos = np.arange(padded, dtype=np.int32)[None]
    curves, routed = program(jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos))
    curve = np.mean([document_coverage_curves(c, routed)[(0, 1)] for c in np.asarray(curves)], axis=0)
    return np.concatenate([curve, np.ones(max_k - len(curve))])  # k past the visible blocks keeps all


def main(argv=None) -> int:
    from jaxsb import cli

    parser = cli.base_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(config="smollm2_finetune")
    parser.add_argument("--docs", type=int, default=24, help="documents to measure")
    parser.add_argument("--max-len", type=int, default=8192, help="tokens per document at most")
    parser.add_argument("--block", type=int, default=256, help="router block size (the simulator's: 256)")
    parser.add_argument("--max-k", type=int, default=64, help="the curve's length")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    args.overrides.insert(0, "model.remat=false")  # the curves leave each layer as outputs, not through remat
    if args.docs < 1 or args.max_len < 2 * args.block or args.block < 1 or args.max_k < 1:
        print("error: need --docs >= 1, --block >= 1, --max-k >= 1 and --max-len >= 2 x --block", file=sys.stderr)
        return 2
    model, tokenizer, cfg = cli.load_model(args)
    from jaxsb.data.sources import stdlib_root

    docs, truncated = pick_documents(tokenizer, stdlib_root(), args.docs, args.max_len, args.block)
    out = []
    program = curve_program(model, args.block, args.max_k)
    for i, (name, ids) in enumerate(docs):
        curve = measure(program, ids, args.block, args.max_k)
        out.append(dict(length=len(ids), curve=[round(float(c), 6) for c in curve], source=name))
        k90 = next((k + 1 for k, c in enumerate(curve) if c >= 0.9), None)
        print(f"[{i + 1}/{len(docs)}] {name}: {len(ids)} tokens, C(8)={curve[min(7, args.max_k - 1)]:.3f} C(32)={curve[min(31, args.max_k - 1)]:.3f}"
              f" k(90%)={k90}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(block_size=args.block, max_k=args.max_k, model=cfg.model.init, truncated=truncated,
                       documents=out), f, indent=1)
    print(f"wrote {args.out}: {len(out)} documents ({truncated} cut to {args.max_len} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
