"""Test setup: 8 simulated CPU devices, set before anything imports JAX, and one compilation
cache for the session.

Many tests compile the very same program: a resumed run and its uninterrupted twin, a run
whose budgets differ only in data, the CLI runs in subprocesses. A persistent compilation
cache in a fresh directory (removed at exit) lets each such program be compiled once per
session, subprocesses included (they inherit the environment). Nothing outlives the session, so
no run can reuse a stale program; a cache hit returns the executable XLA compiled for the same
HLO, so no result changes. JAX_COMPILATION_CACHE_DIR set by the caller is respected.

Training tests share one BPE tokenizer per session as well: the `session_bpe` fixture (below).
Markers (slow, multiprocess, compiled) are registered in the root pytest.ini.
"""

import atexit
import os
import shutil
import sys
import tempfile

import pytest

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


class SessionBPE:
    """BPE tokenizers trained once per session and handed to training runs.

    A run trained from scratch with tokenizer.kind=auto|bpe trains its BPE in `build_tokenizer`,
    which first reloads `workdir/tokenizer.json` if there is one (what a resumed run does).
    `seed(cfg)` puts that file into cfg.train.workdir before the run starts: the tokenizer
    trained, by that same `build_tokenizer`, the first time this session met the same training
    inputs. BPE training is deterministic (test_data checks it), so the run tokenizes exactly as
    if it had trained the BPE itself and no assertion changes. The key is what the training
    reads: tokenizer.vocab_size and train_bytes, and the data source fields (not the batching
    ones: max_len, long_policy, tokens_per_step, row_buckets, rows_per_device).
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.trained: dict[tuple, str] = {}  # key -> the directory holding its tokenizer.json
        self.seeded = 0

    def seed(self, cfg):
        """Copies the session's tokenizer for `cfg` into cfg.train.workdir (unless the run
        brings its own tokenizer or the workdir has one already); returns cfg."""
        from jaxsb.data.tokenizer import TOKENIZER_FILE, build_tokenizer

        t, d, workdir = cfg.tokenizer, cfg.data, cfg.train.workdir
        if not workdir or cfg.model.init != "scratch" or t.kind not in ("auto", "bpe") or d.kind == "tokens":
            return cfg
        target = os.path.join(workdir, TOKENIZER_FILE)
        if os.path.exists(target):
            return cfg
        key = (t.vocab_size, t.train_bytes, d.kind, d.path, tuple(d.extensions), d.text_field,
               d.on_malformed, d.on_undecodable, d.seed)
        if key not in self.trained:
            directory = os.path.join(self.root, f"bpe{len(self.trained)}")
            build_tokenizer(t, d, directory)  # trains and saves directory/tokenizer.json
            self.trained[key] = directory
        os.makedirs(workdir, exist_ok=True)
        shutil.copyfile(os.path.join(self.trained[key], TOKENIZER_FILE), target)
        self.seeded += 1
        return cfg


@pytest.fixture(scope="session")
def session_bpe(tmp_path_factory) -> SessionBPE:
    """`session_bpe.seed(cfg)`: the run of `cfg` reuses this session's BPE (see SessionBPE)."""
    return SessionBPE(str(tmp_path_factory.mktemp("session-bpe")))
