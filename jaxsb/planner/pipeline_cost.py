"""SparseBalance's setting as a cost model: Megatron DP x PP x TP, MoBA attention, 1F1B pipelines.

A layout in this setting is a Plan whose "devices" are the DP pipeline replicas: every
micro-batch slot m has DP degree-1 groups, group r holding the sequences of rank r's m-th
micro-batch. There is no context parallelism (a group of degree > 1 is refused).

Latency of one transformer layer on one TP group, forward + backward, for one sequence of
`s` tokens at a MoBA budget of `k` key blocks of `block` tokens per query block (k = None:
dense causal):

    linear_ms = 6 * P_layer * s / (tp * peak * eff_linear)          (fwd 2, bwd 4 FLOP/param)
    attn_ms   = 3.5 * pairs(s, k) * block^2 * 4 * H * hd / (tp * peak * eff_attn)
                (pairs = sum over query blocks i < nb of min(i + 1, k): the block pairs a
                 block-sparse kernel computes; fwd 1x, bwd 2.5x a flash forward)
    gate_ms   = 2 * s * nb * H * hd / (tp * peak * eff_attn)   (MoBA's block scores; sparse only)
    bytes_ms  = 40 * s * hidden * 2 B / (tp * hbm)             (norms, residuals, SwiGLU, RoPE)
    tp_ms     = 8 * s * hidden * 2 B * (tp - 1) / tp / nvlink  (Megatron sequence parallelism:
                 2 all-gathers + 2 reduce-scatters forward, the same backward; 0 when tp = 1)

A stage holds layers / pp layers; a micro-batch's stage time is the sum over its sequences
(packed, per-document attention) plus the activations' point-to-point send (s * hidden * 2 B,
forward and backward, over NVLink). The LM head and embeddings are left out, as SparseBalance's
one-layer latency table leaves them out.

1F1B (`plan_time_ms`): rank r's iteration = sum_m T[m][r] + (pp - 1) * max_m T[m][r], and the
step is the slowest rank (the gradient barrier). Memory (stage 0, which holds min(pp, n_mb)
consecutive micro-batches in flight; planners bound each micro-batch by an equal share, the
plan's peak takes the heaviest window): 16 B per parameter of the stage (bf16 weights and grads, fp32 Adam
and master weights, no distributed optimizer) + 34 * hidden bytes per token per layer
(selective recompute with sequence parallelism, Korthikanti et al. 2022) / tp.

Split documents (Seq1F1B, Sun et al., NAACL 2025, arXiv 2406.03488): a plan may cut a long
document at block boundaries into parts on consecutive micro-batches of one rank; each later
part attends to the earlier parts' keys and values, and its backward runs before theirs.
A part costs its tokens' share of the per-token terms plus the block pairs of its own query
blocks (`part_ms`), so a document's parts add up to the document; the 1F1B formula above
takes the parts' micro-batches like any others (Seq1F1B's schedule keeps 1F1B's bubble: our
reading of its paper, which reports fewer bubbles, not more). Micro-batches linked by split
documents form a chain (`chains`): a chain's backward waits for its last micro-batch, so a
chain of more than pp micro-batches is refused (neither the formula nor the memory holds), and
stage 0's memory window takes every micro-batch of the chains it touches.

Hardware: H200 SXM data sheet — 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, NVLink 900 GB/s
(450 GB/s each way), 141 GB. Assumed efficiencies: 0.60 of peak for the linear layers, 0.40
for (block-sparse or dense) attention. Architectures: Qwen2.5-0.5B and -3B as published
(config.json of the Hugging Face releases). These are modeled numbers, not measurements.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

H200 = dict(peak_tflops=989.0, hbm_tbs=4.8, nvlink_gbs=450.0, memory_gb=141.0)

# name -> (hidden, layers, heads, kv_heads, head_dim, intermediate)
QWEN25 = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 64, 4864),
    "qwen2.5-3b": (2048, 36, 16, 2, 128, 11008),
}


def block_pairs(length: int, budget: int | None, block: int) -> int:
    """Key blocks computed over all query blocks of one causal sequence: sum_i min(i + 1, k)."""
    return block_pairs_until(-(-int(length) // block), budget)


def block_pairs_until(nb: int, budget: int | None) -> int:
    """sum_{i < nb} min(i + 1, k): the key blocks of a document's first nb query blocks (k None: dense)."""
    if budget is None or budget >= nb:
        return nb * (nb + 1) // 2
    k = max(1, int(budget))
    return k * (k + 1) // 2 + (nb - k) * k


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """The module docstring's model. Groups are DP ranks (degree 1) of one micro-batch slot."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    pp: int = 4
    tp: int = 1
    block: int = 256
    base_budget: int = 32
    eff_linear: float = 0.60
    eff_attn: float = 0.40
    peak_tflops: float = H200["peak_tflops"]
    hbm_tbs: float = H200["hbm_tbs"]
    nvlink_gbs: float = H200["nvlink_gbs"]
    memory_limit_mb: float = H200["memory_gb"] * 1024
    setting: str = "pipeline"

    def __post_init__(self):
        if self.pp < 1 or self.tp < 1 or self.layers % self.pp:
            raise ValueError(f"cost model {self.name}: pp={self.pp} must divide layers={self.layers}; tp={self.tp} >= 1")
        if self.heads % self.tp:
            raise ValueError(f"cost model {self.name}: tp={self.tp} must divide heads={self.heads}")

    @classmethod
    def preset(cls, model: str, **options) -> "PipelineCost":
        if model not in QWEN25:
            raise ValueError(f"unknown sparsebalance-h200 model {model!r}; known: {', '.join(QWEN25)}")
        h, layers, heads, kv, hd, inter = QWEN25[model]
        known = {f.name for f in dataclasses.fields(cls)} - {"name", "setting"}
        bad = sorted(set(options) - known)
        if bad:
            raise ValueError(f"sparsebalance-h200:{model}: unknown options {bad}; known: {sorted(known)}")
        if "memory_limit_gb" in options:
            options["memory_limit_mb"] = options.pop("memory_limit_gb") * 1024
        return cls(f"sparsebalance-h200:{model}", h, layers, heads, kv, hd, inter, **options)

    # ------------------------------------------------------------------ one layer, one sequence
    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.intermediate

    @functools.lru_cache(maxsize=1 << 16)
    def layer_ms(self, length: int, budget: int | None) -> float:
        """Forward + backward of one layer for one sequence (ms), the docstring's formula."""
        return self._per_token_ms(length, budget) * length + self._per_pair_ms * block_pairs(length, budget, self.block)

    @functools.lru_cache(maxsize=1 << 16)
    def _per_token_ms(self, doc_length: int, budget: int | None) -> float:
        """One layer's terms that grow with the tokens (linear, MoBA's gate over the document's
        blocks, element-wise traffic, TP collectives), per token of a document."""
        flops = self.tp * self.peak_tflops * 1e12 / 1e3  # per ms, whole TP group
        linear = 6 * self.layer_params / (flops * self.eff_linear)
        nb = -(-int(doc_length) // self.block)
        gate = 0.0 if budget is None else 2 * nb * self.heads * self.head_dim / (flops * self.eff_attn)
        elementwise = 40 * self.hidden * 2 / (self.tp * self.hbm_tbs * 1e12 / 1e3)
        tp_comm = 8 * self.hidden * 2 * (self.tp - 1) / self.tp / (self.nvlink_gbs * 1e9 / 1e3)
        return linear + gate + elementwise + tp_comm

    @functools.cached_property
    def _per_pair_ms(self) -> float:
        """One layer's attention time per (query block, key block) pair computed."""
        flops = self.tp * self.peak_tflops * 1e12 / 1e3
        return 3.5 * self.block**2 * 4 * self.heads * self.head_dim / (flops * self.eff_attn)

    def sequence_ms(self, length: int, budget: int | None) -> float:
        """One sequence on one pipeline stage (its layers), without the send."""
        return self.layers // self.pp * self.layer_ms(int(length), None if budget is None else int(budget))

    @functools.lru_cache(maxsize=1 << 18)
    def part_ms(self, doc_length: int, start: int, length: int, budget: int | None) -> float:
        """Tokens [start, start + length) of a document of `doc_length` tokens on one stage
        (Seq1F1B's split, the module docstring): the per-token terms for its tokens, attention for
        its query blocks (they see the earlier parts' keys). A document's parts add up to its
        `sequence_ms`. `start` must be a multiple of the block, so no query block is shared."""
        if start % self.block or not 0 <= start < start + length <= doc_length:
            raise ValueError(f"cost model {self.name}: part [{start}, {start + length}) of a {doc_length}-token "
                             f"document must start on a {self.block}-token block and lie inside it")
        k = None if budget is None else int(budget)
        first, stop = start // self.block, -(-(start + length) // self.block)
        pairs = block_pairs_until(stop, k) - block_pairs_until(first, k)
        per_layer = self._per_token_ms(doc_length, k) * length + self._per_pair_ms * pairs
        return self.layers // self.pp * per_layer

    # ----------------------------------------------------------------------- the protocol
    def group_time_ms(self, degree: int, sharded_lengths: Sequence[int], local_lengths: Sequence[Sequence[int]] = (),
                      scheme: str = "ulysses", budgets: Sequence[int] | None = None,
                      spans: Sequence[tuple[int, int]] | None = None) -> float:
        """Stage time of one rank's micro-batch (ms); budgets None = dense; `spans` (split plans):
        per sequence (its first token in its document, the document's length)."""
        if degree != 1:
            raise ValueError(f"cost model {self.name}: no context parallelism in this setting (group degree {degree})")
        lengths = list(sharded_lengths) + [n for ids in local_lengths for n in ids]
        if not lengths:
            return 0.0
        ks = [None] * len(lengths) if budgets is None else list(budgets)
        send = 2 * sum(lengths) * self.hidden * 2 / (self.nvlink_gbs * 1e9 / 1e3) if self.pp > 1 else 0.0
        if spans is None:
            return sum(self.sequence_ms(n, k) for n, k in zip(lengths, ks)) + send
        return sum(self.part_ms(doc, start, n, k) for n, k, (start, doc) in zip(lengths, ks, spans)) + send

    def stage_states_mb(self) -> float:
        return 16 * self.layer_params * (self.layers // self.pp) / self.tp / 2**20

    def group_memory_mb(self, degree: int, sharded_lengths: Sequence[int],
                        local_lengths: Sequence[Sequence[int]] = (), in_flight: int | None = None) -> float:
        """Stage 0's peak per GPU if every in-flight micro-batch were this one."""
        tokens = sum(sharded_lengths) + sum(n for ids in local_lengths for n in ids)
        act = 34 * self.hidden * (self.layers // self.pp) / self.tp / 2**20
        return self.stage_states_mb() + act * tokens * (self.pp if in_flight is None else in_flight)

    def micro_batch_token_capacity(self, in_flight: int | None = None) -> int:
        act = 34 * self.hidden * (self.layers // self.pp) / self.tp / 2**20
        return int((self.memory_limit_mb - self.stage_states_mb()) / (act * (self.pp if in_flight is None else in_flight)))

    def combine_ms(self, times: Sequence[Sequence[float]]) -> float:
        """1F1B: times[m][r] per micro-batch slot and rank -> the step (slowest rank)."""
        if not times:
            return 0.0
        ranks = len(times[0])
        return max(sum(t[r] for t in times) + (self.pp - 1) * max(t[r] for t in times) for r in range(ranks))

    def group_times_ms(self, plan) -> list[list[float]]:
        """times[m][r]: rank r's stage time for its m-th micro-batch (jaxsb.planner.cost's
        group_times_ms does the same for any cost model; this module cannot import it: cost.py
        loads this one)."""
        out = []
        for m, mb in enumerate(plan.template.microbatches):
            row = []
            for g, group in enumerate(mb.groups):
                sharded, local = plan.sequences_of(m, g)
                ids = list(sharded) + [i for r in sorted(local) for i in local[r]]
                ks = None if plan.budgets is None else [plan.budgets[i] for i in ids]
                spans = None if plan.parts is None else [plan.span_of(i) for i in ids]
                row.append(self.group_time_ms(group.degree, [plan.lengths[i] for i in ids], budgets=ks, spans=spans))
            out.append(row)
        return out

    def plan_time_ms(self, plan) -> float:
        self._checked_chains(plan)
        return self.combine_ms(self.group_times_ms(plan))

    @staticmethod
    def chains(plan) -> list[list[int]]:
        """Per rank (group) g, per micro-batch m, the first micro-batch of m's chain: micro-batches
        m and m + 1 are linked when a document has parts in both (one chain holds them all)."""
        out = []
        n_mb = len(plan.template.microbatches)
        for g in range(len(plan.template.microbatches[0].groups) if n_mb else 0):
            head = list(range(n_mb))
            for m in range(1, n_mb):  # a later part (start > 0) continues a document of m - 1
                if plan.parts is not None and any(plan.span_of(i)[0] > 0 for i in plan.sequences_of(m, g)[0]):
                    head[m] = head[m - 1]
            out.append(head)
        return out

    def longest_chain(self, plan, chains: list[list[int]] | None = None) -> int:
        """The most micro-batches of one rank linked by split documents (1 when nothing is split)."""
        chains = self.chains(plan) if chains is None else chains
        return max((sum(1 for h in head if h == x) for head in chains for x in set(head)), default=1)

    def _checked_chains(self, plan) -> list[list[int]]:
        """`chains(plan)`; ValueError for a chain longer than pp (the module docstring)."""
        chains = self.chains(plan)
        longest = self.longest_chain(plan, chains) if plan.parts is not None else 1
        if longest > self.pp:
            raise ValueError(f"cost model {self.name}: split documents link {longest} micro-batches "
                             f"of one rank, more than pp={self.pp}: the 1F1B formula and the in-flight memory "
                             "do not hold for such a Seq1F1B chain")
        return chains

    def plan_memory_mb(self, plan) -> float:
        """Stage 0's peak per GPU: its states and the activations of the pp micro-batches in
        flight at once under 1F1B (the heaviest window of pp consecutive micro-batches). With
        split documents a window holds every micro-batch of the chains it touches (`chains`: a
        micro-batch's backward waits for its documents' later parts, Seq1F1B's order), and a
        split document counts whole: its earlier parts' activations (keys and values too) stay
        until its later parts' backward."""
        chains = self._checked_chains(plan)
        n_mb = len(plan.template.microbatches)
        act = 34 * self.hidden * (self.layers // self.pp) / self.tp / 2**20
        docs = plan.document_lengths()
        peak = 0.0
        for g, head in enumerate(chains):
            held = []  # per micro-batch: the documents it holds
            for m in range(n_mb):
                sharded, local = plan.sequences_of(m, g)
                held.append({plan.document_of(i) for i in list(sharded) + [i for r in local.values() for i in r]})
            w = min(self.pp, n_mb)
            for j in range(n_mb - w + 1):
                heads = set(head[j:j + w])
                window = [m for m in range(n_mb) if head[m] in heads]
                peak = max(peak, sum(docs[d] for d in set().union(*(held[m] for m in window))) * act)
        return self.stage_states_mb() + peak


def imbalance(times: Sequence[Sequence[float]]) -> float:
    """SparseBalance's Eq. 11 over all micro-batches of the global batch: max / mean of their
    (stage) times; 1.0 for an empty or all-zero batch."""
    flat = [t for row in times for t in row]
    mean = sum(flat) / len(flat) if flat else 0.0
    return max(flat) / mean if mean > 0 else 1.0


def pp_lower_bound_ms(cost: PipelineCost, floor_ms: Sequence[float], dp: int, n_mb: int) -> float:
    """A bound on any layout's 1F1B step given each sequence's fastest allowed stage time (at
    its coverage floor; a split document's parts keep it too), split documents allowed: some rank
    holds >= 1/dp of the work, and the rank holding the slowest sequence holds at least its time
    (all its parts are on that rank); a rank's slowest micro-batch is >= its mean, so the rank
    takes >= (1 + (pp - 1) / n_mb) times its work."""
    return max(sum(floor_ms) / dp, max(floor_ms, default=0.0)) * (1 + (cost.pp - 1) / n_mb)


def check_pipeline_sizes(name: str, global_batch: int, dp: int, mbs: int) -> int:
    """Micro-batches per rank, gbs / (mbs * dp); ValueError naming the sizes otherwise."""
    if dp < 1 or mbs < 1 or global_batch % (dp * mbs):
        raise ValueError(f"{name}: global batch {global_batch} must be a multiple of dp {dp} x mbs {mbs}")
    return global_batch // (dp * mbs)

