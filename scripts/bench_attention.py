"""CPU timing of attention forward+backward: jaxsb dense vs jax.nn vs block-sparse.

One run, one row, causal, H=4 query heads over K=2 kv heads of 64 dims, float32, at 4K, 8K
and 16K tokens, for one document and for a packed long-tail mix of documents:
  * jaxsb dense = kernels_pallas.flash_attention(implementation="xla", 256-token blocks);
  * jax.nn.dot_product_attention with the equivalent materialised [B,1,T,T] mask (skipped when
    its score/probability arrays would need more than ~8 GB);
  * block-sparse (kernels_pallas.block_sparse_attention "xla", 128-token blocks, lists from
    jaxsb.models.router.route) at nominal densities 1/2, 1/4, 1/8, 1/16.

Density, honestly: the share of the causal block pairs that dense attention has to compute,
   density = selected block pairs / eligible block pairs,
where a (query block n, key block j) pair is eligible iff j <= n and the two blocks share a
document (the router's eligible set: exactly the block pairs holding an allowed token pair;
jaxsb dense skips the rest too). The budget is chosen to hit the nominal density: per row the
router's budget k with min(k, eligible) key blocks per query block, and where no single k
matches, some query blocks get k and the others k + 1 (the router's per-token budgets: a
query block takes its first token's, so block_counts differ per query block). Where
even the diagonal alone exceeds the nominal density (short documents), the actual is higher.
The table prints the nominal density, the actual block-pair density and the token-pair
density (allowed (i, j) token pairs inside the selected blocks / all allowed pairs: the useful
work; diagonal blocks are half empty).

Prints best-of-n wall times, ratios and useful GFLOP/s (exactly the allowed (i, j) token pairs
computed, fwd 4*D*H flops per pair, bwd 2.5x fwd) next to this machine's measured 2048^3 f32
matmul GFLOP/s. Targets: dense >= 2x faster than jax.nn at 8K; sparse at 1/8 >= 4x faster than
dense at 16K. Usage: python scripts/bench_attention.py [--quick] [--lengths 16384]
[--sparse-block 512] [--densities 8] [--repeats 3] [--no-jax-nn]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxsb.models.router import route  # noqa: E402
from kernels_pallas import block_sparse_attention, flash_attention  # noqa: E402

H, K, D = 4, 2, 64
SPARSE_BLOCK = 128
DENSITIES = (2, 4, 8, 16)
JAX_NN_LIMIT_BYTES = 8e9
FLOPS_PER_PAIR = 3.5 * 4 * D * H  # fwd 4DH per allowed (i, j) pair, bwd 2.5x fwd


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


def doc_starts(seg_T):
    """[T] index of the first token of each token's document (documents are contiguous runs)."""
    pos = np.arange(len(seg_T))
    boundary = np.concatenate([[True], seg_T[1:] != seg_T[:-1]])
    return np.maximum.accumulate(np.where(boundary, pos, 0))


