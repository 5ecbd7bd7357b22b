"""Faults (jaxsb/training/faults.py, jaxsb/wire.py, checkpoints, the workdir).

Unit tests run the real pieces in this process: the coordinator's key-value service with two
clients (one per simulated process, each in a thread) for the message, agreement and
watchdog tests; orbax with an OS error injected at a checkpoint's commit. The slow tests run
`python -m jaxsb.train` as whole processes and do to them what a cluster does: SIGTERM to one,
SIGKILL to one process of two, a process launched with other data. Each prints the fault's
cost (steps lost, seconds to stop, seconds to resume) as a "fault figure" line (`pytest -s`);
the README quotes them.
"""

import base64
import errno
import json
import os
import pickle
import re
import signal
import socket
import threading
import time
import zlib

import numpy as np
import pytest

from jaxsb import wire
from jaxsb.config import ConfigError, load_config
from jaxsb.training.checkpoint import Checkpointer, CheckpointError
from jaxsb.training.faults import EXIT_PEER_LOST, HostsDisagree, PeerWatchdog, StepAgreement, StopRequest
from jaxsb.training.metrics import MetricsWriter, read_metrics
from jaxsb.training.workdir import check_room, prepare_workdir
from launch import REPO, SMALL, Launch
from tolerances import tol

def _figure(text: str) -> None:
    print(f"\nfault figure: {text}")


# --------------------------------------------------------------------- a real key-value store


@pytest.fixture
def two_clients():
    """The coordination service and two connected clients, as two processes of a run have."""
    from jax._src.lib import _jax

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    service = _jax.get_distributed_runtime_service(addr, 2, heartbeat_timeout=100)
    clients = [_jax.get_distributed_runtime_client(addr, i, heartbeat_timeout=100, init_timeout=30)
               for i in range(2)]
    _together([c.connect for c in clients])
    yield clients
    _together([c.shutdown for c in clients])  # shutdown is a barrier of both
    service.shutdown()


def _together(fns):
    """Runs each fn in its own thread (one per simulated process); returns results or exceptions."""
    out = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


# ---------------------------------------------------------------------------- messages


def _tiny_plan():
    from jaxsb.plan import GroupSpec, build_plan

    return build_plan(4, [[GroupSpec(2, "ring", sharded=(0,)), GroupSpec(1, "local", sharded=(1, 2)),
                           GroupSpec(1, "local", sharded=(3,))]], [300, 40, 50, 90], budgets=[4, 1, 1, 2],
                      planner="test", predicted_ms=12.5)


def test_messages_round_trip():
    from jaxsb.data.tokenizer import byte_tokenizer, train_bpe
    from jaxsb.planner.base import SolveInfo

    assert wire.decode("k", "workdir", wire.encode("workdir", "/w/run"))[1] == "/w/run"
    for tok in (byte_tokenizer(), train_bpe(["def f(x):\n    return x + 1\n"] * 50, 300)):
        back = wire.decode("k", "tokenizer", wire.encode("tokenizer", tok))[1]
        text = "def g(y):\n    return [y] * 2  # é\n"
        assert back.encode(text) == tok.encode(text) and back.decode(tok.encode(text)) == text
        assert (back.bos_id, back.eos_id, back.pad_id, back.vocab_size) == (tok.bos_id, tok.eos_id, tok.pad_id,
                                                                            tok.vocab_size)
    plan = _tiny_plan()
    info = SolveInfo(0.25, "ok", False, 10.0, {"degrees": (2, 1), "gap": np.float64(0.5), "bound": float("nan")})
    plan_back, solve_s, info_back = wire.decode("k", "plan", wire.encode("plan", (plan, 0.3, info)))[1]
    assert plan_back == plan and solve_s == 0.3
    assert info_back.details == {"degrees": [2, 1], "gap": 0.5, "bound": None} and info_back.lower_bound_ms == 10.0
    error = wire.decode("k", ("plan", "error"), wire.encode("error", ConfigError("model.hidden: bad")))[1]
    assert isinstance(error, ConfigError) and str(error) == "on process 0: model.hidden: bad"


