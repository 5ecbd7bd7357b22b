"""Compile targets: TPU slices and GPU nodes this host does not have, as compile-only devices.

A target is written `tpu-v5p:2x2x2`, `tpu-v5e:4x4`, `tpu-v6e:4x4` (a TPU slice by its chip
topology; libtpu compiles for it) or `gpu-h100:8` (one node of 8 GPUs), `gpu-h100:8x4` (4 nodes
of 8; XLA's GPU compiler compiles deviceless from a target description built from the chip's
facts in jaxsb.planner.hardware). `target_devices` returns jax devices that programs can be
lowered and compiled for, never run on. It needs the compilers: `bash scripts/setup.sh --targets`
makes `.venv-targets` with libtpu and the CUDA plugin (see docs/compile.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from jaxsb.planner.hardware import CHIPS, Chip

EXAMPLES = ("tpu-v5p:2x2x2", "tpu-v5p:4x4x4", "tpu-v5e:4x4", "tpu-v6e:4x4", "gpu-h100:8", "gpu-h200:8",
            "gpu-a100:8", "gpu-h100:8x4")
SETUP_HINT = ("install the compilers with `bash scripts/setup.sh --targets` and run with .venv-targets/bin/python, "
              "JAX_PLATFORMS=cpu set before jax is imported (python -m jaxsb.compile sets it)")


class TargetError(ValueError):
    """A target that cannot be parsed or whose compiler is not installed."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as written, e.g. "tpu-v5p:2x2x2"
    chip: Chip
    shape: tuple[int, ...]  # TPU: chips per torus dimension; GPU: (devices per node, nodes)

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def num_devices(self) -> int:
        """Devices jax sees: TPU chips (one device per chip on v5p/v5e/v6e) or GPUs."""
        return math.prod(self.shape)

    @property
    def devices_per_node(self) -> int:
        return self.shape[0] if self.platform == "gpu" else self.num_devices

    @property
    def hbm_bytes(self) -> float:
        return self.chip.hbm_gb * 1e9


def parse_target(text: str) -> Target:
    """`tpu-v5p:2x2x2` | `gpu-h100:8` | `gpu-h100:8x4` (devices per node x nodes)."""
    m = re.fullmatch(r"([a-z0-9]+-[a-z0-9]+):(\d+(?:x\d+)*)", text.strip().lower())
    if not m or m.group(1) not in CHIPS:
        raise TargetError(f"--target {text!r}: expected CHIP:SHAPE with CHIP one of {', '.join(CHIPS)}, "
                          f"e.g. {', '.join(EXAMPLES)}")
    chip = CHIPS[m.group(1)]
    shape = tuple(int(x) for x in m.group(2).split("x"))
    if any(n < 1 for n in shape):
        raise TargetError(f"--target {text!r}: every dimension must be >= 1")
    if chip.platform == "tpu":
        want = 3 if chip.name == "tpu-v5p" else 2  # v5p: 3D torus; v5e, v6e: 2D
        if len(shape) != want:
            raise TargetError(f"--target {text!r}: a {chip.name} slice has {want} dimensions, "
                              f"e.g. {chip.name}:{'x'.join(['2'] * want)}")
    elif len(shape) not in (1, 2):
        raise TargetError(f"--target {text!r}: a GPU target is DEVICESxNODES, e.g. {chip.name}:8 or {chip.name}:8x2")
    shape = shape if chip.platform == "tpu" or len(shape) == 2 else shape + (1,)
    return Target(text.strip().lower(), chip, shape)


def gpu_target_config(c: Chip) -> str:
    """XLA's GpuTargetConfig (text proto) for deviceless compilation, from the chip's facts."""
    g = c.gpu
    if g is None:
        raise TargetError(f"{c.name} is not a GPU")
    major, minor = g["cc"]
    return "\n".join([
        "gpu_device_info {",
        "  threads_per_block_limit: 1024", "  threads_per_warp: 32",
        "  shared_memory_per_block: 49152", f"  shared_memory_per_core: {g['smem_per_sm']}",
        "  threads_per_core_limit: 2048", f"  core_count: {g['sms']}", f"  fpus_per_core: {g['fp32_per_sm']}",
        "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535", "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {int(c.hbm_gbs * 1e9)}", f"  l2_cache_size: {g['l2']}",
        f"  clock_rate_ghz: {g['clock_ghz']}", f"  device_memory_size: {g['memory_bytes']}",
        f"  shared_memory_per_block_optin: {g['smem_optin']}",
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info { major: 9 minor: 8 }",
        "runtime_version { major: 12 minor: 8 }",
        f'device_description_str: "{g["description"]}"',
    ]) + "\n"


def target_devices(target: Target) -> list:
    """Compile-only jax devices of the target (lower and compile for them; nothing runs)."""
    from jax.experimental import topologies

    # libtpu keeps one process per host on a real TPU (a lock file); compile-only devices touch
    # no TPU, so several compiling processes (pytest workers, parallel jobs) may load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        if target.platform == "tpu":
            version = target.chip.name.split("-")[1]
            name = f"{version}:{'x'.join(map(str, target.shape))}"
            topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
        else:
            per_node, nodes = target.shape
            topo = topologies.get_topology_desc(platform="cuda", topology_name="cuda",
                                                topology=f"1x{nodes}x{per_node}",
                                                target_config=gpu_target_config(target.chip))
    except Exception as e:  # the plugin is missing or refuses the topology
        raise TargetError(f"cannot make compile-only devices for {target.name}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''} ({SETUP_HINT})") from e
    devices = list(topo.devices)
    if len(devices) != target.num_devices:
        raise TargetError(f"{target.name}: the compiler made {len(devices)} devices, expected {target.num_devices}")
    return devices
