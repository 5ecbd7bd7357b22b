"""Block-sparse ring rounds on the Pallas chunk kernels (a block selection per round).

One suite, two modes (as test_ring_chunk_pallas.py): `TestRingSparsePallas` runs the kernels in
the Pallas interpreter (INTERPRET = True, works on CPU); `TestRingSparsePallasCompiled`
compiles them for the accelerator and is skipped on CPU (scripts/gpu_check.sh runs it).

  * the chunk op with `select` [B, K, nq, nk] against a dense jnp oracle whose mask is the
    token mask and the selection (per kv head), forward out / lse and dq / dk / dv, selections
    from the diagonal only to all pairs;
  * unselected blocks are skipped, not masked: NaN there never arrives;
  * ring_sparse_attention(implementation="pallas", interpreted) on 8 simulated devices equals
    the XLA ring_sparse and single-device sparse_attend (ring_sparse_problems.py's problems,
    as test_ring_sparse.py);
  * the Triton lowering of a whole 2-device sparse ring, exported for CUDA from this host.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tolerances import tol

from attention_inputs import packed_stream
from ring_sparse_problems import ALL, BS, N, SPEC, ring_groups, ring_problem, ring_reference, ring_values

from jaxsb.parallel import ring_sparse
from jaxsb.parallel.ring_loop import RingConfig
from jaxsb.plan.layout import zigzag_layout
from jaxsb.parallel.ring_sparse import ring_sparse_attention
from kernels_pallas.common import NEG
from kernels_pallas.ring_chunk.ops import chunk_backward, chunk_forward

from jax import shard_map

# As test_ring_chunk_pallas.py: interpreted kernels compile faster without LLVM's expensive passes.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jit(fn, **kw):
    if jax.default_backend() != "cpu":
        return jax.jit(fn, **kw)
    return jax.jit(fn, compiler_options=_FAST_COMPILE, **kw)


def selected_reference(q, k, v, sq, pq, sk, pk, select, bq, bk):
    """Dense oracle of the selected chunk: query i (head h) sees key j iff same segment,
    pos_k <= pos_q and select[b, h // G, i // bq, j // bk]. (out float32, lse float32 [B,Lq,H];
    a query that sees nothing: out 0, lse -inf.)"""
    B, Lq, H, D = q.shape
    Lk, K = k.shape[1], k.shape[2]
    hi = jax.lax.Precision.HIGHEST
    qf = q.astype(jnp.float32).reshape(B, Lq, K, H // K, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(jnp.float32), precision=hi) / math.sqrt(D)
    tokens = (sq[:, :, None] == sk[:, None, :]) & (pk[:, None, :] <= pq[:, :, None])
    blocks = jnp.repeat(jnp.repeat(select, bq, axis=2), bk, axis=3)[:, :, :Lq, :Lk]
    mask = (tokens[:, None] & blocks)[:, :, None]  # [B, K, 1, Lq, Lk]
    seen = mask.any(-1)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.where(seen, s.max(-1), 0.0)
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    l = jnp.where(seen, p.sum(-1), 1.0)
    lse = jnp.where(seen, m + jnp.log(l), -jnp.inf)
    out = jnp.einsum("bkgts,bskd->btkgd", p / l[..., None], v.astype(jnp.float32), precision=hi)
    return out.reshape(B, Lq, H, D), lse.reshape(B, H, Lq).transpose(0, 2, 1)


def _ids(B, L, local):
    """Per row a few packed documents (one of one token) and padding; `local`: keys are the
    same tokens, else the keys are the next L tokens of the same stream (queries see earlier
    keys of their own documents only if those sit there: positions decide)."""
    rows = []
    for b in range(B):
        docs = [L // 2 + 3, 1, L // 4] if b == 0 else [5, L - 9]
        seg, pos = packed_stream(2 * L, docs + ([L // 2, L // 3] if not local else []))
        rows.append((seg[:L], pos[:L], seg[:L], pos[:L]) if local else
                    (seg[L:], pos[L:], seg[:L], pos[:L]))  # queries after their keys
    return tuple(jnp.asarray(np.stack(x)) for x in zip(*rows))


def _selections(B, K, n, local, rng):
    """name -> bool [B, K, n, n]: the diagonal only (local) / nothing (split), random per kv
    head, all pairs."""
    eye = np.broadcast_to(np.eye(n, dtype=bool) & local, (B, K, n, n))
    rand = rng.random((B, K, n, n)) < 0.5
    return {"diagonal": eye, "random": rand | eye, "all": np.ones((B, K, n, n), bool)}


# (name, B, L, H, K, D, block, local)
CASES = [("local-gqa2", 2, 64, 4, 2, 16, 16, True),
         ("split-gqa2-d24", 2, 64, 4, 2, 24, 16, False),  # D padded to 32
         # blocks of 64, the backward's of 32: the selection refined (pallas.backward_select)
         ("split-gqa2-b64-bwd32", 1, 128, 4, 2, 16, 64, False)]
PARAMS = [pytest.param(c, jnp.float32, id=f"{c[0]}-f32") for c in CASES] + [
    pytest.param(CASES[0], jnp.bfloat16, id=f"{CASES[0][0]}-bf16")]


@pytest.mark.slow
class TestRingSparsePallas:
    """The selected chunk and the sparse ring through the Pallas interpreter; INTERPRET =
    False compiles them."""

    INTERPRET = True
    BLOCK = 16  # test_unselected_blocks_are_not_read's block (a kernel set may need larger)

    @pytest.fixture(autouse=True)
    def _needs_accelerator(self):
        if not self.INTERPRET and jax.default_backend() == "cpu":
            pytest.skip("compiled Pallas needs a GPU or TPU backend")

    def _kw(self, b, local):
        return dict(local=local, implementation="pallas", block_q=b, block_k=b,
                    interpret=self.INTERPRET)

    @pytest.mark.parametrize("case, dtype", PARAMS)
    def test_selected_chunk_matches_reference(self, case, dtype):
        """out / lse of the rows that see a key, out 0 / lse NEG elsewhere, and dq, dk, dv
        (cotangents on out and lse) vs the oracle's autodiff, for each selection (one
        compiled program: the selection is data)."""
        _, B, L, H, K, D, b, local = case
        rng = np.random.default_rng(0)
        ids = _ids(B, L, local)
        q, k, v = (jnp.asarray(rng.normal(size=(B, L, n, D)), dtype) for n in (H, K, K))
        real = np.asarray(ids[0]) > 0
        ct_out = jnp.asarray(rng.normal(size=q.shape) * real[:, :, None, None], dtype)
        kw = self._kw(b, local)

        @_jit
        def run(q, k, v, select, ct_lse):
            out, lse = chunk_forward(q, k, v, *ids, select=select, **kw)
            delta = (ct_out.astype(jnp.float32) * out).sum(-1) - ct_lse  # d lse / d s = p
            return out, lse, chunk_backward(q, k, v, *ids, ct_out, lse, delta, select=select, **kw)

        @jax.jit
        def reference(q, k, v, select, ct_lse):
            (out, lse), vjp = jax.vjp(
                lambda q, k, v: selected_reference(q, k, v, *ids, select, b, b), q, k, v)
            return out, lse, vjp((ct_out.astype(jnp.float32), ct_lse))

        n = L // b
        for name, select in _selections(B, K, n, local, rng).items():
            select = jnp.asarray(select)
            ref_out, ref_lse, _ = reference(q, k, v, select, jnp.zeros((B, L, H)))
            seen = real[:, :, None] & np.isfinite(np.asarray(ref_lse))  # [B, L, H]
            ct_lse = jnp.asarray(rng.normal(size=(B, L, H)) * seen, jnp.float32)
            out, lse, grads = run(q, k, v, select, ct_lse)
            ref_out, ref_lse, ref_grads = reference(q, k, v, select, ct_lse)
            msg = f"selection {name}"
            if name == "all" or local:
                assert seen[real].all() if local else seen[real].any(), msg
            np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(ref_out)[seen],
                                       err_msg=msg, **tol("attention_out", dtype))
            np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(ref_lse)[seen],
                                       err_msg=msg, **tol("attention_lse", jnp.float32))
            blind = real[:, :, None] & ~seen
            assert (np.asarray(out)[blind] == 0).all() and (np.asarray(lse)[blind] <= NEG / 2).all()
            assert np.isfinite(np.asarray(out)).all(), msg
            for g_name, g, r in zip("qkv", grads, ref_grads):
                np.testing.assert_allclose(np.asarray(g), np.asarray(r, np.float32),
                                           err_msg=f"d{g_name}, {msg}",
                                           **tol("attention_grad", dtype))

    def test_unselected_blocks_are_not_read(self):
        """NaN in key block 1 (one document over 4 blocks, so the token mask allows it):
        kv head 1 never selects it, kv head 0 selects every causal block. Heads of kv head 1
        stay finite in out, lse, dq, and dk/dv are finite for kv head 1; kv head 0's
        outputs from query block 1 on are NaN (the poison is read where selected)."""
        B, H, K, D, b = 1, 4, 2, 16, self.BLOCK
        L = 4 * b
        n = L // b
        seg, pos = (jnp.asarray(x[None]) for x in packed_stream(L, [L]))
        ids = (seg, pos, seg, pos)
        rng = np.random.default_rng(4)
        q, k, v = (jnp.asarray(rng.normal(size=(B, L, m, D)), jnp.float32) for m in (H, K, K))
        poison = (np.arange(L) // b == 1)[None, :, None, None]
        k, v = (jnp.where(poison, jnp.nan, x) for x in (k, v))
        causal = np.tril(np.ones((n, n), bool))
        select = np.stack([causal, causal & (np.arange(n) != 1)[None, :]])[None]  # [1, K, n, n]
        kw = self._kw(b, True)

        @_jit
        def run(q, k, v, select):
            out, lse = chunk_forward(q, k, v, *ids, select=select, **kw)
            delta = out.sum(-1)
            return out, lse, chunk_backward(q, k, v, *ids, jnp.ones_like(out), lse, delta,
                                            select=select, **kw)

        out, lse, (dq, dk, dv) = jax.tree.map(np.asarray, run(q, k, v, jnp.asarray(select)))
        for name, x in (("out", out[:, :, 2:]), ("lse", lse[:, :, 2:]), ("dq", dq[:, :, 2:]),
                        ("dk", dk[:, :, 1]), ("dv", dv[:, :, 1])):
            assert np.isfinite(x).all(), f"{name}: an unselected block was read"
        assert np.isnan(out[:, b:, :2]).all(), "the poison did not arrive where selected"
        assert np.isfinite(out[:, :b, :2]).all()

    def test_ring_on_the_devices_at_hand(self):
        """Compiled only: the sparse ring with compiled Pallas rounds over every device there
        is, under shard_map(check_vma=True), equals the XLA sparse ring (forward, grads)."""
        if self.INTERPRET:
            pytest.skip("compiled kernels only (the 8-device interpreted ring is below)")
        _compare_aligned_ring(len(jax.devices()), interpret=False, check_vma=True)


@pytest.mark.compiled
class TestRingSparsePallasCompiled(TestRingSparsePallas):
    INTERPRET = False


# ------------------------------------------------------------------ the sparse ring


@functools.partial(_jit, static_argnames=("groups", "implementation", "block", "check_vma",
                                          "interpret", "n"))
def _run(q, k, v, seg, pos, bud, ct, groups, implementation, block=BS, check_vma=False,
         interpret=True, n=N):
    """(out, blocks, coverage) and (dq, dk, dv) of the psum'd loss, taken outside shard_map."""

    def body(q, k, v, seg, pos, bud, ct):
        out, stats = ring_sparse_attention(
            q, k, v, seg, pos, bud, axis_name="d", groups=groups, block_size=block,
            implementation=implementation,
            interpret=interpret if implementation == "pallas" else None)
        blocks, cov = stats["sparse_blocks"], stats["sparse_coverage"]
        return jnp.sum(out.astype(jnp.float32) * ct)[None], (out, blocks[None], cov[None])

    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    f = shard_map(body, mesh=mesh, in_specs=(SPEC,) * 7,
                  out_specs=(P("d"), (SPEC, P("d"), P("d"))), check_vma=check_vma)
    (_, aux), grads = jax.value_and_grad(
        lambda q, k, v: (lambda r: (r[0].sum(), r[1]))(f(q, k, v, seg, pos, bud, ct)),
        argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return aux, grads


@pytest.mark.parametrize("degrees", [(8,), (2, 1, 1, 2, 2)], ids=["ring8", "mixed21122"])
@pytest.mark.slow
def test_sparse_ring_through_pallas(degrees):
    """ring_sparse_attention(implementation="pallas", interpreted) on 8 devices == the XLA
    sparse ring (outputs, statistics, dq/dk/dv) and == single-device sparse_attend on the real
    tokens, budgets from the diagonal only to all blocks."""
    if len(jax.devices()) < N:
        pytest.skip(f"needs {N} devices (tests/conftest.py simulates them on CPU)")
    groups, seed = ring_groups(degrees), 20 + len(degrees)
    ring, ref, _ = ring_problem(degrees, seed, [1, 2, 3, ALL])
    (qr, kr, vr, ctr), (q, k, v, ct) = ring_values(ring, ref, seed, jnp.float32)
    ids = tuple(jnp.asarray(ring[f]) for f in ("seg", "pos", "bud"))
    (out, blocks, cov), grads = _run(q, k, v, *ids, ct, groups=groups, implementation="pallas")
    (x_out, x_blocks, x_cov), x_grads = _run(q, k, v, *ids, ct, groups=groups, implementation="xla")
    real = ring["ref"] >= 0
    f32 = tol("attention_out", jnp.float32)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(x_out)[real], **f32)
    np.testing.assert_allclose(np.asarray(blocks), np.asarray(x_blocks), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(cov), np.asarray(x_cov),
                               **tol("router_coverage", "float32"))
    assert np.isfinite(np.asarray(out)).all()
    ref_out, ref_grads = ring_reference(qr, kr, vr, jnp.asarray(ref["seg"]), jnp.asarray(ref["bud"]),
                                        ctr)
    bidx, ridx = np.nonzero(real)[0], ring["ref"][real]
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref_out)[bidx, ridx], **f32)
    for name, g, xg, r in zip("qkv", grads, x_grads, ref_grads):
        g = np.asarray(g)
        np.testing.assert_allclose(g[real], np.asarray(xg)[real], err_msg=f"d{name} vs xla",
                                   **tol("attention_grad", jnp.float32))
        np.testing.assert_allclose(g[real], np.asarray(r)[bidx, ridx], err_msg=f"d{name}",
                                   **tol("attention_grad", jnp.float32))
        assert not g[~real].any(), f"d{name} nonzero at padding"


