"""The Plan: the one object between planning and execution.

A plan has two parts:

* the **template** (`Template`, frozen and hashable): the number of micro-batches and, per
  micro-batch, its groups — each a contiguous run of devices with a degree and an attention
  scheme — and the per-device buffer sizes, taken from a small set of buckets. The executor
  compiles one program per template, so a run compiles a bounded number of programs;
* the **data**: the sequence lengths, where each sequence goes (micro-batch, group, and
  whether it is sharded over the group or kept whole on one of its ranks) and each
  sequence's sparse-attention budget. Data changes every step without recompiling.

A plan's sequences are the batch's documents, in order — unless the plan has `parts`: then
sequence i is the token range [start, start + lengths[i]) of document `parts[i].document`
(Seq1F1B-style splitting of a long document over consecutive micro-batches, which only the
pipeline setting of the simulator plans: the executor refuses such plans). Every document of
such a plan (split or whole) runs in degree-1 groups; the parts of a document tile it in order
from token 0, sit on the same device in consecutive micro-batches, and each later part attends
to the keys and values of the earlier ones.

Schemes: ``local`` (degree 1, no communication), ``ulysses`` (all-to-all sequence <-> heads)
and ``ring`` (key/value blocks passed around the group). Rules, checked by `validate`:

* groups of a micro-batch tile its devices in order (group i starts where i-1 ends); a
  micro-batch may leave trailing devices idle only by giving them empty degree-1 groups;
* ``local`` groups have degree 1; a degree-1 group is always ``local``;
* what the executor can run is narrower (jaxsb/plan/executable.py); the simulator may cost
  plans beyond that (FlexSP's heterogeneous all-to-all groups);
* Skrull's mix: in a group of degree d > 1 a sequence is either *sharded* over all d ranks
  (`Placement.rank == SHARDED`) or kept *whole* on rank r (`rank == r`). Each device's buffer
  has a *shard region* (`MicroBatch.shard_len` tokens: its part of the group's sharded stream,
  or whole sequences in a degree-1 group) followed by a *local region*
  (`MicroBatch.local_len` tokens: whole sequences attended to without communication).

Buffer sizes: `shard_needed` / `local_needed` give the tokens a device needs for a group's
sequences under its scheme's layout (see jaxsb/plan/layout.py); `build_plan` rounds the
largest up to a bucket (`BUFFER_BUCKETS`: 128, then 2^k and 1.5·2^k multiples of 128).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

SCHEMES = ("local", "ulysses", "ring")
SHARDED = -1  # Placement.rank of a sequence split over its whole group


def _buckets(limit: int = 1 << 24) -> tuple[int, ...]:
    """128 and then 2^k and 1.5 * 2^k multiples of 128: at most ~33% padding per buffer."""
    out, b = [128], 256
    while b <= limit:
        out += [b, b * 3 // 2]
        b *= 2
    return tuple(out)


BUFFER_BUCKETS = _buckets()  # 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, ...


def bucket(tokens: int, buckets: Sequence[int] = BUFFER_BUCKETS) -> int:
    """The smallest bucket >= tokens (0 stays 0)."""
    if tokens <= 0:
        return 0
    for b in buckets:
        if b >= tokens:
            return b
    raise PlanError(f"{tokens} tokens per device exceed the largest buffer bucket {buckets[-1]}")


class PlanError(ValueError):
    """An infeasible or malformed plan; the message names the micro-batch, group or sequence."""


@dataclasses.dataclass(frozen=True)
class Group:
    """A contiguous run of devices [start, start + degree) running one attention scheme."""

    start: int
    degree: int
    scheme: str

    @property
    def devices(self) -> range:
        return range(self.start, self.start + self.degree)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Template of one micro-batch: its groups and the per-device buffer regions."""

    groups: tuple[Group, ...]
    shard_len: int  # tokens per device in the shard region
    local_len: int = 0  # tokens per device in the local (whole-sequence) region

    @property
    def tokens_per_device(self) -> int:
        return self.shard_len + self.local_len

    @property
    def scheme(self) -> str:
        """The scheme of the micro-batch's multi-device groups ('local' if it has none)."""
        multi = {g.scheme for g in self.groups if g.degree > 1}
        return multi.pop() if multi else "local"

    def degrees(self) -> str:
        return ",".join(str(g.degree) for g in self.groups)


