"""Mosaic (TPU) attention kernels shared by flash and block-sparse attention.

One forward, one dQ and one dK/dV `pl.pallas_call`, each walking pairs of (query block, key
block) that a *walk* chooses. A walk is two scalar functions of the block tables (int32 arrays
passed as scalar-prefetch operands, so Mosaic keeps them in SMEM and the index maps can read
them):

  * `walk.fwd(tables, b, kv_head, q_block, step) -> (key block, kind)`: the step-th key block
    query block q_block visits (the forward and dQ grids are (B, H, nq, walk.fwd_steps));
  * `walk.bwd(tables, b, kv_head, outer, step) -> (key block, query block, kind, first, last)`
    on the dK/dV grid (B, K, walk.bwd_outer, walk.bwd_steps * G): the steps of one key block
    are consecutive (a run; first / last mark its ends, where dK/dV are zeroed and written),
    and each of the walk's steps is G grid steps, one per query head sharing the kv head
    (`_dkv_step`). Flash has a run of nq steps per key block (outer = key block); block-sparse
    walks one list of (key block, query block) pairs (outer = 1);
  * `walk.fwd_block(tables, b, kv_head, q_block, step) -> key block` (optional): the key
    block alone, for the forward's and dQ's index maps, which then do not compute kinds
    (flash forward, T = 4096, D = 64, bf16, TPU v6e: 0.46 -> 0.44 s);
  * `walk.fwd_tables` / `walk.bwd_tables` (optional): which tables each side reads; the
    kernels get only those (`_Reads`).

kind is SKIP (compute nothing), FULL (every pair allowed) or PARTIAL (mask by segment id,
causality and key padding); FULL and PARTIAL pairs run the same masked body
(`_unless_skip`). Past the end of a block's list a walk repeats its last block with kind SKIP,
so the pipeline issues no new copy and the step costs only the grid overhead: the copies and
the arithmetic both follow the walk, as in splash attention.
`flash_attention/pallas_tpu.py` (contiguous key-block ranges, kinds from per-block segment
summaries), `block_sparse_attention/pallas_tpu.py` (explicit per-block lists) and
`ring_chunk/pallas_tpu.py` (the ring's chunk op: ranges and kinds from its own table)
are the walks. The mask is by token index (causal, padded keys masked) or, for the chunk op
(`Geometry.positions`), by per-token (segment id, position) on both sides, with separate query
and key lengths (`Geometry.T_kv`).

TPU layout rules this file is written to (Mosaic wants the last two dimensions of every block
divisible by (8, 128) or equal to the array's): blocks are multiples of 128 tokens; the head
dim is a whole block dimension. A head of whole 128-lane tiles (D = 128, 256, ...) is read
where the caller has it, heads side by side in [B, T, H * D] (a free reshape of [B, T, H, D];
block (bq, D) at column block h); other head dims are transposed to [B, H, T, Dm] (padded to a
multiple of 128 above 128) and back (`layout`, `Geometry.interleaved`): those transposes made
most of a kernel's TPU compile time. Per-row statistics are held lane-replicated as [rows, 128]
(the running max and sum in VMEM scratch; delta = rowsum(dO * O), which the dQ kernel computes
and writes, as that row sum over [B, T, H * D] compiled slowly in XLA), as [1, T] rows (the
forward's log-sum-exp output, [B, H, 1, T]: the column transposed in the kernel, as slicing
lane 0 of a lane-replicated [B, H, T, 128] output took 0.1 s of the ring chunk op's 0.46 s TPU
forward compile at T = 4096, D = 64, bf16, v6e; turned back into columns in the kernel for
dQ), or sublane-replicated as [8, cols] where the dK/dV kernel needs them as a row (it works on
the transposed scores k @ q.T, so that dV += p.T @ dO and dK += dS.T @ q are plain matmuls).
Segment ids come twice for the same reason: lane-replicated [B, T, 128] (a column
per block) and sublane-replicated [B, 8, T] (a row).

The tables live in SMEM (1 MiB per core on TPU v4 to v6e); `check_smem` refuses tables over
SMEM_BUDGET with the sizes and the way out (larger blocks). Blocks default to 512 x 512 on TPU,
256 x 256 for float32 (ops.default_blocks): fewer grid steps (each costs ~0.35 us) and full MXU
tiles; a step keeps a
few [bq, bk] float32 temporaries in VMEM (about 5 MiB at 512 x 512, within the default scoped
VMEM), so much larger blocks would need `vmem_limit_bytes`.

Numerics: scores, softmax statistics and accumulators are float32; the matmul operands keep
the input dtype (bfloat16 goes to the MXU as bfloat16, float32 at HIGHEST precision), and p /
dS are cast to the value / query dtype before their matmuls, as FlashAttention does.

Checked on a CPU host only: numerics through the Pallas interpreter, and lowering to Mosaic
through `jax.export(..., platforms=["tpu"])` (tests/kernels/test_mosaic_attention.py). Mosaic's own
layout passes run in libtpu when a TPU compiles the kernel; they have not run yet.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.common import NEG, NN, NT, BlockGrid, out_struct, pad_axis

LANES, SUBLANES = 128, 8
SKIP, FULL, PARTIAL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Geometry(BlockGrid):
    """The block grid of one call, and which interpreter runs it when interpreted."""

    tpu_interpreter: bool = True  # interpreted: TPU semantics (slow) or the generic interpreter
    T_kv: int = 0  # key length when it differs from T (the ring's chunks); 0: T
    positions: bool = False  # mask by per-token (segment id, position), not by index

    @property
    def Lk(self) -> int:
        return self.T_kv or self.T

    @property
    def nk(self) -> int:
        return -(-self.Lk // self.bk)

    @property
    def Dm(self) -> int:
        """Head dim as the kernels see it: D up to 128, else padded to a multiple of 128."""
        return self.D if self.D <= LANES else -(-self.D // LANES) * LANES

    @property
    def interleaved(self) -> bool:
        """Heads side by side in the last axis, [B, T, N * D] (the caller's own layout, a free
        reshape), when a head is whole 128-lane tiles; else transposed to [B, N, T, Dm]."""
        return self.D % LANES == 0


def make_geometry(T: int, D: int, block_q: int, block_k: int, causal: bool,
                  interpret: bool, tpu_interpreter: bool = True, T_kv: int = 0,
                  positions: bool = False) -> Geometry:
    """Blocks must be multiples of 128 tokens (interpreted too: one code path); a block longer
    than its side shrinks to the side's length rounded up to 128."""
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b % LANES or b < LANES:
            raise ValueError(f"{name}={b} must be a multiple of {LANES} for the Mosaic (TPU) kernels")
    cap_q, cap_k = (-(-n // LANES) * LANES for n in (T, T_kv or T))
    return Geometry(int(T), int(D), min(block_q, cap_q), min(block_k, cap_k), bool(causal),
                    bool(interpret), bool(tpu_interpreter), int(T_kv), bool(positions))


def layout(x_BxTxNxD, T_pad: int, geo: Geometry):
    """[B, T, N, D] -> the kernels' layout, zero padded to T_pad tokens, dtype kept:
    [B, T_pad, N * D] when `geo.interleaved` (no data moves unless T is padded), else
    [B, N, T_pad, Dm] (a transpose, D padded). Transposes next to the kernels made most of
    their compile time (flash forward, T = 4096, D = 128 on TPU v5p: 1.2 s against 0.5 s
    without them)."""
    x = pad_axis(x_BxTxNxD, 1, T_pad)
    if geo.interleaved:
        return x.reshape(*x.shape[:2], -1)
    return pad_axis(x, 3, geo.Dm).transpose(0, 2, 1, 3)


def unlayout(x, geo: Geometry, dtype, length: int | None = None):
    """The inverse of `layout`: -> [B, length (default T), N, D] in dtype."""
    length = geo.T if length is None else length
    if geo.interleaved:
        return x[:, :length].reshape(x.shape[0], length, -1, geo.D).astype(dtype)
    return x[:, :, :length, : geo.D].transpose(0, 2, 1, 3).astype(dtype)


def heads(x, geo: Geometry) -> int:
    """The number of heads of an array in the kernels' layout."""
    return x.shape[2] // geo.Dm if geo.interleaved else x.shape[1]


def head_struct(B: int, N: int, T_pad: int, geo: Geometry, dtype, like):
    """The ShapeDtypeStruct of N heads of T_pad tokens in the kernels' layout."""
    shape = (B, T_pad, N * geo.Dm) if geo.interleaved else (B, N, T_pad, geo.Dm)
    return out_struct(shape, dtype, like)


def head_spec(rows: int, geo: Geometry, index):
    """BlockSpec of one head's [rows, Dm] block; index(*grid, *tables) -> (batch row, head,
    block along the tokens)."""
    if geo.interleaved:
        return pl.BlockSpec((None, rows, geo.Dm), lambda *a: _bnr(*index(*a)))
    return pl.BlockSpec((None, None, rows, geo.Dm), lambda *a: _brn(*index(*a)))


def _bnr(b, n, r):
    return b, r, n


def _row_spec(rows: int, index):
    """BlockSpec of one head's [1, rows] row of a [B, N, 1, T] array; index(*grid, *tables)
    -> (batch row, head, block along the tokens)."""
    return pl.BlockSpec((None, None, 1, rows), lambda *a: _b_n_0_r(*index(*a)))


def _b_n_0_r(b, n, r):
    return b, n, 0, r


def _brn(b, n, r):
    return b, n, r, 0


def range_block(first, last, step):
    """The block at `step` of a range [first, last): first + step, held at the range's last
    block past its end (the pipeline then issues no new copy) and at 0 for an empty range."""
    return jnp.maximum(jnp.minimum(first + step, last - 1), 0)


def lanes(x_BxT):
    """[B, T] -> [B, T, 128]: each entry repeated along the lanes (a column per block)."""
    return jnp.broadcast_to(x_BxT[..., None], (*x_BxT.shape, LANES))


def sublanes(x_BxT):
    """[B, T] -> [B, 8, T]: the row repeated down the sublanes (a row per block)."""
    return jnp.broadcast_to(x_BxT[..., None, :], (x_BxT.shape[0], SUBLANES, x_BxT.shape[-1]))


def _widen(x_Rx128, n: int):
    """Lane-replicated [rows, 128] -> [rows, n] (n a multiple of 128, or below 128)."""
    if n % LANES == 0:
        return x_Rx128 if n == LANES else jnp.tile(x_Rx128, (1, n // LANES))
    if n < LANES:
        return x_Rx128[:, :n]
    raise ValueError(f"cannot widen 128 lanes to {n}")


def _mm(a, b, dims):
    """Matmul accumulating in float32; float32 operands at full precision."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _mask(ids, row_pos, col_pos, q_is_row: bool, geo: Geometry, cols=slice(None)):
    """[rows, cols] bool for one block pair. ids are the id refs of the pair's two blocks, the
    rows' side lane-replicated [rows, 128], the columns' side sublane-replicated [8, cols] (one
    row of it is loaded, the columns `cols` of it): (segment ids) or, with geo.positions,
    (segment ids rows, segment ids columns, positions rows, positions columns). Same segment,
    and causal: by token index (row_pos / col_pos are the first indices of the rows and of
    the columns) with padded keys masked, or by position."""
    seg_cols = ids[1][:1, cols]
    n = seg_cols.shape[1]
    mask = _widen(ids[0][...], n) == seg_cols
    if geo.positions:
        rows_pos, cols_pos = _widen(ids[2][...], n), ids[3][:1, cols]
        qpos, kpos = (rows_pos, cols_pos) if q_is_row else (cols_pos, rows_pos)
        return mask & (kpos <= qpos)
    shape = mask.shape
    r = row_pos + lax.broadcasted_iota(jnp.int32, shape, 0)
    c = col_pos + lax.broadcasted_iota(jnp.int32, shape, 1)
    qpos, kpos = (r, c) if q_is_row else (c, r)
    if geo.causal:
        mask = mask & (kpos <= qpos)
    if geo.Tk > geo.Lk:
        mask = mask & (kpos < geo.Lk)
    return mask


# The forward computes a key block in parts of FWD_COMPUTE keys, a lax.fori_loop (not
# unrolled) over the block it copied: Mosaic emits vector code per (8, 128) register, so the
# [bq, keys] temporaries of one step set the kernel's size and its compile time, while the
# copies stay whole blocks (fewer grid steps). Splash attention separates the two the same way
# (its block_kv_compute, 128 by default). Flash forward, T = 4096, D = 64, bf16, TPU v6e:
# 0.42-0.44 s with the whole 512-key block at once, 0.35 s in parts of 256, 0.31-0.32 s in
# parts of 128 (the kernel alone: 0.36 -> 0.26 s). The cost at run time (a short loop, and the
# running max and sum updated per part) is unmeasured: no TPU has run the kernels yet.
FWD_COMPUTE = 128
SMEM_BUDGET = 512 * 1024  # bytes of tables; half of the 1 MiB SMEM, the rest for Mosaic


def check_smem(tables, what: str) -> None:
    """Refuse block tables too large for SMEM, with their size and the way out."""
    size = sum(int(t.size) * t.dtype.itemsize for t in tables)
    if size > SMEM_BUDGET:
        raise ValueError(
            f"{what}: the Mosaic kernels' block tables take {size} bytes of SMEM, over the "
            f"{SMEM_BUDGET}-byte budget; use larger blocks (fewer of them), or split the batch"
        )


def _unless_skip(kind, update):
    """Run update() for FULL and PARTIAL pairs alike (masked: a FULL pair's mask is all true),
    nothing for SKIP ones. A second, unmasked body for FULL pairs doubled the kernels' code and
    compile time (flash fwd + bwd at T = 1024, D = 64 for TPU v5p: bf16 4.1 s against 2.75 s,
    f32 8.8 s against 5.0 s) to save a few VPU ops per pair."""
    pl.when(kind != SKIP)(update)


def _interpret(geo: Geometry):
    """Interpreted, by default the TPU interpreter: TPU semantics on any backend (scalar
    prefetch, VMEM scratch filled with NaN until written, out-of-bounds block reads raise).
    tpu_interpreter=False takes the generic Pallas interpreter, about 2x faster (tests)."""
    if not geo.interpret:
        return False
    return pltpu.InterpretParams() if geo.tpu_interpreter else True


def _params(interpret: bool, semantics):
    if interpret:
        return None
    return pltpu.CompilerParams(dimension_semantics=semantics)


_QK_GRID = ("parallel", "parallel", "parallel", "arbitrary")


def _fwd_maps(walk, G: int, geo: Geometry):
    """Block specs' index maps of the (B, H, nq, steps) grids: q-side head blocks, q-side ids,
    k-side head blocks of the walk's key block, k-side ids. Integer division is lax.div (ids
    are non-negative; jnp's floor division lowers through `sign`, which Mosaic only lowers with
    a TPU attached)."""

    key_block = getattr(walk, "fwd_block", None) or (lambda *a: walk.fwd(*a)[0])

    def kv_index(b, h, i, j, *t):
        kvh = lax.div(h, G)
        return b, kvh, key_block(t, b, kvh, i, j)

    def sk_map(b, h, i, j, *t):
        return b, 0, key_block(t, b, lax.div(h, G), i, j)

    return (lambda b, h, i, j, *t: (b, h, i)), (lambda b, h, i, j, *t: (b, i, 0)), kv_index, sk_map


# ----------------------------------------------------------------------------- forward


@dataclasses.dataclass(frozen=True)
class _Reads:
    """A walk given only the tables `which` (indices into the full tuple of `n`): the kernel
    and its index maps see the full tuple again, None where a table was not passed. A walk
    names the tables its forward / backward read as `fwd_tables` / `bwd_tables` (default:
    all), so the forward does not take, and a forward-only program does not compute or
    compile, the backward's tables (block-sparse: the pair codes)."""

    walk: object
    which: tuple
    n: int

    @staticmethod
    def of(walk, direction: str, tables):
        which = tuple(getattr(walk, f"{direction}_tables", range(len(tables))))
        return _Reads(walk, which, len(tables)), tuple(tables[i] for i in which)

    def _full(self, t):
        full = [None] * self.n
        for i, ref in zip(self.which, t):
            full[i] = ref
        return tuple(full)

    def fwd(self, t, *args):
        return self.walk.fwd(self._full(t), *args)

    @property
    def fwd_block(self):
        block = getattr(self.walk, "fwd_block", None)
        return None if block is None else (lambda t, *args: block(self._full(t), *args))

    def bwd(self, t, *args):
        return self.walk.bwd(self._full(t), *args)

    def __getattr__(self, name):  # the walk's step counts
        return getattr(self.walk, name)


def _split(refs, ntab: int, geo: Geometry):
    """(tables, id refs, the rest) of a kernel's refs."""
    nids = 4 if geo.positions else 2
    return refs[:ntab], refs[ntab:ntab + nids], refs[ntab + nids:]


def _fwd_kernel(*refs, geo: Geometry, walk, G: int, ntab: int):
    tables, ids, (q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr) = _split(
        refs, ntab, geo)
    b, h, i, j = (pl.program_id(a) for a in range(4))
    kb, kind = walk.fwd(tables, b, lax.div(h, G), i, j)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, NEG, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    bc = math.gcd(geo.bk, FWD_COMPUTE)  # keys per part (FWD_COMPUTE); blocks are 128s

    def update_part(c, carry):
        """Keys [c * bc, (c + 1) * bc) of the block."""
        keys = pl.ds(pl.multiple_of(c * bc, bc), bc)
        v = v_ref[keys, :]
        mask = _mask(ids, i * geo.bq, kb * geo.bk + c * bc, True, geo, keys)
        s = jnp.where(mask, _mm(q_ref[...], k_ref[keys, :], NT) * geo.scale, NEG)  # [bq, bc]
        m_prev = m_scr[...]  # [bq, 128]
        m_next = jnp.maximum(m_prev, s.max(-1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - _widen(m_next, bc)), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        l_scr[...] = alpha * l_scr[...] + p.sum(-1, keepdims=True)
        m_scr[...] = m_next
        acc_scr[...] = acc_scr[...] * _widen(alpha, geo.Dm) + _mm(p.astype(v.dtype), v, NN)
        return carry

    def update():
        lax.fori_loop(0, geo.bk // bc, update_part, 0)

    _unless_skip(kind, update)

    @pl.when(j == walk.fwd_steps - 1)
    def _finish():
        l = l_scr[...]
        l = jnp.where(l == 0.0, 1.0, l)  # a row that saw nothing: output 0, lse NEG
        o_ref[...] = (acc_scr[...] / _widen(l, geo.Dm)).astype(o_ref.dtype)
        lse_ref[...] = (m_scr[...] + jnp.log(l)).T[:1]  # lane-replicated column -> row


def _id_inputs(ids, rows_first: bool):
    """The id arrays as the kernels take them: ids = (seg_q, seg_k[, pos_q, pos_k]), each
    [B, L] int32 padded to whole blocks; the rows' side (q, or k when not rows_first) goes
    lane-replicated, the other sublane-replicated, segment ids first."""
    out = []
    for q_side, k_side in zip(ids[0::2], ids[1::2]):
        rows, cols = (q_side, k_side) if rows_first else (k_side, q_side)
        out += [lanes(rows), sublanes(cols)]
    return out


def _id_specs(ids, rows_spec, cols_spec):
    return [rows_spec, cols_spec] * (len(ids) // 2)


def forward(tables, ids, qt, kt, vt, geo: Geometry, walk, out_dtype=None):
    """qt (H heads of Tq tokens), kt/vt (K heads of Tk tokens) in the kernels' layout (see
    `layout`), ids (see `_id_inputs`) -> (o like qt in out_dtype (default q's), lse [B, H, Tq]
    float32)."""
    B, H = qt.shape[0], heads(qt, geo)
    G = H // heads(kt, geo)
    bq, bk, Dm = geo.bq, geo.bk, geo.Dm
    walk, tables = _Reads.of(walk, "fwd", tables)

    q_index, sq_map, kv_index, sk_map = _fwd_maps(walk, G, geo)
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, geo=geo, walk=walk, G=G, ntab=len(tables)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(tables),
            grid=(B, H, geo.nq, walk.fwd_steps),
            in_specs=_id_specs(ids, pl.BlockSpec((None, bq, LANES), sq_map),
                               pl.BlockSpec((None, SUBLANES, bk), sk_map)) + [
                head_spec(bq, geo, q_index),
                head_spec(bk, geo, kv_index),
                head_spec(bk, geo, kv_index),
            ],
            out_specs=[
                head_spec(bq, geo, q_index),
                _row_spec(bq, q_index),
            ],
            scratch_shapes=[
                pltpu.VMEM((bq, LANES), jnp.float32),
                pltpu.VMEM((bq, LANES), jnp.float32),
                pltpu.VMEM((bq, Dm), jnp.float32),
            ],
        ),
        out_shape=[
            head_struct(B, H, geo.Tq, geo, out_dtype or qt.dtype, qt),
            out_struct((B, H, 1, geo.Tq), jnp.float32, qt),
        ],
        compiler_params=_params(geo.interpret, _QK_GRID),
        interpret=_interpret(geo),
        name="mosaic_attention_fwd",
    )(*tables, *_id_inputs(ids, True), qt, kt, vt)
    return o, lse[:, :, 0]


# ----------------------------------------------------------------------------- backward


def _dq_kernel(*refs, geo: Geometry, walk, G: int, ntab: int, has_o: bool, has_delta: bool):
    """dQ of one query block. Its delta = rowsum(dO * O) (+ the given delta rows) is made
    lane-replicated [bq, 128] in scratch at the block's first step, and, when summed here from
    O, written out for the dK/dV kernel (given rows alone, it reads them itself)."""
    tables, ids, (q_ref, k_ref, v_ref, do_ref, *rest) = _split(refs, ntab, geo)
    o_ref = rest.pop(0) if has_o else None
    lse_ref = rest.pop(0)
    delta_in = rest.pop(0) if has_delta else None
    dq_ref = rest.pop(0)
    delta_out = rest.pop(0) if has_o else None
    dq_scr, delta_ref = rest
    b, h, i, j = (pl.program_id(a) for a in range(4))
    kb, kind = walk.fwd(tables, b, lax.div(h, G), i, j)

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
        delta = jnp.zeros((geo.bq, 1), jnp.float32)
        if has_o:
            prod = do_ref[...].astype(jnp.float32) * o_ref[...].astype(jnp.float32)
            delta = delta + prod.sum(-1, keepdims=True)
        if has_delta:
            delta = delta + jnp.expand_dims(delta_in[0], -1)  # row [1, bq] -> column
        delta_ref[...] = jnp.broadcast_to(delta, delta_ref.shape)
        if has_o:
            delta_out[...] = delta_ref[...]

    def update():
        k = k_ref[...]
        s = _mm(q_ref[...], k, NT) * geo.scale
        p = jnp.exp(s - jnp.expand_dims(lse_ref[0], -1))  # lse row [1, bq] -> column
        # `where`, never a product: exp of a masked score may overflow
        p = jnp.where(_mask(ids, i * geo.bq, kb * geo.bk, True, geo), p, 0.0)
        dp = _mm(do_ref[...], v_ref[...], NT)
        ds = p * (dp - _widen(delta_ref[...], geo.bk))
        dq_scr[...] += _mm(ds.astype(k.dtype), k, NN)

    _unless_skip(kind, update)

    @pl.when(j == walk.fwd_steps - 1)
    def _finish():
        dq_ref[...] = (dq_scr[...] * geo.scale).astype(dq_ref.dtype)


def _dkv_step(walk, t, b, kvh, outer, step, G: int):
    """Step `step` of the dK/dV grid's last axis (walk.bwd_steps * G long) -> (key block, query
    block, kind, first, last, query head): the walk's step // G for query head step % G of kv
    head kvh. The G heads of a pair are consecutive steps, so a key block's run stays
    consecutive; a SKIP step takes head G - 1's block, the one of the step before it at the end
    of a run, so it issues no copy."""
    s, g = lax.div(step, G), lax.rem(step, G)
    kb, qb, kind, first, last = walk.bwd(t, b, kvh, outer, s)
    head = kvh * G + jnp.where(kind == SKIP, G - 1, g)
    return kb, qb, kind, first & (g == 0), last & (g == G - 1), head


def _dkv_kernel(*refs, geo: Geometry, walk, G: int, ntab: int):
    """One step: key block kb against query block qb for one of the G query heads of kv head
    kvh. The steps of one key block are consecutive (a run): dK/dV accumulate in scratch from
    the run's first step and are written at its last."""
    tables, ids, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_scr,
                  dv_scr) = _split(refs, ntab, geo)
    b, kvh, outer, step = (pl.program_id(a) for a in range(4))
    kb, qb, kind, first, last, _ = _dkv_step(walk, tables, b, kvh, outer, step, G)

    @pl.when(first)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def update():
        k, v, q, do = k_ref[...], v_ref[...], q_ref[...], do_ref[...]
        mask = _mask(ids, kb * geo.bk, qb * geo.bq, False, geo)
        st = _mm(k, q, NT) * geo.scale  # [bk, bq]: scores transposed
        pt = jnp.where(mask, jnp.exp(st - lse_ref[:1, :]), 0.0)
        dv_scr[...] += _mm(pt.astype(do.dtype), do, NN)
        dst = pt * (_mm(v, do, NT) - delta_ref[:1, :])
        dk_scr[...] += _mm(dst.astype(q.dtype), q, NN)

    _unless_skip(kind, update)

    @pl.when(last)
    def _finish():
        dk_ref[...] = (dk_scr[...] * geo.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def backward(tables, ids, qt, kt, vt, do_t, lse, geo: Geometry, walk, grad_dtype=None, *,
             o_t=None, delta=None):
    """Cotangent do_t (layout of q) and lse float32 [B, H, Tq] -> dq, dk, dv in the kernels'
    layout, in grad_dtype (default: q's, k's, v's). delta = rowsum(dO * O) is computed by the dQ
    kernel from o_t, the output in q's layout, plus `delta` float32 [B, H, Tq] when given; or
    is `delta` alone (the ring's, of its merged output). In XLA, that row sum over heads side by
    side ([B, T, H * D]) took a third of a TPU fwd + bwd program's compile (the chunk op,
    T = 4096, D = 128, bf16, v5p: 1.85 s, 1.1 s without it)."""
    if o_t is None and delta is None:
        raise ValueError("backward needs the output o_t, a delta, or both")
    B, H, K = qt.shape[0], heads(qt, geo), heads(kt, geo)
    G = H // K
    bq, bk, Dm = geo.bq, geo.bk, geo.Dm
    walk_fwd, fwd_tables = _Reads.of(walk, "fwd", tables)
    walk, tables = _Reads.of(walk, "bwd", tables)

    q_index, sq_map, kv_index, sk_map = _fwd_maps(walk_fwd, G, geo)
    row_spec = _row_spec(bq, q_index)  # [B, H, 1, Tq]: a row per block
    o_in = [] if o_t is None else [o_t]
    delta_in = [] if delta is None else [delta[:, :, None]]
    dq, *delta_lanes = pl.pallas_call(
        functools.partial(_dq_kernel, geo=geo, walk=walk_fwd, G=G, ntab=len(fwd_tables),
                          has_o=o_t is not None, has_delta=delta is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(fwd_tables),
            grid=(B, H, geo.nq, walk.fwd_steps),
            in_specs=_id_specs(ids, pl.BlockSpec((None, bq, LANES), sq_map),
                               pl.BlockSpec((None, SUBLANES, bk), sk_map)) + [
                head_spec(bq, geo, q_index),  # q
                head_spec(bk, geo, kv_index),  # k
                head_spec(bk, geo, kv_index),  # v
                head_spec(bq, geo, q_index),  # do
                *[head_spec(bq, geo, q_index)] * len(o_in),  # o
                row_spec,  # lse
                *[row_spec] * len(delta_in),  # delta
            ],
            out_specs=[head_spec(bq, geo, q_index), *[pl.BlockSpec(
                (None, None, bq, LANES), lambda *a: _brn(*q_index(*a)))] * len(o_in)],
            scratch_shapes=[pltpu.VMEM((bq, Dm), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32)],
        ),
        out_shape=[head_struct(B, H, geo.Tq, geo, grad_dtype or qt.dtype, qt),
                   *[out_struct((B, H, geo.Tq, LANES), jnp.float32, qt)] * len(o_in)],
        compiler_params=_params(geo.interpret, _QK_GRID),
        interpret=_interpret(geo),
        name="mosaic_attention_dq",
    )(*fwd_tables, *_id_inputs(ids, True), qt, kt, vt, do_t, *o_in, lse[:, :, None], *delta_in)

    # dK/dV: grid (B, K, walk.bwd_outer, walk.bwd_steps * G), see `_dkv_step`.
    def step_of(b, kvh, outer, step, *t):
        return _dkv_step(walk, t, b, kvh, outer, step, G)

    def q_index_bwd(*a):
        r = step_of(*a)
        return a[0], r[5], r[1]

    def k_index_bwd(*a):
        return a[0], a[1], step_of(*a)[0]

    def rows_index(*a):
        b, head, qb = q_index_bwd(*a)
        return b, head, 0, qb

    rows_spec = pl.BlockSpec((None, None, SUBLANES, bq), rows_index)
    rows8 = lambda x: jnp.broadcast_to(x[:, :, None, :], (B, H, SUBLANES, geo.Tq))  # noqa: E731
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, geo=geo, walk=walk, G=G, ntab=len(tables)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(tables),
            grid=(B, K, walk.bwd_outer, walk.bwd_steps * G),
            in_specs=_id_specs(
                ids, pl.BlockSpec((None, bk, LANES), lambda *a: (a[0], step_of(*a)[0], 0)),
                pl.BlockSpec((None, SUBLANES, bq), lambda *a: (a[0], 0, step_of(*a)[1]))) + [
                head_spec(bq, geo, q_index_bwd),  # q
                head_spec(bk, geo, k_index_bwd),  # k
                head_spec(bk, geo, k_index_bwd),  # v
                head_spec(bq, geo, q_index_bwd),  # do
                rows_spec,  # lse rows
                rows_spec,  # delta rows
            ],
            out_specs=[head_spec(bk, geo, k_index_bwd), head_spec(bk, geo, k_index_bwd)],
            scratch_shapes=[pltpu.VMEM((bk, Dm), jnp.float32), pltpu.VMEM((bk, Dm), jnp.float32)],
        ),
        out_shape=[
            head_struct(B, K, geo.Tk, geo, grad_dtype or kt.dtype, kt),
            head_struct(B, K, geo.Tk, geo, grad_dtype or vt.dtype, kt),
        ],
        compiler_params=_params(geo.interpret, _QK_GRID),
        interpret=_interpret(geo),
        name="mosaic_attention_dkv",
    )(*tables, *_id_inputs(ids, False), qt, kt, vt, do_t, rows8(lse),
      rows8(delta_lanes[0][..., 0] if delta_lanes else delta))
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom_vjp


def _layouts(q, k, v, geo: Geometry):
    return tuple(layout(x, n, geo) for x, n in ((q, geo.Tq), (k, geo.Tk), (v, geo.Tk)))


def edge_ids(seg_BxT, geo: Geometry):
    """(seg_q, seg_k) of one row's own tokens padded to whole blocks by repeating the last id:
    padded queries see real keys (their outputs are sliced off, their cotangent is zero) and
    padded keys are masked by index."""
    return (pad_axis(seg_BxT, 1, geo.Tq, mode="edge"), pad_axis(seg_BxT, 1, geo.Tk, mode="edge"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def attention(q, k, v, seg_BxT, tables, geo: Geometry, walk):
    """Attention over the pairs `walk` visits: q [B, T, H, D], k/v [B, T, K, D] in, q's layout
    and dtype out; seg_BxT int32 (not differentiated), tables a tuple of flat int32 arrays."""
    o, _ = forward(tables, edge_ids(seg_BxT, geo), *_layouts(q, k, v, geo), geo, walk)
    return unlayout(o, geo, q.dtype)


def _attention_fwd(q, k, v, seg_BxT, tables, geo, walk):
    o, lse = forward(tables, edge_ids(seg_BxT, geo), *_layouts(q, k, v, geo), geo, walk)
    return unlayout(o, geo, q.dtype), (q, k, v, seg_BxT, tables, o, lse)


def _attention_bwd(geo, walk, res, do):
    q, k, v, seg_BxT, tables, o, lse = res
    dq, dk, dv = backward(tables, edge_ids(seg_BxT, geo), *_layouts(q, k, v, geo),
                          layout(do, geo.Tq, geo), lse, geo, walk, o_t=o)
    grads = (unlayout(g, geo, x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))
    return (*grads, None, None)


attention.defvjp(_attention_fwd, _attention_bwd)
