"""Long real documents for length evaluations: the largest .py files of Python's standard library.

The file list is the one the training data's kind=stdlib source reads (jaxsb.data.sources), so
evaluation documents come from the same tree, with the same directories left out; a training
run with `data.holdout_largest=N` leaves out exactly the files `--long-docs N` scores.
"""

from __future__ import annotations

from jaxsb.data.sources import EXCLUDED_DIRS, largest_files, stdlib_root, walk_files


def longest_stdlib_files(n: int) -> list[str]:
    """Paths of the n largest stdlib .py files by byte size, largest first (ties: by path)."""
    if n < 1:
        raise ValueError(f"longest_stdlib_files: n={n} must be >= 1")
    root = stdlib_root()
    files = walk_files(root, (".py",), EXCLUDED_DIRS)
    if len(files) < n:
        raise ValueError(f"longest_stdlib_files: asked for {n} files, {root} holds only {len(files)} .py files")
    return largest_files(files, n)
