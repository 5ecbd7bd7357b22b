"""Side-by-side CPU timing: jaxsb's XLA flash attention vs jax.nn.dot_product_attention.

Causal, one row, 4 heads x 64. Usage: python scripts/bench_flash_xla.py [T ...] [--block N]
Prints compile and steady-state times (best of a few runs) for forward and forward+backward.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas.flash_attention import flash_attention  # noqa: E402


def _time(fn, *args, repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return first, best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("T", type=int, nargs="*", default=[4096, 8192])
    parser.add_argument("--block", type=int, nargs="*", default=[256, 512])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    H, D = args.heads, args.head_dim
    for T in args.T:
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.normal(size=(1, T, H, D)), jnp.float32) for _ in range(3))
        impls = {}
        if not args.skip_baseline:
            impls["jax.nn.dot_product_attention"] = lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True
            )
        for b in args.block:
            impls[f"xla block={b}"] = lambda q, k, v, b=b: flash_attention(
                q, k, v, causal=True, implementation="xla", block_q=b, block_k=b
            )
        for name, f in impls.items():
            fwd = jax.jit(f)
            fwd_bwd = jax.jit(jax.grad(lambda q, k, v, f=f: f(q, k, v).sum(), argnums=(0, 1, 2)))
            c1, t1 = _time(fwd, q, k, v, repeats=args.repeats)
            c2, t2 = _time(fwd_bwd, q, k, v, repeats=args.repeats)
            print(
                f"T={T:6d} {name:32s} fwd {t1:7.3f} s (first {c1:6.2f} s)   "
                f"fwd+bwd {t2:7.3f} s (first {c2:6.2f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
