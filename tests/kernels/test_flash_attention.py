"""Flash attention (XLA blocked version) vs the dense reference: outputs, gradients, masking.

Shapes are small (T ~ 80, blocks of 16/32) so that many blocks, padding and documents that
straddle blocks are all exercised quickly on CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tolerances import tol
from attention_inputs import out_and_vjp as _out_and_vjp, random_qkv as _inputs, segments as _segments

from kernels_pallas import attention_reference, flash_attention
from kernels_pallas.flash_attention import xla as flash_xla
from kernels_pallas.flash_attention.reference import attention_mask


# Row 0: a 50-token document spanning several blocks, a one-token document, then padding.
# Row 1: several short documents, one of length 1, filling the row (no padding).
T_MAIN = 75  # not a multiple of any block size used below
SEG_MAIN = [[50, 1, 20], [7, 1, 30, 12, 25]]

CASES = [
    # (name, H, K, causal, block_q, block_k, segments)
    ("gqa1-causal-16x16", 4, 4, True, 16, 16, SEG_MAIN),
    ("gqa2-causal-32x16", 4, 2, True, 32, 16, SEG_MAIN),
    ("gqa4-causal-16x32", 4, 1, True, 16, 32, SEG_MAIN),
    ("gqa2-noncausal-16x32", 4, 2, False, 16, 32, SEG_MAIN),
    ("gqa4-noncausal-32x16", 4, 1, False, 32, 16, SEG_MAIN),
    ("gqa1-causal-nosegments", 4, 4, True, 32, 16, None),
    ("gqa2-noncausal-nosegments", 4, 2, False, 16, 16, None),
    ("gqa2-causal-block>T", 4, 2, True, 256, 256, SEG_MAIN),
    # one row, padding filling whole blocks (a batch-wide "any" cannot hide a per-row bug)
    ("gqa2-causal-padding-heavy", 4, 2, True, 16, 8, [[40, 1, 10]]),
]


# Every case in float32; bfloat16 (same float32 arithmetic inside, different casts at the
# edges) on a subset to keep the suite short.
PARAMS = [pytest.param(c, jnp.float32, id=f"{c[0]}-f32") for c in CASES] + [
    pytest.param(c, jnp.bfloat16, id=f"{c[0]}-bf16") for c in CASES if c[0] in (
        "gqa2-causal-32x16", "gqa4-noncausal-32x16", "gqa1-causal-nosegments")
]


@pytest.mark.parametrize("case, dtype", PARAMS)
@pytest.mark.slow
def test_xla_matches_reference(case, dtype):
    _, H, K, causal, bq, bk, docs = case
    B, D = (2 if docs is None else len(docs)), 16
    q, k, v = _inputs(B, T_MAIN, H, K, D, dtype)
    seg = None if docs is None else _segments(T_MAIN, docs)

    def flash(q, k, v):
        return flash_attention(q, k, v, seg, causal, "xla", block_q=bq, block_k=bk)

    def ref(q, k, v):
        return attention_reference(q, k, v, seg, causal)

    out, grads = _out_and_vjp(flash, (q, k, v))
    out_ref, grads_ref = _out_and_vjp(ref, (q, k, v))
    assert out.dtype == dtype and out.shape == q.shape
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(out_ref, np.float32), **tol("attention_out", dtype)
    )
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert g.dtype == dtype, name
        np.testing.assert_allclose(
            np.asarray(g, np.float32),
            np.asarray(g_ref, np.float32),
            err_msg=f"d{name}",
            **tol("attention_grad", dtype),
        )


def test_reference_dispatch_and_auto():
    q, k, v = _inputs(2, 40, 4, 2, 8, jnp.float32)
    seg = _segments(40, [[10, 30], [40]])
    ref = attention_reference(q, k, v, seg)
    np.testing.assert_array_equal(flash_attention(q, k, v, seg, implementation="reference"), ref)
    auto = jax.jit(
        lambda q, k, v: flash_attention(q, k, v, seg, implementation="auto", block_q=16, block_k=16)
    )(q, k, v)
    np.testing.assert_allclose(auto, ref, **tol("attention_out", jnp.float32))


@pytest.mark.slow
def test_reference_is_a_real_oracle():
    """The oracle itself vs an independent numpy loop (one GQA, segmented, causal case)."""
    B, T, H, K, D = 1, 12, 4, 2, 8
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=3)
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3], np.int32)
    out = np.asarray(attention_reference(q, k, v, jnp.asarray(seg), causal=True))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    want = np.zeros((B, T, H, D))
    for h in range(H):
        kv = h // (H // K)
        for i in range(T):
            js = [j for j in range(i + 1) if seg[0, j] == seg[0, i]]
            s = np.array([qn[0, i, h] @ kn[0, j, kv] for j in js]) / np.sqrt(D)
            p = np.exp(s - s.max())
            p /= p.sum()
            want[0, i, h] = sum(pj * vn[0, j, kv] for pj, j in zip(p, js))
    np.testing.assert_allclose(out, want, **tol("attention_out", jnp.float32))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.slow
def test_no_information_crosses_documents(causal):
    """d(outputs of document A) / d(q, k, v of any other token) is exactly zero."""
    T = 60
    docs = [[20, 25, 10]]  # documents 1, 2, 3 then 5 padding tokens
    seg = _segments(T, docs)
    q, k, v = _inputs(1, T, 4, 2, 8, jnp.float32, seed=5)
    in_a = np.asarray(seg[0]) == 2  # the middle document: others before and after it
    weights = jnp.asarray(np.random.default_rng(6).normal(size=(1, T, 4, 8)), jnp.float32)
    weights = weights * jnp.asarray(in_a)[None, :, None, None]

    def loss(q, k, v):
        out = flash_attention(q, k, v, seg, causal, "xla", block_q=16, block_k=8)
        return (out * weights).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for name, g in zip("qkv", grads):
        g = np.asarray(g)
        assert np.all(g[0, ~in_a] == 0.0), f"d{name} leaks outside document 2"
        assert np.any(g[0, in_a] != 0.0), f"d{name} is zero inside document 2"


@pytest.mark.slow
def test_padded_keys_get_no_mass():
    """T not a multiple of block_k: padded keys must not enter any softmax (huge v there
    would not show, so check via non-causal attention where every query could reach them)."""
    T = 21
    q, k, v = _inputs(1, T, 2, 2, 8, jnp.float32, seed=7)
    out = flash_attention(q, k, v, None, False, "xla", block_q=8, block_k=16)
    ref = attention_reference(q, k, v, None, False)
    np.testing.assert_allclose(out, ref, **tol("attention_out", jnp.float32))


def test_block_kinds_are_conservative_and_skip():
    """Every pair with an allowed entry is computed; FULL pairs are entirely allowed; pairs
    with nothing allowed are skipped (SKIP), and the fully-inside-a-document pairs are FULL."""
    T, bq, bk = 96, 16, 8
    all_rows = _segments(T, [[40, 1, 30], [8, 8, 50, 30], [96]])
    for seg, causal in [(s, c) for s in [all_rows, *all_rows[:, None]] for c in (True, False)]:
        B = seg.shape[0]
        blocking = flash_xla.make_flash_blocks(T, causal, bq, bk)
        kinds = np.asarray(flash_xla.block_kinds(seg, seg, blocking))
        mask = np.asarray(attention_mask(seg, T, causal, B))  # [B, T, T]
        blocks = mask.reshape(B, blocking.nq, bq, blocking.nk, bk)
        any_b = blocks.any(axis=(0, 2, 4))
        all_b = blocks.all(axis=(0, 2, 4))
        assert np.all(kinds[any_b] != flash_xla.SKIP), causal
        assert np.all(all_b[kinds == flash_xla.FULL]), causal
        if not causal:  # tight for packed layouts (causal adds the diagonal's triangle)
            assert np.all(kinds[~any_b] == flash_xla.SKIP)
        else:  # above the diagonal: outside the loop bounds, and marked SKIP too
            upper = (np.arange(blocking.nk)[None, :] * bk
                     > np.arange(1, blocking.nq + 1)[:, None] * bq - 1)
            assert np.all(kinds[upper] == flash_xla.SKIP)
        assert (kinds == flash_xla.FULL).sum() > 0, causal


@pytest.mark.slow
def test_under_checkpoint_and_grad_of_grad_free_paths():
    """jax.checkpoint around the call, float32, gradients still match the reference."""
    q, k, v = _inputs(1, 40, 4, 2, 8, jnp.float32, seed=8)
    seg = _segments(40, [[13, 27]])

    def make(impl):
        @jax.checkpoint
        def layer(q, k, v):
            return jnp.tanh(flash_attention(q, k, v, seg, True, impl, block_q=16, block_k=16))

        return jax.jit(jax.grad(lambda q, k, v: layer(q, k, v).sum(), argnums=(0, 1, 2)))

    for g, g_ref in zip(make("xla")(q, k, v), make("reference")(q, k, v)):
        np.testing.assert_allclose(g, g_ref, **tol("attention_grad", jnp.float32))


@pytest.mark.slow
def test_batch_sharded_jit_matches_reference():
    """Inside a GSPMD jit with the batch axis sharded over 8 devices."""
    devices = np.array(jax.devices())
    assert devices.size == 8, "tests/conftest.py should simulate 8 CPU devices"
    mesh = Mesh(devices, ("data",))
    B, T = 8, 40
    q, k, v = _inputs(B, T, 4, 2, 8, jnp.float32, seed=9)
    # rows coded by rank: different document layouts per row, so a row mix-up shows
    seg = _segments(T, [[40], [5, 35], [20, 20], [1, 39], [39, 1], [30], [10, 10, 10], [3] * 13])
    shard = NamedSharding(mesh, P("data"))
    q, k, v, seg = (jax.device_put(x, shard) for x in (q, k, v, seg))

    def loss(impl):
        def f(q, k, v, seg):
            out = flash_attention(q, k, v, seg, True, impl, block_q=16, block_k=8)
            return (out * jnp.arange(1, 5, dtype=out.dtype)[None, None, :, None]).sum(), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    hlo = loss("xla").lower(q, k, v, seg).compile().as_text()
    assert "all-gather" not in hlo, "inputs were gathered: the batch axis did not stay sharded"
    (_, out), grads = loss("xla")(q, k, v, seg)
    (_, out_ref), grads_ref = loss("reference")(q, k, v, seg)
    assert out.sharding.is_equivalent_to(shard, out.ndim)
    np.testing.assert_allclose(out, out_ref, **tol("attention_out", jnp.float32))
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, **tol("attention_grad", jnp.float32))


@pytest.mark.parametrize(
    "shapes, kwargs, message",
    [
        (((2, 8, 4, 8), (2, 8, 3, 8), (2, 8, 3, 8)), {}, "H=4 must be a multiple of kv heads K=3"),
        (((2, 8, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8)), {}, "k.shape=(2, 9, 2, 8)"),
        (((2, 8, 4, 8), (2, 8, 2, 8), (2, 8, 2, 4)), {}, "v.shape=(2, 8, 2, 4)"),
        (((2, 8, 4, 8), (2, 8, 2, 16), (2, 8, 2, 16)), {}, "disagree on B, T or D"),
        (((2, 8, 32), (2, 8, 2, 16), (2, 8, 2, 16)), {}, "q.shape=(2, 8, 32)"),
        (((2, 8, 4, 8),) * 3, {"implementation": "triton"}, "implementation='triton'"),
        (((2, 8, 4, 8),) * 3, {"segment_ids": np.ones((2, 7), np.int32)}, "(2, 7)"),
        (((2, 8, 4, 8),) * 3, {"segment_ids": np.ones((2, 8), np.float32)}, "integer"),
        (((2, 8, 4, 8),) * 3, {"block_q": 0}, "block_q=0"),
        (((2, 8, 4, 8),) * 3, {"block_k": 16.0}, "block_k=16.0"),
    ],
)
def test_argument_errors(shapes, kwargs, message):
    q, k, v = (jnp.zeros(s, jnp.float32) for s in shapes)
    with pytest.raises(ValueError) as info:
        flash_attention(q, k, v, **kwargs)
    assert message in str(info.value)
