"""Faults a long run meets, and what the trainer does about each.

* **Preemption** (`StopRequest`): SLURM, Kubernetes and preemptible TPU / GPU VMs send SIGTERM
  some seconds before they take the machine back; a user presses Ctrl-C (SIGINT). Either only
  sets a flag. At the next step boundary every process learns of it (`StepAgreement`), they
  finish the step in flight, save a checkpoint and exit 0; the same command resumes. A second
  SIGINT interrupts at once.
* **Hosts that disagree** (`StepAgreement.check`): before each step is dispatched, every
  process publishes the digest of the step it is about to run (its data, and the plan) through
  the coordinator's key-value store; all meet at a barrier and compare. A process that read
  other data or holds another plan stops the run with both digests named, before the step
  runs (a collective over different programs would hang; over different data it would train
  silently wrong).
* **Dead or hung peers** (`PeerWatchdog`): every process beats a counter in the key-value
  store each second from a thread; a peer whose beat has not moved for
  `parallel.peer_timeout_s` (killed, or stopped, or its host gone) is missing. The process
  prints one line naming it and the last checkpoint and leaves at once with `EXIT_PEER_LOST`
  (a collective waiting on a dead peer may never return, and JAX's own shutdown would wait
  on it too). Checkpoints are committed by rename, so a write cut short leaves only a
  temporary directory, removed at the next start.

One process: the stop request works the same; there are no peers to agree with or watch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

from jaxsb import devices, wire

EXIT_PEER_LOST = 3  # a peer process died or stopped answering (EX_ ... none fits; documented in docs/multihost.md)
BEAT_INTERVAL_S = 1.0
DONE = "done"  # a finished process's last beat: it is no longer watched


class HostsDisagree(RuntimeError):
    """Two processes were about to run different steps (other data, or another plan)."""


def _this_run() -> tuple:
    """(the coordinator's key-value client or None with one process, process index, count)."""
    import jax

    return devices._client(), jax.process_index(), jax.process_count()


class StopRequest:
    """SIGTERM / SIGINT become a request to stop at the next step boundary (`reason`, e.g.
    "SIGTERM"), while the `with` block runs. Handlers are installed only in the main thread
    (a notebook's or a test's worker thread keeps the defaults)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.reason: str | None = None
        self._old: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without the checkpoint
        if self.reason is None:
            self.reason = name
            print(f"jaxsb: {name} received; stopping after the current step with a checkpoint "
                  f"(send SIGINT again to stop at once)", file=sys.stderr, flush=True)


class StepAgreement:
    """Per step, before dispatch: every process's digest and stop request, compared.

    `check(step, digest, stop)` returns why the run stops here (e.g. "SIGTERM on process 1"),
    or None to go on; raises HostsDisagree naming both digests when they differ. One process:
    only its own stop request."""

    def __init__(self, timeout_s: float = devices.SHARE_TIMEOUT_S, peers: tuple | None = None):
        """`peers`: (key-value client, this process, process count); default: this run's."""
        self.client, self.process, self.count = peers or _this_run()
        self.timeout_s = timeout_s

    def check(self, step: int, digest: str, stop: str | None) -> str | None:
        if self.client is None:
            return stop
        key = f"jaxsb/step/{step}"
        self.client.key_value_set_bytes(f"{key}/{self.process}", wire.encode(
            "step", {"process": self.process, "step": step, "digest": digest, "stop": stop}))
        try:
            self.client.wait_at_barrier(key, int(self.timeout_s * 1000))
        except Exception as e:  # noqa: BLE001 - the runtime raises its own error types
            raise TimeoutError(f"step {step}: process {self.process} waited {self.timeout_s:g} s for the other "
                               f"processes to reach the step: {e}") from e
        reports = {}
        for name, payload in self.client.key_value_dir_get_bytes(key):
            _, report = wire.decode(name, "step", payload)
            reports[report["process"]] = report
        if step > 2 and self.process == 0:  # every process is past step-1's reads by now
            self.client.key_value_delete(f"jaxsb/step/{step - 2}")
        mine = reports[self.process]["digest"]
        for p in sorted(reports):
            if reports[p]["digest"] != mine:
                a, b = sorted((self.process, p))
                raise HostsDisagree(
                    f"step {step}: process {a} and process {b} were about to run different steps: digest "
                    f"{reports[a]['digest']} on process {a}, {reports[b]['digest']} on process {b}. Every "
                    "process must read the same data (same files, data.* and tokenizer settings) and run "
                    "the same jaxsb; nothing of this step was run.")
        stops = [f"{reports[p]['stop']} on process {p}" for p in sorted(reports) if reports[p]["stop"]]
        return ", ".join(stops) or None


def workdir_line(checkpoint: tuple[str, int | None]) -> str:
    directory, step = checkpoint
    if step is None:
        return f"No checkpoint yet in {directory}: a relaunch starts from the beginning"
    return f"Last checkpoint: step {step} in {directory}; relaunch every process with the same command to resume"


class PeerWatchdog:
    """Beats for this process and watches the others' beats; see the module doc.

    Two threads: the *poller* talks to the key-value store (sets this process's beat, reads
    the others'); the *monitor* only reads clocks, so that it still decides when the poller
    is stuck in a call to a coordinator that no longer answers (process 0 frozen or its host
    gone: such a call may never return). `checkpoint()` returns (checkpoint directory, last
    completed step or None) for the line it prints; `exit` is how it leaves (os._exit; a test
    passes its own)."""

    def __init__(self, timeout_s: float, checkpoint: Callable[[], tuple[str, int | None]],
                 exit: Callable[[int], None] = os._exit, interval_s: float = BEAT_INTERVAL_S,
                 peers: tuple | None = None):
        self.client, self.process, self.count = peers or _this_run()
        self.timeout_s, self.interval_s = timeout_s, min(interval_s, timeout_s / 4)
        self.checkpoint, self._exit = checkpoint, exit
        self.missing: int | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        now = time.monotonic()
        # per peer: (its last beat, when that beat changed); DONE once it finished
        self._seen = {p: (None, now) for p in range(self.count) if p != self.process}
        self._call_since: float | None = None  # when the poller's call in flight began

    def start(self) -> "PeerWatchdog":
        if self.client is not None:
            self._threads = [threading.Thread(target=f, name=f"jaxsb-peer-{f.__name__.strip('_')}", daemon=True)
                             for f in (self._poll, self._monitor)]
            for t in self._threads:
                t.start()
        return self

    def stop(self, done: bool) -> None:
        """Stops watching. `done`: this process finished (or stopped cleanly) and tells the
        others it is not lost; after an error it just goes silent, so that they stop too."""
        if not self._threads:
            return
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s)
        if not done:
            return
        try:
            self.client.key_value_set(self._beat_key(self.process), DONE, allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator may have finished first
            pass

    def _beat_key(self, p: int) -> str:
        return f"jaxsb/alive/{p}"

    def _call(self, fn, *args):
        self._call_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._call_since = None

    def _poll(self) -> None:
        beat = 0
        while not self._stop.wait(self.interval_s):
            beat += 1
            try:
                self._call(self.client.key_value_set, self._beat_key(self.process), str(beat), True)
            except Exception:  # noqa: BLE001 - the store may be gone: the monitor sees the silence
                pass
            for p, (value, _) in list(self._seen.items()):
                try:
                    current = self._call(self.client.key_value_try_get, self._beat_key(p))
                except Exception:  # noqa: BLE001 - not beaten yet, or the store is unreachable
                    continue
                if current != value:
                    self._seen[p] = (current, time.monotonic())

    def _monitor(self) -> None:
        while not self._stop.wait(self.interval_s / 2):
            now = time.monotonic()
            since = self._call_since
            if since is not None and now - since > self.timeout_s:
                return self._lost(0, now - since, "its key-value store does not answer")
            for p, (value, changed) in list(self._seen.items()):
                if value != DONE and now - changed > self.timeout_s:
                    return self._lost(p, now - changed, "it died or hangs")

    def _lost(self, p: int, silent_s: float, why: str) -> None:
        self.missing = p
        what = " (the coordinator)" if p == 0 else ""
        print(f"jaxsb: process {p} of {self.count}{what} has not answered for {silent_s:.0f} s "
              f"(parallel.peer_timeout_s={self.timeout_s:g}): {why}; process {self.process} stops. "
              f"{workdir_line(self.checkpoint())}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        self._exit(EXIT_PEER_LOST)

    def await_verdict(self) -> None:
        """After a collective failed: gives the watchdog the time to name a missing peer (and
        leave); returns if every peer still answers, so the caller re-raises the error."""
        if self._threads:
            self._threads[1].join(self.timeout_s + 4 * self.interval_s)
