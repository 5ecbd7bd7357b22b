"""Ulysses sequence-parallel attention on 8 CPU devices vs the dense reference per group stream.

The mesh is (groups, sp) = (8 // degree, degree); every global row is one group stream of
S tokens, cut into `degree` contiguous chunks of T = S / degree. Streams pack documents of
different lengths (one of them a single token, several crossing device boundaries) and end
in padding (segment id 0). Outputs and dq/dk/dv of the sharded program are compared with
`attention_reference` on the unsharded rows, and with `sparse_attend` on the unsharded rows
for a routed block-sparse attention_fn.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from attention_inputs import out_and_vjp, random_qkv, segments
from tolerances import tol

from jaxsb.models.attention import sparse_attend
from jaxsb.parallel.ulysses import head_layout, ulysses_attention
from kernels_pallas import flash_attention
from kernels_pallas.flash_attention.reference import attention_reference

S = 256  # tokens per group stream; T per device = S / degree (32..128 for degree 8..2)
ROWS_PER_GROUP = 2
D = 16
BLOCK = 16


def _mesh(degree):
    devices = np.asarray(jax.devices()[:8]).reshape(8 // degree, degree)
    return Mesh(devices, ("groups", "sp"))


def _docs(num_rows, seed):
    """Per-row document lengths: random lengths with a 1-token document, then 3..20 padding."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_rows):
        budget = S - int(rng.integers(3, 21))
        lengths = [int(rng.integers(20, 90)), 1]
        while sum(lengths) < budget:
            lengths.append(min(int(rng.integers(5, 70)), budget - sum(lengths)))
        rows.append(lengths)
    return rows


def _problem(degree, H, K, dtype, seed=0):
    rows = (8 // degree) * ROWS_PER_GROUP
    q, k, v = random_qkv(rows, S, H, K, D, dtype, seed=seed)
    return q, k, v, segments(S, _docs(rows, seed))


def _sharded(degree, attention_fn_of, check_vma=False):
    """shard_map'ed ulysses_attention over global [rows, S, ...] arrays; attention_fn_of(extra
    local args) -> attention_fn lets a test close over per-row inputs such as budgets.

    check_vma is off by default because the blocked XLA kernels' loop carries are created
    device-invariant (jax 0.10 rejects them inside a varying shard_map body); ulysses_attention
    itself is checked with vma on in test_vma_checked_with_jnp_attention_under_jit_grad."""
    spec = P("groups", "sp")

    def body(q, k, v, seg, *extra):
        return ulysses_attention(q, k, v, seg, axis_name="sp", degree=degree,
                                 attention_fn=attention_fn_of(*extra))

    def run(q, k, v, seg, *extra):
        fn = jax.shard_map(body, mesh=_mesh(degree), out_specs=spec, check_vma=check_vma,
                           in_specs=(spec, spec, spec, spec) + (P("groups"),) * len(extra))
        return fn(q, k, v, seg, *extra)

    return run


def _flash(*_):
    return functools.partial(flash_attention, causal=True, implementation="xla",
                             block_q=BLOCK, block_k=BLOCK)


def _assert_close(got, want, dtype, what, name):
    assert got.dtype == want.dtype, name
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               err_msg=name, **tol(what, dtype))


def _check_against(out, grads, out_ref, grads_ref, dtype):
    _assert_close(out, out_ref, dtype, "attention_out", "out")
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        _assert_close(g, g_ref, dtype, "attention_grad", f"d{name}")


CASES = [
    # (degree, H, K): what it exercises (layout = head_layout(H, K, degree))
    (1, 4, 2),  # no collectives
    (2, 4, 4),  # kv heads split, G = 1
    (2, 4, 1),  # kv repeated x2 (G' = 2)
    (4, 8, 4),  # kv heads split, G = 2
    (4, 4, 2),  # kv repeated x2 (G' = 1)
    (4, 8, 2),  # kv repeated x2 (G' = 2)
    (4, 6, 2),  # query heads padded 6 -> 8, kv repeated x3 then padded
    (4, 4, 1),  # kv repeated x4
    (8, 8, 2),  # kv repeated x4
    (8, 4, 4),  # query and kv heads padded 4 -> 8
]
# Each case compiles a sharded forward+backward (~3 s on 2 cores), so bf16 runs on the case
# with both head padding and kv repetition only.
PARAMS = [pytest.param(c, jnp.float32, id=f"n{c[0]}-H{c[1]}-K{c[2]}-f32") for c in CASES] + [
    pytest.param((4, 6, 2), jnp.bfloat16, id="n4-H6-K2-bf16")
]


