"""The Mosaic (TPU) attention kernels (kernels_pallas/mosaic.py and the two walks) on a CPU host.

Numbers: the kernels run interpreted against the dense references, forward and dQ/dK/dV, float32
and bfloat16: the case matrix in the generic Pallas interpreter, the skipped-blocks tests (which
also run every kernel) in the TPU interpreter (`pltpu.InterpretParams`: TPU semantics, scalar
prefetch, scratch filled with NaN until written, out-of-bounds block reads raise). Lowering: forward and
backward export for the "tpu" platform from this host (Pallas -> Mosaic MLIR; libtpu's own
compilation of that MLIR needs a TPU). Blocks are multiples of 128 tokens (Mosaic's tiling), so
rows are ~300-500 tokens: still several blocks, documents straddling blocks, a one-token
document, padding and a ragged last block.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ring_chunk_problems as ring_problems
import test_ring_chunk_pallas as chunk_tests
import test_ring_sparse_pallas as selected_chunk_tests
from attention_inputs import out_and_vjp, random_blocks, random_qkv, segments
from jax.sharding import Mesh, PartitionSpec as P
from tolerances import tol

from jaxsb.parallel import ring as ring_module
from kernels_pallas.ring_chunk import ops as chunk_module, tables as chunk_tables

from kernels_pallas import attention_reference, block_sparse_attention, flash_attention, mosaic
from kernels_pallas.block_sparse_attention import pallas as sparse_pallas
from kernels_pallas.block_sparse_attention.pallas_tpu import block_sparse_attention_mosaic, pair_codes
from kernels_pallas.flash_attention import pallas as flash_pallas
from kernels_pallas.flash_attention import pallas_tpu as flash_tpu


def _assert_close(got, want, dtype):
    (out, grads), (out_ref, grads_ref) = got, want
    assert out.dtype == dtype and out.shape == out_ref.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32),
                               **tol("attention_out", dtype))
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert g.dtype == dtype and g.shape == g_ref.shape, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32),
                                   err_msg=f"d{name}", **tol("attention_grad", dtype))


# Interpreted everywhere; compiled too where the backend is a TPU (scripts/gpu_check.sh tpu).
MODES = pytest.mark.parametrize("interpret", [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.skipif(
        jax.default_backend() != "tpu", reason="compiled Mosaic needs a TPU")),
])


def _flash(seg, causal, bq, bk, interpret=True, tpu_interpreter=True):
    return lambda q, k, v: flash_tpu.flash_attention_mosaic(q, k, v, seg, causal, bq, bk,
                                                            interpret, tpu_interpreter)


def _sparse(idx, counts, seg, bs, interpret=True, tpu_interpreter=True):
    return lambda q, k, v: block_sparse_attention_mosaic(q, k, v, idx, counts, seg, bs,
                                                         interpret, tpu_interpreter)


T_MAIN = 300  # not a multiple of 128
# Row 0: a 150-token document over two blocks, a one-token document, a 100-token one, then 49
# padding tokens. Row 1: five documents (one of length 1) filling the row.
SEG_MAIN = [[150, 1, 100], [7, 1, 130, 12, 150]]

FLASH_CASES = [
    # (name, H, K, D, causal, block_q, block_k, documents, dtype)
    ("gqa2-causal-128x128-d64", 2, 1, 64, True, 128, 128, SEG_MAIN, jnp.float32),
    # key blocks of several mosaic.FWD_COMPUTE-key parts (the forward's loop)
    ("gqa2-causal-128x256-d64", 2, 1, 64, True, 128, 256, SEG_MAIN, jnp.float32),
    ("gqa4-causal-128x256-d128-bf16", 4, 1, 128, True, 128, 256, SEG_MAIN[:1], jnp.bfloat16),
    ("gqa1-noncausal-256x128-d192", 2, 2, 192, False, 256, 128, None, jnp.float32),  # D -> 256
    # heads side by side ([B, T, H * D]: D is whole lanes), two kv heads
    ("gqa2-kv2-causal-256x128-d128", 4, 2, 128, True, 256, 128, SEG_MAIN, jnp.float32),
    # a row whose padding fills whole blocks
    ("gqa2-causal-padding-heavy", 2, 1, 64, True, 128, 128, [[120, 1, 10]], jnp.float32),
]


@MODES
@pytest.mark.parametrize("case", FLASH_CASES, ids=[c[0] for c in FLASH_CASES])
@pytest.mark.slow
def test_flash_matches_reference(case, interpret):
    _, H, K, D, causal, bq, bk, docs, dtype = case
    B = 1 if docs is None else len(docs)
    q, k, v = random_qkv(B, T_MAIN, H, K, D, dtype)
    seg = None if docs is None else segments(T_MAIN, docs)
    # the generic interpreter here (2x faster); the not-read tests below use the TPU one
    got = out_and_vjp(_flash(seg, causal, bq, bk, interpret, tpu_interpreter=False), (q, k, v))
    want = out_and_vjp(lambda q, k, v: attention_reference(q, k, v, seg, causal), (q, k, v))
    _assert_close(got, want, dtype)


@MODES
@pytest.mark.slow
def test_flash_skipped_blocks_are_not_read(interpret):
    """Document 1 comes back after document 2: query block 3 walks key blocks 0..3 and the
    in-kernel kind must skip blocks 1-2. NaN in every input of document 2 must not reach the
    other document's outputs or gradients (a masked 0 * NaN would still be NaN)."""
    ids = [1] * 128 + [2] * 256 + [1] * 128
    T = len(ids)
    seg = jnp.asarray([ids], jnp.int32)
    q, k, v = random_qkv(1, T, 2, 1, 64, jnp.float32, seed=8)
    poisoned = np.asarray(ids) == 2
    mask = jnp.asarray(poisoned)[None, :, None, None]
    q, k, v = (jnp.where(mask, jnp.nan, x) for x in (q, k, v))
    out, grads = out_and_vjp(_flash(seg, True, 128, 128, interpret), (q, k, v))
    for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        x = np.asarray(x)
        assert np.all(np.isfinite(x[0, ~poisoned])), f"{name}: a skipped block was computed"
        assert np.all(np.isnan(x[0, poisoned])), f"{name}: the poison did not arrive"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T, bq, bk", [(300, 128, 128), (640, 128, 256), (640, 256, 128)])
