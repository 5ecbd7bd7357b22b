"""The ring schedule shared by dense (ring.py) and block-sparse (ring_sparse.py) ring attention.

`RingConfig` is the static description of one call (mesh axis, groups, block, chunk
implementation); `ring_config` checks a call's arguments and builds it. `ring_loop` runs
rounds r = 0 .. max_degree-1 over groups of different degrees side by side: in round r a
device holds what rank (rank - r) mod degree sent, read-only data (`ride`, moved before the
compute so the transfer can overlap) and accumulators (`acc`, moved after it), with one
`lax.ppermute` per move = the union of one cycle per ring that has that round. Rounds with the
same permutations run as one `lax.scan`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas.common import check_qkv
from kernels_pallas.ring_chunk.ops import check_interpreter_outside_vma, resolve_chunk_implementation
from kernels_pallas.ring_chunk.tables import make_chunk_blocks

@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static description of one call: the mesh axis, its groups, the block size and the
    chunk implementation ("xla" | "pallas" | "mosaic", already resolved; `interpret` for
    Pallas)."""

    axis_name: str
    groups: tuple[tuple[int, int], ...]
    block: int
    implementation: str = "xla"
    interpret: bool = False

    @property
    def max_degree(self) -> int:
        return max(d for _, d in self.groups)

    def degrees(self) -> np.ndarray:
        """[N] int32: the degree of each device's group."""
        return np.concatenate([np.full(d, d, np.int32) for _, d in self.groups])

    def phases(self) -> list[tuple[int, int]]:
        """Runs [lo, hi) of the middle rounds 1 .. max_degree-2 that use the same two
        permutations (rings of degree >= r + 2 prefetch, rings of degree >= r + 1 computed)."""
        runs: list[list[int]] = []
        for r in range(1, self.max_degree - 1):
            key = (self.shift_perm(r + 2), self.shift_perm(r + 1))
            if runs and (self.shift_perm(runs[-1][0] + 2), self.shift_perm(runs[-1][0] + 1)) == key:
                runs[-1][1] = r + 1
            else:
                runs.append([r, r + 1])
        return [(lo, hi) for lo, hi in runs]

    def shift_perm(self, min_degree: int) -> list[tuple[int, int]]:
        """One step along every ring of degree >= min_degree (rank j -> j+1 mod degree)."""
        return [
            (s + j, s + (j + 1) % d) for s, d in self.groups if d >= min_degree for j in range(d)
        ]


def check_groups(groups, num_devices: int | None = None) -> tuple[tuple[int, int], ...]:
    """Normalised groups; they must tile 0..num_devices-1 contiguously in order."""
    try:
        groups = tuple((int(s), int(d)) for s, d in groups)
    except (TypeError, ValueError) as e:
        raise ValueError(f"groups={groups!r} must be a tuple of (start, degree) pairs") from e
    if not groups:
        raise ValueError("groups must not be empty")
    expect = 0
    for s, d in groups:
        if d < 1:
            raise ValueError(f"group (start={s}, degree={d}) must have degree >= 1; {groups=}")
        if s != expect:
            raise ValueError(f"group (start={s}, degree={d}) must start at {expect}: groups "
                             f"tile the axis contiguously in order; {groups=}")
        expect = s + d
    if num_devices is not None and expect != num_devices:
        raise ValueError(f"groups cover {expect} devices but the axis has {num_devices}; {groups=}")
    return groups


def axis_size(axis_name) -> int:
    if hasattr(lax, "axis_size"):
        return lax.axis_size(axis_name)
    return lax.psum(1, axis_name)


def _my_degree(cfg: RingConfig):
    """This device's group degree (traced scalar), from the axis index and a static table."""
    return jnp.asarray(cfg.degrees())[lax.axis_index(cfg.axis_name)]


def vma_full(ref, shape, value=0.0):
    """float32 constant of `shape` that varies over the same manual mesh axes as `ref`.

    Constants made inside shard_map (initial carries, zero blocks) would otherwise be
    replicated while everything computed from the inputs varies, and loop carries and switch
    branches must agree; `lax.full_like` carries ref's varying axes over (check_vma=True)."""
    return lax.full_like(ref, value, jnp.float32, shape)


