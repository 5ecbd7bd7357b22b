"""Device setup that must happen before JAX is imported.

On a machine with no accelerator, jaxsb simulates `count` CPU devices through
`XLA_FLAGS=--xla_force_host_platform_device_count=N` so that the sharded code paths run the
same way they would on a pod. A user's own XLA_FLAGS setting of the count is respected.
"""

from __future__ import annotations

import os
import sys

DEFAULT_HOST_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"


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