def test_pair_kind_matches_block_tables(T, bq, bk, causal):
    """The kernels rebuild each pair's kind from two per-block summaries (SMEM is small); it
    must equal `block_tables`' kind (the GPU and XLA rule) for every visited pair, and the
    visited ranges must be block_tables' ranges."""
    seg = segments(T, [[40, 1, 200, 30], [T], [128, 128, 5]])
    geo = mosaic.make_geometry(T, 64, bq, bk, causal, True)
    seg_q = np.pad(np.asarray(seg), ((0, 0), (0, geo.Tq - T)), mode="edge")
    seg_k = np.pad(np.asarray(seg), ((0, 0), (0, geo.Tk - T)), mode="edge")
    kinds, k_range, q_range = (np.asarray(x) for x in flash_pallas.block_tables(
        jnp.asarray(seg_q), jnp.asarray(seg_k), geo))
    fields = [np.asarray(t).reshape(seg.shape[0], -1) for t in flash_tpu.tables(seg, geo)]
    qtab, ktab = (np.stack(side, axis=-1) for side in (fields[:flash_tpu.FIELDS],
                                                       fields[flash_tpu.FIELDS:]))
    np.testing.assert_array_equal(qtab[..., 4:], k_range)
    np.testing.assert_array_equal(ktab[..., 4:], q_range)
    qi, kb = np.meshgrid(np.arange(geo.nq), np.arange(geo.nk), indexing="ij")
    for b in range(seg.shape[0]):
        rebuilt = flash_tpu.pair_kind(
            tuple(qtab[b, :, f][:, None] for f in range(4)),
            tuple(ktab[b, :, f][None, :] for f in range(4)), qi, kb, geo)
        in_range = (kb >= k_range[b, :, :1]) & (kb < k_range[b, :, 1:])
        np.testing.assert_array_equal(np.asarray(rebuilt)[in_range], kinds[b][in_range])
    assert (kinds == mosaic.FULL).any() and (kinds == mosaic.PARTIAL).any()


# ------------------------------------------------------------------ block-sparse

