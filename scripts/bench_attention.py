"""CPU timing of attention forward+backward: jaxsb dense vs jax.nn vs block-sparse.

One run, one row, causal, H=4 query heads over K=2 kv heads of 64 dims, float32, at 4K, 8K
and 16K tokens, for one document and for a packed long-tail mix of documents:
  * jaxsb dense = kernels_pallas.flash_attention(implementation="xla", 256-token blocks);
  * jax.nn.dot_product_attention with the equivalent materialised [B,1,T,T] mask (skipped when
    its score/probability arrays would need more than ~8 GB);
  * block-sparse (kernels_pallas.block_sparse_attention, 128-token blocks, lists from
    jaxsb.router.route) with a budget of density x (T / 128) key blocks per query block, for
    densities 1/2, 1/4, 1/8, 1/16.
Prints best-of-n wall times, ratios and useful GFLOP/s (dense: exactly the allowed (i, j)
pairs; sparse: the selected block pairs, diagonal blocks counted as triangles) next to this
machine's measured 2048^3 f32 matmul GFLOP/s. Targets: dense >= 2x faster than jax.nn at 8K;
sparse at 1/8 >= 4x faster than dense at 16K.
Usage: python scripts/bench_attention.py [--quick] [--lengths 16384] [--sparse-block 512]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxsb.router import route  # noqa: E402
from kernels_pallas import block_sparse_attention, flash_attention  # noqa: E402

H, K, D = 4, 2, 64
SPARSE_BLOCK = 128


def set_sparse_block(size: int) -> None:
    global SPARSE_BLOCK
    SPARSE_BLOCK = size
DENSITIES = (2, 4, 8, 16)
JAX_NN_LIMIT_BYTES = 8e9


def _best(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops():
    a = jnp.asarray(np.random.default_rng(0).normal(size=(2048, 2048)), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return 2 * 2048**3 / _best(f, a, repeats=3) / 1e9


def long_tail_segments(T, seed=0):
    """[1, T] ids of packed documents with Pareto lengths (many short, a few long)."""
    rng = np.random.default_rng(seed)
    seg, start, doc = np.zeros(T, np.int32), 0, 1
    while start < T:
        n = int(min(T - start, 32 + rng.pareto(1.1) * 400))
        seg[start : start + n] = doc
        start, doc = start + n, doc + 1
    return jnp.asarray(seg[None])


def dense_pairs(seg):
    _, counts = np.unique(np.asarray(seg[0]), return_counts=True)
    return float((counts * (counts + 1) // 2).sum())


def sparse_pairs(counts):
    c = np.asarray(counts, np.float64)
    return float(((c - 1) * SPARSE_BLOCK**2 + SPARSE_BLOCK * (SPARSE_BLOCK + 1) / 2).sum() / K)


def fwd_bwd(f):
    return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="4K only, one repeat")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4096, 8192, 16384], help="comma-separated T values")
    parser.add_argument("--sparse-block", type=int, default=SPARSE_BLOCK,
                        help=f"block-sparse block size (default {SPARSE_BLOCK})")
    args = parser.parse_args()
    set_sparse_block(args.sparse_block)
    lengths = [4096] if args.quick else args.lengths
    peak = matmul_gflops()
    print(f"devices: {jax.devices()}  matmul 2048^3 f32: {peak:.1f} GFLOP/s")
    print(f"B=1 H={H} K={K} D={D} float32, forward+backward, best of n (noisy: shared cores)")
    header = f"{'T':>6} {'docs':>9} {'impl':<28} {'time s':>8} {'GFLOP/s':>8} {'%mm':>5}  ratio"
    print(header)
    print("-" * len(header))
    rows = []
    for T in lengths:
        repeats = 1 if (args.quick or T >= 16384) else 2
        rng = np.random.default_rng(T)
        q = jnp.asarray(rng.normal(size=(1, T, H, D)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(1, T, K, D)), jnp.float32) for _ in range(2))
        for layout, seg in (("one", jnp.ones((1, T), jnp.int32)), ("long-tail", long_tail_segments(T))):
            def line(name, t, flops, ratio):
                g = flops / t / 1e9
                print(f"{T:>6} {layout:>9} {name:<28} {t:8.3f} {g:8.1f} {100 * g / peak:5.0f}  {ratio}",
                      flush=True)
                rows.append((T, layout, name, t))

            flops_dense = 3.5 * 4 * D * H * dense_pairs(seg)  # fwd 4DH per pair, bwd 2.5x fwd
            t_dense = _best(
                fwd_bwd(lambda q, k, v: flash_attention(q, k, v, seg, implementation="xla")),
                q, k, v, repeats=repeats,
            )
            line("jaxsb dense (xla)", t_dense, flops_dense, "1.00x (baseline)")
            if 4 * H * T * T * 4 <= JAX_NN_LIMIT_BYTES:
                mask = ((seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((T, T), bool)))[:, None]
                t_nn = _best(
                    fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask)),
                    q, k, v, repeats=repeats,
                )
                line("jax.nn.dot_product_attention", t_nn, flops_dense,
                     f"dense is {t_nn / t_dense:.2f}x faster")
            else:
                print(f"{T:>6} {layout:>9} {'jax.nn.dot_product_attention':<28} skipped: "
                      f"~{4 * H * T * T * 4 / 1e9:.0f} GB of [H,T,T] float32 arrays", flush=True)
            nb = -(-T // SPARSE_BLOCK)
            for d in DENSITIES:
                budget = max(1, nb // d)
                r = jax.jit(lambda q, k, seg, b=budget: route(
                    q, k, seg, jnp.array([b]), SPARSE_BLOCK, max_blocks=b))
                t_route = _best(r, q, k, seg, repeats=repeats)
                idx, counts, cov = r(q, k, seg)
                t_sp = _best(
                    fwd_bwd(lambda q, k, v, idx=idx, counts=counts: block_sparse_attention(
                        q, k, v, idx, counts, seg, SPARSE_BLOCK, "xla")),
                    q, k, v, repeats=repeats,
                )
                line(f"sparse 1/{d} (k={budget})", t_sp, 3.5 * 4 * D * H * sparse_pairs(counts),
                     f"{t_dense / t_sp:.2f}x faster than dense; route {t_route * 1e3:.0f} ms, "
                     f"coverage {float(cov.per_row[0]):.2f}")


if __name__ == "__main__":
    main()
