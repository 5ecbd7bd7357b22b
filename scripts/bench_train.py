"""Side-by-side training throughput: jaxsb's packed pipeline vs a naive baseline, one process.

    .venv/bin/python scripts/bench_train.py [--config default] [--steps 20] [--set key=value ...]

Both train the same model shape from the same initial parameters on the same document pieces
(taken from jaxsb's data iterator), on the same devices:

- jaxsb: the config as is — pieces packed into rows balanced by cost, bucketed row length,
  blocked flash attention that skips cross-document and above-diagonal blocks.
- naive: every piece alone in a row padded to `data.max_len`, no packing, plain
  `jax.nn.dot_product_attention` with the equivalent mask, a fixed number of rows per step.

Useful tokens/s counts real tokens only. Compilation is excluded from both (each program is
compiled ahead of time before the clock starts). Prints both rates and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxsb.devices import setup_host_devices  # noqa: E402

setup_host_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxsb import mesh as mesh_lib  # noqa: E402
from jaxsb.config import load_config  # noqa: E402
from jaxsb.data import Batch, DataIterator  # noqa: E402
from jaxsb.training.state import build_model_fns, load_model_and_tokenizer  # noqa: E402
from jaxsb.training.step import make_train_step  # noqa: E402
from jaxsb.training.steps import BATCH_FIELDS, StepCompiler  # noqa: E402


def unpack_pieces(batch: Batch) -> list[dict[str, np.ndarray]]:
    """Each packed document piece as its own arrays (tokens, targets, loss_mask)."""
    pieces = []
    for r in range(batch.tokens.shape[0]):
        seg = batch.segment_ids[r]
        for s in np.unique(seg[seg > 0]):
            where = seg == s
            pieces.append({"tokens": batch.tokens[r, where], "targets": batch.targets[r, where],
                           "loss_mask": batch.loss_mask[r, where]})
    return pieces


def naive_batches(pieces: list[dict[str, np.ndarray]], rows: int, row_len: int, pad_id: int) -> list[dict]:
    """`rows` pieces per step, each alone in a row of `row_len` tokens."""
    out = []
    for start in range(0, len(pieces), rows):
        group = pieces[start:start + rows]
        arrays = {name: np.zeros((rows, row_len), np.float32 if name == "loss_mask" else np.int32)
                  for name in BATCH_FIELDS}
        arrays["tokens"][:] = pad_id
        for r, p in enumerate(group):
            n = p["tokens"].size
            arrays["tokens"][r, :n] = p["tokens"]
            arrays["targets"][r, :n] = p["targets"]
            arrays["loss_mask"][r, :n] = p["loss_mask"]
            arrays["segment_ids"][r, :n] = 1
            arrays["positions"][r, :n] = np.arange(n)
        out.append((arrays, int(sum(p["tokens"].size for p in group))))
    return out


def timed_run(name, model_cfg, cfg, mesh, batches) -> tuple[float, int, list[float]]:
    """Trains on `batches` [(arrays, real tokens)]; returns (seconds, tokens, losses)."""
    graphdef, rest, tx, state, shardings = build_model_fns(model_cfg, cfg.train, mesh, cfg.parallel.fsdp)
    compiler = StepCompiler(make_train_step(graphdef, rest, tx), shardings)
    sharding = mesh_lib.batch_sharding(mesh)
    placed = [({k: jax.device_put(v, sharding) for k, v in arrays.items()}, n) for arrays, n in batches]
    for arrays, _ in placed:  # compile every shape before timing
        compiler.get(state, arrays)
    losses, tokens = [], 0
    t0 = time.perf_counter()
    for arrays, n in placed:
        program, _ = compiler.get(state, arrays)
        state, metrics = program(state, arrays)
        losses.append(metrics["loss"])
        tokens += n
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    print(f"  {name}: {len(placed)} steps, {tokens:,} tokens, {seconds:.1f} s, "
          f"{compiler.count} programs ({compiler.compile_seconds:.1f} s compiling, excluded)", flush=True)
    return seconds, tokens, [float(x) for x in losses]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="default")
    parser.add_argument("--steps", type=int, default=20, help="jaxsb steps; the baseline trains the same pieces")
    parser.add_argument("--naive-rows", type=int, default=8, help="rows per naive step (a multiple of devices)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="jaxsb-bench-")
    cfg = load_config(args.config, [f"train.workdir={workdir}", *args.overrides])
    mesh = mesh_lib.make_mesh(cfg.parallel.devices)
    model_cfg, tokenizer, _ = load_model_and_tokenizer(cfg, workdir)
    data = DataIterator(cfg.data, tokenizer, mesh.devices.size * cfg.data.rows_per_device)
    packed = [data.next() for _ in range(args.steps)]
    pieces = [p for b in packed for p in unpack_pieces(b)]
    naive = naive_batches(pieces, args.naive_rows, cfg.data.max_len, tokenizer.pad_id)
    packed_tokens = sum(b.num_tokens for b in packed)
    assert packed_tokens == sum(n for _, n in naive), "both runs must see the same tokens"
    print(f"bench_train: {jax.device_count()} {jax.devices()[0].platform} devices, model "
          f"{model_cfg.hidden}x{model_cfg.layers}, {len(pieces)} document pieces, {packed_tokens:,} tokens; "
          f"jaxsb rows {packed[0].tokens.shape[0]} x bucketed <= {max(cfg.data.row_buckets)}, "
          f"naive rows {args.naive_rows} x {cfg.data.max_len}", flush=True)
    jaxsb_batches = [({k: np.asarray(getattr(b, k)) for k in BATCH_FIELDS}, b.num_tokens) for b in packed]
    t_jaxsb, n_jaxsb, _ = timed_run("jaxsb", model_cfg, cfg, mesh, jaxsb_batches)
    naive_cfg = dataclasses.replace(model_cfg, attention="jax")
    t_naive, n_naive, _ = timed_run("naive", naive_cfg, cfg, mesh, naive)
    rate_jaxsb, rate_naive = n_jaxsb / t_jaxsb, n_naive / t_naive
    pad_naive = 1 - n_naive / (len(naive) * args.naive_rows * cfg.data.max_len)
    pad_jaxsb = 1 - n_jaxsb / sum(b.tokens.size for b in packed)
    print(f"useful tokens/s  jaxsb {rate_jaxsb:,.0f} (padding {pad_jaxsb:.1%})  "
          f"naive {rate_naive:,.0f} (padding {pad_naive:.1%})")
    print(f"ratio jaxsb/naive: {rate_jaxsb / rate_naive:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
