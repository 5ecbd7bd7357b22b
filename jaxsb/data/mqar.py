"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology", arXiv 2312.04927).

An example of `length` tokens opens with `pairs` key-value pairs (k1 v1 k2 v2 ...), distinct keys
drawn from the lower half of the vocabulary and values from the upper half; the rest of the
sequence is noise (value-half tokens, so that a key never occurs by chance: with a small
vocabulary random keys would give the recall ambiguous targets) in which every key comes back once
as a query, followed by its value. Only
those values are targets: a model is right when, at a query key, it predicts the value that key
had in the context — recall over the distance between the pair and the query, which is what
sparse attention has to keep. Everything is a function of (seed, example index), so training
(data.kind=mqar, `MqarSource`) and evaluation (`python -m jaxsb.eval --task mqar`, the seed plus
EVAL_SEED_OFFSET) never share an example by accident and every run can be reproduced.
"""

from __future__ import annotations

import numpy as np

EVAL_SEED_OFFSET = 1_000_003  # evaluation examples: seed + this, apart from the training stream


def pairs_for(length: int, kv_fraction: float, vocab: int) -> int:
    """Key-value pairs of an example: kv_fraction of its tokens (two per pair), at least one, at
    most the distinct keys (vocab // 2) and at most what leaves room for every query."""
    pairs = max(1, int(length * kv_fraction) // 2)
    return min(pairs, vocab // 2, length // 4)


def example(rng: np.random.Generator, length: int, kv_fraction: float, vocab: int,
            pairs: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [length] int32, targets [length] bool): one MQAR example (module docstring) of
    `pairs` key-value pairs (default pairs_for(length, ...)); targets[j] says token j is a recalled
    value, predicted from token j - 1 (its query key)."""
    if length < 4:
        raise ValueError(f"an MQAR example needs length >= 4, got {length}")
    if vocab < 4 or vocab % 2:
        raise ValueError(f"the MQAR vocabulary must be even and >= 4, got {vocab}")
    half = vocab // 2
    pairs = pairs_for(length, kv_fraction, vocab) if pairs is None else pairs
    if not 1 <= pairs <= min(half, length // 4):
        raise ValueError(f"{pairs} pairs do not fit an MQAR example of {length} tokens and {vocab} ids")
    keys = rng.choice(half, size=pairs, replace=False)
    values = rng.integers(half, vocab, size=pairs)
    tokens = rng.integers(half, vocab, size=length)  # noise between the queries: never a key
    tokens[0:2 * pairs:2], tokens[1:2 * pairs:2] = keys, values
    slots = (length - 2 * pairs) // 2  # query slots: (key, value) at 2 * pairs + 2s, +1
    chosen = np.sort(rng.choice(slots, size=pairs, replace=False))
    order = rng.permutation(pairs)
    at = 2 * pairs + 2 * chosen
    tokens[at], tokens[at + 1] = keys[order], values[order]
    targets = np.zeros(length, bool)
    targets[at + 1] = True
    return tokens.astype(np.int32), targets


def examples(seed: int, lengths: list[int], count: int, kv_fraction: float, vocab: int):
    """`count` examples per length, example i of length L from rng [seed, L, i]."""
    return [example(np.random.default_rng([seed, L, i]), L, kv_fraction, vocab)
            for L in lengths for i in range(count)]


def recall_accuracy(predicted: np.ndarray, tokens: np.ndarray, targets: np.ndarray) -> tuple[int, int]:
    """(correct, total) over the targets: predicted[j - 1] (the argmax after token j - 1) ==
    tokens[j] wherever targets[j]."""
    hits = (predicted[..., :-1] == tokens[..., 1:]) & targets[..., 1:]
    return int(hits.sum()), int(targets[..., 1:].sum())