def _compare_aligned_ring(n, interpret, check_vma, bs=16):
    """One ring of n devices, blocks of bs (compiled Pallas: a power of two >= 16): documents
    padded to whole blocks in a zigzag stream; Pallas vs XLA sparse ring in bf16."""
    B, H, K, D, T = 1, 4, 2, 16, 4 * bs
    c_docs = [3 * bs + 1, 1, bs - 3, 2 * bs]
    seg, pos, bud = (np.zeros((B, n * T), np.int32) for _ in range(3))
    at = 0
    for i, length in enumerate(c_docs * n):
        blocks = -(-length // bs)
        if at + blocks * bs > n * T:
            break
        seg[0, at:at + length], pos[0, at:at + length] = i + 1, np.arange(length)
        bud[0, at:at + length] = 1 + i % 3
        at += blocks * bs
    perm = zigzag_layout(n * T, n).reshape(-1)
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=(B, n * T, m, D)), jnp.bfloat16) for m in (H, K, K))
    ct = jnp.asarray(rng.normal(size=q.shape) * (seg > 0)[:, :, None, None], jnp.float32)
    args = [jnp.asarray(x)[:, perm] for x in (q, k, v, seg, pos, bud, ct)]
    kw = dict(groups=((0, n),), block=bs, check_vma=check_vma, n=n)
    (out, _, _), grads = _run(*args, implementation="pallas", interpret=interpret, **kw)
    (x_out, _, _), x_grads = _run(*args, implementation="xla", **kw)
    real = np.asarray(args[3]) > 0
    np.testing.assert_allclose(np.asarray(out, np.float32)[real],
                               np.asarray(x_out, np.float32)[real],
                               **tol("attention_out", jnp.bfloat16))
    for name, g, xg in zip("qkv", grads, x_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32)[real],
                                   np.asarray(xg, np.float32)[real],
                                   err_msg=f"d{name}", **tol("attention_grad", jnp.bfloat16))