@dataclasses.dataclass(frozen=True)
class Template:
    """What the executor compiles: hashable, compared by value."""

    num_devices: int
    microbatches: tuple[MicroBatch, ...]

    def summary(self) -> str:
        """e.g. '4,2,1,1|8' — groups per micro-batch, micro-batches separated by '|'."""
        return "|".join(mb.degrees() for mb in self.microbatches)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one sequence goes: micro-batch, group index in it, SHARDED or a rank of the group."""

    microbatch: int
    group: int
    rank: int = SHARDED


@dataclasses.dataclass(frozen=True)
class Part:
    """Which document a sequence of a split plan is a part of, and its first token there."""

    document: int
    start: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """Template + data. `lengths[i]`, `placements[i]`, `budgets[i]` (and `parts[i]`) describe
    sequence i."""

    template: Template
    lengths: tuple[int, ...]
    placements: tuple[Placement, ...]
    budgets: tuple[int, ...] | None = None  # sparse budget (key blocks) per sequence
    planner: str = ""
    predicted_ms: float = float("nan")  # the cost model's step time, if the planner has one
    parts: tuple[Part, ...] | None = None  # None: sequence i is document i, whole

    def document_of(self, i: int) -> int:
        return i if self.parts is None else self.parts[i].document

    def span_of(self, i: int) -> tuple[int, int]:
        """(first token of sequence i in its document, the document's length)."""
        if self.parts is None:
            return 0, self.lengths[i]
        return self.parts[i].start, self.document_lengths()[self.parts[i].document]

    def parts_of(self, document: int) -> list[int]:
        """The sequence ids of a document, in token order ([document] when nothing is split)."""
        return [document] if self.parts is None else list(self._documents[1].get(document, ()))

    def document_lengths(self) -> tuple[int, ...]:
        """Per document of the batch its length (the plan's lengths when nothing is split)."""
        if self.parts is None:
            return self.lengths
        return self._documents[0]

    @functools.cached_property
    def _documents(self) -> tuple[tuple[int, ...], dict[int, list[int]]]:
        """(document lengths, {document: its sequence ids in token order})."""
        parts: dict[int, list[int]] = {}
        for i, p in enumerate(self.parts or ()):
            parts.setdefault(p.document, []).append(i)
        for ids in parts.values():
            ids.sort(key=lambda i: self.parts[i].start)
        n_docs = max(parts, default=-1) + 1
        return tuple(sum(self.lengths[i] for i in parts.get(d, ())) for d in range(n_docs)), parts

    def sequences_of(self, microbatch: int, group: int) -> tuple[list[int], dict[int, list[int]]]:
        """(sharded sequence ids, {rank: whole sequence ids}) of one group, in input order."""
        sharded, local = self._members.get((microbatch, group), ((), {}))
        return list(sharded), {rank: list(ids) for rank, ids in local.items()}

    @functools.cached_property
    def _members(self) -> dict:
        """{(microbatch, group): (sharded ids, {rank: whole ids})}, made once per plan (plans of
        thousands of sequences and groups are costed group by group)."""
        out: dict = {}
        for i, p in enumerate(self.placements):
            sharded, local = out.setdefault((p.microbatch, p.group), ([], {}))
            if p.rank == SHARDED:
                sharded.append(i)
            else:
                local.setdefault(p.rank, []).append(i)
        return out

    def summary(self) -> str:
        return self.template.summary()

    def with_budgets(self, budgets: Sequence[int]) -> "Plan":
        """The same layout with these per-sequence budgets (each >= 1)."""
        budgets = tuple(int(b) for b in budgets)
        if len(budgets) != len(self.lengths):
            raise PlanError(f"{len(self.lengths)} sequences but {len(budgets)} budgets")
        if budgets and min(budgets) < 1:
            i = min(range(len(budgets)), key=budgets.__getitem__)
            raise PlanError(f"sequence {i}: budget {budgets[i]} must be >= 1")
        return dataclasses.replace(self, budgets=budgets)


# ----------------------------------------------------------------------- buffer arithmetic


def padded_length(n: int, align: int) -> int:
    """A sequence's footprint in a buffer: rounded up to `align` (the sparse block size, else 1)."""
    return -(-n // align) * align


def shard_needed(scheme: str, degree: int, lengths: Sequence[int], align: int = 1) -> int:
    """Tokens per device for a group's sharded sequences, laid out as jaxsb/plan/layout.py
    does: the concatenated stream is padded once (not per sequence) to a multiple of degree
    (ulysses: contiguous chunks) or 2·degree (ring: zigzag chunks, each a whole number of
    `align` blocks, so that routed sparse blocks never straddle two chunks)."""
    stream = sum(padded_length(n, align) for n in lengths)
    if stream == 0:
        return 0
    if degree == 1:
        return stream
    if scheme == "ring":
        return 2 * padded_length(-(-stream // (2 * degree)), align)
    return -(-stream // degree)


def ring_shard_len(shard_len: int, align: int) -> int:
    """A ring micro-batch's buffer: two zigzag chunks of whole `align` blocks each."""
    return padded_length(shard_len, 2 * align)


def local_needed(lengths: Sequence[int], align: int = 1) -> int:
    return sum(padded_length(n, align) for n in lengths)


# ------------------------------------------------------------------------------ building


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """A planner's description of one group: degree, scheme, and its sequences.

    `sharded`: ids of sequences split over the group; `local`: per rank, ids kept whole there
    (Skrull); a degree-1 group holds its sequences in `sharded`."""

    degree: int
    scheme: str
    sharded: tuple[int, ...] = ()
    local: tuple[tuple[int, ...], ...] = ()


def build_plan(num_devices: int, microbatches: Sequence[Sequence[GroupSpec]], lengths: Sequence[int], *,
               budgets: Sequence[int] | None = None, align: int = 1,
               buckets: Sequence[int] = BUFFER_BUCKETS, planner: str = "",
               predicted_ms: float = float("nan"), parts: Sequence[Part] | None = None) -> Plan:
    """Turns per-micro-batch group lists into a validated Plan (`parts`: see the module docstring).

    Groups are placed on consecutive devices in the given order; devices left over at the end
    of a micro-batch get empty degree-1 groups. Buffer sizes are the largest need of any group
    rounded up to a bucket."""
    lengths = tuple(int(n) for n in lengths)
    mbs, placements = [], {}
    for m, specs in enumerate(microbatches):
        groups, shard_need, local_need, start = [], 0, 0, 0
        for g, spec in enumerate(specs):
            scheme = "local" if spec.degree == 1 else spec.scheme
            groups.append(Group(start, spec.degree, scheme))
            start += spec.degree
            if spec.degree == 1:  # whole sequences, all in the shard region
                spec = GroupSpec(1, "local", tuple(spec.sharded) + tuple(i for ids in spec.local for i in ids))
            for i in spec.sharded:
                _place(placements, i, Placement(m, g, SHARDED), lengths)
            for r, ids in enumerate(spec.local):
                for i in ids:
                    _place(placements, i, Placement(m, g, r), lengths)
                local_need = max(local_need, local_needed([lengths[i] for i in ids], align))
            shard_need = max(shard_need, shard_needed(scheme, spec.degree,
                                                      [lengths[i] for i in spec.sharded], align))
        if start > num_devices:
            raise PlanError(f"micro-batch {m}: groups use {start} devices, only {num_devices} exist "
                            f"(degrees {[s.degree for s in specs]})")
        groups += [Group(d, 1, "local") for d in range(start, num_devices)]
        shard_len = bucket(shard_need, buckets)
        if any(grp.scheme == "ring" for grp in groups):
            shard_len = ring_shard_len(shard_len, align)
        mbs.append(MicroBatch(tuple(groups), shard_len, bucket(local_need, buckets)))
    missing = [i for i in range(len(lengths)) if i not in placements]
    if missing:
        raise PlanError(f"sequences {missing[:10]} (lengths {[lengths[i] for i in missing[:10]]}) are placed "
                        f"nowhere{' (and more)' if len(missing) > 10 else ''}")
    plan = Plan(Template(num_devices, tuple(mbs)), lengths,
                tuple(placements[i] for i in range(len(lengths))),
                None if budgets is None else tuple(int(b) for b in budgets), planner, predicted_ms,
                None if parts is None else tuple(parts))
    validate(plan, align)
    return plan


def _place(placements: dict, i: int, p: Placement, lengths) -> None:
    if not 0 <= i < len(lengths):
        raise PlanError(f"sequence id {i} out of range: the batch has {len(lengths)} sequences")
    if i in placements:
        raise PlanError(f"sequence {i} (length {lengths[i]}) placed twice: {placements[i]} and {p}")
    placements[i] = p


# ----------------------------------------------------------------------------- validation


def validate(plan: Plan, align: int = 1) -> Plan:
    """Raises PlanError naming the first problem; returns the plan unchanged when it is valid."""
    t = plan.template
    if len(plan.placements) != len(plan.lengths):
        raise PlanError(f"{len(plan.lengths)} lengths but {len(plan.placements)} placements")
    if plan.budgets is not None and len(plan.budgets) != len(plan.lengths):
        raise PlanError(f"{len(plan.lengths)} sequences but {len(plan.budgets)} budgets")
    for i, n in enumerate(plan.lengths):
        if n < 1:
            raise PlanError(f"sequence {i} has length {n}; lengths must be >= 1")
    for m, mb in enumerate(t.microbatches):
        where = f"micro-batch {m} (groups {mb.degrees()})"
        nxt = 0
        for g, group in enumerate(mb.groups):
            if group.scheme not in SCHEMES:
                raise PlanError(f"{where} group {g}: scheme {group.scheme!r} is not one of {SCHEMES}")
            if group.degree < 1:
                raise PlanError(f"{where} group {g}: degree {group.degree} must be >= 1")
            if group.start != nxt:
                raise PlanError(f"{where} group {g} starts at device {group.start}, expected {nxt}: "
                                "groups must tile the devices in order without overlap")
            if (group.degree == 1) != (group.scheme == "local"):
                raise PlanError(f"{where} group {g}: degree {group.degree} with scheme {group.scheme!r} "
                                "(degree 1 is exactly the 'local' scheme)")
            nxt += group.degree
        if nxt != t.num_devices:
            raise PlanError(f"{where}: groups cover {nxt} devices, the plan has {t.num_devices} "
                            f"({'over-used' if nxt > t.num_devices else 'some devices unassigned'})")
        for g, group in enumerate(mb.groups):
            sharded, local = plan.sequences_of(m, g)
            need = shard_needed(group.scheme, group.degree, [plan.lengths[i] for i in sharded], align)
            if need > mb.shard_len:
                raise PlanError(f"{where} group {g}: sequences {sharded} need {need} tokens per device in "
                                f"the shard region, buffer holds {mb.shard_len}")
            for r, ids in local.items():
                if not 0 <= r < group.degree:
                    raise PlanError(f"{where} group {g}: sequences {ids} placed on rank {r}, "
                                    f"group degree {group.degree}")
                need = local_needed([plan.lengths[i] for i in ids], align)
                if need > mb.local_len:
                    raise PlanError(f"{where} group {g} rank {r}: local sequences {ids} need {need} "
                                    f"tokens, the local region holds {mb.local_len}")
    for i, p in enumerate(plan.placements):
        if not 0 <= p.microbatch < len(t.microbatches):
            raise PlanError(f"sequence {i}: micro-batch {p.microbatch} does not exist")
        if not 0 <= p.group < len(t.microbatches[p.microbatch].groups):
            raise PlanError(f"sequence {i}: group {p.group} does not exist in micro-batch {p.microbatch}")
        if p.rank != SHARDED and t.microbatches[p.microbatch].groups[p.group].degree == 1:
            raise PlanError(f"sequence {i}: degree-1 groups hold sequences as SHARDED (whole), got rank {p.rank}")
    if plan.parts is not None:
        _validate_parts(plan)
    return plan


def _validate_parts(plan: Plan) -> None:
    """A split plan's rules (module docstring): every document 0..D-1 tiled in order from token
    0 by parts in one degree-1 group of consecutive micro-batches."""
    if len(plan.parts) != len(plan.lengths):
        raise PlanError(f"{len(plan.lengths)} sequences but {len(plan.parts)} parts")
    for i, part in enumerate(plan.parts):
        if part.document < 0:
            raise PlanError(f"sequence {i}: part of document {part.document}; documents are numbered from 0")
    doc_lengths, parts = plan._documents
    for d in range(len(doc_lengths)):
        ids = parts.get(d, [])
        if not ids:
            raise PlanError(f"document {d} has no part (the plan's parts name documents up to {len(doc_lengths) - 1})")
        at = 0
        for j, i in enumerate(ids):
            part, place = plan.parts[i], plan.placements[i]
            if part.start != at:
                raise PlanError(f"document {d}: part {j} (sequence {i}) starts at token {part.start}, expected {at}: "
                                "parts must tile their document in order")
            at += plan.lengths[i]
            if plan.template.microbatches[place.microbatch].groups[place.group].degree != 1:
                raise PlanError(f"document {d}: part {j} (sequence {i}) is in a group of degree "
                                f"{plan.template.microbatches[place.microbatch].groups[place.group].degree}; "
                                "split documents run whole on one rank per part (degree-1 groups)")
            if j:
                prev = plan.placements[ids[j - 1]]
                device = plan.template.microbatches[place.microbatch].groups[place.group].start
                before = plan.template.microbatches[prev.microbatch].groups[prev.group].start
                if (device, place.microbatch) != (before, prev.microbatch + 1):
                    raise PlanError(f"document {d}: part {j} (sequence {i}) is in micro-batch {place.microbatch} "
                                    f"on device {device}, expected micro-batch {prev.microbatch + 1} on device "
                                    f"{before}: a document's parts follow each other on one rank")
