"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark attention"): find a number in filler.

A prompt is the task intro, k repeats of a fixed filler block with the needle (a 5-digit pass
key, stated twice) inserted between whole repeats at a given depth, and a question the model
completes with the key. k is the largest count whose prompt fits the length's token budget
minus `reserve` tokens for the answer; the count is measured by encoding, never estimated, so
a sample is exactly as long as the tokenizer says. Keys come from (seed, length, depth index),
so the same seed always gives the same samples.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from jaxsb.evals.scoring import accuracy, accuracy_line, contains_answer

__all__ = ["FILLER", "INTRO", "QUESTION", "PasskeySample", "TextTokenizer", "accuracy_line", "build_prompt",
           "depths", "format_table", "is_correct", "make_samples", "needle", "prompt_prefix", "summarize"]

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = " What is the pass key? The pass key is"
_REPEAT = " " + FILLER  # every piece after the intro starts with a space, so pieces join as words
_KEY_RANGE = (10000, 100000)  # 5-digit keys


class TextTokenizer(Protocol):
    """What the task needs of a tokenizer (jaxsb.data.tokenizer.Tokenizer qualifies)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class PasskeySample:
    """One prompt; `needle_token_start` is the token index where the needle's text begins."""

    length: int  # the token budget the prompt was built for (prompt_tokens <= length - reserve)
    depth: float  # share of the filler before the needle (0: right after the intro)
    key: str
    prompt: str
    prompt_tokens: int
    needle_token_start: int
    id: str


def depths(n: int) -> list[float]:
    """n depths spread evenly over [0, 1]: the middles of n equal parts of the filler, so each
    sample stands for one part and none sits on the degenerate ends (at depth 1 the needle
    would be the question's own last sentence); a single depth is the middle."""
    if n < 1:
        raise ValueError(f"depths: n={n} must be >= 1")
    return [(i + 0.5) / n for i in range(n)]


def needle(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


def _repeats_before(repeats: int, depth: float) -> int:
    return round(depth * repeats)


def prompt_prefix(repeats: int, depth: float) -> str:
    """The text before the needle: the intro and the filler repeats that precede it."""
    return INTRO + _REPEAT * _repeats_before(repeats, depth)


def build_prompt(key: str, repeats: int, depth: float) -> str:
    """Intro, `repeats` filler blocks with the needle between whole blocks at `depth`, question."""
    after = repeats - _repeats_before(repeats, depth)
    return prompt_prefix(repeats, depth) + needle(key) + _REPEAT * after + QUESTION


def _draw_key(seed: int, length: int, depth_index: int) -> str:
    return str(np.random.default_rng([seed, length, depth_index]).integers(*_KEY_RANGE))


def _largest_fitting(fits: Callable[[int], bool], guess: int) -> int:
    """The largest k >= 1 with fits(k), given fits(1) and that fits is monotone (True, then False).
    Costs two calls when `guess` is right; otherwise gallops past it and bisects."""
    lo, hi, step = 1, max(guess, 2), 1
    while fits(hi):
        lo, hi, step = hi, hi + step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _repeats_for(tokenizer: TextTokenizer, key: str, depth: float, budget: int, length: int) -> int:
    """The largest filler repeat count whose prompt encodes to at most `budget` tokens."""
    count = functools.cache(lambda k: len(tokenizer.encode(build_prompt(key, k, depth))))
    if count(1) > budget:
        raise ValueError(f"passkey: length {length} is too short: even one filler repeat makes a "
                         f"{count(1)}-token prompt, more than the {budget} tokens left after the reserve")
    per_repeat = len(tokenizer.encode(_REPEAT * 8)) / 8
    guess = 1 + int((budget - count(1)) // max(per_repeat, 1.0))
    return _largest_fitting(lambda k: count(k) <= budget, guess)


def _make_sample(tokenizer: TextTokenizer, length: int, depth: float, key: str, reserve: int) -> PasskeySample:
    repeats = _repeats_for(tokenizer, key, depth, length - reserve, length)
    prompt = build_prompt(key, repeats, depth)
    return PasskeySample(length=length, depth=depth, key=key, prompt=prompt,
                         prompt_tokens=len(tokenizer.encode(prompt)),
                         needle_token_start=len(tokenizer.encode(prompt_prefix(repeats, depth))),
                         id=f"passkey-L{length}-d{depth:.2f}")


def make_samples(tokenizer: TextTokenizer, lengths: list[int], samples: int, seed: int,
                 reserve: int = 16) -> list[PasskeySample]:
    """`samples` prompts (one per depth of `depths(samples)`) for each token budget in `lengths`."""
    return [_make_sample(tokenizer, length, d, _draw_key(seed, length, i), reserve)
            for length in lengths for i, d in enumerate(depths(samples))]


def is_correct(sample_or_answer: PasskeySample | str, continuation: str) -> bool:
    answer = sample_or_answer.key if isinstance(sample_or_answer, PasskeySample) else sample_or_answer
    return contains_answer(answer, continuation)


def summarize(samples: list[PasskeySample], correct: list[bool]) -> dict:
    """{"accuracy": overall, "by_length": {L: acc}, "by_length_depth": {L: {depth: acc}}}."""
    if len(samples) != len(correct):
        raise ValueError(f"summarize: {len(samples)} samples but {len(correct)} results")
    groups: dict[int, dict[float, list[bool]]] = {}
    for s, c in zip(samples, correct):
        groups.setdefault(s.length, {}).setdefault(s.depth, []).append(bool(c))
    lengths = sorted(groups)
    return {
        "accuracy": accuracy(correct),
        "by_length": {L: accuracy([c for cs in groups[L].values() for c in cs]) for L in lengths},
        "by_length_depth": {L: {d: accuracy(groups[L][d]) for d in sorted(groups[L])} for L in lengths},
    }


def format_table(summary: dict) -> list[str]:
    """One row per length: accuracy at each depth ('-' where not run) and over the length."""
    by_depth = summary["by_length_depth"]
    columns = sorted({d for row in by_depth.values() for d in row})
    header = ["length", *(f"d={d:.2f}" for d in columns), "all"]
    rows = [[str(L), *(f"{by_depth[L][d]:.2f}" if d in by_depth[L] else "-" for d in columns),
             f"{summary['by_length'][L]:.4f}"] for L in by_depth]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [" | ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in [header, *rows]]