# ----------------------------------------------------------------------------- loop


def _shift(x, cfg: RingConfig, min_degree: int):
    return lax.ppermute(x, cfg.axis_name, cfg.shift_perm(min_degree))


def ring_round(cfg: RingConfig, step, r, local: bool, last: bool, ride, acc, carry):
    """One round: prefetch the next round's `ride` (async with the compute that follows, which
    reads the current one), run step, then pass `acc` on along the rings that computed."""
    degree = _my_degree(cfg)
    nxt = ride if last else _shift(ride, cfg, r + 2)  # rings with a round r + 1
    acc, carry = step(degree > r, local, ride, acc, carry)
    sent = max(2, r + 1)  # rings that computed in round r (degree 1 has nowhere to go)
    if acc is not None and cfg.shift_perm(sent):
        moved = _shift(acc, cfg, sent)
        acc = jax.tree.map(lambda new, old: jnp.where(degree >= sent, new, old), moved, acc)
    return nxt, acc, carry


def ring_loop(cfg: RingConfig, step, ride, acc, carry):
    """Rounds r = 0 .. max_degree-1; in round r a device holds `ride` (and `acc`) of ring rank
    (rank - r) mod degree. step(active, local, ride, acc, carry) -> (acc, carry); `active`
    (traced bool) is False on devices whose ring has no round r (the step must not add
    anything; their `acc` stays put); `local` (static) is True in round 0 only.

    `ride` (read-only: k, v, ids) moves before the compute that does not need it, so the
    transfer can overlap; `acc` (updated by step: dK, dV) moves after it. A ring of degree d
    shifts `acc` d times in total, which brings it back to its owner. The middle rounds run as
    lax.scans over runs of rounds with the same permutations, so the step is traced a handful
    of times (3 for equal degrees), not max_degree times. Returns (acc, carry).
    """
    R = cfg.max_degree
    ride, acc, carry = ring_round(cfg, step, 0, True, R == 1, ride, acc, carry)
    for lo, hi in cfg.phases():

        def body(c, r, lo=lo):
            # The permutations are those of round lo throughout the run; r only gates compute.
            degree = _my_degree(cfg)
            ride, acc, carry = c
            nxt = _shift(ride, cfg, lo + 2)
            acc, carry = step(degree > r, False, ride, acc, carry)
            if acc is not None:
                moved = _shift(acc, cfg, lo + 1)
                acc = jax.tree.map(lambda new, old: jnp.where(degree > r, new, old), moved, acc)
            return (nxt, acc, carry), None

        (ride, acc, carry), _ = lax.scan(
            body, (ride, acc, carry), jnp.arange(lo, hi, dtype=jnp.int32))
    if R > 1:
        _, acc, carry = ring_round(cfg, step, R - 1, False, True, ride, acc, carry)
    return acc, carry


# ----------------------------------------------------------------------------- arguments


def ring_config(q, k, v, seg, pos, axis_name, groups, block, implementation: str = "xla",
           interpret: bool | None = None) -> RingConfig:
    """Argument checks of a ring call and its static RingConfig (dense and sparse rings: the
    sparse ring's own XLA rounds under the "xla" default, or the Pallas chunk and its block
    rules)."""
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype: {q.dtype=} {k.dtype=} {v.dtype=}")
    B, T, _, _, _ = check_qkv(q, k, v, None)
    for name, x in (("seg_BxT", seg), ("pos_BxT", pos)):
        if tuple(x.shape) != (B, T):
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be (B, T)={(B, T)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype=}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive int")
    implementation, interpret = resolve_chunk_implementation(implementation, interpret)
    check_interpreter_outside_vma(implementation, interpret, q)
    groups = check_groups(groups, axis_size(axis_name))
    if implementation == "xla":  # the Pallas chunk clamps to a power of two itself
        block = min(block, T)
    make_chunk_blocks(T, T, q.shape[3], block, block, True, pallas=implementation != "xla",
                      interpret=interpret, mosaic=implementation == "mosaic")  # errors now
    return RingConfig(axis_name=axis_name, groups=groups, block=block,
                      implementation=implementation, interpret=interpret)
