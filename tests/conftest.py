"""Test setup: 8 simulated CPU devices, set before anything imports JAX, and one compilation
cache for the session.

Many tests compile the very same program: a resumed run and its uninterrupted twin, a run
whose budgets differ only in data, the CLI runs in subprocesses. A persistent compilation
cache in a fresh directory (removed at exit) lets each such program be compiled once per
session, subprocesses included (they inherit the environment). Nothing outlives the session, so
no run can reuse a stale program; a cache hit returns the executable XLA compiled for the same
HLO, so no result changes. JAX_COMPILATION_CACHE_DIR set by the caller is respected.
"""

import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="jaxsb-test-compile-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    # every program, not only those over JAX's default 1 s: small ones recur across tests too
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
