"""`python -m jaxsb.train` runs as subprocesses for the tests that need whole processes: one
process × 8 CPU devices, or several × (8 / processes) joined over loopback
(parallel.coordinator), as a multi-host run would be.

Output goes to files, not pipes (a process must never block on a full pipe); `wait` collects it
and kills what outlives its deadline, so a hung run fails its test with its output shown.
"""

import os
import socket
import subprocess
import sys
import time

import numpy as np

from jaxsb.training.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tiny, shrunk further: one layer, 512 tokens per step, a small BPE trained in a second
SMALL = ["train.steps=3", "parallel.preset=flexsp-a100:gpt-7b", "data.tokens_per_step=512",
         "data.max_len=128", "model.layers=1", "tokenizer.train_bytes=30000", "tokenizer.vocab_size=300"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """One `python -m jaxsb.train` run: a single process × 8 devices, or `processes` × 4."""

    def __init__(self, workdir, overrides, processes: int = 1, per_process: dict | None = None):
        """`per_process`: {process id: extra overrides} (a process launched differently)."""
        self.workdir, self.procs, self.logs = str(workdir), [], []
        self.started = time.monotonic()
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}")
        args = ["--config", "tiny", "--workdir", self.workdir]
        for o in [*SMALL, *overrides]:
            args += ["--set", o]
        port = free_port()
        for i in range(processes):
            launch = [] if processes == 1 else [
                "--set", f"parallel.coordinator=127.0.0.1:{port}", "--set", f"parallel.num_processes={processes}",
                "--set", f"parallel.process_id={i}"]
            for o in (per_process or {}).get(i, []):
                launch += ["--set", o]
            # output to files, not pipes: a process must never block on a full pipe
            log = open(os.path.join(f"{self.workdir}.process{i}.log"), "w+")
            self.logs.append(log)
            self.procs.append(subprocess.Popen([sys.executable, "-u", "-m", "jaxsb.train", *args, *launch],
                                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.outputs: list[str] | None = None

    def wait(self, deadline: float, grace_s: float = 30.0) -> "Launch":
        """Collects every process's output. Once one fails the others get `grace_s` to exit
        (they should: process 0's errors reach them); past that, or the deadline, all are killed."""
        if self.outputs is not None:
            return self
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            if any(p.poll() not in (0, None) for p in self.procs):
                deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.2)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.outputs = []
        for log in self.logs:
            log.seek(0)
            self.outputs.append(log.read())
            log.close()
        return self

    @property
    def returncodes(self) -> list[int]:
        return [p.returncode for p in self.procs]

    def report(self) -> str:
        return "\n".join(f"--- process {i} (exit {p.returncode}), last output:\n{out[-3000:]}"
                         for i, (p, out) in enumerate(zip(self.procs, self.outputs or [])))

    def records(self) -> list[dict]:
        path = os.path.join(self.workdir, "metrics.jsonl")
        return read_metrics(path) if os.path.exists(path) else []

    def wait_for_step(self, step: int, deadline: float) -> float:
        """Blocks until metrics.jsonl records `step` (returns that time), or fails past the deadline."""
        while time.monotonic() < deadline:
            if any(r["step"] >= step for r in self.records()):
                return time.monotonic()
            assert all(p.poll() is None for p in self.procs), self.wait(deadline).report()
            time.sleep(0.1)
        raise AssertionError(f"no step {step} before the deadline\n{self.wait(deadline).report()}")

    def losses(self, steps: int = 3) -> np.ndarray:
        assert self.returncodes == [0] * len(self.procs), self.report()
        records = self.records()
        assert [r["step"] for r in records] == list(range(1, steps + 1)), self.report()
        return np.array([r["loss"] for r in records], np.float32)