T_SPARSE = 600  # 5 blocks of 128, the last ragged
SEG_SPARSE = [[300, 1, 200], [20, 1, 260, 30, 289]]


@MODES
@pytest.mark.parametrize(
    "H, K, D, docs, budgets, dtype",
    [(2, 1, 64, SEG_SPARSE, [2, 4], jnp.float32), (4, 1, 128, SEG_SPARSE[:1], [3], jnp.bfloat16)],
    ids=["gqa2-f32", "gqa4-bf16"],
)
@pytest.mark.slow
def test_sparse_matches_reference(H, K, D, docs, budgets, dtype, interpret):
    B, bs = len(docs), 128
    q, k, v = random_qkv(B, T_SPARSE, H, K, D, dtype, seed=3)
    seg = segments(T_SPARSE, docs)
    idx, counts = random_blocks(B, K, -(-T_SPARSE // bs), 4, budgets, seed=2)
    got = out_and_vjp(_sparse(idx, counts, seg, bs, interpret, tpu_interpreter=False), (q, k, v))
    want = out_and_vjp(
        lambda q, k, v: block_sparse_attention(q, k, v, idx, counts, seg, bs, "reference"),
        (q, k, v))
    _assert_close(got, want, dtype)


@MODES
@pytest.mark.slow
def test_sparse_unlisted_blocks_are_not_read_and_empty_rows_are_zero(interpret):
    """Key block 1 is listed only past the counts: NaN in its inputs stays in its own rows.
    Query block 3 lists nothing: its output and dq are 0, with no NaN."""
    T, bs, H, K, D = 512, 128, 2, 1, 64
    nq = T // bs
    q, k, v = random_qkv(1, T, H, K, D, jnp.float32, seed=7)
    idx = jnp.full((1, K, nq, 3), 1, jnp.int32).at[..., 0].set(jnp.arange(nq))
    counts = jnp.ones((1, K, nq), jnp.int32).at[:, :, 3].set(0)
    poisoned = (np.arange(T) >= bs) & (np.arange(T) < 2 * bs)
    mask = jnp.asarray(poisoned)[None, :, None, None]
    q, k, v = (jnp.where(mask, jnp.nan, x) for x in (q, k, v))
    out, grads = out_and_vjp(_sparse(idx, counts, None, bs, interpret), (q, k, v))
    for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        x = np.asarray(x)
        assert np.all(np.isfinite(x[0, ~poisoned])), f"{name}: an unlisted block was read"
        assert np.all(np.isnan(x[0, poisoned])), f"{name}: the poison did not arrive"
    empty = slice(3 * bs, 4 * bs)
    np.testing.assert_array_equal(np.asarray(out)[0, empty], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0])[0, empty], 0.0)


def test_pair_codes_walk_every_selected_pair_once_by_key_block():
    """The dK/dV walk, decoded, against a brute force over the selection: per (row, kv head)
    the steps run over key blocks in ascending order, each key block's selected query blocks
    ascending (or one zero-writing step when none selected it), then tail steps that only
    extend the last run."""
    rng = np.random.default_rng(4)
    B, K, nq, M = 2, 2, 6, 3
    idx = jnp.asarray(rng.integers(-1, nq + 1, size=(B, K, nq, M)), jnp.int32)
    counts = jnp.asarray(rng.integers(0, M + 1, size=(B, K, nq)), jnp.int32)
    sel = np.asarray(sparse_pallas.selection(idx, counts, nq))
    codes = np.asarray(pair_codes(jnp.asarray(sel), M))
    assert codes.shape[-1] == nq + nq * M
    for b in range(B):
        for k in range(K):
            want = []
            for kb in range(nq):
                qs = [(kb, qi + 1) for qi in range(nq) if sel[b, k, qi, kb]]
                want += qs or [(kb, 0)]
            got = [divmod(int(c), nq + 1) for c in codes[b, k]]
            assert got[: len(want)] == want
            assert all(g == (want[-1][0], 0) for g in got[len(want):])


