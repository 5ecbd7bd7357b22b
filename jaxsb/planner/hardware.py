"""Accelerators from their data sheets, and the cost model a planner uses on one of them until
`python -m jaxsb.calibrate` has measured the machine.

`CHIPS` holds published figures only (each `Chip` names its source): peak dense bf16 FLOP/s,
HBM size and bandwidth, and the links — ICI inside a TPU slice, NVLink inside a GPU node and
InfiniBand between nodes. `hardware_cost(chip, model_cfg, num_devices)` turns them into the
FlexSP-family formula of `jaxsb.planner.cost.FormulaCost` for one model:

    a1 (ms per token^2)  attention FLOPs of forward + backward, 7 * layers * heads * head_dim per
                         token^2 (causal: s^2/2 pairs of 4*H*D FLOPs forward, 2.5x that backward:
                         FlashAttention-2's 5 matmuls against 2), at ATTENTION_EFFICIENCY of peak;
    a2 (ms per token)    6 FLOPs per matmul parameter per token (8 with remat: the forward again),
                         LM head included, at MATMUL_EFFICIENCY of peak;
    b1 (ms per group)    a fixed cost per group and micro-batch (kernel launches, collectives'
                         latency): B1_MS_PER_LAYER per layer;
    comm                 Ulysses: all-to-all of q, k, v (forward) and of their gradients (backward)
                         plus o both ways; ring: k and v forward, k, v, dk, dv backward, per hop;
                         over NVLink / ICI inside a node, InfiniBand across nodes;
    memory               model states (param, grad and Adam's two moments, in the param dtype) split
                         over the devices with FSDP, plus, with FSDP, the whole parameters and
                         their gradient while a micro-batch runs (the executor gathers the
                         parameters at the start of each micro-batch), plus activations per
                         token held.

The efficiencies and the fixed cost are stated assumptions, not measurements: they make the
planner's choices realistic in kind (attention's quadratic share, communication's price), and
`calibrate` replaces them with measured constants. float32 compute runs at `f32_tflops`.
"""

from __future__ import annotations

import dataclasses

from jaxsb.config import ModelConfig
from jaxsb.planner.cost import FormulaCost

# Assumptions (not data-sheet figures), stated once; `python -m jaxsb.calibrate` measures instead.
MATMUL_EFFICIENCY = 0.5  # fraction of peak reached by the linear layers
ATTENTION_EFFICIENCY = 0.35  # ... by the attention kernels (softmax, masking, smaller tiles)
B1_MS_PER_LAYER = 0.05  # fixed ms per layer, per group and micro-batch
XLA_GPU_MEMORY_FRACTION = 0.75  # JAX preallocates 75% of a GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION)
TPU_MEMORY_FRACTION = 0.95  # HBM left to a program on TPU after the runtime's reservations


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's published figures. Link bandwidths are per device and per direction."""

    name: str
    platform: str  # "tpu" | "gpu"
    bf16_tflops: float  # dense peak
    f32_tflops: float  # float32 matmul peak at full precision
    hbm_gb: float
    hbm_gbs: float
    intra_gbs: float  # ICI (TPU slice) / NVLink (GPU node), per device per direction
    inter_gbs: float  # between nodes: InfiniBand per GPU (TPU: the slice is one ICI domain)
    devices_per_node: int  # GPUs per node; TPU: 0 = the whole slice is one ICI domain
    source: str
    device_kinds: tuple[str, ...] = ()  # jax's device_kind strings of this chip
    # deviceless GPU compilation: the target description's facts (compute capability, SMs, ...)
    gpu: dict | None = None

    @property
    def memory_fraction(self) -> float:
        return XLA_GPU_MEMORY_FRACTION if self.platform == "gpu" else TPU_MEMORY_FRACTION


def _ici(gbps_per_chip: float) -> float:
    """A TPU's ICI figure (Gbit/s per chip, all links, both directions) as GB/s per direction."""
    return gbps_per_chip / 8 / 2


