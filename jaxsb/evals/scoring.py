"""Scoring shared by the evaluation tasks: answer-in-continuation matching and accuracy."""

from __future__ import annotations


def contains_answer(answer: str, continuation: str) -> bool:
    """True when the answer (surrounding whitespace stripped) occurs anywhere in the continuation."""
    needle = answer.strip()
    if not needle:
        raise ValueError(f"contains_answer: empty answer {answer!r} would match any continuation")
    return needle in continuation


def accuracy(correct: list[bool]) -> float:
    """Fraction of True entries."""
    if not correct:
        raise ValueError("accuracy: no results to score (empty list)")
    return sum(bool(c) for c in correct) / len(correct)


def accuracy_line(correct: list[bool]) -> str:
    """The last line an evaluation prints, e.g. 'accuracy: 0.9167'."""
    return f"accuracy: {accuracy(correct):.4f}"
