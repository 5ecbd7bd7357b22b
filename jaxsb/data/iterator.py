"""DataIterator: each training step's pieces, with a small, exact, resumable state.

Position = (epoch, cursor, piece): the unit at index `cursor` of epoch `epoch`'s seeded
permutation, and the next piece of that unit's document. A step takes pieces in order until
the token budget would be exceeded (always at least one). What happens next is the step's
layout:
  * `next()` (the rows path, `parallel.planner=none`) packs them into `num_rows` rows
    (`batching.pack_rows`) and carries pieces that fit no row to the front of the next step;
  * `next_pieces()` (planned steps) hands them over as they are (`StepPieces`): the planner
    lays them out, so nothing is carried and the budget is `data.tokens_per_step` itself.
Carried pieces are saved by reference (epoch, cursor, piece) and re-read on restore, so the
state stays small while `restore(state)` + `next()` gives exactly the step an uninterrupted
iterator would have given; the counters travel with the state, so totals match too.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from jaxsb.config import DataConfig
from jaxsb.data.batching import Batch, Piece, StepPieces, build_batch, cut_pieces, pack_rows
from jaxsb.data.catalog import open_source
from jaxsb.data.sources import DataError, Source, epoch_permutation
from jaxsb.data.stats import DataStats
from jaxsb.data.tokenizer import Tokenizer, encode_document

STATE_VERSION = 1
log = logging.getLogger(__name__)


class DataIterator:
    """Steps of `cfg`'s documents. `num_rows` (devices × rows_per_device) is the rows path's
    layout; without it only `next_pieces()` is available."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, num_rows: int | None = None) -> None:
        cfg.validate()
        if num_rows is not None and num_rows < 1:
            raise ValueError(f"DataIterator: num_rows={num_rows} must be >= 1")
        self.cfg, self.tokenizer, self.num_rows = cfg, tokenizer, num_rows
        self.source: Source = open_source(cfg, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id)
        self.stats = DataStats(self.source.describe())
        # More than num_rows × the largest bucket can never be packed; taking it would only grow the carry.
        self.budget = cfg.tokens_per_step if num_rows is None else min(cfg.tokens_per_step,
                                                                         num_rows * max(cfg.row_buckets))
        if self.budget < cfg.tokens_per_step:
            log.warning("data.tokens_per_step=%d exceeds num_rows=%d × largest row bucket %d: each step takes "
                        "at most %d tokens", cfg.tokens_per_step, num_rows, max(cfg.row_buckets), self.budget)
        self._epoch = self._cursor = self._piece = 0
        self._loaded: list[Piece] | None = None  # pieces of the unit at (epoch, cursor), counted in stats
        self._epoch_pieces = 0  # pieces produced so far in this epoch (an epoch with none is an error)
        self._carry: list[Piece] = []
        self._perms: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ reading

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = epoch_permutation(len(self.source), self.cfg.seed, epoch)
        return self._perms[epoch]

    def _load(self, epoch: int, cursor: int, stats: DataStats) -> list[Piece]:
        doc = self.source.read(int(self._perm(epoch)[cursor]), stats)
        if doc is None:
            return []
        ids, flags = encode_document(doc, self.tokenizer)
        return cut_pieces(ids, flags, doc.origin, (epoch, cursor), self.cfg.max_len, self.cfg.long_policy, stats)

    def _peek(self) -> Piece:
        """The next piece in order (loading, and counting, units as needed); does not consume it."""
        while True:
            if self._loaded is None:
                self._loaded = self._load(self._epoch, self._cursor, self.stats)
                self._epoch_pieces += len(self._loaded)
            if self._piece < len(self._loaded):
                return self._loaded[self._piece]
            self._loaded, self._piece = None, 0
            self._cursor += 1
            if self._cursor == len(self.source):
                if self._epoch_pieces == 0:
                    raise DataError(f"{self.source.looked_for()}: a whole pass found no usable document.\n"
                                    f"{self.stats.summary()}")
                self._epoch, self._cursor, self._epoch_pieces = self._epoch + 1, 0, 0
                self.stats.add("epochs_completed")

    # ------------------------------------------------------------------ stepping

    def _take(self, budget: int) -> list[Piece]:
        """The carry, then pieces in order while they fit `budget` tokens (at least one)."""
        taken, self._carry = self._carry, []
        total = sum(len(p) for p in taken)
        while True:
            piece = self._peek()
            if taken and total + len(piece) > budget:
                return taken
            taken.append(piece)
            total += len(piece)
            self._piece += 1

    def _count(self, step, slots: int) -> None:
        s = self.stats
        s.add("steps")
        s.add("pieces_packed", len(step.doc_lengths))
        s.add("tokens_packed", step.num_tokens)
        s.add("targets_packed", step.num_targets)
        s.add("padding_tokens", slots - step.num_tokens)
        s.add("carried_pieces", len(self._carry))

    def next(self) -> Batch:
        """The rows path: the step's pieces packed into `num_rows` rows."""
        if self.num_rows is None:
            raise ValueError("DataIterator.next packs rows: build the iterator with num_rows "
                             "(or take a planned step's pieces with next_pieces())")
        carried = len(self._carry)
        taken = self._take(self.budget)
        packing = pack_rows([len(p) for p in taken], self.num_rows, self.cfg.row_buckets,
                            priority=[1] * carried + [0] * (len(taken) - carried))
        self._carry = [taken[i] for i in packing.unplaced]
        batch = build_batch(taken, packing, self.num_rows, self.tokenizer.pad_id)
        self._count(batch, batch.tokens.size)
        return batch

    def next_pieces(self) -> StepPieces:
        """A planned step: up to `data.tokens_per_step` tokens of pieces, unpacked, none carried
        (padding is the planner's layout's, counted in the step's metrics)."""
        step = StepPieces(self._take(self.cfg.tokens_per_step))
        self._count(step, step.num_tokens)
        return step

    __next__ = next

    def __iter__(self) -> "DataIterator":
        return self

    def in_flight(self) -> tuple[int, int]:
        """(tokens, targets) read and counted as produced but not yet packed: the carry plus the
        rest of the current document. produced = packed + truncated + dropped + in flight,
        where split pieces' one-token overlaps count in packed tokens."""
        rest = self._carry + (self._loaded[self._piece:] if self._loaded else [])
        return sum(len(p) for p in rest), sum(p.num_targets for p in rest)

    # ------------------------------------------------------------------ checkpointing

    def _fingerprint(self) -> dict[str, Any]:
        c = self.cfg
        return {"kind": c.kind, "path": c.path, "seed": c.seed, "units": len(self.source),
                "max_len": c.max_len, "long_policy": c.long_policy, "vocab_size": self.tokenizer.vocab_size}

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position, carry references and counters."""
        return {
            "version": STATE_VERSION,
            "position": [self._epoch, self._cursor, self._piece],
            "loaded": self._loaded is not None,
            "epoch_pieces": self._epoch_pieces,
            "carry": [list(p.ref) for p in self._carry],
            "stats": self.stats.state(),
            "fingerprint": self._fingerprint(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data iterator state version {state.get('version')!r}, this code reads {STATE_VERSION}")
        saved, now = state["fingerprint"], self._fingerprint()
        changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if changed:
            detail = ", ".join(f"{k}: saved {a!r} now {b!r}" for k, (a, b) in changed.items())
            raise DataError(f"cannot resume the data position: the data changed since it was saved ({detail})")
        self._epoch, self._cursor, self._piece = (int(x) for x in state["position"])
        self._epoch_pieces = int(state["epoch_pieces"])
        self.stats.load_state(state["stats"])
        quiet = DataStats()  # re-reading what the saved counters already include
        cache: dict[tuple[int, int], list[Piece]] = {}

        def pieces(epoch: int, cursor: int) -> list[Piece]:
            if (epoch, cursor) not in cache:
                cache[(epoch, cursor)] = self._load(epoch, cursor, quiet)
            return cache[(epoch, cursor)]

        self._loaded = pieces(self._epoch, self._cursor) if state["loaded"] else None
        self._carry = [pieces(e, c)[p] for e, c, p in state["carry"]]
