"""The device mesh and the sharding rules: one mesh axis over all devices.

Parameters and optimiser state are sharded FSDP-style: each array is split along its largest
dimension that the device count divides (replicated when none does, e.g. norm scales of odd
width). Batches are split by rows. Model code never names devices; only this module does.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "devices"


def make_mesh(num_devices: int = 0) -> Mesh:
    """A 1-D mesh over the first `num_devices` devices (0 = all)."""
    devices = jax.devices()
    if num_devices:
        if num_devices > len(devices):
            raise ValueError(f"parallel.devices={num_devices} but only {len(devices)} devices are visible "
                             f"({devices[0].platform})")
        devices = devices[:num_devices]
    return Mesh(np.array(devices), (AXIS,))


def fsdp_spec(shape: tuple[int, ...], num_devices: int) -> P:
    """Shard the largest dimension divisible by the device count; replicate otherwise."""
    best = None
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % num_devices == 0 and shape[dim] >= num_devices:
            best = dim
            break
    if best is None or num_devices == 1:
        return P()
    spec = [None] * len(shape)
    spec[best] = AXIS
    return P(*spec)


def state_shardings(mesh: Mesh, abstract_tree, fsdp: bool = True):
    """NamedShardings for a pytree of arrays / ShapeDtypeStructs (params, optimiser state)."""
    n = mesh.devices.size

    def one(leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        return NamedSharding(mesh, fsdp_spec(shape, n) if fsdp else P())

    return jax.tree.map(one, abstract_tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a [rows, tokens] batch split over the devices."""
    return NamedSharding(mesh, P(AXIS, None))


