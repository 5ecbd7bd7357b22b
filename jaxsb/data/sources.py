"""Document sources: numbered units (files, JSONL lines, pre-tokenized documents) read on demand.

A source is an indexable list of *units*. `read(unit, stats)` turns one unit into at most one
`Document` (or None, counted in `stats` under the reason it was skipped). Nothing is read or
tokenized up front beyond a cheap index (a sorted file list, the byte offsets of JSONL lines,
the boundaries of a token array), so the iterator's position is just (epoch, index into a
seeded permutation of units, piece within a split document) and resuming costs one read.

Bad input never crashes later: policies from DataConfig decide between a `DataError` whose
message names the file, the line or byte offset and what was expected, and a counted skip.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sysconfig
from collections.abc import Iterator

import numpy as np

from jaxsb.config import DataConfig
from jaxsb.data.stats import DataStats

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
CHAT_ROLES = ("system", "user", "assistant")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class DataError(ValueError):
    """Input data is unusable; the message names the file (and line/offset) and what was expected."""


@dataclasses.dataclass
class Document:
    """One training document: exactly one of text, ids (pre-tokenized) or messages is set."""

    origin: str  # "path", "path:line" or "path[doc i]", for messages
    text: str | None = None
    ids: np.ndarray | None = None
    targets: np.ndarray | None = None  # with ids: bool per id, which are trained targets (default all)
    messages: list[tuple[str, str]] | None = None  # (role, content), kind=chat

    def as_text(self) -> str:
        """Plain text of a text or chat document (chat rendered with the ChatML template)."""
        if self.messages is not None:
            return render_chat(self.messages)
        return self.text or ""


def render_chat(messages: list[tuple[str, str]]) -> str:
    """ChatML-like rendering: `<|im_start|>role\\ncontent<|im_end|>\\n` per message."""
    return "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The unit order of one epoch: a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def _decode(raw: bytes, policy: str, where: str, base_offset: int, stats: DataStats) -> str | None:
    """UTF-8 decode under data.on_undecodable; None means skipped (and counted)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if policy == "error":
            raise DataError(
                f"{where}: not valid UTF-8 at byte offset {base_offset + e.start} ({e.reason}); "
                f"set data.on_undecodable=skip or replace to continue past such input") from None
        if policy == "skip":
            stats.add("skipped_undecodable", origin=where)
            return None
        stats.add("replaced_undecodable", origin=where)
        return raw.decode("utf-8", errors="replace")


class Source:
    """Base class: `len(source)` units; `read(unit, stats)` -> Document | None."""

    kind = ""
    unit_name = "units"

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, unit: int, stats: DataStats) -> Document | None:
        raise NotImplementedError

    def describe(self) -> str:
        return f"kind={self.kind} path={self.cfg.path} ({len(self):,} {self.unit_name})"

    def looked_for(self) -> str:
        """What this source reads, for 'no usable text' errors."""
        return self.describe()

    def _malformed(self, where: str, expected: str, stats: DataStats) -> None:
        """A bad record or row, under data.on_malformed: a DataError naming it, or a counted skip."""
        if self.cfg.on_malformed == "error":
            raise DataError(f"{where}: expected {expected}; set data.on_malformed=skip to skip such {self.unit_name}")
        stats.add("skipped_malformed", origin=where)

    def texts(self, seed: int, stats: DataStats | None = None) -> Iterator[str]:
        """Document texts in the seeded order of epoch 0 (used to train a BPE tokenizer)."""
        stats = stats if stats is not None else DataStats()
        for unit in epoch_permutation(len(self), seed, 0):
            doc = self.read(int(unit), stats)
            if doc is not None and doc.ids is None:
                yield doc.as_text()


# ----------------------------------------------------------------------------- file trees


def _matches(name: str, extensions: tuple[str, ...]) -> bool:
    return "*" in extensions or name.endswith(tuple(extensions))


def walk_files(root: str, extensions: tuple[str, ...], exclude: frozenset[str] = frozenset()) -> list[str]:
    if os.path.isfile(root):
        return [root]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in exclude)
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if _matches(f, extensions))
    return sorted(found)


