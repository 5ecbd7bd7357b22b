"""Cutting documents into pieces; a step's pieces as they are (`StepPieces`, what a planner
lays out) or packed into equal-length rows (`Batch`, the layout of the rows path).

Long documents follow data.long_policy. `split` cuts a document of n tokens into pieces of at
most max_len tokens that overlap by one token: piece k+1 starts with piece k's last token, so
every next-token target of the document is trained exactly once (a piece's last token has no
target inside the piece; the next piece's first token re-supplies that context position).

Packing balances per-row *cost*, not token count: attention makes a row of one 2048-token
document about twice as expensive as a row of sixteen 128-token documents.
cost(n) = n + n² / ATTENTION_COST_C: the linear term stands for the per-token work (MLP,
projections, embeddings), the quadratic one for causal attention over the document. With
C = 2048 the two terms are equal at n = 2048 tokens, about where attention starts to dominate
for the small LLaMA shapes jaxsb trains by default; only the ranking of rows matters here. The
planner (`jaxsb/planner/cost.py`) has the calibrated per-device model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxsb.data.stats import DataStats

ATTENTION_COST_C = 2048.0


def cost(n: int | np.ndarray) -> float | np.ndarray:
    """Relative compute cost of one causal document of n tokens."""
    return n + n * n / ATTENTION_COST_C


@dataclasses.dataclass
class Piece:
    """A document, or a max_len piece of one, ready to pack."""

    ids: np.ndarray  # int32 [n]
    flags: np.ndarray  # bool [n]: flags[j] = token j is a trained target (flags[0] ignored)
    ref: tuple[int, int, int]  # (epoch, index in that epoch's unit order, piece index): resumable
    origin: str

    def __len__(self) -> int:
        return int(self.ids.size)

    @property
    def num_targets(self) -> int:
        return int(self.flags[1:].sum())


def cut_pieces(ids: np.ndarray, flags: np.ndarray, origin: str, ref: tuple[int, int], max_len: int,
               policy: str, stats: DataStats) -> list[Piece]:
    """Applies the long-document policy and the <2-token / no-target rules; counts everything."""
    n = int(ids.size)
    targets = int(flags[1:].sum())
    if n < 2:
        stats.add("skipped_short", origin=origin)
        return []
    if targets == 0:
        stats.add("skipped_no_targets", origin=origin)
        return []
    stats.add("docs_accepted")
    stats.add("tokens_produced", n)
    stats.add("targets_produced", targets)
    epoch, index = ref
    if n <= max_len:
        return [Piece(ids, flags, (epoch, index, 0), origin)]
    if policy == "drop":
        stats.add("dropped_long_docs", origin=origin)
        stats.add("dropped_long_tokens", n)
        stats.add("dropped_long_targets", targets)
        return []
    if policy == "truncate":
        stats.add("truncated_docs", origin=origin)
        stats.add("truncated_tokens", n - max_len)
        stats.add("truncated_targets", int(flags[max_len:].sum()))
        return [Piece(ids[:max_len], flags[:max_len], (epoch, index, 0), origin)]
    stride = max_len - 1  # one token of overlap between consecutive pieces
    starts = range(0, n - 1, stride)
    pieces = [Piece(ids[s:s + max_len], flags[s:s + max_len], (epoch, index, k), origin)
              for k, s in enumerate(starts)]
    # A piece whose targets are all untrained (possible in chat) still carries context; keep it
    # so that the counts stay exact and simple.
    stats.add("split_docs", origin=origin)
    stats.add("split_pieces", len(pieces))
    return pieces


@dataclasses.dataclass
class StepPieces:
    """One step's pieces in reading order, not packed: a planned step lays them out itself."""

    pieces: list[Piece]

    @property
    def doc_lengths(self) -> list[int]:
        return [len(p) for p in self.pieces]

    @property
    def doc_origins(self) -> list[str]:
        return [p.origin for p in self.pieces]

    @property
    def doc_refs(self) -> list[tuple[int, int, int]]:
        return [p.ref for p in self.pieces]

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.pieces)

    @property
    def num_targets(self) -> int:
        return sum(p.num_targets for p in self.pieces)

    def digest(self) -> str:
        """A fingerprint of the step's data, to check that every process drew the same step."""
        import hashlib

        h = hashlib.sha256()
        for p in self.pieces:
            h.update(np.asarray(len(p), np.int64).tobytes())
            h.update(np.ascontiguousarray(p.ids, np.int32).tobytes())
            h.update(np.ascontiguousarray(p.flags, bool).tobytes())
        return h.hexdigest()


@dataclasses.dataclass
class Packing:
    rows: list[list[int]]  # per row, indices into the input lengths, in input order
    row_len: int  # the chosen bucket T
    unplaced: list[int]  # indices that fit no row (carried to the next step), in input order


