"""Coverage curves for choosing budgets: C(k) per sequence, floors, synthetic and measured curves.

A sequence's curve is an array `c` of length K with `c[k - 1] = C(k)`, the routing mass its
query blocks keep with their k best key blocks (the router's definition,
`jaxsb.models.router.coverage_curves`): non-decreasing, in [0, 1], 1 once k covers every
visible block. The quality rule of SparseBalance (`../shared/notes/sparsebalance.md`): a budget
k may replace the base budget only while the drop `C(k_base) - C(k)` is at most p; `k_min` is
the smallest such k, the floor.

* `synthetic_curve(length, alpha, block, max_k)`: query block i (0-based) sees i + 1 key
  blocks whose sorted routing probabilities follow a power law r_j ~ j^-alpha; C(k) is the
  per-row mass of the top k averaged over the rows (closed form below). With 256-token blocks
  a 32K sequence reaches C = 0.9 at k ~ 10 for alpha = 1.7 and at k ~ 49 for alpha = 0.8:
  `synthetic_coverage` draws alpha uniformly in [0.8, 1.7] per sequence (seeded), the spread of
  concentration SparseBalance's Fig. 4 shows (some sequences at 90% by k ~ 10, others needing
  k ~ 36-50). Modeled, not measured.
* `MeasuredCoverage.load(path)`: curves jaxsb measured on a real model (JSON written by
  `scripts/measure_coverage.py`: {"block_size", "max_k", "documents": [{"length", "curve"}]});
  a simulated sequence takes the curve of a measured document from its log2 length bin (the
  nearest bin when its own is empty), drawn with a seeded generator.
"""

from __future__ import annotations

import json
import math
from typing import Sequence

import numpy as np


def coverage_at(curve: np.ndarray, k: int) -> float:
    """C(k) for k >= 1 (k past the curve's end: its last value)."""
    return float(curve[min(int(k), len(curve)) - 1])


def coverage_drop(curve: np.ndarray, base: int, k: int) -> float:
    """C(base) - C(k): positive when k keeps less routing mass than the base budget."""
    return coverage_at(curve, base) - coverage_at(curve, k)


def k_min(curve: np.ndarray, base: int, p: float) -> int:
    """The smallest k in [1, base] whose drop against `base` is at most p."""
    target = coverage_at(curve, base) - p
    for k in range(1, int(base) + 1):
        if coverage_at(curve, k) >= target - 1e-12:
            return k
    return int(base)