def test_tables_over_the_smem_budget_are_refused():
    """Caught at trace time, before anything runs: 64 rows of 32K tokens in 128-token blocks
    need ~0.8 MB of flash tables; the message names the size and the way out."""
    q = jax.ShapeDtypeStruct((64, 32768, 1, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((64, 32768), jnp.int32)
    fn = lambda q, s: flash_tpu.flash_attention_mosaic(q, q, q, s, True, 128, 128, False)  # noqa: E731
    with pytest.raises(ValueError, match="SMEM.*use larger blocks"):
        jax.eval_shape(fn, q, seg)
    jax.eval_shape(lambda q, s: flash_tpu.flash_attention_mosaic(q, q, q, s, True, 512, 512,
                                                                 False), q, seg)


# ------------------------------------------------------------------ the ring's chunk op

# (name, B, L, H, K, D, block, local): 3 blocks of 128 per chunk
CHUNK_PARAMS = [
    pytest.param(("local-gqa2", 2, 384, 4, 2, 64, 128, True), jnp.float32, id="local-gqa2-f32"),
    pytest.param(("split-gqa2-d192", 1, 384, 4, 2, 192, 128, False), jnp.float32,
                 id="split-gqa2-d192-f32"),
    pytest.param(("local-gqa2", 1, 384, 2, 1, 64, 128, True), jnp.bfloat16, id="local-gqa2-bf16"),
    pytest.param(("split-gqa2-d128", 1, 384, 4, 2, 128, 128, False), jnp.float32,
                 id="split-gqa2-d128-f32"),  # heads side by side
]


@pytest.fixture
def mosaic_chunks(monkeypatch):
    """implementation="pallas" resolves to the Mosaic chunk kernels, as on a TPU backend."""
    monkeypatch.setattr(chunk_module, "pallas_target", lambda: "mosaic")


class TestRingChunkMosaic(selected_chunk_tests.TestRingSparsePallas):
    """The chunk op's suite with a block selection (which, at "all", is the plain chunk) on
    the Mosaic kernels in the (generic) Pallas interpreter: out / lse / dq / dk / dv vs the
    dense oracle for
    diagonal, random and all selections, local and split chunks; unselected blocks never read.
    Compiled on a TPU (scripts/gpu_check.sh tpu)."""

    BLOCK = 128

    @pytest.fixture(autouse=True)
    def _mosaic(self, mosaic_chunks):
        pass

    @pytest.mark.parametrize("case, dtype", CHUNK_PARAMS)
    def test_selected_chunk_matches_reference(self, case, dtype):
        super().test_selected_chunk_matches_reference(case, dtype)

    def test_resolves_to_mosaic(self):
        assert chunk_module.resolve_chunk_implementation("pallas", True) == ("mosaic", True)


@pytest.mark.compiled
class TestRingChunkMosaicCompiled(TestRingChunkMosaic):
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_accelerator(self):
        if jax.default_backend() != "tpu":
            pytest.skip("compiled Mosaic needs a TPU")


# (name, B, L, H, K, D, block_q, block_k, local), test_ring_chunk_pallas.CASES' form
VJP_CASES = [
    pytest.param(("local-gqa2-d128", 2, 300, 4, 2, 128, 128, 128, True), jnp.float32,
                 id="local-gqa2-d128-f32"),  # heads side by side
    pytest.param(("split-gqa4-d64", 2, 300, 4, 1, 64, 128, 256, False), jnp.bfloat16,
                 id="split-gqa4-d64-bf16"),
]


@pytest.mark.parametrize("case, dtype", VJP_CASES)
@pytest.mark.slow
def test_attention_chunk_vjp_through_mosaic(case, dtype, mosaic_chunks):
    """attention_chunk's own vjp on the Mosaic kernels (interpreted), cotangents on out and
    on lse, against the oracle's autodiff: its delta, rowsum(dO * out) minus the lse
    cotangent, is summed by the dQ kernel from the output and the given rows together
    (chunk_backward, which the suite above runs, gets the ring's delta alone)."""
    chunk_tests.TestRingChunkPallas().test_matches_reference(case, dtype)


@pytest.mark.slow
def test_ring_attention_through_mosaic(mosaic_chunks):
    """ring_attention(implementation="pallas") with the Mosaic chunk kernels (interpreted) on
    8 devices, rings of 2 and 1 (idle rounds: active=False), equals per-group single-device
    attention, forward and gradients."""
    if len(jax.devices()) < ring_problems.N:
        pytest.skip(f"needs {ring_problems.N} devices")
    seg, pos, perm, groups = ring_problems.ring_problem((2, 1, 1, 2, 2), 2, seed=5)
    ring_problems.compare_ring(seg, pos, perm, groups, ring_problems.N, check_vma=False,
                               interpret=True, dtype=jnp.float32, block=128)


@pytest.mark.compiled
def test_chunk_and_ring_lower_to_mosaic_for_tpu():
    """The chunk op's forward, dQ and dK/dV, and a 2-device ring of them under
    shard_map(check_vma=True) (out_shapes carry the varying mesh axis), lower to Mosaic for
    TPU from this host."""
    B, L, H, K, D = 1, 600, 4, 2, 128
    q = jax.ShapeDtypeStruct((B, L, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, L, K, D), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((B, L), jnp.int32)
    blocks = chunk_tables.make_chunk_blocks(L, L, D, 256, 128, False, pallas=True,
                                            interpret=False, mosaic=True)

    def loss(q, k, v, sq, pq, sk, pk):
        out, lse = chunk_module._chunk(q, k, v, sq, pq, sk, pk, "mosaic", blocks)
        return out.astype(jnp.float32).sum() + lse.sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    module = jax.export.export(grad, platforms=("tpu",))(q, kv, kv, ids, ids, ids, ids).mlir_module()
    assert module.count("tpu_custom_call") == 3

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    cfg = ring_module.RingConfig("d", ((0, 2),), 128, implementation="mosaic", interpret=False)
    f = ring_problems.shard_map(lambda q, k, v, s, p: ring_module._ring(q, k, v, s, p, cfg),
                                mesh=mesh, in_specs=(P(None, "d"),) * 5, out_specs=P(None, "d"),
                                check_vma=True)
    grad = jax.jit(jax.grad(lambda q, k, v, s, p: f(q, k, v, s, p).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2)))
    x = jax.ShapeDtypeStruct((1, 2 * 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 2 * 256, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 2 * 256), jnp.int32)
    module = jax.export.export(grad, platforms=("tpu",))(x, kv, kv, ids, ids).mlir_module()
    assert module.count("tpu_custom_call") == 6  # 2 rounds x forward, dQ, dK/dV


# ------------------------------------------------------------------ lowering and dispatch


def _tpu_kernels(fn, *shapes):
    """Export fn's forward + backward for the TPU platform; returns the StableHLO text."""
    grad = jax.jit(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    return jax.export.export(grad, platforms=("tpu",))(*shapes).mlir_module()


@pytest.mark.parametrize("D", [64, 128, 192])
@pytest.mark.compiled
def test_lower_to_mosaic_for_tpu(D):
    """Forward, dQ and dK/dV of both ops lower to Mosaic custom calls for TPU from this host,
    bfloat16 inputs, several blocks, GQA."""
    B, T, H, K = 1, 1000, 8, 2
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
    module = _tpu_kernels(
        lambda q, k, v, s: flash_tpu.flash_attention_mosaic(q, k, v, s, True, 128, 256, False),
        q, kv, kv, seg)
    assert module.count("tpu_custom_call") == 3, "expected forward, dQ and dK/dV kernels"
    nq = -(-T // 128)
    idx = jax.ShapeDtypeStruct((B, K, nq, 8), jnp.int32)
    counts = jax.ShapeDtypeStruct((B, K, nq), jnp.int32)
    module = _tpu_kernels(
        lambda q, k, v, s, i, c: block_sparse_attention_mosaic(q, k, v, i, c, s, 128, False),
        q, kv, kv, seg, idx, counts)
    assert module.count("tpu_custom_call") == 3, "expected forward, dQ and dK/dV kernels"


@pytest.mark.compiled
def test_delta_is_summed_in_the_dq_kernel():
    """delta = rowsum(dO * O) is the dQ kernel's work, not XLA's: the exported TPU forward +
    backward of flash attention and of the chunk op (heads side by side, D = 128) reduce no
    float array outside the kernels (that row sum was a third of the chunk op's TPU compile)."""
    q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
    blocks = chunk_tables.make_chunk_blocks(1024, 1024, 128, 256, 256, False, pallas=True,
                                            interpret=False, mosaic=True)
    modules = {
        "flash": _tpu_kernels(lambda q, k, v, s: flash_tpu.flash_attention_mosaic(
            q, k, v, s, True, 256, 256, False), q, kv, kv, ids),
        "chunk": _tpu_kernels(lambda q, k, v, s, p: chunk_module._chunk(
            q, k, v, s, p, s, p, "mosaic", blocks)[0], q, kv, kv, ids, ids),
    }
    for name, module in modules.items():
        assert module.count("tpu_custom_call") == 3, name
        reduces = [ln for ln in module.splitlines() if "stablehlo.reduce" in ln and "xf32>" in ln]
        assert reduces == [], f"{name}: a float reduce outside the kernels: {reduces}"


@pytest.mark.compiled
def test_whole_lane_heads_are_not_transposed():
    """Heads of whole 128-lane tiles go to the kernels side by side, [B, T, H * D], a free
    reshape: the exported forward + backward has no transpose of q, k, v or their gradients
    (transposes beside the kernels made most of their TPU compile time). D = 64 keeps the
    transposed [B, H, T, D] layout."""
    def transposes(D):
        q = jax.ShapeDtypeStruct((1, 1024, 8, D), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, 1024, 2, D), jnp.bfloat16)
        seg = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
        module = _tpu_kernels(
            lambda q, k, v, s: flash_tpu.flash_attention_mosaic(q, k, v, s, True, 256, 256, False),
            q, kv, kv, seg)
        return [ln for ln in module.splitlines() if "stablehlo.transpose" in ln and "bf16" in ln]

    assert transposes(128) == []
    assert len(transposes(64)) >= 4  # q, k, v in, and gradients out


def test_float32_takes_smaller_default_blocks():
    """Mosaic blocks default to 512 x 512, 256 x 256 for float32 (its six-pass matmuls
    compiled 2-3x slower at 512); Triton ones to 128 x 64, 32 x 32 for float32 (its 3xTF32
    kernels compiled 2-4x slower at 128 x 64, 2-2.5x at 64 x 32); the XLA kernel keeps its own."""
    from kernels_pallas.flash_attention.ops import DEFAULT_BLOCKS, BlockSizes, default_blocks

    assert default_blocks("mosaic", jnp.bfloat16) == BlockSizes(512, 512)
    assert default_blocks("mosaic", jnp.float32) == BlockSizes(256, 256)
    assert default_blocks("pallas", jnp.bfloat16) == BlockSizes(128, 64)
    assert default_blocks("pallas", jnp.float32) == BlockSizes(32, 32)
    assert default_blocks("xla", jnp.float32) == DEFAULT_BLOCKS["xla"]


def test_dispatch_on_tpu_backend(monkeypatch):
    """implementation="pallas" on a TPU backend reaches the Mosaic kernels (default blocks
    shrink to the 256-token row); "auto" stays on XLA there until they have run on a TPU."""
    import kernels_pallas.common as common

    monkeypatch.setattr(common.jax, "default_backend", lambda: "tpu")
    q, k, v = random_qkv(1, 256, 2, 1, 64, jnp.float32)
    seg = segments(256, [[100, 156]])
    idx, counts = random_blocks(1, 1, 2, 2, [2])

    def jaxpr(f):
        return str(jax.make_jaxpr(f)(q, k, v))

    assert "mosaic_attention_fwd" in jaxpr(
        lambda q, k, v: flash_attention(q, k, v, seg, implementation="pallas", interpret=True))
    assert "mosaic_attention_fwd" in jaxpr(
        lambda q, k, v: block_sparse_attention(q, k, v, idx, counts, seg, 128, "pallas",
                                               interpret=True))
    assert "pallas_call" not in jaxpr(lambda q, k, v: flash_attention(q, k, v, seg))


def test_block_sizes_must_be_multiples_of_128():
    with pytest.raises(ValueError, match="block_k=64 must be a multiple of 128"):
        mosaic.make_geometry(300, 64, 128, 64, True, True)
    q, k, v = random_qkv(1, 128, 2, 1, 64, jnp.float32)
    idx, counts = random_blocks(1, 1, 2, 2, [2])
    with pytest.raises(ValueError, match="block_size=64 must be a multiple of 128"):
        block_sparse_attention_mosaic(q, k, v, idx, counts, None, 64, True)