# Below this share of filled tokens, a longer bucket is preferred over carrying items.
MIN_FILL_TO_CARRY = 0.75


def pack_rows(lengths: Sequence[int], num_rows: int, buckets: Sequence[int],
              priority: Sequence[int] | None = None, min_fill: float = MIN_FILL_TO_CARRY) -> Packing:
    """Longest-processing-time-first greedy by cost with a token-capacity check.

    Items are taken by (priority desc, cost desc, index) and each goes to the cheapest row that
    still has room. Row length T starts at the smallest bucket that could hold the items
    (≥ the longest item and ≥ the mean tokens per row); if some item finds no row, the next
    bucket is tried — unless the rows are already at least `min_fill` full, in which case the
    items that found no row are carried instead (a longer bucket would mostly add padding).
    At the largest bucket, items that still find no row are returned in `unplaced` (the caller
    carries them to the next step)."""
    n = len(lengths)
    lens = np.asarray(lengths, dtype=np.int64)
    if num_rows < 1:
        raise ValueError(f"pack_rows: num_rows={num_rows} must be >= 1")
    if n == 0:
        return Packing([[] for _ in range(num_rows)], int(buckets[0]), [])
    prio = np.zeros(n, np.int64) if priority is None else np.asarray(priority, np.int64)
    costs = cost(lens.astype(np.float64))
    order = sorted(range(n), key=lambda i: (-prio[i], -costs[i], i))
    lower = max(int(lens.max()), math.ceil(int(lens.sum()) / num_rows))
    candidates = [b for b in buckets if b >= lower] or [buckets[-1]]
    for T in candidates:
        row_tokens = np.zeros(num_rows, np.int64)
        row_cost = np.zeros(num_rows, np.float64)
        assign = np.full(n, -1, np.int64)
        for i in order:
            room = row_tokens + lens[i] <= T
            if not room.any():
                continue
            r = int(np.argmin(np.where(room, row_cost, np.inf)))
            assign[i] = r
            row_tokens[r] += lens[i]
            row_cost[r] += costs[i]
        if (assign >= 0).all() or T == candidates[-1]:
            break
        if row_tokens.sum() >= min_fill * num_rows * T:
            break  # carrying the rest to the next step wastes less than a longer bucket
    rows = [[int(i) for i in np.flatnonzero(assign == r)] for r in range(num_rows)]
    unplaced = [int(i) for i in np.flatnonzero(assign < 0)]
    used = max((int(lens[r].sum()) for r in rows if r), default=1)
    row_len = next(b for b in buckets if b >= used)
    return Packing(rows, int(row_len), unplaced)


@dataclasses.dataclass
class Batch:
    """One step's packed rows (host numpy). R rows of T tokens; padding has segment id 0."""

    tokens: np.ndarray  # int32 [R,T]
    targets: np.ndarray  # int32 [R,T]: next token within the same document (pad id elsewhere)
    segment_ids: np.ndarray  # int32 [R,T]: 1, 2, 3... per document in a row, 0 = padding
    positions: np.ndarray  # int32 [R,T]: restart at 0 for every document
    loss_mask: np.ndarray  # float32 [R,T]: 0 on padding, documents' last tokens, untrained (chat) targets
    num_targets: int  # loss_mask.sum()
    doc_lengths: list[int]  # per packed piece, row by row
    doc_rows: list[int]  # the row of each entry of doc_lengths
    doc_origins: list[str]  # "file[:line]" of each packed piece
    doc_refs: list[tuple[int, int, int]]  # (epoch, unit index in that epoch's order, piece) of each

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    @property
    def num_tokens(self) -> int:
        return int(sum(self.doc_lengths))


def build_batch(pieces: Sequence[Piece], packing: Packing, num_rows: int, pad_id: int) -> Batch:
    T = packing.row_len
    tokens = np.full((num_rows, T), pad_id, np.int32)
    targets = np.full((num_rows, T), pad_id, np.int32)
    segment_ids = np.zeros((num_rows, T), np.int32)
    positions = np.zeros((num_rows, T), np.int32)
    loss_mask = np.zeros((num_rows, T), np.float32)
    lengths, rows, origins, refs = [], [], [], []
    for r, members in enumerate(packing.rows):
        at = 0
        for seg, i in enumerate(members, start=1):
            p = pieces[i]
            n = len(p)
            tokens[r, at:at + n] = p.ids
            targets[r, at:at + n - 1] = p.ids[1:]
            segment_ids[r, at:at + n] = seg
            positions[r, at:at + n] = np.arange(n, dtype=np.int32)
            loss_mask[r, at:at + n - 1] = p.flags[1:]
            at += n
            lengths.append(n)
            rows.append(r)
            origins.append(p.origin)
            refs.append(p.ref)
    return Batch(tokens, targets, segment_ids, positions, loss_mask, int(loss_mask.sum()), lengths, rows, origins,
                 refs)
