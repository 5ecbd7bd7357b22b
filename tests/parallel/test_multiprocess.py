"""Many machines, tested on one: two processes × 4 CPU devices joined over loopback by
`jax.distributed.initialize` (parallel.coordinator) train the same losses as one process × 8
devices — planned (static ring over all 8 devices, so the ring crosses the processes) and
plain data-parallel rows. Process 0 alone writes the run's files; an error on process 0 at
start-up stops every process with its message.

Every run is a `python -m jaxsb.train` subprocess; the three training runs start together
(the processes mostly wait on each other and on the compiler) and each is killed past a
deadline, its output shown in the failure message.
"""

import json
import os
import time

import numpy as np
import pytest

from jaxsb.config import ConfigError, load_config
from jaxsb.training.metrics import read_metrics
from launch import Launch
from tolerances import tol

DEADLINE_S = 240


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference and both multi-process runs, started together."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    launches = {
        "one": Launch(tmp / "one", ["parallel.planner=static"]),
        "static": Launch(tmp / "static", ["parallel.planner=static"], processes=2),
        "rows": Launch(tmp / "rows", ["parallel.planner=none"], processes=2),
    }
    deadline = time.monotonic() + DEADLINE_S
    try:
        yield {name: launch.wait(deadline) for name, launch in launches.items()}
    finally:
        for launch in launches.values():
            for p in launch.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.compiled
def test_two_processes_train_like_one_planned(runs):
    one, two = runs["one"], runs["static"]
    np.testing.assert_allclose(two.losses(), one.losses(), **tol("sharded_loss", np.float32),
                               err_msg=two.report())
    records = read_metrics(os.path.join(two.workdir, "metrics.jsonl"))
    assert all(r["plan"] == "8" for r in records), [r["plan"] for r in records]  # a ring over both processes


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.compiled
def test_two_processes_train_like_one_rows(runs):
    # planner=none lays the same batch out as packed rows: the loss is the same mean over targets
    np.testing.assert_allclose(runs["rows"].losses(), runs["one"].losses(), **tol("sharded_loss", np.float32),
                               err_msg=runs["rows"].report())


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.compiled
def test_only_process_zero_writes_and_reports(runs):
    two = runs["static"]
    two.losses()
    assert sorted(os.listdir(two.workdir)) == ["checkpoints", "config.json", "imbalance.png", "metrics.jsonl",
                                              "plans.jsonl", "plans.png", "summary.json", "tensorboard",
                                              "tokenizer.json", "training.png"]
    with open(os.path.join(two.workdir, "summary.json")) as f:
        assert json.load(f)["last_step"] == 3
    assert "trained 3 steps" in two.outputs[0] and "2 processes" in two.outputs[0], two.report()
    assert "trained" not in two.outputs[1] and "jaxsb:" not in two.outputs[1], two.report()
    with open(os.path.join(two.workdir, "config.json")) as f:  # the launch is recorded, not frozen
        assert json.load(f)["parallel"]["num_processes"] == 2


@pytest.mark.multiprocess
def test_an_error_on_process_zero_stops_every_process(tmp_path):
    # a workdir holding a run of another model: process 0 refuses it, process 1 hears why
    other = load_config("tiny", ["model.hidden=32"])
    with open(tmp_path / "config.json", "w") as f:
        f.write(other.to_json())
    launch = Launch(tmp_path, ["parallel.planner=none"], processes=2).wait(time.monotonic() + 120)
    assert launch.returncodes == [2, 2], launch.report()
    assert "model.hidden: saved 32, now 64" in launch.outputs[0], launch.report()
    assert "on process 0:" in launch.outputs[1] and "model.hidden" in launch.outputs[1], launch.report()


@pytest.mark.parametrize("overrides, message", [
    (["parallel.num_processes=2"], "parallel.num_processes"),
    (["parallel.coordinator=auto", "parallel.process_id=1"], "coordinator=auto takes both"),
    (["parallel.coordinator=localhost", "parallel.num_processes=2"], "parallel.coordinator"),
    (["parallel.coordinator=localhost:99999", "parallel.num_processes=2"], "parallel.coordinator"),
    (["parallel.coordinator=localhost:1234", "parallel.num_processes=2", "parallel.process_id=2"],
     "parallel.process_id: must be in [0, 1]"),
])
def test_bad_process_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config("tiny", overrides)


def test_process_settings_that_are_accepted():
    assert load_config("tiny", ["parallel.coordinator=auto"]).parallel.coordinator == "auto"
    p = load_config("tiny", ["parallel.coordinator=10.0.0.1:1234", "parallel.num_processes=4",
                             "parallel.process_id=3"]).parallel
    assert (p.coordinator, p.num_processes, p.process_id) == ("10.0.0.1:1234", 4, 3)