def dense_pairs(seg):
    _, counts = np.unique(np.asarray(seg[0]), return_counts=True)
    return float((counts * (counts + 1) // 2).sum())


def eligible_blocks(seg_T, bs):
    """[nq] key blocks j <= n sharing a document with query block n (the router's eligible
    set): blocks from the one holding the start of n's first token's document up to n."""
    nq = -(-len(seg_T) // bs)
    first = np.arange(nq) * bs
    return np.arange(nq) - doc_starts(seg_T)[first] // bs + 1


def choose_counts(elig_N, density):
    """(k, [nq] counts): min(k, eligible) or min(k + 1, eligible) per query block, so that
    the selected pairs are as close as possible to density x eligible pairs."""
    target = int(round(elig_N.sum() * density))
    k = 1
    while k < elig_N.max() and np.minimum(k + 1, elig_N).sum() <= target:
        k += 1
    lo, hi = np.minimum(k, elig_N), np.minimum(k + 1, elig_N)
    room = np.flatnonzero(hi > lo)
    extra = int(np.clip(target - lo.sum(), 0, len(room)))
    counts = lo.copy()
    counts[room[np.linspace(0, len(room) - 1, extra).round().astype(int)] if extra else []] += 1
    return k, counts


def token_pairs(idx_KxNxM, counts_KxN, seg_T, bs):
    """Allowed (i, j) token pairs inside the selected blocks, summed over the K kv heads
    (documents are contiguous runs, blocks listed once each)."""
    T = len(seg_T)
    nq = counts_KxN.shape[1]
    starts = np.concatenate([doc_starts(seg_T), np.full(nq * bs - T, T)])  # padding: nothing
    i = np.arange(nq * bs).reshape(nq, 1, bs)  # query tokens of block n
    total = 0.0
    for kh in range(counts_KxN.shape[0]):
        j0 = idx_KxNxM[kh][..., None] * bs  # [nq, M, 1] first key of each selected block
        lo = np.maximum(starts.reshape(nq, 1, bs), j0)
        hi = np.minimum(np.minimum(i, j0 + bs - 1), T - 1)
        valid = np.arange(idx_KxNxM.shape[-1])[None, :, None] < counts_KxN[kh][:, None, None]
        total += float((np.maximum(hi - lo + 1, 0) * valid).sum())
    return total / counts_KxN.shape[0]


def fwd_bwd(f):
    return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="4K only, one repeat")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4096, 8192, 16384], help="comma-separated T values")
    parser.add_argument("--sparse-block", type=int, default=SPARSE_BLOCK,
                        help=f"block-sparse block size (default {SPARSE_BLOCK})")
    parser.add_argument("--densities", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(DENSITIES), help="comma-separated d for density 1/d")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per entry (default 2, 1 at 16K and with --quick)")
    parser.add_argument("--no-jax-nn", action="store_true", help="skip jax.nn.dot_product_attention")
    args = parser.parse_args()
    bs = args.sparse_block
    lengths = [4096] if args.quick else args.lengths
    peak = matmul_gflops()
    print(f"devices: {jax.devices()}  matmul 2048^3 f32: {peak:.1f} GFLOP/s")
    print(f"B=1 H={H} K={K} D={D} float32, forward+backward, best of n (noisy: shared cores); "
          f"sparse blocks of {bs}; density = selected / eligible causal block pairs")
    header = (f"{'T':>6} {'docs':>9} {'impl':<28} {'nominal':>7} {'actual':>6} {'tokens':>6} "
              f"{'time s':>8} {'GFLOP/s':>8} {'%mm':>5}  ratio")
    print(header)
    print("-" * len(header))
    for T in lengths:
        repeats = args.repeats or (1 if (args.quick or T >= 16384) else 2)
        rng = np.random.default_rng(T)
        q = jnp.asarray(rng.normal(size=(1, T, H, D)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(1, T, K, D)), jnp.float32) for _ in range(2))
        for layout, seg in (("one", jnp.ones((1, T), jnp.int32)), ("long-tail", long_tail_segments(T))):
            seg_T = np.asarray(seg[0])

            def line(name, t, flops, ratio, dens=("", "", "")):
                g = flops / t / 1e9
                print(f"{T:>6} {layout:>9} {name:<28} {dens[0]:>7} {dens[1]:>6} {dens[2]:>6} "
                      f"{t:8.3f} {g:8.1f} {100 * g / peak:5.0f}  {ratio}", flush=True)

            all_pairs = dense_pairs(seg)
            t_dense = _best(
                fwd_bwd(lambda q, k, v: flash_attention(q, k, v, seg, implementation="xla")),
                q, k, v, repeats=repeats,
            )
            line("jaxsb dense (xla)", t_dense, FLOPS_PER_PAIR * all_pairs, "1.00x (baseline)",
                 ("1", "1", "1"))
            if args.no_jax_nn:
                pass
            elif 4 * H * T * T * 4 <= JAX_NN_LIMIT_BYTES:
                mask = ((seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((T, T), bool)))[:, None]
                t_nn = _best(
                    fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask)),
                    q, k, v, repeats=repeats,
                )
                line("jax.nn.dot_product_attention", t_nn, FLOPS_PER_PAIR * all_pairs,
                     f"dense is {t_nn / t_dense:.2f}x faster", ("1", "1", "1"))
            else:
                print(f"{T:>6} {layout:>9} {'jax.nn.dot_product_attention':<28} skipped: "
                      f"~{4 * H * T * T * 4 / 1e9:.0f} GB of [H,T,T] float32 arrays", flush=True)
            elig = eligible_blocks(seg_T, bs)
            for d in args.densities:
                budget, want = choose_counts(elig, 1.0 / d)
                # per-token budgets: a query block takes its first token's (k or k + 1)
                per_token = jnp.asarray(np.repeat(want, bs)[None, :T], jnp.int32)
                r = jax.jit(lambda q, k, seg, m=min(budget + 1, len(elig)): route(
                    q, k, seg, per_token, bs, max_blocks=m))
                t_route = _best(r, q, k, seg, repeats=repeats)
                idx, counts, cov = r(q, k, seg)
                got = np.asarray(counts)  # [1, K, nq]
                assert (got == want).all(), "router counts differ from the chosen budgets"
                blocks = got.sum() / (K * elig.sum())
                tokens = token_pairs(np.asarray(idx[0]), got[0], seg_T, bs)
                t_sp = _best(
                    fwd_bwd(lambda q, k, v, idx=idx, counts=counts: block_sparse_attention(
                        q, k, v, idx, counts, seg, bs, "xla")),
                    q, k, v, repeats=repeats,
                )
                kk = f"k={budget}" if (want == np.minimum(budget, elig)).all() else f"k={budget}-{budget + 1}"
                line(f"sparse 1/{d} ({kk})", t_sp, FLOPS_PER_PAIR * tokens,
                     f"{t_dense / t_sp:.2f}x faster than dense; route {t_route * 1e3:.0f} ms, "
                     f"coverage {float(cov.per_row[0]):.2f}",
                     (f"1/{d}", f"{blocks:.3f}", f"{tokens / all_pairs:.3f}"))


if __name__ == "__main__":
    main()