def test_a_large_plan_round_trips_exactly_and_packed():
    """A 1024-device plan of 4096 sequences (Ulysses and ring groups, Skrull-style local ranks,
    budgets) comes back equal, and its per-sequence columns travel packed, not as JSON lists."""
    from jaxsb.plan import GroupSpec, build_plan
    from jaxsb.planner.base import SolveInfo

    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 300_000, 4096)]
    specs, ids = [], iter(range(4096))
    for m in range(2):
        mb = [GroupSpec(64, "ulysses", sharded=tuple(next(ids) for _ in range(8))),
              GroupSpec(32, "ring", sharded=tuple(next(ids) for _ in range(4)))]
        mb += [GroupSpec(8, "ring", sharded=(next(ids),), local=tuple((next(ids), next(ids)) for _ in range(8)))
               for _ in range(116)]
        specs.append(mb)
    rest = [i for i in ids]
    specs.append([GroupSpec(1, "local", sharded=(i,)) for i in rest])  # 128 left: one per device
    plan = build_plan(1024, specs, lengths, budgets=[int(b) for b in rng.integers(1, 64, 4096)], planner="jaxsb",
                      predicted_ms=1234.5)
    payload = wire.encode("plan", (plan, 1.5, SolveInfo(1.5)))
    assert wire.decode("k", "plan", payload)[1][0] == plan
    body = json.loads(payload)["body"]["plan"]
    assert set(body["lengths"]) == {"count", "int32_zlib"} and body["placements"]["count"] == 3 * 4096
    assert len(payload) < len(json.dumps(wire.plan_to_json(plan))) / 3
    with pytest.raises(TypeError, match=r"plan.lengths\[1\]: values must fit int32"):
        wire.pack_ints([1, 2**31], "plan.lengths")
    for bad in (1.7, True, 2**70):
        with pytest.raises(TypeError, match=r"plan.budgets\[1\]"):
            wire.pack_ints([1, bad], "plan.budgets")