# ------------------------------------------------------------------ host-side checks (CPU)


def test_dispatch_and_errors():
    """"auto" is XLA on a CPU host (no pallas_call); "pallas" reaches the kernels; the
    interpreter under check_vma=True and a selection for the XLA chunk are refused."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    x = jnp.zeros((1, 64, 2, 16))
    s = jnp.ones((1, 64), jnp.int32)

    def ring(check_vma=True, **kw):
        return shard_map(lambda q, k, v, s, p, b: ring_sparse_attention(
            q, k, v, s, p, b, axis_name="d", groups=((0, 2),), block_size=16, **kw)[0],
            mesh=mesh, in_specs=(P(None, "d"),) * 6, out_specs=P(None, "d"), check_vma=check_vma)

    def jaxpr(f):
        return str(jax.make_jaxpr(f)(x, x, x, s, s, s))

    if jax.default_backend() == "cpu":
        assert "pallas_call" not in jaxpr(ring())
    assert "pallas_call" in jaxpr(ring(False, implementation="pallas", interpret=True))
    with pytest.raises(ValueError, match="check_vma=False"):
        jaxpr(ring(implementation="pallas", interpret=True))
    ids = (s, s, s, s)
    with pytest.raises(ValueError, match="needs implementation='pallas'"):
        chunk_forward(x, x, x, *ids, implementation="xla", block_q=16, block_k=16,
                      select=jnp.ones((1, 2, 4, 4), bool))
    with pytest.raises(ValueError, match=r"select must be a bool \[B, K, nq, nk\]"):
        chunk_forward(x, x, x, *ids, implementation="pallas", interpret=True, block_q=16,
                      block_k=16, select=jnp.ones((1, 2, 4, 3), bool))


@pytest.mark.compiled
def test_compiled_sparse_ring_lowers_to_triton_under_check_vma():
    """The whole sparse ring (2 devices, routing, forward and backward) with compiled Pallas
    rounds under shard_map(check_vma=True), exported for CUDA from this host: every round's
    fwd, dQ and dK/dV kernel lowers through Triton (2 rounds x 3)."""
    from jax import export

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    # RingConfig directly: ring_sparse_attention refuses compiled Pallas on a CPU host
    cfg = RingConfig("d", ((0, 2),), 16, implementation="pallas", interpret=False)

    def body(q, k, v, s, p, b):
        s_owner, s_local, _ = ring_sparse._route(q, k, s, b, cfg, 8)
        return ring_sparse._sparse_ring(q, k, v, s, p, s_owner, s_local, cfg)

    f = shard_map(body, mesh=mesh, in_specs=(P(None, "d"),) * 6, out_specs=P(None, "d"),
                  check_vma=True)
    grad = jax.jit(jax.grad(
        lambda q, k, v, s, p, b: f(q, k, v, s, p, b).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    x = jax.ShapeDtypeStruct((1, 2 * 64, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 2 * 64, 2, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 2 * 64), jnp.int32)
    triton = "__gpu$xla.gpu.triton"
    exported = export.export(grad, platforms=("cuda",), disabled_checks=[
        export.DisabledSafetyCheck.custom_call(triton)])(x, kv, kv, ids, ids, ids)
    assert exported.mlir_module().count(f"@{triton}") == 6