def largest_files(files: list[str], n: int) -> list[str]:
    """The n largest of `files` by byte size, largest first (ties: by path)."""
    return sorted(files, key=lambda p: (-os.path.getsize(p), p))[:n]


class FileTreeSource(Source):
    """One document per file (kind=text: a directory or file; kind=stdlib: Python's stdlib)."""

    unit_name = "files"

    def __init__(self, cfg: DataConfig, root: str, kind: str, exclude: frozenset[str] = frozenset()) -> None:
        super().__init__(cfg)
        self.kind, self.root = kind, root
        if not os.path.exists(root):
            raise DataError(f"{root}: no such file or directory (data.path for data.kind={kind})")
        self.files = walk_files(root, tuple(cfg.extensions), exclude)
        if not self.files:
            raise DataError(
                f"{root}: no files ending in {', '.join(cfg.extensions)} found "
                f"(data.kind={kind}; change data.extensions, '*' reads every file)")
        # held out for evaluation (e.g. eval --long-docs N on the same tree): never trained on
        self.held_out = largest_files(self.files, cfg.holdout_largest) if cfg.holdout_largest else []
        if len(self.held_out) >= len(self.files):
            raise DataError(f"{root}: data.holdout_largest={cfg.holdout_largest} leaves none of its "
                            f"{len(self.files)} files to train on")
        held = set(self.held_out)
        self.files = [f for f in self.files if f not in held]

    def __len__(self) -> int:
        return len(self.files)

    def describe(self) -> str:
        held = f"; the {len(self.held_out)} largest held out" if self.held_out else ""
        return f"kind={self.kind} path={self.root} ({len(self):,} files{held})"

    def looked_for(self) -> str:
        return f"{self.root}: files ending in {', '.join(self.cfg.extensions)} ({len(self):,} found)"

    def read(self, unit: int, stats: DataStats) -> Document | None:
        path = self.files[unit]
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror})") from None
        stats.add("files_read")
        if not raw.strip():
            stats.add("skipped_empty", origin=path)
            return None
        text = _decode(raw, self.cfg.on_undecodable, path, 0, stats)
        if text is None:
            return None
        if not text.strip():
            stats.add("skipped_empty", origin=path)
            return None
        return Document(origin=path, text=text)


# ----------------------------------------------------------------------------- JSONL


def _line_starts(path: str) -> np.ndarray:
    """Byte offsets of every line start (int64, plus the file size at the end)."""
    data = np.fromfile(path, dtype=np.uint8)
    ends = np.flatnonzero(data == 10) + 1  # one past each '\n'
    starts = np.concatenate([[0], ends]).astype(np.int64)
    if starts[-1] != data.size:  # last line without a trailing newline
        starts = np.append(starts, data.size)
    return starts