class _RunsCode:
    """Unpickling this runs `touch <marker>`: what an attacker would publish."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_published_under_a_read_key_is_refused_not_run(two_clients, tmp_path):
    from jaxsb.devices import _publish
    from jaxsb.wire import receive

    marker = tmp_path / "owned"
    payload = pickle.dumps(_RunsCode(marker))
    pickle.loads(payload)  # the payload is live: unpickling it would run the command
    assert marker.exists()
    marker.unlink()
    _publish(two_clients[0], "jaxsb/plan/1", payload)  # under the key process 1 reads its plan from
    with pytest.raises(wire.WireError, match=r"'jaxsb/plan/1': not a jaxsb message"):
        receive(two_clients[1], "jaxsb/plan/1", "plan", timeout_s=10)
    assert not marker.exists()
    # a well-formed message of another schema under the key is refused as well
    _publish(two_clients[0], "jaxsb/tokenizer", wire.encode("workdir", "/tmp"))
    with pytest.raises(wire.WireError, match=r"field 'jaxsb': expected 'tokenizer' or 'error', got 'workdir'"):
        receive(two_clients[1], "jaxsb/tokenizer", "tokenizer", timeout_s=10)


def test_no_pickle_on_the_cross_host_paths():
    for root, _, files in os.walk(os.path.join(REPO, "jaxsb")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    text = f.read()
                assert not re.search(r"^\s*(import pickle|from pickle|import cloudpickle|import dill)", text,
                                     re.M), name


def _message(schema, body, version=None):
    return json.dumps({"jaxsb": schema, "version": wire.VERSIONS[schema] if version is None else version,
                       "body": body}).encode()


def _plan_body(**change):
    body = json.loads(wire.encode("plan", (_tiny_plan(), 0.1, _info())))["body"]
    body["plan"].update(change)
    return body


def _info():
    from jaxsb.planner.base import SolveInfo

    return SolveInfo(0.1)


@pytest.mark.parametrize("payload, message", [
    (b"\x80\x04K\x01.", "not a jaxsb message"),
    (b'["a list"]', "field 'message': expected an object, got list"),
    (json.dumps({"jaxsb": "plan", "body": {}}).encode(), "field 'message.version': missing"),
    (_message("plan", {}, version=99), "of version 3, got 99"),
    (_message("workdir", {"path": 3}), "field 'message.body.path': expected str, got int"),
    (_message("plan", _plan_body(lengths=[300, 40, 50, 90])), "field 'message.body.plan.lengths': expected dict, got list"),
    (_message("plan", _plan_body(lengths={"count": 4, "int32_zlib": "not base64!"})),
     "field 'message.body.plan.lengths.int32_zlib': not base64"),
    (_message("plan", _plan_body(lengths={"count": 4, "int32_zlib": "AAAA"})),
     "field 'message.body.plan.lengths.int32_zlib': not zlib data"),
    (_message("plan", _plan_body(lengths=wire.pack_ints([300, 40, 50, 90, 7], "x") | {"count": 4})),
     r"field 'message.body.plan.lengths.int32_zlib': expected 4 int32 values \(16 bytes\), got more"),
    (_message("plan", _plan_body(lengths=wire.pack_ints([300, 40, 50], "x"))),
     "field 'message.body.plan.placements': expected 3 columns of 3 .* got 12 values"),
    (_message("plan", _plan_body(placements=wire.pack_ints([0] * 4 + [0, 1, 1, 9] + [-1] * 4, "x"))),
     "not a valid plan: sequence 3: group 9"),
    (_message("plan", _plan_body(microbatches=[{"shard_len": 512, "local_len": 0,
                                                "groups": wire.pack_ints([0, 2, 3, 2, 1, 1, 2, 0, 7], "x")}])),
     r"field 'message.body.plan.microbatches\[0\].groups': scheme code 7 out of range"),
    (_message("plan", _plan_body(microbatches=[{"shard_len": 512, "local_len": 0,
                                                "groups": wire.pack_ints([0, 2, 3, 2], "x")}])),
     r"groups': expected start, degree and scheme columns of equal length, got 4 values"),
    (_message("plan", _plan_body(lengths={"count": 10**20, "int32_zlib": "AAAA"})),
     r"field 'message.body.plan.lengths.count': 100000000000000000000 int32 values cannot come from 3"),
    (_message("plan", _plan_body(lengths={"count": 4, "int32_zlib": base64.b64encode(
        zlib.compress(bytes(16)) + b"xx").decode()})), "got 16 bytes and 2 bytes after the stream"),
    (_message("plan", _plan_body(lengths={"count": 4, "int32_zlib": base64.b64encode(
        zlib.compress(bytes(16))[:-5]).decode()})), "the compressed stream ends early"),
    (_message("plan", _plan_body(lengths=wire.pack_ints([300, 40, 50, 90], "x") | {"count": 5})),
     r"lengths.int32_zlib': expected 5 int32 values \(20 bytes\), got 16 bytes"),
    (_message("plan", _plan_body(num_devices=True)), "field 'message.body.plan.num_devices': expected int, got bool"),
])
def test_malformed_messages_name_the_key_and_field(payload, message):
    with pytest.raises(wire.WireError, match=message) as e:
        wire.decode("jaxsb/plan/7", ("plan", "workdir"), payload)
    assert "'jaxsb/plan/7'" in str(e.value)


# ------------------------------------------------------------------ agreement and watchdog


def test_processes_agree_on_a_step_and_on_stopping(two_clients):
    def agree(p, digest, stop, step):
        return lambda: StepAgreement(10, peers=(two_clients[p], p, 2)).check(step, digest, stop)

    assert _together([agree(0, "data a plan b", None, 1), agree(1, "data a plan b", None, 1)]) == [None, None]
    # a stop request on one process stops both at the same step
    assert _together([agree(0, "x", None, 2), agree(1, "x", "SIGTERM", 2)]) == ["SIGTERM on process 1"] * 2

    def steps(p, n=50):
        a = StepAgreement(10, peers=(two_clients[p], p, 2))
        t0 = time.perf_counter()
        for step in range(3, 3 + n):
            assert a.check(step, "data 0123456789abcdef plan 0123456789abcdef", None) is None
        return (time.perf_counter() - t0) / n

    cost = max(_together([lambda: steps(0), lambda: steps(1)]))
    _figure(f"the per-step agreement (2 processes over loopback): {cost * 1e3:.1f} ms per step")


def test_processes_that_disagree_stop_naming_both_digests(two_clients):
    out = _together([lambda p=p: StepAgreement(10, peers=(two_clients[p], p, 2)).check(
        5, f"data {'ab' if p == 0 else 'cd'}12 plan ee", None) for p in range(2)])
    for e in out:
        assert isinstance(e, HostsDisagree), out
        assert "step 5: process 0 and process 1" in str(e)
        assert "digest data ab12 plan ee on process 0, data cd12 plan ee on process 1" in str(e)


def test_watchdog_names_a_silent_peer_within_its_timeout(two_clients, capsys):
    exits = []
    watch = [PeerWatchdog(2.0, lambda: ("/run/checkpoints", 6), exit=exits.append, peers=(two_clients[p], p, 2))
             for p in range(2)]
    for w in watch:
        w.start()
    time.sleep(3)  # both beat: nobody is lost
    assert exits == []
    t0 = time.monotonic()
    watch[1].stop(done=False)  # process 1 goes silent (killed, hung)
    watch[0].await_verdict()
    assert exits == [EXIT_PEER_LOST] and watch[0].missing == 1
    assert time.monotonic() - t0 <= 2.0 + 1.0
    err = capsys.readouterr().err
    assert "process 1 of 2 has not answered" in err and "Last checkpoint: step 6 in /run/checkpoints" in err


class _FrozenStore:
    """A key-value client whose calls never return: a coordinator stopped by SIGSTOP (the
    slow test below freezes a real one)."""

    def __init__(self):
        self.release = threading.Event()

    def key_value_set(self, *args):
        self.release.wait()

    key_value_try_get = key_value_set


def test_a_call_stuck_on_a_frozen_coordinator_is_found_by_the_clock(capsys):
    store, exits = _FrozenStore(), []
    watch = PeerWatchdog(2.0, lambda: ("/c", 3), exit=exits.append, peers=(store, 1, 2)).start()
    watch.await_verdict()
    store.release.set()
    assert exits == [EXIT_PEER_LOST] and watch.missing == 0
    assert "process 0 of 2 (the coordinator) has not answered for 2 s" in capsys.readouterr().err


def test_a_finished_peer_is_not_lost(two_clients):
    exits = []
    watch = [PeerWatchdog(2.0, lambda: ("/c", None), exit=exits.append, peers=(two_clients[p], p, 2))
             for p in range(2)]
    for w in watch:
        w.start()
    time.sleep(1)
    watch[1].stop(done=True)
    time.sleep(3.5)
    assert exits == [] and watch[0].missing is None
    watch[0].stop(done=True)


def test_sigint_twice_interrupts_at_once():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stop.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) is before


# ------------------------------------------------------------------------ disk and workdir


class _FailCommits:
    """os.rename raising ENOSPC when orbax commits the checkpoint of `step`, `times` times."""

    def __init__(self, monkeypatch, step: int, times: int):
        self.step, self.left, self.real = str(step), times, os.rename
        monkeypatch.setattr(os, "rename", self)

    def __call__(self, src, dst, *args, **kwargs):
        if self.left > 0 and ".orbax-checkpoint-tmp" in str(src) and os.path.basename(str(dst)) == self.step:
            self.left -= 1
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return self.real(src, dst, *args, **kwargs)


def _state(x):
    import jax.numpy as jnp

    return {"w": jnp.full((8,), float(x)), "step": jnp.asarray(x)}


def test_a_failed_checkpoint_write_is_retried_once(tmp_path, monkeypatch):
    ckpt = Checkpointer(str(tmp_path), keep=1)
    ckpt.save(3, _state(3), {"step": 3})
    _FailCommits(monkeypatch, step=6, times=1)
    warnings = []
    ckpt.save(6, _state(6), {"step": 6}, log=warnings.append)
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and "retrying once" in warnings[0]
    assert ckpt.latest_step() == 6 and sorted(os.listdir(tmp_path)) == ["6"]  # keep=1: 3 went after 6 was whole
    ckpt.close()


def test_a_checkpoint_failing_twice_stops_and_keeps_the_previous(tmp_path, monkeypatch):
    import jax

    ckpt = Checkpointer(str(tmp_path), keep=1)
    ckpt.save(3, _state(3), {"step": 3})
    _FailCommits(monkeypatch, step=6, times=2)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(6, _state(6), {"step": 6}, log=lambda _: None)
    assert str(e.value).startswith(f"{tmp_path}/6: writing the checkpoint of step 6 failed twice")
    assert "[Errno 28] No space left on device" in str(e.value)
    assert f"the checkpoint of step 3 in {tmp_path} is intact" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["3"]  # nothing of step 6 is left, step 3 is
    state, meta = Checkpointer(str(tmp_path)).restore(3, jax.eval_shape(lambda: _state(0)))
    assert meta == {"step": 3} and float(state["w"][0]) == 3.0


def test_what_a_killed_write_left_is_removed_at_the_next_start(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    ckpt = Checkpointer(str(tmp_path), keep=2)
    ckpt.save(3, _state(3), {"step": 3})
    ckpt.close()
    # orbax itself writing step 6, cut short at its commit (as a kill there would leave it)
    bare = ocp.CheckpointManager(str(tmp_path))
    with monkeypatch.context() as m:
        m.setattr(os, "rename", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "cut short")))
        with pytest.raises(OSError):
            bare.save(6, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(6))))
            bare.wait_until_finished()
    assert sorted(os.listdir(tmp_path)) == ["3", "6.orbax-checkpoint-tmp"]
    again = Checkpointer(str(tmp_path), keep=2)
    assert again.removed_leftovers == ["6.orbax-checkpoint-tmp"]
    assert again.latest_step() == 3 and again.last_saved == 3
    again.close()
    assert sorted(os.listdir(tmp_path)) == ["3"]


def test_an_unwritable_or_full_workdir_is_found_before_training(tmp_path, monkeypatch):
    import shutil

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    cfg = load_config("tiny", [f"train.workdir={blocker}/run"])
    with pytest.raises(ConfigError, match=f"{blocker}/run: cannot create the workdir"):
        prepare_workdir(cfg)
    check_room(str(tmp_path), 10_000_000, keep=2)  # room enough
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9 - 5_000_000,
                                                                                  5_000_000))
    with pytest.raises(ConfigError, match=r"5\.0 MB free on its disk, the run's checkpoints need about 30\.0 MB "
                                          r"\(train.keep_checkpoints=2 kept and one being written, 10\.0 MB each\)"):
        check_room(str(tmp_path), 10_000_000, keep=2)


def test_a_metrics_line_cut_short_by_a_kill_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "lo')
    writer = MetricsWriter(str(path), resume_from_step=2)
    writer.write({"step": 3, "loss": 3.5})
    writer.close()
    assert writer.dropped_partial == 1
    assert [r["step"] for r in read_metrics(str(path))] == [1, 2, 3]
    path.write_text('{"step": 1}\n{"ste\n{"step": 2}\n')  # damage inside the file is an error, not skipped
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        MetricsWriter(str(path), resume_from_step=2)


# ----------------------------------------------------------------- whole processes, faulted

DEADLINE_S = 300
RUN = ["parallel.planner=static", "train.checkpoint_every=3", "train.progress=false"]
SMALL_RUN = [*SMALL[1:], *RUN]  # in this process: the launches' settings


@pytest.mark.slow
@pytest.mark.compiled
def test_sigterm_stops_with_a_checkpoint_and_the_rerun_matches(tmp_path):
    steps = 12
    overrides = [*RUN, f"train.steps={steps}", "train.checkpoint_every=100"]  # only the stop's checkpoint
    deadline = time.monotonic() + DEADLINE_S
    reference = Launch(tmp_path / "reference", overrides)
    run = Launch(tmp_path / "run", overrides)
    run.wait_for_step(3, deadline)
    t_signal = time.monotonic()
    run.procs[0].send_signal(signal.SIGTERM)
    done_before = max(r["step"] for r in run.records())
    run.wait(deadline)
    stop_s = time.monotonic() - t_signal
    out = run.outputs[0]
    assert run.returncodes == [0], run.report()
    m = re.search(r"jaxsb: stopped \(SIGTERM\) after step (\d+): checkpoint of step \1 in (\S+); the same command "
                  "resumes from it", out)
    assert m, run.report()
    stopped_at = int(m.group(1))
    assert m.group(2) == os.path.join(run.workdir, "checkpoints") and os.listdir(m.group(2)) == [str(stopped_at)]
    assert done_before <= stopped_at < steps
    assert [r["step"] for r in run.records()] == list(range(1, stopped_at + 1))  # nothing after the checkpoint

    rerun = Launch(tmp_path / "run", overrides)
    first_new = rerun.wait_for_step(stopped_at + 1, deadline) - rerun.started
    rerun.wait(deadline)
    np.testing.assert_allclose(rerun.losses(steps), reference.wait(deadline).losses(steps), **tol("resume_loss",
                                                                                                  np.float32))
    assert f"resumed from {run.workdir}/checkpoints at step {stopped_at}" in rerun.outputs[0], rerun.report()
    _figure(f"SIGTERM (single process, tiny): 0 steps lost (signal once step {done_before} was recorded, stopped "
            f"after step {stopped_at} with its checkpoint), exited 0 {stop_s:.1f} s after the signal; the rerun "
            f"recorded its first new step {first_new:.1f} s after its launch")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.compiled
def test_a_killed_peer_stops_the_other_and_the_relaunch_matches(tmp_path):
    steps, timeout = 9, 10
    overrides = [*RUN, f"train.steps={steps}", f"parallel.peer_timeout_s={timeout}"]
    deadline = time.monotonic() + DEADLINE_S
    reference = Launch(tmp_path / "reference", overrides, processes=2)
    run = Launch(tmp_path / "run", overrides, processes=2)
    run.wait_for_step(5, deadline)
    t_kill = time.monotonic()
    run.procs[1].kill()
    done = max(r["step"] for r in run.records())
    while run.procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    stop_s = time.monotonic() - t_kill
    run.wait(deadline)
    assert run.returncodes[0] == EXIT_PEER_LOST, run.report()
    assert stop_s <= timeout + 5, run.report()
    checkpoints = os.path.join(run.workdir, "checkpoints")
    m = re.search(rf"jaxsb: process 1 of 2 has not answered for \d+ s \(parallel.peer_timeout_s={timeout}\): it "
                  rf"died or hangs; process 0 stops. Last checkpoint: step (\d+) in {checkpoints}; relaunch every "
                  "process with the same command to resume", run.outputs[0])
    assert m, run.report()
    saved = int(m.group(1))
    assert saved in (3, 6) and str(saved) in os.listdir(checkpoints)
    assert "Check failure stack trace" not in run.outputs[0], run.report()

    relaunch = Launch(tmp_path / "run", overrides, processes=2)
    back = relaunch.wait_for_step(done + 1, deadline) - relaunch.started  # past where the killed run was
    relaunch.wait(deadline)
    np.testing.assert_allclose(relaunch.losses(steps), reference.wait(deadline).losses(steps),
                               **tol("resume_loss", np.float32), err_msg=relaunch.report())
    _figure(f"SIGKILL of process 1 of 2 (tiny, checkpoint every 3, peer_timeout_s={timeout}): killed after step "
            f"{done} was recorded, {done - saved} steps lost (resumed from step {saved}), process 0 exited "
            f"{EXIT_PEER_LOST} {stop_s:.1f} s after the kill; the relaunch recorded step {done + 1} (past the "
            f"killed run) {back:.1f} s after its launch")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_process_reading_other_data_stops_the_run_before_the_step(tmp_path):
    launch = Launch(tmp_path / "run", [*RUN, "train.steps=3"], processes=2,
                    per_process={1: ["data.seed=1"]}).wait(time.monotonic() + DEADLINE_S)
    assert launch.returncodes == [1, 1], launch.report()
    for out in launch.outputs:
        assert re.search(r"error: step 1: process 0 and process 1 were about to run different steps: digest "
                         r"data [0-9a-f]{16} plan [0-9a-f]{16} on process 0, data [0-9a-f]{16} plan [0-9a-f]{16} "
                         r"on process 1", out), launch.report()
    assert not os.path.exists(os.path.join(launch.workdir, "metrics.jsonl")) or not read_metrics(
        os.path.join(launch.workdir, "metrics.jsonl"))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_hung_coordinator_stops_the_other_process(tmp_path):
    # process 0 frozen (SIGSTOP): it runs the key-value store too, so calls to it hang
    timeout = 10
    run = Launch(tmp_path / "run", [*RUN, "train.steps=40", f"parallel.peer_timeout_s={timeout}"], processes=2)
    deadline = time.monotonic() + DEADLINE_S
    try:
        run.wait_for_step(2, deadline)
        t_stop = time.monotonic()
        run.procs[0].send_signal(signal.SIGSTOP)
        while run.procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_s = time.monotonic() - t_stop
    finally:
        run.procs[0].kill()
    run.wait(deadline)
    assert run.returncodes[1] == EXIT_PEER_LOST, run.report()
    assert stop_s <= timeout + 5, run.report()
    assert re.search(rf"jaxsb: process 0 of 2 \(the coordinator\) has not answered for \d+ s "
                     rf"\(parallel.peer_timeout_s={timeout}\)", run.outputs[1]), run.report()
    _figure(f"SIGSTOP of process 0 of 2 (the coordinator; peer_timeout_s={timeout}): process 1 exited "
            f"{EXIT_PEER_LOST} {stop_s:.1f} s after the stop")


@pytest.mark.slow
@pytest.mark.compiled
def test_the_run_stops_when_a_checkpoint_fails_twice(tmp_path, monkeypatch, capsys, session_bpe):
    from jaxsb import train

    args = ["--config", "tiny", "--workdir", str(tmp_path)]
    for o in [*SMALL_RUN, "train.steps=6", "train.keep_checkpoints=1"]:
        args += ["--set", o]
    session_bpe.seed(load_config("tiny", [f"train.workdir={tmp_path}", *SMALL_RUN]))
    _FailCommits(monkeypatch, step=6, times=2)
    assert train.main(args) == 1
    err = capsys.readouterr().err
    assert f"error: {tmp_path}/checkpoints/6: writing the checkpoint of step 6 failed twice" in err, err
    assert "No space left on device" in err and "the checkpoint of step 3" in err and "is intact" in err, err
    assert os.listdir(tmp_path / "checkpoints") == ["3"]
    monkeypatch.undo()  # the disk has room again: the rerun resumes from step 3 and finishes
    assert train.main(args) == 0
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == list(range(1, 7))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    run = Launch(tmp_path / "run", [*RUN, "train.steps=40", "train.checkpoint_every=100"], processes=2)
    deadline = time.monotonic() + DEADLINE_S
    run.wait_for_step(2, deadline)
    run.procs[1].send_signal(signal.SIGTERM)  # the scheduler took back only process 1's host
    run.wait(deadline)
    assert run.returncodes == [0, 0], run.report()
    m = re.search(r"jaxsb: stopped \(SIGTERM on process 1\) after step (\d+): checkpoint of step \1", run.outputs[0])
    assert m, run.report()
    assert os.listdir(os.path.join(run.workdir, "checkpoints")) == [m.group(1)]
    assert max(r["step"] for r in run.records()) == int(m.group(1))
