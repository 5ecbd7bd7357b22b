"""Entry point for Bazel's py_test targets: runs one test file through pytest.

Usage (set by the BUILD file): bazel_pytest_main.py tests/test_x.py [extra pytest args]
It fails the target if tests/conftest.py was not loaded, because conftest is what pins JAX to
8 simulated CPU devices.
"""

import os
import sys

import pytest


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: bazel_pytest_main.py TEST_FILE [PYTEST_ARGS...]", file=sys.stderr)
        return 2
    test_file, extra = sys.argv[1], sys.argv[2:]
    # Bazel's sandbox may have no writable HOME; keep caches inside the test's tmpdir.
    if os.environ.get("TEST_TMPDIR") and not os.environ.get("HOME"):
        os.environ["HOME"] = os.environ["TEST_TMPDIR"]
    code = pytest.main([test_file, "-q", "-p", "no:cacheprovider", *extra])
    conftest = os.path.join(os.path.dirname(test_file), "conftest.py")
    loaded = [
        m for m in list(sys.modules.values())
        if os.path.basename(getattr(m, "__file__", None) or "") == "conftest.py"
    ]
    if os.path.exists(conftest) and not loaded:
        print(f"bazel_pytest_main: {conftest} was not loaded by pytest", file=sys.stderr)
        return 1
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
