"""`--prompts FILE.jsonl`: one JSON object per line, {"prompt": str, "answer": str, "id": str|int}.

Every problem with the file is found before the model runs and raised as a `PromptsError` that
names the file and line and what was expected; results go back out as JSON lines.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, Protocol

EXPECTED = 'expected JSON lines with "prompt" and "answer"'


class PromptsError(ValueError):
    """The prompts file is unusable; the message names `file:line` and what was expected."""


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    id: str
    prompt: str
    answer: str
    line: int  # 1-based line of the record in its file


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise PromptsError(f"{path}: cannot read the prompts file ({e.strerror or e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise PromptsError(f"{path}: not valid UTF-8 at byte offset {e.start} (line {line}: {e.reason})") from None


def _text_field(obj: dict, name: str, where: str) -> str:
    if name not in obj:
        raise PromptsError(f'{where}: missing "{name}" ({EXPECTED})')
    value = obj[name]
    if not isinstance(value, str):
        raise PromptsError(f'{where}: "{name}" must be a string, got {type(value).__name__}')
    if not value.strip():
        raise PromptsError(f'{where}: "{name}" is empty or only whitespace')
    return value


def _record_id(obj: dict, lineno: int, where: str) -> str:
    value = obj.get("id")
    if value is None:
        return f"line{lineno}"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise PromptsError(f'{where}: "id" must be a string or an integer, got {type(value).__name__}')
    return str(value)


def _parse_line(text: str, lineno: int, path: str) -> PromptRecord:
    where = f"{path}:{lineno}"
    try:
        obj: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptsError(f"{where}: bad JSON ({e.msg} at column {e.colno}); {EXPECTED}") from None
    if not isinstance(obj, dict):
        raise PromptsError(f"{where}: not a JSON object (got {type(obj).__name__}); {EXPECTED}")
    return PromptRecord(id=_record_id(obj, lineno, where), prompt=_text_field(obj, "prompt", where),
                        answer=_text_field(obj, "answer", where), line=lineno)


def load_prompts(path: str) -> list[PromptRecord]:
    """The records of a JSONL prompts file, in file order; blank lines are skipped."""
    records: list[PromptRecord] = []
    first_line_of: dict[str, int] = {}
    # split on "\n" only: str.splitlines would also break at U+2028, which JSON strings may hold.
    for lineno, text in enumerate(_read_text(path).split("\n"), start=1):
        if not text.strip():
            continue
        record = _parse_line(text, lineno, path)
        if record.id in first_line_of:
            raise PromptsError(f"{path}:{lineno}: duplicate id {record.id!r} (first on line {first_line_of[record.id]})")
        first_line_of[record.id] = lineno
        records.append(record)
    if not records:
        raise PromptsError(f"{path}: no records ({EXPECTED})")
    return records


def check_lengths(records: Sequence[PromptRecord], tokenizer: Encoder, max_tokens: int, max_new_tokens: int,
                  path: str) -> list[list[int]]:
    """The token ids of every prompt, after checking each prompt plus its answer fits the context."""
    all_ids = []
    for r in records:
        ids = list(tokenizer.encode(r.prompt))
        n = len(ids)
        if n == 0:
            raise PromptsError(f"{path}:{r.line}: prompt encodes to no tokens")
        if n + max_new_tokens > max_tokens:
            raise PromptsError(f"{path}:{r.line}: prompt is {n} tokens; with --max-new-tokens {max_new_tokens} "
                               f"it needs {n + max_new_tokens} > the model's context {max_tokens}")
        all_ids.append(ids)
    return all_ids


def write_results(path: str, records: Sequence[PromptRecord], continuations: Sequence[str],
                  correct: Sequence[bool]) -> None:
    """One JSON line per record: {"id", "answer", "continuation", "correct"}."""
    if not len(records) == len(continuations) == len(correct):
        raise ValueError(f"write_results: {len(records)} records, {len(continuations)} continuations, "
                         f"{len(correct)} results")
    with open(path, "w", encoding="utf-8") as f:
        for r, text, ok in zip(records, continuations, correct):
            row = {"id": r.id, "answer": r.answer, "continuation": text, "correct": bool(ok)}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