@pytest.mark.parametrize("case, dtype", PARAMS)
@pytest.mark.slow
def test_matches_dense_reference_per_stream(case, dtype):
    degree, H, K = case
    q, k, v, seg = _problem(degree, H, K, dtype)
    run = _sharded(degree, _flash)
    out, grads = out_and_vjp(lambda q, k, v: run(q, k, v, seg), (q, k, v))
    out_ref, grads_ref = out_and_vjp(lambda q, k, v: attention_reference(q, k, v, seg), (q, k, v))
    assert out.shape == q.shape
    _check_against(out, grads, out_ref, grads_ref, dtype)


@pytest.mark.slow
def test_block_sparse_routed_matches_unsharded():
    """Routing is per kv head over its query group; with K % degree == 0 each device holds
    whole groups over the whole stream, so selection and output equal the unsharded run.
    (With kv repetition the groups shrink to G' heads and the routing may differ.)"""
    degree, H, K, dtype = 4, 8, 4, jnp.float32
    q, k, v, seg = _problem(degree, H, K, dtype, seed=3)
    rows = q.shape[0]
    budgets = jnp.asarray(np.resize([1, 3, 5, 16], rows), jnp.int32)  # 16 = every block

    def sparse_of(budgets_local):
        return lambda q, k, v, s: sparse_attend(q, k, v, s, budgets_local, block_size=BLOCK)[0]

    run = _sharded(degree, sparse_of)
    out, grads = out_and_vjp(lambda q, k, v: run(q, k, v, seg, budgets), (q, k, v))
    out_ref, grads_ref = out_and_vjp(
        lambda q, k, v: sparse_of(budgets)(q, k, v, seg), (q, k, v))
    _check_against(out, grads, out_ref, grads_ref, dtype)
    # Not vacuous: the small budgets really drop blocks, so the result is not dense attention.
    dense = attention_reference(q, k, v, seg)
    assert not np.allclose(np.asarray(out_ref[0]), np.asarray(dense[0]),
                           **tol("attention_out", dtype))


@pytest.mark.slow
def test_head_layout_routes_every_query_head_to_its_kv_head():
    """Exhaustive over small shapes: after padding and repetition, device i's local query
    head j reads local kv head j // G', which must be a copy of kv head h // G for a real
    query head h, and a padding kv head for a padding query head."""
    for degree, K, G in itertools.product(range(1, 9), range(1, 9), range(1, 9)):
        H = K * G
        Hp, r, Kp, Gl = head_layout(H, K, degree)
        assert Hp % degree == 0 and Hp - H < degree and Kp % degree == 0
        assert Kp * Gl == Hp and r * Gl == G
        if K % degree == 0:
            assert r == 1 and Hp == H
        hq, hk = Hp // degree, Kp // degree
        assert hq == hk * Gl
        for h in range(Hp):
            i, j = divmod(h, hq)
            e = i * hk + j // Gl  # expanded, padded kv head index
            if h < H:
                assert e < K * r and e // r == h // G, (degree, H, K, h)
            else:
                assert e >= K * r, (degree, H, K, h)


@pytest.mark.slow
def test_vma_checked_with_jnp_attention_under_jit_grad():
    """ulysses_attention itself type-checks with check_vma on (jnp attention_fn), and
    jax.jit(jax.grad) of a scalar loss matches the unsharded one; H = 6 on degree 4 pads two
    zero query heads whose outputs are dropped, so they must not add to any gradient."""
    degree, H, K = 4, 6, 2
    q, k, v, seg = _problem(degree, H, K, jnp.float32, seed=5)
    run = _sharded(degree, lambda: attention_reference, check_vma=True)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)

    g = jax.jit(jax.grad(loss(lambda q, k, v: run(q, k, v, seg)), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(loss(lambda q, k, v: attention_reference(q, k, v, seg)),
                     argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g, g_ref):
        _assert_close(a, b, jnp.float32, "attention_grad", f"d{name}")


def test_errors_name_the_problem():
    q, k, v, seg = _problem(4, 4, 2, jnp.float32)
    with pytest.raises(ValueError, match="degree=2 must equal the size of mesh axis 'sp'"):
        jax.shard_map(
            lambda q, k, v, s: ulysses_attention(q, k, v, s, axis_name="sp", degree=2,
                                                 attention_fn=_flash()),
            mesh=_mesh(4), in_specs=(P("groups", "sp"),) * 4, out_specs=P("groups", "sp"),
        )(q, k, v, seg)
    with pytest.raises(ValueError, match="share a dtype"):
        ulysses_attention(q, k.astype(jnp.bfloat16), v, seg, axis_name="sp", degree=4,
                          attention_fn=_flash())
    with pytest.raises(ValueError, match="H=4 must be a multiple of kv heads K=3"):
        head_layout(4, 3, 2)
