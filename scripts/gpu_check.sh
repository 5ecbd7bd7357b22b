#!/usr/bin/env bash
# Accelerator check for the Pallas kernels (cannot run on a CPU-only machine):
#   1. the kernel test suites compiled for the device (TestFlashAttentionPallasCompiled,
#      TestBlockSparseAttentionPallasCompiled, TestRingChunkPallasCompiled: the ring's chunk
#      kernels and a ring over the devices at hand under shard_map(check_vma=True)),
#      TestRingSparsePallasCompiled (the chunk kernels with a block selection, as block-sparse
#      ring rounds use them, and a sparse ring over the devices at hand) and, for
#      comparison, the same assertions through the interpreter (the 8-device ring tests skip
#      unless the machine has 8 devices);
#   2. a small timing table: pallas vs xla vs jax.nn.dot_product_attention, causal, bf16,
#      forward and forward+backward (best of a few runs, after one compile run), plus
#      block-sparse attention (pallas vs xla) at densities 1/8 and 1/4 of the key blocks, plus
#      the ring's chunk op (pallas vs xla; one local chunk holding one document = causal).
# On TPU ("tpu"): the Mosaic kernels (tests/kernels/test_mosaic_attention.py, compiled and interpreted:
# flash, block-sparse and the ring's chunk op, a sparse ring over the TPU's devices) instead of
# the Triton suites, 512 x 512 blocks (the Mosaic default) and block-sparse blocks of 128.
# Usage: scripts/gpu_check.sh [cuda|tpu] [T ...]      (default: cuda, T = 2048 4096 8192)
# Environment: PYTHON (default .venv/bin/python), HEADS (8), KV_HEADS (2), HEAD_DIM (128),
# BLOCK_Q (128; tpu 512), BLOCK_K (64; tpu 512), REPEATS (5), SPARSE_BLOCK (64; tpu 128).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

platform="${1:-cuda}"
shift || true
lengths=("$@")
if [ "${#lengths[@]}" -eq 0 ]; then
  lengths=(2048 4096 8192)
fi
python="${PYTHON:-$root/.venv/bin/python}"

# tests/conftest.py only defaults JAX_PLATFORMS to cpu; an explicit platform wins.
export JAX_PLATFORMS="$platform"
"$python" -c "import jax; b = jax.default_backend(); print('jax', jax.__version__, b, jax.devices());
assert b != 'cpu', 'gpu_check.sh needs an accelerator backend'"

if [ "$platform" = "tpu" ]; then
  echo "== Mosaic kernels, compiled and interpreted =="
  "$python" -m pytest -q tests/kernels/test_mosaic_attention.py -rs
  default_block_q=512 default_block_k=512 default_sparse=128
else
  echo "== compiled kernels =="
  "$python" -m pytest -q tests/kernels/test_flash_attention_pallas.py \
    tests/kernels/test_block_sparse_attention_pallas.py tests/kernels/test_ring_chunk_pallas.py \
    tests/kernels/test_ring_sparse_pallas.py -k "Compiled" -rs
  echo "== same suites, interpreted, on the device backend =="
  "$python" -m pytest -q tests/kernels/test_flash_attention_pallas.py \
    tests/kernels/test_block_sparse_attention_pallas.py tests/kernels/test_ring_chunk_pallas.py \
    tests/kernels/test_ring_sparse_pallas.py -k "not Compiled"
  default_block_q=128 default_block_k=64 default_sparse=64
fi

echo "== timing (seconds, best of ${REPEATS:-5}) =="
HEADS="${HEADS:-8}" KV_HEADS="${KV_HEADS:-2}" HEAD_DIM="${HEAD_DIM:-128}" \
BLOCK_Q="${BLOCK_Q:-$default_block_q}" BLOCK_K="${BLOCK_K:-$default_block_k}" \
REPEATS="${REPEATS:-5}" SPARSE_BLOCK="${SPARSE_BLOCK:-$default_sparse}" \
"$python" - "${lengths[@]}" <<'PY'
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.block_sparse_attention import block_sparse_attention
from kernels_pallas.flash_attention import flash_attention
from kernels_pallas.ring_chunk import attention_chunk

H, K, D = (int(os.environ[n]) for n in ("HEADS", "KV_HEADS", "HEAD_DIM"))
bq, bk, repeats = (int(os.environ[n]) for n in ("BLOCK_Q", "BLOCK_K", "REPEATS"))
sbs = int(os.environ["SPARSE_BLOCK"])


def best_of(fn, *args):
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def sdpa(q, k, v, seg):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def impl(name):
    def f(q, k, v, seg):
        return flash_attention(q, k, v, seg, True, name, block_q=bq, block_k=bk)

    return f


def chunk(name):
    """The ring's chunk op on one local chunk: per-token (segment id, position) mask."""

    def f(q, k, v, seg):
        pos = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32), seg.shape)
        return attention_chunk(q, k, v, seg, pos, seg, pos, local=True, implementation=name,
                               block_q=bq, block_k=bk)[0]

    return f


def sparse_lists(T, density):
    """Query block n lists itself and the budget - 1 blocks before it (budget = density * nb)."""
    nb = -(-T // sbs)
    budget = max(1, round(density * nb))
    n = np.arange(nb)[:, None]
    idx = np.maximum(n - np.arange(budget)[None, :], 0)
    counts = np.minimum(n[:, 0] + 1, budget)
    shape = (1, K, nb, budget)
    return (jnp.asarray(np.broadcast_to(idx, shape), jnp.int32),
            jnp.asarray(np.broadcast_to(counts, shape[:3]), jnp.int32))


def sparse(name, density, T):
    idx, counts = sparse_lists(T, density)

    def f(q, k, v, seg):
        return block_sparse_attention(q, k, v, idx, counts, seg, sbs, name)

    return f


print(f"B=1 H={H} K={K} D={D} bf16 causal, one document per row; blocks {bq}x{bk}")
print(f"{'T':>6s} {'implementation':28s} {'fwd':>9s} {'fwd+bwd':>9s}")
for T in map(int, sys.argv[1:]):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, T, H, D)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(1, T, K, D)), jnp.bfloat16) for _ in range(2))
    seg = jnp.ones((1, T), jnp.int32)
    rows = [("pallas", impl("pallas")), ("xla", impl("xla")),
            ("jax.nn.dot_product_attention", sdpa)]
    rows += [("ring-chunk-pallas", chunk("pallas")), ("ring-chunk-xla", chunk("xla"))]
    for label, density in (("1/8", 1 / 8), ("1/4", 1 / 4)):
        for name in ("pallas", "xla"):
            rows.append((f"sparse-{name} {label} b{sbs}", sparse(name, density, T)))
    for name, f in rows:
        try:
            fwd = jax.jit(f)
            grad = jax.jit(jax.grad(lambda q, k, v, s, f=f: f(q, k, v, s).astype(jnp.float32).sum(),
                                    argnums=(0, 1, 2)))
            t1, t2 = best_of(fwd, q, k, v, seg), best_of(grad, q, k, v, seg)
            print(f"{T:6d} {name:28s} {t1:9.5f} {t2:9.5f}", flush=True)
        except Exception as e:  # keep the table going; the message says what failed
            print(f"{T:6d} {name:28s} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
PY
