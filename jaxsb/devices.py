"""Device setup: simulated CPU devices (before JAX is imported) and joining a multi-process run.

On a machine with no accelerator, jaxsb simulates `count` CPU devices through
`XLA_FLAGS=--xla_force_host_platform_device_count=N` so that the sharded code paths run the
same way they would on a pod. A user's own XLA_FLAGS setting of the count is respected.

Many machines (TPU pod slices, multi-node GPU, or several CPU processes on one host) run one
process per host; `init_distributed` joins them through `jax.distributed.initialize` before
any device is used, after which `jax.devices()` lists the devices of every process and each
jitted step is one SPMD program over all of them. Every process runs the same host code on
the same data; what must be decided once (the workdir, the tokenizer, a time-limited plan) is
decided by process 0 and shared through the coordinator's key-value store (this file's
`_publish` / `_fetch` carry the bytes; jaxsb/wire.py's `share_from_main` decides what they
hold: JSON with a declared schema, checked on receipt, never code), so no process waits on a
device collective for host data.
"""

from __future__ import annotations

import os
import sys

DEFAULT_HOST_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
# How long a process waits for process 0's share of host data (planning included).
SHARE_TIMEOUT_S = 600
_CHUNK = 1 << 20  # key-value store values are split into chunks of this many bytes


def _has_accelerator() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() in ("cpu",):
        return False
    if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio"):
        return True
    return False


def setup_host_devices(count: int = DEFAULT_HOST_DEVICES) -> None:
    """Simulates `count` CPU devices unless an accelerator exists or the user chose a count."""
    if "jax" in sys.modules:
        return  # too late to change; whatever the process already has is kept
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG in flags or _has_accelerator():
        return
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()


def init_distributed(coordinator: str, num_processes: int = 1, process_id: int = 0,
                     peer_timeout_s: float = 60.0) -> None:
    """Joins a multi-process run (parallel.coordinator); a no-op for a single process.

    `coordinator`: "" (one process), "auto" (TPU pod slices, SLURM, Open MPI: the cluster's
    environment names the coordinator and this process) or "host:port" of process 0, with
    `num_processes` and this process's `process_id`. Must run before any device is used.
    JAX's own heartbeat (which aborts a process whose peer is gone) waits well past
    `peer_timeout_s`, so that jaxsb's watchdog (training/faults.py) speaks first."""
    if not coordinator:
        return
    import jax

    # CPU processes exchange collectives through gloo (the setting is ignored on GPU / TPU).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = {"heartbeat_timeout_seconds": int(max(100, 3 * peer_timeout_s))}
    if coordinator == "auto":
        jax.distributed.initialize(**heartbeat)
    else:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id, **heartbeat)


def process_index() -> int:
    import jax

    return jax.process_index()


def is_main_process() -> bool:
    """Process 0 writes the run's files and prints; the others stay quiet."""
    return process_index() == 0


def _client():
    import jax

    if jax.process_count() == 1:
        return None
    from jax._src import distributed  # the coordinator's key-value store (orbax uses it too)

    return distributed.global_state.client


def _publish(client, key: str, payload: bytes) -> None:
    chunks = [payload[i:i + _CHUNK] for i in range(0, len(payload), _CHUNK)] or [b""]
    for i, chunk in enumerate(chunks):
        client.key_value_set_bytes(f"{key}/{i}", chunk)
    client.key_value_set(f"{key}/n", str(len(chunks)))  # last: readers wait on it


def _fetch(client, key: str, timeout_s: float) -> bytes:
    ms = int(timeout_s * 1000)
    try:
        n = int(client.blocking_key_value_get(f"{key}/n", ms))
    except Exception as e:  # noqa: BLE001 - the runtime raises its own error types
        raise TimeoutError(f"process {process_index()} waited {timeout_s:g} s for process 0 to share "
                           f"{key!r}: {e}") from e
    return b"".join(client.blocking_key_value_get_bytes(f"{key}/{i}", ms) for i in range(n))


def global_array(host, sharding):
    """A host array that every process holds whole (computed the same way everywhere) placed
    on `sharding`'s devices: each process fills only its own devices' shards, so nothing
    crosses between processes. One process: a plain `jax.device_put`."""
    import jax

    if jax.process_count() == 1:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
