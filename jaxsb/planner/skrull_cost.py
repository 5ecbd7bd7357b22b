"""Skrull's performance model (Xu et al., NeurIPS'25, arXiv 2505.19609) as a jaxsb cost model.

`SkrullCost` makes the paper's model concrete: FLOPs(S) = 20·h²·S + 4·h·h_kv·S + 4·h·S² per
layer, time = α·FLOPs + β, collectives from the paper's profiled H100 latency table, memory
as a per-rank token capacity C. Constants the paper does not publish are assumptions, stated
below. The planner that uses it is jaxsb/planner/skrull.py.

Dimension letters: S a sequence length in tokens, T a group's sharded stream (sum of S),
h model width, h_kv the width of K (= kv_heads * head_dim), L layers, d (= cp) a group degree.
"""

from __future__ import annotations

import functools
from typing import Sequence


from jaxsb.plan import Plan

# ------------------------------------------------------------------------------ published facts

# Skrull's H100-80GB profile (arXiv 2505.19609, Table 5 / Appendix C), as copied into
# ../shared/data/cost_presets.json ("skrull_h100_80g"): collective latencies in microseconds for
# message sizes in MiB, and the per-rank token capacity of each model. Kept here so the module
# works without that file.
SKRULL_H100_PROFILE = {
    "collective_latency_us_by_mb": {
        "sizes_mb": (2, 64, 1024),
        "all_gather": (53, 489, 6468),
        "all_to_all": (81, 502, 6630),
        "reduce_scatter": (59, 459, 6294),
        "all_reduce": (85, 860, 12126),
    },
    "token_capacity_per_rank": {"qwen2.5-0.5b": 26000, "qwen2.5-7b": 13000},
}

# Model cards (hidden width, layers, attention heads, kv heads), same file "model_architectures".
ARCHITECTURES = {
    "qwen2.5-0.5b": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2},
    "qwen2.5-3b": {"hidden": 2048, "layers": 36, "heads": 16, "kv_heads": 2},
    "qwen2.5-7b": {"hidden": 3584, "layers": 28, "heads": 28, "kv_heads": 4},
    "llama2-7b": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 32},
    "smollm2-135m": {"hidden": 576, "layers": 30, "heads": 9, "kv_heads": 3},
}

PRESET_PREFIX = "skrull-h100:"
SKRULL_PRESETS = tuple(PRESET_PREFIX + m for m in SKRULL_H100_PROFILE["token_capacity_per_rank"])

# ----------------------------------------------------------------------------- assumptions

H100_BF16_DENSE_TFLOPS = 989.0  # NVIDIA's H100 SXM dense bf16 peak (no sparsity)
DEFAULT_MFU = 0.40  # assumed fraction of peak reached by the model's matmuls and attention
DEFAULT_BETA_US_PER_LAYER = 5.0  # assumed fixed forward cost per sequence (piece) per layer
FWD_BWD = 3.0  # backward = 2 x forward
H100_MEMORY_MB = 80 * 1024.0  # nominal H100-80GB
BYTES_PER_ELEMENT = 2  # bf16 activations on the wire


