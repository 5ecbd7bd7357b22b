"""The ring's chunk op (kernels_pallas/ring_chunk/) vs its dense reference, and
ring attention running it through Pallas on 8 simulated devices.

One suite, two modes (as test_flash_attention_pallas.py): `TestRingChunkPallas` runs the Pallas
kernels in the interpreter (INTERPRET = True, works on CPU); `TestRingChunkPallasCompiled`
compiles them for the accelerator and is skipped on CPU (scripts/gpu_check.sh runs it).
Chunks hold tokens in shuffled order, several documents, padding (id 0) and lengths that are
not multiples of the blocks; the mask is (segment id, position) per token only.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tolerances import tol

from attention_inputs import packed_stream
from ring_chunk_problems import N, compare_ring, ring_problem

from jaxsb.parallel import ring as ring_module
from jaxsb.parallel.ring import ring_attention
from kernels_pallas.common import NEG
from kernels_pallas.flash_attention.reference import attention_reference
from kernels_pallas.ring_chunk import ops as chunk_module, tables as chunk_tables
from kernels_pallas.ring_chunk.ops import (attention_chunk, chunk_backward, chunk_forward,
                                           merge_chunks)
from kernels_pallas.ring_chunk.reference import chunk_reference

from jax import shard_map

# The Pallas interpreter turns each kernel into a large XLA program whose CPU compile dominates
# these tests; compiling it without LLVM's expensive passes halves that (same float32 ops).
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jit(fn):
    if jax.default_backend() != "cpu":
        return jax.jit(fn)
    return jax.jit(fn, compiler_options=_FAST_COMPILE)


def _qkv(B, Lq, Lk, H, K, D, dtype, seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(B, Lq, H, D)), dtype),
            jnp.asarray(rng.normal(size=(B, Lk, K, D)), dtype),
            jnp.asarray(rng.normal(size=(B, Lk, K, D)), dtype))


def _local_ids(B, L, rng):
    """[B, L] ids and positions of a local chunk: per row a few documents (one of one token)
    plus padding, tokens shuffled."""
    seg, pos = np.zeros((B, L), np.int32), np.zeros((B, L), np.int32)
    for b in range(B):
        docs = [L // 2, 1, L - L // 2 - 6] if b == 0 else [7, L - 12, 2]
        s, p = packed_stream(L, docs)
        order = rng.permutation(L)
        seg[b], pos[b] = s[order], p[order]
    return seg, pos


def _split_ids(B, L, rng):
    """A stream of 2L tokens per row cut into a query chunk and a key chunk of L tokens each
    (shuffled), so queries meet keys of the same documents before and after them, keys of
    documents they do not hold, and some queries see no key at all."""
    sq, pq, sk, pk = (np.zeros((B, L), np.int32) for _ in range(4))
    for b in range(B):
        seg, pos = packed_stream(2 * L, [L, 3, L // 2, L // 3] if b == 0 else [L // 4, L, 5])
        order = rng.permutation(2 * L)
        sq[b], pq[b] = seg[order[:L]], pos[order[:L]]
        sk[b], pk[b] = seg[order[L:]], pos[order[L:]]
    return sq, pq, sk, pk


# (name, B, L, H, K, D, block_q, block_k, local)
CASES = [
    ("local-gqa2-32x16", 2, 45, 4, 2, 16, 32, 16, True),
    ("split-gqa4-16x32-d24", 2, 45, 4, 1, 24, 16, 32, False),  # D padded to 32
    # forward tiles 64 x 64, the backward's 32 x 32 (common.backward_blocks): other tables
    ("local-gqa2-64x64-bwd32", 2, 45, 4, 2, 16, 64, 64, True),
]  # GQA 1: test_chunks_merge_with_global_lse; GQA 2 also in the ring tests
PARAMS = [pytest.param(c, jnp.float32, id=f"{c[0]}-f32") for c in CASES] + [
    pytest.param(CASES[0], jnp.bfloat16, id=f"{CASES[0][0]}-bf16")]


@pytest.mark.slow
class TestRingChunkPallas:
    """The chunk kernels through the Pallas interpreter; INTERPRET = False compiles them."""

    INTERPRET = True

    @pytest.fixture(autouse=True)
    def _needs_accelerator(self):
        if not self.INTERPRET and jax.default_backend() == "cpu":
            pytest.skip("compiled Pallas needs a GPU or TPU backend")

    def _kw(self, bq, bk):
        return dict(implementation="pallas", block_q=bq, block_k=bk, interpret=self.INTERPRET)

    @pytest.mark.parametrize("case, dtype", PARAMS)
    def test_matches_reference(self, case, dtype):
        """out and lse on real queries; out 0 / lse NEG where a query sees no key; dq, dk, dv
        through both outputs (cotangents on out and on lse) vs the reference's autodiff."""
        _, B, L, H, K, D, bq, bk, local = case
        rng = np.random.default_rng(0)
        ids = (*_local_ids(B, L, rng),) * 2 if local else _split_ids(B, L, rng)  # q side, k side
        ids = tuple(jnp.asarray(x) for x in ids)
        q, k, v = _qkv(B, L, L, H, K, D, dtype, seed=1)
        real = np.asarray(ids[0]) > 0
        ct_out = jnp.asarray(rng.normal(size=q.shape) * real[:, :, None, None], dtype)
        ct_lse = jnp.asarray(rng.normal(size=(B, L, H)) * real[:, :, None], jnp.float32)

        def run(fn):
            @_jit
            def go(q, k, v):
                (out, lse), vjp = jax.vjp(fn, q, k, v)
                return out, lse, vjp((ct_out, ct_lse))

            return go(q, k, v)

        out, lse, grads = run(lambda q, k, v: attention_chunk(q, k, v, *ids, local=local,
                                                              **self._kw(bq, bk)))
        ref_out, ref_lse, ref_grads = run(lambda q, k, v: chunk_reference(q, k, v, *ids))
        assert out.dtype == dtype and lse.dtype == jnp.float32
        seen = np.isfinite(np.asarray(ref_lse))  # [B, L, H]: the query sees some key
        assert seen[real].all() if local else (~seen[real]).any() and seen[real].any()
        rows = real[:, :, None] & seen
        np.testing.assert_allclose(np.asarray(out, np.float32)[rows],
                                   np.asarray(ref_out, np.float32)[rows],
                                   **tol("attention_out", dtype))
        np.testing.assert_allclose(np.asarray(lse)[rows], np.asarray(ref_lse)[rows],
                                   **tol("attention_lse", jnp.float32))  # float32 arithmetic
        blind = real[:, :, None] & ~seen
        assert (np.asarray(out, np.float32)[blind] == 0).all()
        assert (np.asarray(lse)[blind] <= NEG / 2).all()
        assert np.isfinite(np.asarray(out, np.float32)).all()  # padding rows too
        for name, g, r in zip("qkv", grads, ref_grads):
            assert g.dtype == dtype, name
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                       err_msg=f"d{name}", **tol("attention_grad", dtype))

    def test_chunks_merge_with_global_lse(self):
        """The ring's contract: keys cut into two chunks; merge_chunks of the two forwards is
        attention over all keys, and chunk_backward with the global lse and delta gives each
        chunk's dk, dv and its share of dq (summed) of full attention. (The XLA chunk meets
        the same contract inside every test of test_ring_attention.py.)"""
        B, L, H, K, D, bq, bk = 1, 40, 2, 2, 16, 16, 16
        rng = np.random.default_rng(3)
        seg, pos = _local_ids(B, 2 * L, rng)  # queries: all 2L tokens; keys: two halves
        seg, pos = jnp.asarray(seg), jnp.asarray(pos)
        q, k, v = _qkv(B, 2 * L, 2 * L, H, K, D, jnp.float32, seed=4)
        real = np.asarray(seg) > 0
        do = jnp.asarray(rng.normal(size=q.shape) * real[:, :, None, None], jnp.float32)
        kw = self._kw(bq, bk)

        def halves(x):  # [B, 2L, ...] -> [2, B, L, ...]
            return jnp.moveaxis(x.reshape(B, 2, L, *x.shape[2:]), 1, 0)

        @_jit
        def ring_of_two(q, k, v, do):
            kv_halves = tuple(halves(x) for x in (k, v, seg, pos))
            # lax.map: one traced kernel set serves both halves (interpreted compiles are slow)
            outs, lses = jax.lax.map(
                lambda c: chunk_forward(q, c[0], c[1], seg, pos, c[2], c[3], **kw), kv_halves)
            out, lse = merge_chunks(outs[0], lses[0], outs[1], lses[1])
            delta = (do * out).sum(-1)
            dqs, dks, dvs = jax.lax.map(lambda c: chunk_backward(
                q, c[0], c[1], seg, pos, c[2], c[3], do, lse, delta, **kw), kv_halves)
            whole = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, 2 * L, *x.shape[3:])  # noqa: E731
            return out, lse, (dqs.sum(0), whole(dks), whole(dvs))

        out, lse, grads = ring_of_two(q, k, v, do)
        (ref_out, ref_lse), vjp = jax.vjp(
            lambda q, k, v: chunk_reference(q, k, v, seg, pos, seg, pos), q, k, v)
        np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref_out)[real],
                                   **tol("attention_out", jnp.float32))
        np.testing.assert_allclose(np.asarray(lse)[real], np.asarray(ref_lse)[real],
                                   **tol("attention_lse", jnp.float32))
        for name, g, r in zip("qkv", grads, vjp((do, jnp.zeros_like(ref_lse)))):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), err_msg=f"d{name}",
                                       **tol("attention_grad", jnp.float32))

    def test_skipped_blocks_are_not_read(self):
        """Skipped, not just masked: NaN in k and v of key blocks that no query can see (by
        segment range or by position range) never reaches outputs or gradients (a masked
        product 0 * NaN is still NaN); a poisoned block that is read does poison."""
        b = 16
        # key blocks: [doc 1, positions 16..31], [doc 2, 0..15], [doc 1, 0..15]
        sk = np.array([[1] * b + [2] * b + [1] * b], np.int32)
        pk = np.array([list(range(b, 2 * b)) + list(range(b)) * 2], np.int32)
        # query blocks: [doc 1, 0..15], [doc 3, 0..15] (sees no key), 10 queries of doc 2
        sq = np.array([[1] * b + [3] * b + [2] * 10], np.int32)
        pq = np.array([list(range(b)) * 2 + list(range(10))], np.int32)
        perm = np.random.default_rng(5).permutation(b)  # shuffled inside a block
        sq[:, :b], pq[:, :b] = sq[:, perm], pq[:, perm]
        ids = tuple(jnp.asarray(x) for x in (sq, pq, sk, pk))
        q, k, v = _qkv(1, sq.shape[1], sk.shape[1], 4, 2, 16, jnp.float32, seed=6)

        @_jit
        def run(poison):
            mask = poison[None, :, None, None]
            kp, vp = (jnp.where(mask, jnp.nan, x) for x in (k, v))
            fn = lambda q, k, v: attention_chunk(q, k, v, *ids, **self._kw(b, b))[0]  # noqa: E731
            out, vjp = jax.vjp(fn, q, kp, vp)
            return (out, *vjp(jnp.ones_like(out)))

        key_block = np.arange(3 * b) // b
        out, dq, dk, dv = run(jnp.asarray(key_block == 0))
        for name, x in (("out", out), ("dq", dq), ("dk", dk[:, b:]), ("dv", dv[:, b:])):
            assert np.isfinite(np.asarray(x)).all(), f"{name}: a skipped block was read"
        assert (np.asarray(out)[0, b : 2 * b] == 0).all()  # doc 3 sees nothing
        out = run(jnp.asarray(key_block == 1))[0]  # read by the doc-2 queries
        assert np.isnan(np.asarray(out)[0, 2 * b :]).all(), "the poison did not arrive"
        assert np.isfinite(np.asarray(out)[0, : 2 * b]).all()

    def test_inactive_reads_nothing(self):
        """active=False (an idle ring device): out 0, lse NEG and zero gradients even when
        every input is NaN."""
        rng = np.random.default_rng(7)
        ids = tuple(jnp.asarray(x) for x in (*_local_ids(1, 20, rng),) * 2)
        q, k, v = (jnp.full_like(x, jnp.nan) for x in _qkv(1, 20, 20, 2, 1, 16, jnp.float32, 0))
        kw = dict(local=True, active=jnp.asarray(False), **self._kw(16, 16))

        @_jit
        def run(q, k, v):
            out, lse = chunk_forward(q, k, v, *ids, **kw)
            return out, lse, chunk_backward(q, k, v, *ids, q, lse, lse, **kw)

        out, lse, grads = run(q, k, v)
        assert (np.asarray(out) == 0).all() and (np.asarray(lse) == NEG).all()
        for name, g in zip("qkv", grads):
            assert (np.asarray(g) == 0).all(), f"d{name}"


    def test_ring_on_the_devices_at_hand(self):
        """Compiled only: ring_attention(implementation="pallas") in one ring over every
        device there is (one GPU: a ring of 1), under shard_map(check_vma=True), so the
        kernels' out_shapes must carry the varying mesh axes. The interpreted ring is
        test_ring_attention_through_pallas below."""
        if self.INTERPRET:
            pytest.skip("compiled kernels only (the interpreter needs check_vma=False)")
        n = len(jax.devices())
        seg, pos, perm, groups = ring_problem((n,), 1, seed=3, num_devices=n)
        compare_ring(seg, pos, perm, groups, n, check_vma=True, interpret=False,
                     dtype=jnp.bfloat16)


