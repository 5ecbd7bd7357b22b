"""Entry point for Bazel's py_test targets: runs one test file through pytest.

Usage (set by the BUILD file): bazel_pytest_main.py tests/test_x.py [extra pytest args]
JAXSB_PYTEST_MARKERS, if set and not empty, is passed as `-m` (a marker expression, e.g.
"not slow and not multiprocess" from .bazelrc's `fast` config; markers are registered in
pytest.ini). A file whose tests are all deselected passes (pytest's exit code 5, "no tests
collected", counts as success). It fails the target if tests/conftest.py was not loaded,
because conftest is what pins JAX to 8 simulated CPU devices.
"""

import os
import sys

import pytest

MARKERS_ENV = "JAXSB_PYTEST_MARKERS"


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: bazel_pytest_main.py TEST_FILE [PYTEST_ARGS...]", file=sys.stderr)
        return 2
    test_file, extra = sys.argv[1], sys.argv[2:]
    # Bazel's sandbox may have no writable HOME; keep caches inside the test's tmpdir.
    if os.environ.get("TEST_TMPDIR") and not os.environ.get("HOME"):
        os.environ["HOME"] = os.environ["TEST_TMPDIR"]
    markers = os.environ.get(MARKERS_ENV, "").strip()
    select = ["-m", markers] if markers else []
    code = pytest.main([test_file, "-q", "-p", "no:cacheprovider", *select, *extra])
    conftest = os.path.join(os.path.dirname(test_file), "conftest.py")
    loaded = [
        m for m in list(sys.modules.values())
        if os.path.basename(getattr(m, "__file__", None) or "") == "conftest.py"
    ]
    if os.path.exists(conftest) and not loaded:
        print(f"bazel_pytest_main: {conftest} was not loaded by pytest", file=sys.stderr)
        return 1
    if code == pytest.ExitCode.NO_TESTS_COLLECTED and markers:
        print(f"bazel_pytest_main: every test of {test_file} deselected by -m {markers!r}")
        return 0
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
