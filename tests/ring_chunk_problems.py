"""Ring attention problems shared by tests/kernels/test_ring_chunk_pallas.py (the ring on the Pallas
chunk kernels) and tests/kernels/test_mosaic_attention.py (the same ring on the Mosaic kernels):
`ring_problem` lays packed documents of each ring group over its ranks in random token order,
`compare_ring` runs ring_attention(implementation="pallas") on them and checks outputs and
dq, dk, dv against per-group single-device attention.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from tolerances import tol

from attention_inputs import packed_stream

from jaxsb.parallel.ring import ring_attention
from kernels_pallas import attention_reference

from jax import shard_map

# As test_ring_chunk_pallas.py: interpreted kernels compile faster without LLVM's expensive passes.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast_jit(fn):
    if jax.default_backend() != "cpu":
        return jax.jit(fn)
    return jax.jit(fn, compiler_options=_FAST_COMPILE)


N, T_LOCAL = 8, 24  # tokens per device; the Pallas block (16) does not divide it


def ring_problem(degrees, B, seed, num_devices=N):
    """Per group a stream of packed documents then padding, laid out over its ranks in random
    token order; returns global seg, pos [B, n*T] in stream order, the device layout perm and
    the groups."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, num_devices * T_LOCAL), np.int32)
    pos = np.zeros((B, num_devices * T_LOCAL), np.int32)
    perm, groups, start = [], [], 0
    for d in degrees:
        n, lo = d * T_LOCAL, start * T_LOCAL
        for b in range(B):
            docs = [n // 2 + 1, 1, n // 4] if b == 0 else [3, n - 9]
            seg[b, lo : lo + n], pos[b, lo : lo + n] = packed_stream(n, docs)
        perm.append(lo + rng.permutation(n))
        groups.append((start, d))
        start += d
    assert start == num_devices
    return seg, pos, np.concatenate(perm), tuple(groups)


def compare_ring(seg, pos, perm, groups, num_devices, check_vma, interpret, dtype, block=16):
    """ring_attention(implementation="pallas") vs per-group single-device attention: outputs
    and dq, dk, dv (grad of the psum'd loss, taken outside the shard_map)."""
    B, H, K, D = seg.shape[0], 4, 2, 16
    inv = np.argsort(perm)
    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(rng.normal(size=(B, seg.shape[1], n, D)), dtype) for n in (H, K, K))
    real = seg > 0
    ct = jnp.asarray(rng.normal(size=q.shape) * real[:, :, None, None], jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("d",))
    spec = P(None, "d")
    sharded = [jnp.asarray(x)[:, perm] for x in (seg, pos, ct)]

    def body(q, k, v, seg, pos, ct):
        out = ring_attention(q, k, v, seg, pos, axis_name="d", groups=groups, block=block,
                             implementation="pallas", interpret=interpret)
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * ct), "d"), out

    f = shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=(P(), spec),
                  check_vma=check_vma)
    (_, out), grads = fast_jit(jax.value_and_grad(
        lambda q, k, v: f(q, k, v, *sharded), argnums=(0, 1, 2), has_aux=True))(
            q[:, perm], k[:, perm], v[:, perm])

    def attend(q, k, v):
        parts = []
        for s, d in groups:
            t = slice(s * T_LOCAL, (s + d) * T_LOCAL)
            parts.append(attention_reference(q[:, t], k[:, t], v[:, t], jnp.asarray(seg[:, t])))
        return jnp.concatenate(parts, axis=1)

    ref_out, vjp = jax.vjp(attend, q, k, v)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32)[:, inv][real],
                               np.asarray(ref_out, np.float32)[real], **tol("attention_out", dtype))
    for name, g, r in zip("qkv", grads, vjp(ct.astype(dtype))):
        assert g.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32)[:, inv], np.asarray(r, np.float32),
                                   err_msg=f"d{name}", **tol("attention_grad", dtype))