@pytest.mark.compiled
class TestRingChunkPallasCompiled(TestRingChunkPallas):
    INTERPRET = False


# ------------------------------------------------------------------ host-side logic (CPU only)


def test_chunk_reference_is_the_document_oracle():
    """In natural order (positions count up per document) the chunk reference is the causal
    document-masked attention of reference.py, which test_flash_attention checks by loops."""
    T = 30
    seg, pos = packed_stream(T, [12, 1, 14])
    seg, pos = jnp.asarray(seg[None]), jnp.asarray(pos[None])
    q, k, v = _qkv(1, T, T, 4, 2, 8, jnp.float32, seed=2)
    out, lse, want = jax.jit(lambda q, k, v: (*chunk_reference(q, k, v, seg, pos, seg, pos),
                                              attention_reference(q, k, v, seg)))(q, k, v)
    real = np.asarray(seg[0]) > 0  # padding (all at position 0) differs: it is unspecified
    np.testing.assert_allclose(np.asarray(out)[0, real], np.asarray(want)[0, real],
                               **tol("attention_out", jnp.float32))
    assert np.isfinite(np.asarray(lse)).all()


def test_row_tables_are_conservative():
    """Per-row kinds (Pallas) on random ids (0..3, random positions) and on packed rows,
    blocks of different sizes: SKIP only if no real entry is allowed, FULL only if every
    entry is; with `local`, every padding query's own key block is visited; visit ranges
    cover every non-SKIP pair."""
    rng = np.random.default_rng(0)
    B, L, bq, bk = 3, 48, 8, 16

    @functools.partial(jax.jit, static_argnums=4)
    def tables_fn(sq, pq, sk, pk, local):
        flags = chunk_tables.pair_flags(chunk_tables.block_summaries(sq, pq, bq),
                                        chunk_tables.block_summaries(sk, pk, bk), bq, bk, local)
        kinds = chunk_tables.row_kinds(*flags)
        return kinds, chunk_tables.visit_ranges(kinds)

    seen_kinds = set()
    for trial in range(6):
        local = trial % 2 == 0
        sq = rng.integers(0, 4, size=(B, L)).astype(np.int32)
        pq = rng.integers(0, 20, size=(B, L)).astype(np.int32)
        sk, pk = (sq, pq) if local else (rng.permutation(sq.T).T, rng.permutation(pq.T).T)
        if trial >= 4:  # packed documents (then padding) make FULL and SKIP pairs common
            sq, pq = (np.stack(x) for x in zip(*(packed_stream(L, [37, 1, 6]),) * B))
            sk, pk = sq, pq
        kinds, ranges = (np.asarray(x) for x in tables_fn(sq, pq, sk, pk, local))
        ok = (sq[:, :, None] == sk[:, None, :]) & (pk[:, None, :] <= pq[:, :, None])
        ok = ok.reshape(B, L // bq, bq, L // bk, bk).transpose(0, 1, 3, 2, 4)  # [B,nq,nk,bq,bk]
        real = ok & (sq > 0).reshape(B, L // bq, 1, bq, 1)
        assert not real[kinds == chunk_tables.SKIP].any(), trial
        assert ok[kinds == chunk_tables.FULL].all(), trial
        if local:
            b_, t = np.nonzero(sq == 0)
            assert (kinds[b_, t // bq, t // bk] != chunk_tables.SKIP).all()
        cols = np.arange(L // bk)
        outside = (cols < ranges[..., :1]) | (cols >= ranges[..., 1:])
        assert (kinds[outside] == chunk_tables.SKIP).all()
        seen_kinds |= set(np.unique(kinds).tolist())
    assert seen_kinds == {chunk_tables.SKIP, chunk_tables.FULL, chunk_tables.PARTIAL}


def test_ring_dispatch_and_errors():
    """"auto" is XLA on a CPU host (no pallas_call in the program); "pallas" reaches the
    kernels; an interpreted ring under check_vma=True, compiled Pallas on CPU and unknown
    names are refused with messages that say what to do."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    x = jnp.zeros((1, 32, 2, 16))
    s = jnp.ones((1, 32), jnp.int32)

    def ring(check_vma=True, **kw):
        return shard_map(functools.partial(ring_attention, axis_name="d", groups=((0, 2),),
                                           block=16, **kw),
                         mesh=mesh, in_specs=(P(None, "d"),) * 5, out_specs=P(None, "d"),
                         check_vma=check_vma)

    def jaxpr(f):
        return str(jax.make_jaxpr(f)(x, x, x, s, s))

    if jax.default_backend() == "cpu":
        assert "pallas_call" not in jaxpr(ring())
        with pytest.raises(ValueError, match="interpret=True"):
            jaxpr(ring(implementation="pallas", interpret=False))
    assert "pallas_call" in jaxpr(ring(False, implementation="pallas", interpret=True))
    with pytest.raises(ValueError, match="check_vma=False"):
        jaxpr(ring(implementation="pallas", interpret=True))
    with pytest.raises(ValueError, match="must be one of"):
        jaxpr(ring(implementation="triton"))


@pytest.mark.compiled
def test_compiled_chunk_kernels_lower_to_triton_for_gpu():
    """Forward, dQ and dK/dV lower through Pallas' Triton path for CUDA, checked on any host
    by exporting for the "cuda" platform (compiling the Triton IR still needs a GPU)."""
    from jax import export

    B, L, H, K, D = 1, 200, 4, 2, 64  # L not a multiple of the blocks; nk = 7
    q = jax.ShapeDtypeStruct((B, L, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, L, K, D), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((B, L), jnp.int32)

    # the op itself: the public entry refuses compiled Pallas on a CPU host
    blocks = chunk_tables.make_chunk_blocks(L, L, D, 64, 32, False, pallas=True, interpret=False)

    def loss(q, k, v, sq, pq, sk, pk):
        out, lse = chunk_module._chunk(q, k, v, sq, pq, sk, pk, "pallas", blocks)
        return out.astype(jnp.float32).sum() + lse.sum()

    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    triton = "__gpu$xla.gpu.triton"
    exported = export.export(fwd_bwd, platforms=("cuda",), disabled_checks=[
        export.DisabledSafetyCheck.custom_call(triton)])(q, kv, kv, ids, ids, ids, ids)
    assert exported.mlir_module().count(f"@{triton}") >= 3, "expected fwd, dQ, dK/dV kernels"


@pytest.mark.compiled
def test_compiled_ring_lowers_to_triton_under_check_vma():
    """The whole ring (2 devices, forward and backward) with compiled Pallas chunks, under
    shard_map(check_vma=True), exported for CUDA from this host: every kernel's out_shape
    carries the varying mesh axis and lowers through Triton (2 rounds x fwd, dQ, dK/dV)."""
    from jax import export

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    # RingConfig directly: ring_attention refuses compiled Pallas on a CPU host
    cfg = ring_module.RingConfig("d", ((0, 2),), 64, implementation="pallas", interpret=False)
    f = shard_map(lambda q, k, v, s, p: ring_module._ring(q, k, v, s, p, cfg), mesh=mesh,
                  in_specs=(P(None, "d"),) * 5, out_specs=P(None, "d"), check_vma=True)
    grad = jax.jit(jax.grad(lambda q, k, v, s, p: f(q, k, v, s, p).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2)))
    x = jax.ShapeDtypeStruct((1, 2 * 100, 4, 64), jnp.bfloat16)  # 100 tokens per device
    kv = jax.ShapeDtypeStruct((1, 2 * 100, 2, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 2 * 100), jnp.int32)
    triton = "__gpu$xla.gpu.triton"
    exported = export.export(grad, platforms=("cuda",), disabled_checks=[
        export.DisabledSafetyCheck.custom_call(triton)])(x, kv, kv, ids, ids)
    assert exported.mlir_module().count(f"@{triton}") == 6


# ------------------------------------------------------------------ the ring through Pallas

# Mixed: rings of 2 and of 1, so in round 1 the degree-1 devices are idle (active=False).
# (Rings of several distinct degrees > 2 only add ring.py scan phases, which
# test_ring_attention covers; each phase is one more interpreted kernel set to compile.)
@pytest.mark.parametrize("degrees", [(8,), (2, 1, 1, 2, 2)], ids=["ring8", "mixed21122"])
@pytest.mark.slow
def test_ring_attention_through_pallas(degrees):
    """ring_attention(implementation="pallas", interpreted) on 8 devices equals per-group
    single-device attention, forward and gradients, under shard_map(check_vma=False) as the
    executor runs it."""
    if len(jax.devices()) < N:
        pytest.skip(f"needs {N} devices (tests/conftest.py simulates them on CPU)")
    seg, pos, perm, groups = ring_problem(degrees, 2, seed=len(degrees))
    compare_ring(seg, pos, perm, groups, N, check_vma=False, interpret=True, dtype=jnp.float32)