_H100 = Chip(
    "gpu-h100", "gpu", bf16_tflops=989, f32_tflops=67, hbm_gb=80, hbm_gbs=3350,
    intra_gbs=450, inter_gbs=50, devices_per_node=8, device_kinds=("NVIDIA H100 80GB HBM3",),
    source="NVIDIA H100 Tensor Core GPU datasheet, SXM5 (989 TFLOP/s dense bf16, 67 TFLOP/s fp32, "
           "80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s both directions); DGX H100: one 400 Gb/s "
           "ConnectX-7 InfiniBand NIC per GPU",
    gpu=dict(sms=132, cc=(9, 0), smem_per_sm=233472, smem_optin=232448, l2=50 * 2**20, clock_ghz=1.98,
             fp32_per_sm=128, memory_bytes=85899345920, description="NVIDIA H100 80GB HBM3"))

CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("tpu-v5p", "tpu", bf16_tflops=459, f32_tflops=459 / 6, hbm_gb=95, hbm_gbs=2765,
         intra_gbs=_ici(4800), inter_gbs=_ici(4800), devices_per_node=0, device_kinds=("TPU v5", "TPU v5p"),
         source="cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GB HBM2e at 2765 GB/s, ICI 4800 Gbps "
                "per chip, 3D torus); f32 = bf16/6 (f32 at HIGHEST precision runs as 6 bf16 passes)"),
    Chip("tpu-v5e", "tpu", bf16_tflops=197, f32_tflops=197 / 6, hbm_gb=16, hbm_gbs=819,
         intra_gbs=_ici(1600), inter_gbs=_ici(1600), devices_per_node=0,
         device_kinds=("TPU v5 lite", "TPU v5e"),
         source="cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 1600 Gbps "
                "per chip, 2D torus); f32 = bf16/6"),
    Chip("tpu-v6e", "tpu", bf16_tflops=918, f32_tflops=918 / 6, hbm_gb=32, hbm_gbs=1640,
         intra_gbs=_ici(3584), inter_gbs=_ici(3584), devices_per_node=0,
         device_kinds=("TPU v6 lite", "TPU v6e"),
         source="cloud.google.com/tpu/docs/v6e (Trillium: 918 TFLOP/s bf16, 32 GB HBM at 1640 GB/s, "
                "ICI 3584 Gbps per chip, 2D torus); f32 = bf16/6"),
    _H100,
    # the same die as H100: only memory size and bandwidth differ
    dataclasses.replace(
        _H100, name="gpu-h200", hbm_gb=141, hbm_gbs=4800, device_kinds=("NVIDIA H200",),
        source="NVIDIA H200 Tensor Core GPU datasheet, SXM (989 TFLOP/s dense bf16, 67 TFLOP/s fp32, "
               "141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s both directions); HGX H200: one 400 Gb/s "
               "InfiniBand NIC per GPU",
        gpu=_H100.gpu | dict(memory_bytes=150754820096, description="NVIDIA H200")),
    Chip("gpu-a100", "gpu", bf16_tflops=312, f32_tflops=19.5, hbm_gb=80, hbm_gbs=2039,
         intra_gbs=300, inter_gbs=25, devices_per_node=8, device_kinds=("NVIDIA A100-SXM4-80GB",),
         source="NVIDIA A100 Tensor Core GPU datasheet, SXM4 80GB (312 TFLOP/s dense bf16, 19.5 TFLOP/s "
                "fp32, 80 GB HBM2e at 2039 GB/s, NVLink 600 GB/s both directions); DGX A100: one 200 Gb/s "
                "HDR InfiniBand NIC per GPU",
         gpu=dict(sms=108, cc=(8, 0), smem_per_sm=167936, smem_optin=166912, l2=40 * 2**20, clock_ghz=1.41,
                  fp32_per_sm=64, memory_bytes=85899345920, description="NVIDIA A100-SXM4-80GB")),
)}


def chip(name: str) -> Chip:
    if name not in CHIPS:
        raise ValueError(f"unknown chip {name!r}; known: {', '.join(CHIPS)}")
    return CHIPS[name]


def chip_for_device_kind(kind: str) -> Chip | None:
    """The chip jax reports as `device_kind` (e.g. "TPU v5 lite", "NVIDIA H100 80GB HBM3"), or None."""
    for c in CHIPS.values():
        if kind in c.device_kinds:
            return c
    return None


