"""Compiled programs, ahead of time, one per key, counted.

Training compiles one program per batch shape (packed rows) or per plan template (planned
steps); the count is what `parallel.max_programs` bounds and what the metrics log as `compiles`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable


class ProgramCache:
    """key -> compiled program; `compile_seconds` is the time spent compiling so far."""

    def __init__(self):
        self._compiled: dict[Hashable, Any] = {}
        self.compile_seconds = 0.0

    @property
    def count(self) -> int:
        return len(self._compiled)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._compiled

    def get_or_compile(self, key: Hashable, make_jitted: Callable[[], Any], *args) -> tuple[Any, bool]:
        """(the program for `key`, whether it was compiled now): `make_jitted()` is lowered and
        compiled for `args` the first time a key is seen."""
        if key in self._compiled:
            return self._compiled[key], False
        t0 = time.perf_counter()
        self._compiled[key] = make_jitted().lower(*args).compile()
        self.compile_seconds += time.perf_counter() - t0
        return self._compiled[key], True