class JsonlSource(Source):
    """One record per JSONL line; kind=jsonl reads `text_field`, kind=chat reads `messages`."""

    unit_name = "records"

    def __init__(self, cfg: DataConfig, kind: str) -> None:
        super().__init__(cfg)
        self.kind = kind
        path = cfg.path
        if not os.path.exists(path):
            raise DataError(f"{path}: no such file or directory (data.path for data.kind={kind})")
        self.files = walk_files(path, (".jsonl",)) if os.path.isdir(path) else [path]
        if not self.files:
            raise DataError(f"{path}: no files ending in .jsonl found (data.kind={kind})")
        self.starts = [_line_starts(f) for f in self.files]
        counts = np.array([len(s) - 1 for s in self.starts], dtype=np.int64)
        self.first_unit = np.concatenate([[0], np.cumsum(counts)])
        if self.first_unit[-1] == 0:
            raise DataError(f"{path}: no lines in {', '.join(self.files)} (data.kind={kind} expects JSONL records)")

    def __len__(self) -> int:
        return int(self.first_unit[-1])

    def describe(self) -> str:
        return f"kind={self.kind} path={self.cfg.path} ({len(self.files)} .jsonl files, {len(self):,} lines)"

    def looked_for(self) -> str:
        what = f"string field {self.cfg.text_field!r}" if self.kind == "jsonl" else "'messages' lists"
        return f"{self.cfg.path}: JSONL records with a {what} in {len(self.files)} file(s), {len(self):,} lines"

    def read(self, unit: int, stats: DataStats) -> Document | None:
        fi = int(np.searchsorted(self.first_unit, unit, side="right") - 1)
        line = unit - int(self.first_unit[fi])
        path = self.files[fi]
        start, end = int(self.starts[fi][line]), int(self.starts[fi][line + 1])
        with open(path, "rb") as f:
            f.seek(start)
            raw = f.read(end - start)
        stats.add("records_read")
        where = f"{path}:{line + 1}"
        if not raw.strip():
            stats.add("skipped_blank_lines")
            return None
        text = _decode(raw, self.cfg.on_undecodable, where, start, stats)
        if text is None:
            return None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            self._malformed(where, f"a JSON object per line, got invalid JSON ({e.msg} at column {e.colno})", stats)
            return None
        if not isinstance(record, dict):
            self._malformed(where, f"a JSON object, got {type(record).__name__}", stats)
            return None
        if self.kind == "chat":
            return self._chat(record, where, stats)
        field = self.cfg.text_field
        if field not in record:
            self._malformed(where, f"a string field {field!r}; the record has keys {sorted(record)[:8]}", stats)
            return None
        value = record[field]
        if not isinstance(value, str):
            self._malformed(where, f"field {field!r} to be a string, got {type(value).__name__}", stats)
            return None
        if not value.strip():
            stats.add("skipped_empty", origin=where)
            return None
        return Document(origin=where, text=value)

    def _chat(self, record: dict, where: str, stats: DataStats) -> Document | None:
        if "messages" not in record:
            self._malformed(where, "a 'messages' list of {'role', 'content'} objects, got no 'messages' key", stats)
            return None
        return chat_document(record["messages"], where, stats, lambda expected: self._malformed(where, expected, stats))


def chat_document(messages, where: str, stats: DataStats, malformed) -> Document | None:
    """A chat Document from a record's `messages` (a list of {"role", "content"} objects), or None:
    `malformed(expected)` is called (it raises or counts, per data.on_malformed) for a bad list,
    an empty list is counted as skipped_empty."""
    if not isinstance(messages, list):
        malformed(f"a 'messages' list of {{'role', 'content'}} objects, got 'messages' of type "
                  f"{type(messages).__name__}")
        return None
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            malformed(f"messages[{i}] to be an object, got {type(m).__name__}")
            return None
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            malformed(f"messages[{i}].role in {', '.join(CHAT_ROLES)}, got {role!r}")
            return None
        if not isinstance(content, str):
            malformed(f"messages[{i}].content to be a string, got {type(content).__name__}")
            return None
        out.append((role, content))
    if not out:
        stats.add("skipped_empty", origin=where)
        return None
    return Document(origin=where, messages=out)


# ----------------------------------------------------------------------------- pre-tokenized