# ------------------------------------------------------------------------------ the cost model


def _bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def matmul_params(m: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: the layers' projections and the LM head
    (embedding lookup excluded, the head counted whether tied or not). Also MFU's count
    (jaxsb.training.metrics)."""
    attn = m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.hidden
    return m.layers * (attn + 3 * m.hidden * m.ffn) + m.vocab_size * m.hidden


def model_params(m: ModelConfig) -> int:
    """All parameters: matmuls, the norms, and the embedding when it is not tied to the head."""
    embedding = 0 if m.tie_embeddings else m.vocab_size * m.hidden
    return matmul_params(m) + m.layers * 2 * m.hidden + m.hidden + embedding


TPU_LANES = 128  # a TPU keeps arrays in tiles of 128 lanes along their minor dimension


def activation_bytes_per_token(m: ModelConfig, lanes: int = 1) -> float:
    """What the backward pass keeps per token, in bytes: per layer the norms' inputs, q, k, v,
    the attention output and its softmax statistics, the MLP's gate, up and product (or only the
    block's input with remat, one block's worth recomputed at a time), plus the float32 logits
    and their gradient. `lanes`: the per-head arrays' minor dimension (head_dim) is padded to a
    multiple of it (TPU_LANES on a TPU)."""
    b = _bytes(m.dtype)
    qkvo = (2 * m.heads + 2 * m.kv_heads) * (-(-m.head_dim // lanes) * lanes)
    per_layer = b * (4 * m.hidden + qkvo + 3 * m.ffn) + 4 * m.heads
    layers = b * m.hidden * m.layers + per_layer if m.remat else per_layer * m.layers
    return layers + 2 * 4 * m.vocab_size


def hardware_cost(c: Chip, m: ModelConfig, num_devices: int, *, fsdp: bool = True, block: int = 128,
                  devices_per_node: int | None = None) -> FormulaCost:
    """The formula cost model of `m` on `num_devices` of chip `c` (see the module docstring)."""
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1")
    if not m.vocab_size:
        raise ValueError("the model's vocab_size must be known (the tokenizer's) to price the LM head")
    tflops = c.bf16_tflops if m.dtype == "bfloat16" else c.f32_tflops
    ms_per_flop = 1e3 / (tflops * 1e12)
    a1 = 7 * m.layers * m.heads * m.head_dim * ms_per_flop / ATTENTION_EFFICIENCY
    a2 = (8 if m.remat else 6) * matmul_params(m) * ms_per_flop / MATMUL_EFFICIENCY
    node = devices_per_node if devices_per_node is not None else (c.devices_per_node or num_devices)
    b = _bytes(m.dtype)
    ulysses_bytes = m.layers * 2 * (2 * m.heads + 2 * m.kv_heads) * m.head_dim * b
    ring_bytes = m.layers * 3 * 2 * m.kv_heads * m.head_dim * b
    ulysses, ring = {}, {}
    for d in range(2, num_devices + 1):  # a group of d devices spans nodes when d > node
        gbs = c.intra_gbs if d <= node else c.inter_gbs
        ulysses[d] = ulysses_bytes * (d - 1) / d / (gbs * 1e9) * 1e3
        ring[d] = ring_bytes / (gbs * 1e9) * 1e3
    state_bytes = model_params(m) * 4 * _bytes(m.param_dtype)  # param, grad, Adam's mu and nu
    # FSDP: each micro-batch's shard_map holds the gathered parameters and their gradient whole
    gathered_bytes = model_params(m) * 2 * _bytes(m.param_dtype) if fsdp and num_devices > 1 else 0
    return FormulaCost(
        name=f"{c.name}:{num_devices}", a1=a1, a2=a2, b1=B1_MS_PER_LAYER * m.layers,
        memory_limit_mb=c.hbm_gb * 1e9 * c.memory_fraction / 2**20,
        states_mb=(state_bytes / (num_devices if fsdp else 1) + gathered_bytes) / 2**20,
        act_per_token_mb=activation_bytes_per_token(m, TPU_LANES if c.platform == "tpu" else 1) / 2**20,
        ulysses_ms_per_token=ulysses, ring_ms_per_token=ring, block=block)