def synthetic_curve(length: int, alpha: float, block: int, max_k: int) -> np.ndarray:
    """C(1..max_k) of the module docstring's power-law rows. Row V (V visible blocks) keeps
    S(min(k, V)) / S(V) with S(n) = sum_{j <= n} j^-alpha, so
    C(k) = (min(k, nb) + S(k) * sum_{V > k} 1 / S(V)) / nb."""
    nb = max(1, -(-int(length) // block))
    s = np.cumsum(np.arange(1, nb + 1, dtype=np.float64) ** -float(alpha))  # S(1..nb)
    tail = np.concatenate([np.cumsum((1.0 / s)[::-1])[::-1], [0.0]])  # tail[v] = sum_{V > v} 1/S(V)
    ks = np.arange(1, max_k + 1)
    kk = np.minimum(ks, nb)
    curve = (kk + s[kk - 1] * tail[kk]) / nb
    return np.minimum(curve, 1.0)


def synthetic_coverage(lengths: Sequence[int], *, block: int, max_k: int, seed: int = 0,
                       alpha_range: tuple[float, float] = (0.8, 1.7)) -> list[np.ndarray]:
    """One synthetic curve per length; alpha drawn per sequence from `alpha_range` (seeded)."""
    rng = np.random.default_rng(seed)
    alphas = rng.uniform(*alpha_range, size=len(lengths))
    return [synthetic_curve(n, a, block, max_k) for n, a in zip(lengths, alphas)]


def check_curve(curve, what: str) -> np.ndarray:
    c = np.asarray(curve, np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"{what}: a coverage curve must be a non-empty list of numbers")
    if not np.all(np.isfinite(c)) or c.min() < -1e-6 or c.max() > 1 + 1e-6:
        raise ValueError(f"{what}: coverage values must lie in [0, 1], got min {c.min()} max {c.max()}")
    if np.any(np.diff(c) < -1e-6):
        i = int(np.argmax(np.diff(c) < -1e-6))
        raise ValueError(f"{what}: coverage must not decrease with k (C({i + 1})={c[i]} > C({i + 2})={c[i + 1]})")
    return np.clip(c, 0.0, 1.0)


def length_bin(length: int) -> int:
    """floor(log2(tokens)): the length bins of measured curves (the router's LENGTH_BINS)."""
    return int(math.floor(math.log2(max(1, int(length)))))


class MeasuredCoverage:
    """Measured curves by length (module docstring)."""

    def __init__(self, block_size: int, lengths: Sequence[int], curves: Sequence[np.ndarray], source: str = ""):
        if not curves:
            raise ValueError(f"{source or 'coverage'}: no documents")
        self.block_size, self.source = int(block_size), source
        self.lengths = [int(n) for n in lengths]
        self.curves = list(curves)
        self.bins: dict[int, list[int]] = {}
        for i, n in enumerate(self.lengths):
            self.bins.setdefault(length_bin(n), []).append(i)

    @classmethod
    def load(cls, path: str) -> "MeasuredCoverage":
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read coverage file {path}: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object with block_size, max_k, documents")
        for field in ("block_size", "documents"):
            if field not in data:
                raise ValueError(f"{path}: missing field {field!r} (expected block_size, max_k, documents)")
        lengths, curves = [], []
        for i, doc in enumerate(data["documents"]):
            what = f"{path}: documents[{i}]"
            if not isinstance(doc, dict) or "length" not in doc or "curve" not in doc:
                raise ValueError(f"{what}: expected an object with 'length' and 'curve'")
            if not isinstance(doc["length"], int) or doc["length"] < 1:
                raise ValueError(f"{what}.length: expected a positive integer, got {doc['length']!r}")
            lengths.append(doc["length"])
            curves.append(check_curve(doc["curve"], f"{what}.curve"))
        return cls(data["block_size"], lengths, curves, source=path)

    def curves_for(self, lengths: Sequence[int], max_k: int, seed: int = 0) -> list[np.ndarray]:
        """A measured curve per simulated length, extended with its last value to max_k."""
        rng = np.random.default_rng(seed)
        keys = np.array(sorted(self.bins))
        out = []
        for n in lengths:
            b = length_bin(n)
            if b not in self.bins:
                b = int(keys[np.argmin(np.abs(keys - b))])
            c = self.curves[self.bins[b][int(rng.integers(len(self.bins[b])))]]
            out.append(np.concatenate([c, np.full(max(0, max_k - len(c)), c[-1])])[:max_k])
        return out


class CoverageHistory:
    """What training plans budgets from: per document-length bin (floor(log2 tokens), the
    router's LENGTH_BINS), a moving average (momentum 0.5) of the documents' coverage curves
    that the sparse layers measured in past steps (`update` with the step's
    coverage_bin_sums / coverage_bin_blocks). `curves_for(lengths)`: each sequence takes its
    bin's curve; a bin not measured yet gets the curve that allows no change (C = 0 below the
    base budget, 1 from it): budget = base until measured. Thread-safe (the trainer updates it
    while the next step is planned in the background)."""

    def __init__(self, base: int, max_k: int, momentum: float = 0.5):
        import threading

        self.base, self.max_k, self.momentum = int(base), int(max_k), float(momentum)
        self.curves: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def update(self, bin_sums, bin_blocks) -> None:
        sums, blocks = np.asarray(bin_sums, np.float64), np.asarray(bin_blocks, np.float64)
        with self._lock:
            for b in np.nonzero(blocks > 0)[0]:
                c = np.maximum.accumulate(np.clip(sums[b] / blocks[b], 0.0, 1.0))[: self.max_k]
                old = self.curves.get(int(b))
                self.curves[int(b)] = c if old is None else self.momentum * old + (1 - self.momentum) * c

    def unmeasured(self) -> np.ndarray:
        return (np.arange(1, self.max_k + 1) >= self.base).astype(np.float64)

    def curves_for(self, lengths: Sequence[int]) -> list[np.ndarray]:
        with self._lock:
            return [self.curves.get(length_bin(n), self.unmeasured()).copy() for n in lengths]

    def measured(self, lengths: Sequence[int]) -> list[bool]:
        with self._lock:
            return [length_bin(n) in self.curves for n in lengths]