class TokenArraySource(Source):
    """Pre-tokenized documents: a .npz with `tokens` (1-D ids) and `offsets` (document starts or
    boundaries), or a .npy of concatenated ids in which every document ends with the eos id.

    Offsets may omit the leading 0 and the trailing len(tokens); they must be non-decreasing
    and within [0, len(tokens)]. Every id must lie in [0, vocab_size)."""

    kind = "tokens"
    unit_name = "documents"

    def __init__(self, cfg: DataConfig, vocab_size: int, eos_id: int) -> None:
        super().__init__(cfg)
        path = cfg.path
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file (data.kind=tokens expects a .npz with 'tokens' and "
                            f"'offsets', or a .npy of ids with eos={eos_id} ending each document)")
        try:
            if path.endswith(".npz"):
                with np.load(path, allow_pickle=False) as z:
                    if "tokens" not in z.files or "offsets" not in z.files:
                        raise DataError(f"{path}: expected arrays 'tokens' and 'offsets', found {sorted(z.files)}")
                    tokens, offsets = z["tokens"], z["offsets"]
            elif path.endswith(".npy"):
                tokens = np.load(path, mmap_mode="r", allow_pickle=False)
                offsets = None
            else:
                raise DataError(f"{path}: data.kind=tokens expects a .npz or .npy file")
        except (ValueError, OSError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{path}: cannot load as a numpy array file ({e})") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"{path}: expected 'tokens' to be a 1-D integer array, got shape "
                            f"{tokens.shape} dtype {tokens.dtype}")
        if tokens.size:
            bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
            if bad.size:
                i = int(bad[0])
                raise DataError(f"{path}: token id {int(tokens[i])} at index {i} is outside the vocabulary "
                                f"[0, {vocab_size}) ({bad.size} such ids); wrong tokenizer?")
        n = tokens.size
        if offsets is None:
            bounds = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
        else:
            if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
                raise DataError(f"{path}: expected 'offsets' to be a 1-D integer array, got shape "
                                f"{offsets.shape} dtype {offsets.dtype}")
            bounds = offsets.astype(np.int64)
            dec = np.flatnonzero(np.diff(bounds) < 0)
            if dec.size:
                i = int(dec[0])
                raise DataError(f"{path}: 'offsets' must be non-decreasing; offsets[{i}]={bounds[i]} > "
                                f"offsets[{i + 1}]={bounds[i + 1]}")
            if bounds.size and (bounds[0] < 0 or bounds[-1] > n):
                raise DataError(f"{path}: 'offsets' must lie in [0, {n}] (len(tokens)), got "
                                f"[{bounds[0]}, {bounds[-1]}]")
        bounds = np.asarray(bounds, dtype=np.int64)
        if not bounds.size or bounds[0] != 0:
            bounds = np.concatenate([[0], bounds])
        if bounds[-1] != n:
            bounds = np.append(bounds, n)
        self.path, self.tokens, self.bounds, self.eos_id = path, tokens, bounds, eos_id
        if len(self) == 0:
            raise DataError(f"{path}: no documents (empty token array)")

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def read(self, unit: int, stats: DataStats) -> Document | None:
        stats.add("records_read")
        where = f"{self.path}[doc {unit}]"
        a, b = int(self.bounds[unit]), int(self.bounds[unit + 1])
        if a == b:
            stats.add("skipped_empty", origin=where)
            return None
        return Document(origin=where, ids=np.asarray(self.tokens[a:b], dtype=np.int32))


class MqarSource(Source):
    """Synthetic multi-query associative recall examples (jaxsb/data/mqar.py): unit i is example i
    of the seeded stream, `data.mqar.lengths[i % len]` tokens long with the eos, its recalled
    values the only targets."""

    kind = "mqar"
    unit_name = "examples"

    def __init__(self, cfg: DataConfig, vocab_size: int, eos_id: int) -> None:
        super().__init__(cfg)
        if cfg.mqar.vocab > vocab_size:
            raise DataError(f"data.mqar.vocab={cfg.mqar.vocab} ids do not fit the tokenizer's vocabulary of "
                            f"{vocab_size} (tokenizer.kind=bytes covers 256)")
        if eos_id < cfg.mqar.vocab:
            raise DataError(f"the tokenizer's eos id {eos_id} lies inside the MQAR ids [0, {cfg.mqar.vocab}): "
                            "use tokenizer.kind=bytes (eos 258) or a smaller data.mqar.vocab")

    def __len__(self) -> int:
        return self.cfg.mqar.examples

    def describe(self) -> str:
        m = self.cfg.mqar
        return f"kind=mqar lengths={list(m.lengths)} kv_fraction={m.kv_fraction} vocab={m.vocab} ({len(self):,} examples)"

    def read(self, unit: int, stats: DataStats) -> Document | None:
        from jaxsb.data.mqar import example, pairs_for

        stats.add("records_read")
        m = self.cfg.mqar
        length = m.lengths[unit % len(m.lengths)]
        # length - 1 tokens and the eos; the pairs of a `length`-token example, as the evaluation's
        # (unless the one token less leaves no room for them)
        pairs = min(pairs_for(length, m.kv_fraction, m.vocab), (length - 1) // 4)
        tokens, targets = example(np.random.default_rng([self.cfg.seed, unit]), length - 1, m.kv_fraction, m.vocab,
                                  pairs)
        return Document(origin=f"mqar[{unit}]", ids=tokens, targets=targets)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]
