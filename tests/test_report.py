"""`python -m jaxsb.report`: the boxes of the plan picture against a hand-built plan, and the
pictures of a real run (run at the end of training, and from the command line)."""

import os

import numpy as np
import pytest

from jaxsb.config import load_config
from jaxsb.plan import GroupSpec, build_plan
from jaxsb.report import Box, main, pick_steps, plan_boxes
from jaxsb.training.metrics import read_metrics
from jaxsb.wire import plan_to_json


def test_plan_boxes_follow_the_groups_and_the_micro_batches():
    # micro-batch 0: a ring of 2 (one 300-token sequence) beside two whole-sequence devices;
    # micro-batch 1: one ring of 4
    plan = build_plan(4, [[GroupSpec(2, "ring", sharded=(0,)), GroupSpec(1, "local", sharded=(1, 2)),
                           GroupSpec(1, "local")],
                          [GroupSpec(4, "ring", sharded=(3,))]], [300, 40, 50, 900])
    times = [[10.0, 4.0, 0.0], [7.0]]
    boxes = plan_boxes(plan_to_json(plan), times)
    assert boxes == [
        Box(0, 0, 0, 2, 0.0, 10.0, "ring ×2\n1 seq, 300", True),
        Box(0, 1, 2, 1, 0.0, 4.0, "whole ×1\n2 seq, 90", False),
        # the empty group on device 3 has no box; micro-batch 1 starts when its straggler ends
        Box(1, 0, 0, 4, 10.0, 17.0, "ring ×4\n1 seq, 900", True),
    ]


def test_pick_steps_shows_first_mixed_imbalanced_last():
    def layout(degrees):
        specs = [GroupSpec(d, "ring" if d > 1 else "local", sharded=(i,)) for i, d in enumerate(degrees)]
        return {"plan": plan_to_json(build_plan(sum(degrees), [specs], [100] * len(degrees)))}

    layouts = {1: layout([2, 2]), 2: layout([2, 1, 1]), 3: layout([4]), 4: layout([2, 2])}
    records = [{"step": s, "load_imbalance": x} for s, x in zip([1, 2, 3, 4], [1.1, 1.0, 1.5, 1.2])]
    assert pick_steps(records, layouts) == [1, 2, 3, 4]
    assert pick_steps(records, {}) == []
    # groups without sequences do not count as mixed: step 2 is "4,2,1,1" with both 1s idle
    idle = {"plan": plan_to_json(build_plan(8, [[GroupSpec(4, "ring", sharded=(0,)), GroupSpec(2, "ring", sharded=(1,))]],
                                            [100, 100]))}
    layouts = {1: layout([2, 2, 2, 2]), 2: idle, 3: layout([4, 2, 1, 1]), 4: layout([2, 2, 2, 2])}
    records = [{"step": s, "load_imbalance": 1.0} for s in (1, 2, 3, 4)]
    assert idle["plan"]["microbatches"][0]["groups"][-1][1] == 1  # the executor's idle group
    assert pick_steps(records, layouts) == [1, 3, 4]


@pytest.mark.slow
@pytest.mark.compiled
def test_a_run_draws_its_pictures(tmp_path, session_bpe, capsys):
    import matplotlib.image

    from jaxsb.training.trainer import train

    cfg = session_bpe.seed(load_config("tiny", [f"train.workdir={tmp_path}", "train.steps=3",
                                                "parallel.preset=flexsp-a100:gpt-7b"]))
    train(cfg, log=lambda *_: None)
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    layouts = read_metrics(str(tmp_path / "plans.jsonl"))
    assert [r["step"] for r in layouts] == [r["step"] for r in records] == [1, 2, 3]
    for r, layout in zip(records, layouts):  # plans.jsonl holds the plan each step ran
        assert "|".join(",".join(str(g[1]) for g in mb["groups"]) for mb in layout["plan"]["microbatches"]) \
            == r["plan"]
        assert max(layout["group_ms"][0]) > 0
    for name in ("training.png", "plans.png", "imbalance.png"):
        os.remove(tmp_path / name)
    assert main(["--workdir", str(tmp_path)]) == 0  # docs/training.md's command
    for name in ("training.png", "plans.png", "imbalance.png"):
        image = matplotlib.image.imread(str(tmp_path / name))
        assert image.shape[0] > 200 and image.shape[1] > 400 and np.std(image) > 0.01, name
    assert not (tmp_path / "budgets.png").exists()  # dense attention: no budgets to draw


def test_report_of_a_directory_that_is_no_run_is_a_clear_error(tmp_path, capsys):
    assert main(["--workdir", str(tmp_path)]) == 2
    assert f"{tmp_path}/metrics.jsonl: no such file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["--workdir", str(tmp_path)]) == 2
    assert "no steps recorded yet" in capsys.readouterr().err