def _interp_latency_us(sizes_mb: Sequence[float], latency_us: Sequence[float], mb: float) -> float:
    """Piecewise-linear in the message size; below the smallest profiled size the latency is
    that size's (a floor: small messages are latency-bound), above the largest it continues the
    last segment's slope (bandwidth-bound). 0 bytes cost nothing."""
    if mb <= 0:
        return 0.0
    if mb <= sizes_mb[0]:
        return float(latency_us[0])
    for (x0, y0), (x1, y1) in zip(zip(sizes_mb, latency_us), zip(sizes_mb[1:], latency_us[1:])):
        if mb <= x1:
            return y0 + (y1 - y0) * (mb - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = (sizes_mb[-2], latency_us[-2]), (sizes_mb[-1], latency_us[-1])
    return y1 + (y1 - y0) * (mb - x1) / (x1 - x0)


def _preset_model(name: str) -> str:
    model = name[len(PRESET_PREFIX):] if name.startswith(PRESET_PREFIX) else name
    if model not in ARCHITECTURES:
        raise ValueError(f"unknown Skrull model {name!r}; known: {sorted(ARCHITECTURES)} "
                         f"(presets {SKRULL_PRESETS})")
    return model


class SkrullCost:
    """Skrull's performance model on H100-80GB, in milliseconds per DP x CP group and micro-batch.

    Compute (the paper's FLOPs model, b = 1, packed sequences), per layer and forward pass:

        FLOPs(S) = 20 h^2 S + 4 h h_kv S + 4 h S^2

    times L layers; a sequence's time is ``3 * (alpha * FLOPs(S) + beta)`` (fwd + bwd = 3 x fwd).
    The paper fits alpha and beta by profiling; they are not published, so here they are
    **assumptions**: ``alpha = 1 / (989 TFLOP/s * mfu)`` (H100 SXM dense bf16 peak times an
    assumed model FLOPs utilisation, default 0.40) and ``beta = L * 5 us`` per sequence piece
    (kernel launches, varlen bookkeeping and under-filled tiles that a sequence costs regardless
    of its length). A sequence *sharded* over d ranks costs every rank ``alpha * FLOPs(S) / d +
    beta``: the load-balanced (zigzag) layout splits both the linear and the S^2 term evenly, but
    each rank still pays the fixed cost of its piece -- that is what makes CP wasteful for short
    sequences. A *local* sequence costs its rank ``alpha * FLOPs(S) + beta`` and nothing elsewhere.

    Communication of a group's sharded stream T = sum of its sharded lengths (local sequences
    communicate nothing), from the profiled piecewise table ``collective_latency_us_by_mb``
    (linear interpolation on the message size in MiB, `_interp_latency_us`):

    * ``ring`` (default) is costed as all-gather CP (Llama-3 style; a ring moves the same bytes
      per rank in d-1 peer-to-peer steps): per layer, forward one all-gather of K and V of the
      whole stream (``T * 2 * h_kv * 2 bytes``), backward one all-gather again (K/V are not kept
      gathered) and one reduce-scatter of dK/dV of the same size;
    * ``ulysses``: per layer, forward an all-to-all of q, k, v (``T/d * (h + 2 h_kv) * 2 bytes``
      per rank) and one of the output (``T/d * h * 2 bytes``), backward the same two again.

    The table was profiled on one 8-GPU NVLink node and is used as is for every degree.
    Communication is *not* overlapped with compute by default (``overlap=False``):

        group_time = max_r (sum_sharded share(S) + sum_{local on r} full(S)) + comm(T)

    With ``overlap=True`` the local sequences' compute hides the communication (the paper's
    motivation for DACP): ``sum_sharded share(S) + max(comm(T), max_r local_r)``.

    Memory is the paper's token capacity C per rank (26K tokens for Qwen2.5-0.5B, 13K for
    Qwen2.5-7B): a rank holds its local sequences plus ``ceil(T / d)`` tokens of the stream. It is
    expressed in MB as ``tokens * memory_limit_mb / C`` with ``memory_limit_mb`` = 80 GiB, so
    "memory <= limit" is exactly "tokens <= C".
    """

    def __init__(self, model: str = "qwen2.5-0.5b", *, token_capacity: int | None = None,
                 mfu: float = DEFAULT_MFU, beta_us_per_layer: float = DEFAULT_BETA_US_PER_LAYER,
                 peak_tflops: float = H100_BF16_DENSE_TFLOPS, overlap: bool = False,
                 memory_limit_mb: float = H100_MEMORY_MB, profile: dict | None = None):
        self.model = _preset_model(model)
        arch = ARCHITECTURES[self.model]
        profile = SKRULL_H100_PROFILE if profile is None else profile
        if token_capacity is None:
            caps = profile["token_capacity_per_rank"]
            if self.model not in caps:
                raise ValueError(f"no published token capacity for {self.model!r} (have {sorted(caps)}); "
                                 "pass token_capacity=")
            token_capacity = caps[self.model]
        if token_capacity < 1 or not 0 < mfu <= 1 or beta_us_per_layer < 0:
            raise ValueError(f"{token_capacity=} must be >= 1, {mfu=} in (0, 1], {beta_us_per_layer=} >= 0")
        self.hidden = int(arch["hidden"])
        self.layers = int(arch["layers"])
        self.kv_hidden = int(arch["kv_heads"]) * (self.hidden // int(arch["heads"]))
        self.token_capacity = int(token_capacity)
        self.mfu = float(mfu)
        self.beta_us_per_layer = float(beta_us_per_layer)
        self.peak_tflops = float(peak_tflops)
        self.overlap = bool(overlap)
        self.memory_limit_mb = float(memory_limit_mb)
        self.mb_per_token = self.memory_limit_mb / self.token_capacity
        self._table = profile["collective_latency_us_by_mb"]
        self.alpha_ms_per_flop = 1e3 / (self.peak_tflops * 1e12 * self.mfu)
        self.beta_ms = self.layers * self.beta_us_per_layer * 1e-3
        self._full = functools.lru_cache(maxsize=1 << 16)(self._full_uncached)
        self._share = functools.lru_cache(maxsize=1 << 16)(self._share_uncached)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "SkrullCost":
        """'skrull-h100:qwen2.5-0.5b' | 'skrull-h100:qwen2.5-7b' (or the bare model name)."""
        return cls(name, **overrides)

    @property
    def name(self) -> str:
        return PRESET_PREFIX + self.model

    def __repr__(self) -> str:
        return (f"SkrullCost({self.model!r}, token_capacity={self.token_capacity}, mfu={self.mfu}, "
                f"beta_us_per_layer={self.beta_us_per_layer}, overlap={self.overlap})")

    # ------------------------------------------------------------------ per-sequence pieces

    def flops(self, s: int) -> float:
        """Forward FLOPs of one sequence of s tokens through all layers."""
        h, hkv = self.hidden, self.kv_hidden
        return self.layers * (20.0 * h * h * s + 4.0 * h * hkv * s + 4.0 * h * float(s) * s)

    def _full_uncached(self, s: int) -> float:
        return FWD_BWD * (self.alpha_ms_per_flop * self.flops(s) + self.beta_ms)

    def full_ms(self, s: int) -> float:
        """fwd+bwd ms of a sequence kept whole on one rank."""
        return self._full(int(s))

    def _share_uncached(self, s: int, degree: int) -> float:
        return FWD_BWD * (self.alpha_ms_per_flop * self.flops(s) / degree + self.beta_ms)

    def share_ms(self, s: int, degree: int) -> float:
        """fwd+bwd ms one rank spends on its 1/degree piece of a sharded sequence."""
        if degree == 1:
            return self.full_ms(s)
        return self._share(int(s), int(degree))

    def comm_ms(self, degree: int, stream_tokens: int, scheme: str = "ring") -> float:
        """fwd+bwd communication ms of a group's sharded stream (see the class docstring)."""
        if degree <= 1 or stream_tokens <= 0:
            return 0.0
        t = self._table
        mib = 1.0 / (1 << 20)
        if scheme == "ulysses":
            per_rank = stream_tokens / degree * BYTES_PER_ELEMENT * mib
            qkv = _interp_latency_us(t["sizes_mb"], t["all_to_all"], per_rank * (self.hidden + 2 * self.kv_hidden))
            out = _interp_latency_us(t["sizes_mb"], t["all_to_all"], per_rank * self.hidden)
            per_layer = 2 * (qkv + out)
        elif scheme == "ring":
            kv_mb = stream_tokens * 2 * self.kv_hidden * BYTES_PER_ELEMENT * mib
            per_layer = (2 * _interp_latency_us(t["sizes_mb"], t["all_gather"], kv_mb)
                         + _interp_latency_us(t["sizes_mb"], t["reduce_scatter"], kv_mb))
        else:
            raise ValueError(f"scheme {scheme!r} for a group of degree {degree}: expected 'ring' or 'ulysses'")
        return self.layers * per_layer * 1e-3

    # --------------------------------------------------------------------- group level

    @staticmethod
    def _local_lists(degree: int, local_lengths) -> list[list[int]]:
        local = [list(map(int, ids)) for ids in local_lengths]
        if len(local) > degree:
            raise ValueError(f"local_lengths has {len(local)} ranks, the group has degree {degree}")
        return local + [[] for _ in range(degree - len(local))]

    def rank_tokens(self, degree: int, sharded_lengths: Sequence[int],
                    local_lengths: Sequence[Sequence[int]] = ()) -> list[int]:
        """Tokens each rank of the group holds: its local sequences + its share of the stream."""
        local = self._local_lists(degree, local_lengths)
        if degree == 1:
            return [sum(map(int, sharded_lengths)) + sum(local[0])]
        share = -(-sum(map(int, sharded_lengths)) // degree)
        return [share + sum(ids) for ids in local]

    def group_time_ms(self, degree: int, sharded_lengths: Sequence[int],
                      local_lengths: Sequence[Sequence[int]] = (), scheme: str = "ring",
                      budgets=None) -> float:
        """One DP rank's CP group for one micro-batch (budgets: dense model, ignored)."""
        local = self._local_lists(degree, local_lengths)
        if degree == 1:
            return sum(self.full_ms(s) for s in sharded_lengths) + sum(self.full_ms(s) for s in local[0])
        shard = sum(self.share_ms(s, degree) for s in sharded_lengths)
        local_ms = max(sum(self.full_ms(s) for s in ids) for ids in local)
        return self.combine_ms(degree, shard, local_ms, sum(map(int, sharded_lengths)), scheme)

    def combine_ms(self, degree: int, shard_ms: float, max_local_ms: float, stream_tokens: int,
                   scheme: str = "ring") -> float:
        """A group's time from its parts: every rank's share of the sharded sequences, the
        slowest rank's local sequences, and the stream's communication (overlapped or not)."""
        comm = self.comm_ms(degree, stream_tokens, scheme)
        if self.overlap:
            return shard_ms + max(comm, max_local_ms)
        return shard_ms + max_local_ms + comm

    def group_memory_mb(self, degree: int, sharded_lengths: Sequence[int],
                        local_lengths: Sequence[Sequence[int]] = ()) -> float:
        return max(self.rank_tokens(degree, sharded_lengths, local_lengths)) * self.mb_per_token

    def plan_time_ms(self, plan: Plan) -> float:
        """Sum over micro-batches of the slowest group. With DP the groups of a micro-batch are the
        DP ranks' CP groups: ranks synchronise every micro-batch (ZeRO-3 gathers parameters per
        layer), so a micro-batch lasts as long as its slowest DP rank."""
        total = 0.0
        for m, mb in enumerate(plan.template.microbatches):
            worst = 0.0
            for g, group in enumerate(mb.groups):
                sharded, local = plan.sequences_of(m, g)
                local_lengths = [[plan.lengths[i] for i in local.get(r, [])] for r in range(group.degree)]
                worst = max(worst, self.group_time_ms(group.degree, [plan.lengths[i] for i in sharded],
                                                      local_lengths, group.scheme if group.degree > 1 else "ring"))
            total += worst
        return total
