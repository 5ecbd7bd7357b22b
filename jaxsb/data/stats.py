"""Counters for everything the data pipeline reads, skips, splits, truncates, drops and packs.

The "no silent loss" invariant (docs/DESIGN.md) is kept by counting: every document read is
either packed (maybe in pieces) or counted under a named reason, and every next-token target
the sources produced is either packed or counted as truncated/dropped. The counters are part
of the iterator's checkpointed state, so a resumed run reports the same totals as an
uninterrupted one. A few example origins ("file:line") are kept per reason so a summary says
*which* inputs were skipped, not only how many.
"""

from __future__ import annotations

from typing import Any

# Every counter, in summary order. Units: files/records/documents are counts of inputs,
# *_tokens and *_targets count token ids and next-token targets.
COUNTERS = (
    "files_read",  # stdlib/text files read (once per epoch each)
    "records_read",  # JSONL lines / pre-tokenized documents read
    "docs_accepted",  # documents that produced at least one piece
    "tokens_produced",  # tokens of accepted documents (eos included), before the long policy
    "targets_produced",  # trainable next-token targets of accepted documents
    "skipped_empty",  # empty or whitespace-only file/record/document
    "skipped_blank_lines",  # blank lines in JSONL files (no record there)
    "skipped_undecodable",  # not valid UTF-8, on_undecodable=skip
    "replaced_undecodable",  # not valid UTF-8, decoded with U+FFFD, on_undecodable=replace
    "skipped_malformed",  # bad JSON / missing or mistyped field, on_malformed=skip
    "skipped_short",  # fewer than 2 tokens: no next-token target
    "skipped_no_targets",  # chat record without an assistant turn: nothing to train on
    "split_docs",  # longer than max_len, long_policy=split
    "split_pieces",  # pieces those documents became
    "truncated_docs",  # long_policy=truncate
    "truncated_tokens",
    "truncated_targets",
    "dropped_long_docs",  # long_policy=drop
    "dropped_long_tokens",
    "dropped_long_targets",
    "epochs_completed",
    "steps",
    "pieces_packed",  # pieces handed to steps (packed into rows, or to a planner)
    "tokens_packed",
    "targets_packed",
    "padding_tokens",  # the rows path's padding (a planned step's is in its metrics)
    "carried_pieces",  # pieces that did not fit a step's rows and went to the next step
)

# Reasons whose example origins are remembered (a few each) for the summary.
EXAMPLE_REASONS = (
    "skipped_empty", "skipped_undecodable", "replaced_undecodable", "skipped_malformed",
    "skipped_short", "skipped_no_targets", "truncated_docs", "dropped_long_docs",
)
MAX_EXAMPLES = 3


class DataStats:
    """Named integer counters plus a few example origins per skip/loss reason."""

    def __init__(self, description: str = "") -> None:
        self.description = description
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.examples: dict[str, list[str]] = {}

    def add(self, name: str, n: int = 1, origin: str | None = None) -> None:
        if name not in self.counts:
            raise KeyError(f"unknown data counter {name!r}; known: {', '.join(COUNTERS)}")
        self.counts[name] += int(n)
        if origin is not None and name in EXAMPLE_REASONS:
            seen = self.examples.setdefault(name, [])
            if len(seen) < MAX_EXAMPLES:
                seen.append(origin)

    def __getitem__(self, name: str) -> int:
        return self.counts[name]

    def as_dict(self) -> dict[str, int]:
        """Flat counters, for metrics logging."""
        return dict(self.counts)

    def state(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "examples": {k: list(v) for k, v in self.examples.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        self.counts = dict.fromkeys(COUNTERS, 0)
        for k, v in state.get("counts", {}).items():
            if k in self.counts:
                self.counts[k] = int(v)
        self.examples = {k: list(v) for k, v in state.get("examples", {}).items()}

    def summary(self) -> str:
        """A readable multi-line report of what was read, skipped, cut and packed."""
        c = self.counts

        def n(x: int) -> str:
            return f"{x:,}"

        def pct(part: int, whole: int) -> str:
            return f"{100.0 * part / whole:.1f}%" if whole else "0.0%"

        lines = [f"data: {self.description}" if self.description else "data:"]
        lines.append(
            f"  read: {n(c['files_read'])} files, {n(c['records_read'])} records; "
            f"{n(c['epochs_completed'])} full epochs done")
        lines.append(
            f"  accepted: {n(c['docs_accepted'])} documents, {n(c['tokens_produced'])} tokens, "
            f"{n(c['targets_produced'])} targets")
        lines.append(
            f"  skipped: {n(c['skipped_empty'])} empty, {n(c['skipped_undecodable'])} undecodable, "
            f"{n(c['skipped_malformed'])} malformed, {n(c['skipped_short'])} shorter than 2 tokens, "
            f"{n(c['skipped_no_targets'])} without trainable tokens, "
            f"{n(c['skipped_blank_lines'])} blank JSONL lines")
        if c["replaced_undecodable"]:
            lines.append(f"  undecodable bytes replaced with U+FFFD in {n(c['replaced_undecodable'])} inputs")
        lines.append(
            f"  long documents: {n(c['split_docs'])} split into {n(c['split_pieces'])} pieces; "
            f"{n(c['truncated_docs'])} truncated ({n(c['truncated_targets'])} targets lost); "
            f"{n(c['dropped_long_docs'])} dropped ({n(c['dropped_long_targets'])} targets lost)")
        slots = c["tokens_packed"] + c["padding_tokens"]
        lines.append(
            f"  packed: {n(c['steps'])} steps, {n(c['pieces_packed'])} pieces, {n(c['tokens_packed'])} tokens, "
            f"{n(c['targets_packed'])} targets; padding {pct(c['padding_tokens'], slots)}; "
            f"{n(c['carried_pieces'])} pieces carried to a later step")
        for reason in EXAMPLE_REASONS:
            if self.examples.get(reason):
                lines.append(f"  e.g. {reason}: {', '.join(self.examples[reason])}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        nonzero = {k: v for k, v in self.counts.items() if v}
        return f"DataStats({nonzero})"
