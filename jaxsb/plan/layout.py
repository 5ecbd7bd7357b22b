"""Host-side layout: a Plan plus the step's sequences -> per-device token buffers.

For micro-batch m every device gets one buffer of `MicroBatch.tokens_per_device` tokens:
the shard region (`shard_len`) then the local region (`local_len`). Per token it carries the
token id, target, loss mask, segment id (sequence i of the batch has id i + 1; 0 is padding),
RoPE position (the sequence's own, so positions stay right under any sharding) and the
sequence's sparse budget.

Shard region of a group of degree d, by scheme (the group's *stream* is its sharded
sequences concatenated in plan order, each padded to `align` tokens — the sparse block size,
so that every sequence starts on a block boundary wherever it lands — and the stream padded
once at the end, never per sequence):
  * local (d = 1): the stream itself;
  * ulysses: contiguous chunks of `shard_len` tokens, rank r holds stream[r·S:(r+1)·S], so the
    all-to-all rebuilds the stream in order;
  * ring: zigzag — the stream padded to 2·d·c tokens is cut into 2·d chunks of c; rank r holds
    chunks r and 2d−1−r. With causal attention, chunk j's work grows with j, so every rank
    gets one cheap and one expensive chunk (balanced for one long document; the ring kernel
    masks by (segment, position), not by buffer index, so any order is correct).
Local region: rank r's whole sequences (Skrull), concatenated.

Padding tokens: segment 0, position 0, target 0, loss mask 0, budget 0.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxsb.plan.plan import MicroBatch, Plan, PlanError, padded_length

FIELDS = ("tokens", "targets", "loss_mask", "segment_ids", "positions", "budgets")


@dataclasses.dataclass(frozen=True)
class SeqData:
    """One training sequence (a document or a piece of one): arrays of equal length n."""

    tokens: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    positions: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


class _Stream:
    """Sequences concatenated (each padded to `align`), as per-field arrays."""

    def __init__(self, ids: Sequence[int], seqs: Sequence[SeqData], budgets, align: int):
        n = sum(padded_length(len(seqs[i]), align) for i in ids)
        self.arrays = {f: np.zeros(n, np.float32 if f == "loss_mask" else np.int32) for f in FIELDS}
        at = 0
        for i in ids:
            s = seqs[i]
            sl = slice(at, at + len(s))
            self.arrays["tokens"][sl] = s.tokens
            self.arrays["targets"][sl] = s.targets
            self.arrays["loss_mask"][sl] = s.loss_mask
            self.arrays["positions"][sl] = s.positions
            self.arrays["segment_ids"][sl] = i + 1
            self.arrays["budgets"][sl] = budgets[i]
            at += padded_length(len(s), align)
        self.length = n

    def padded(self, n: int) -> dict[str, np.ndarray]:
        assert n >= self.length, (n, self.length)
        return {f: np.pad(a, (0, n - self.length)) for f, a in self.arrays.items()}


def zigzag_layout(num_tokens: int, degree: int) -> np.ndarray:
    """[degree, 2*c] int64 indices into a group's token stream, row r = rank r's tokens: the one
    zigzag helper (the layout below, the ring's tests and the work counts all go through it).

    The stream is padded to P = a multiple of 2*degree and cut into 2*degree chunks of
    c = P / (2*degree); rank r gets chunks r and 2*degree-1-r, so each rank holds one early
    and one late chunk and causal work is balanced. Indices >= num_tokens are padding.
    """
    if num_tokens < 1 or degree < 1:
        raise ValueError(f"{num_tokens=} and {degree=} must be positive")
    c = -(-num_tokens // (2 * degree))
    ranks = np.arange(degree)[:, None]
    offsets = np.arange(c)[None, :]
    return np.concatenate([ranks * c + offsets, (2 * degree - 1 - ranks) * c + offsets], axis=1)


def layout_microbatch(plan: Plan, m: int, seqs: Sequence[SeqData], align: int = 1,
                      default_budget: int = 0) -> dict[str, np.ndarray]:
    """Per-device buffers of micro-batch m: {field: [num_devices, tokens_per_device]}."""
    if plan.parts is not None:
        raise PlanError("the executor lays out whole documents only; this plan splits documents into parts "
                        "(the pipeline simulator's Seq1F1B layouts)")
    mb: MicroBatch = plan.template.microbatches[m]
    N, S, L = plan.template.num_devices, mb.shard_len, mb.local_len
    budgets = plan.budgets if plan.budgets is not None else [default_budget] * len(plan.lengths)
    out = {f: np.zeros((N, S + L), np.float32 if f == "loss_mask" else np.int32) for f in FIELDS}
    for g, group in enumerate(mb.groups):
        sharded, local = plan.sequences_of(m, g)
        stream = _Stream(sharded, seqs, budgets, align)
        d = group.degree
        if group.scheme == "ring" and d > 1 and S:
            full = stream.padded(d * S)
            rows = zigzag_layout(d * S, d)  # [d, S]: S = 2c, so no index is past the padded stream
            for f in FIELDS:
                out[f][group.start:group.start + d, :S] = full[f][rows]
        else:  # ulysses chunks, or a degree-1 group's whole sequences
            full = stream.padded(d * S)
            for r in range(d):
                for f in FIELDS:
                    out[f][group.start + r, :S] = full[f][r * S:(r + 1) * S]
        for r, ids in local.items():
            part = _Stream(ids, seqs, budgets, align).padded(L)
            for f in FIELDS:
                out[f][group.start + r, S:] = part[f]
    return out


def single_device_layout(seqs: Sequence[SeqData], budgets: Sequence[int], align: int = 1) -> dict[str, np.ndarray]:
    """The reference layout: every sequence in one row [1, total] (same ids, same alignment)."""
    stream = _Stream(range(len(seqs)), seqs, budgets, align)
    return {f: a[None] for f, a in stream.padded(padded_length(stream.length, align)).items()}
