"""Training through planners: every planner trains the same model (same fixed-seed loss
trajectory within 1e-4 relative per step), the per-step metrics carry the plan, and a longer
run on long-tailed data compiles at most `parallel.max_programs` programs. Every run trains
from scratch with the session's BPE (conftest's `session_bpe`) instead of training its own."""

import json
import os

import numpy as np
import pytest

from jaxsb.config import load_config
from jaxsb.training.trainer import train
from tolerances import tol

pytestmark = [pytest.mark.slow, pytest.mark.compiled]  # every test trains

PRESET = "parallel.preset=flexsp-a100:gpt-7b"  # a published profile: plans differ by planner


def _run(bpe, tmp_path, name, *overrides):
    workdir = tmp_path / name
    cfg = bpe.seed(load_config("tiny", [f"train.workdir={workdir}", "train.steps=3",
                                        "train.checkpoint_every=100", "data.tokens_per_step=3072", PRESET,
                                        *overrides]))
    result = train(cfg, log=lambda *_: None)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return result, [json.loads(line) for line in f]


# The rows path packs each step into 8 rows and carries what fits no row; a planned step takes
# the step's pieces as they are. One 1024-token bucket holds any 3072 tokens of pieces of at most
# max_len=256 in 8 rows, so the rows reference carries nothing and trains the same data.
NO_CARRY_ROWS = "data.row_buckets=[1024]"


@pytest.fixture(scope="module")
def rows_run(tmp_path_factory, session_bpe):
    return _run(session_bpe, tmp_path_factory.mktemp("rows"), "rows", "parallel.planner=none", NO_CARRY_ROWS)


# static = rows is also checked across processes (tests/parallel/test_multiprocess.py)
@pytest.mark.parametrize("planner, extra", [
    ("skrull", ["parallel.cp=4"]),
    ("jaxsb", []),
])
def test_every_planner_trains_the_same_model(rows_run, tmp_path, planner, extra, session_bpe):
    _, want = rows_run
    _, got = _run(session_bpe, tmp_path, planner, f"parallel.planner={planner}", *extra)
    assert [(r["tokens"], r["docs"]) for r in got] == [(r["tokens"], r["docs"]) for r in want]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], **tol("planner_loss", np.float32))
    for r in got:
        assert r["planner"] in (planner, "fallback") and r["plan"]
        assert r["predicted_step_ms"] > 0 and r["measured_step_ms"] > 0
        assert r["load_max_ms"] >= r["load_mean_ms"] > 0 and r["load_imbalance"] >= 1.0
        assert r["plan_solve_s"] >= 0 and r["plan_wait_s"] >= 0


def test_compiled_programs_stay_within_the_bound(tmp_path, session_bpe):
    result, records = _run(session_bpe, tmp_path, "bounded", "train.steps=50",
                           "parallel.planner=batch-adaptive", "parallel.max_programs=3",
                           "data.tokens_per_step=2048")
    assert result.compiles <= 3
    assert all(r["compiles"] <= 3 for r in records)
    assert len({r["plan"] for r in records}) >= 1
    assert sum(r["compiled_now"] for r in records) == result.compiles
    with open(tmp_path / "bounded" / "summary.json") as f:
        admissions = json.load(f)["plan_admissions"]
    assert sum(admissions.values()) == 50 and admissions.get("over-bound", 0) == 0


PLANNERS = ("static", "batch-adaptive", "flexsp", "skrull", "jaxsb")


def _default_run(bpe, workdir, attention, planner):
    """The main job's config as a new user runs it (`python -m jaxsb.train --set
    parallel.planner=...`), two short steps: per step (tokens, documents) and loss. The rows
    reference packs into one 2048-token bucket, which holds any 4096 tokens of pieces of at most
    2048 (data.max_len) in 8 rows: it carries nothing, so it trains the same pieces as the planned steps."""
    rows = ["data.row_buckets=[2048]"] if planner == "none" else []
    cfg = bpe.seed(load_config("default", [
        f"train.workdir={workdir}", "train.steps=2", "train.checkpoint_every=100",
        "data.tokens_per_step=4096", f"model.attention={attention}", f"parallel.planner={planner}", *rows]))
    train(cfg, log=lambda *_: None)
    with open(workdir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 2, planner
    if planner != "none":
        assert all(r["planner"].startswith(planner) for r in records), (planner, [r["planner"] for r in records])
    return [(r["tokens"], r["docs"]) for r in records], [r["loss"] for r in records]


@pytest.fixture(scope="module")
def default_rows(tmp_path_factory, session_bpe):
    """The rows path's run of the default config, per attention kind (made once per module and worker)."""
    done = {}

    def get(attention):
        if attention not in done:
            done[attention] = _default_run(session_bpe, tmp_path_factory.mktemp(f"rows-{attention}"), attention, "none")
        return done[attention]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("attention", ["xla", "sparse"])
def test_default_config_trains_with_every_planner(tmp_path, attention, planner, default_rows, session_bpe):
    """Every planner runs the default config (skrull's default CP group of all devices used to
    crash on micro-batches with no sharded sequence) and trains the same model as the rows path,
    dense and sparse."""
    steps, losses = _default_run(session_bpe, tmp_path / planner, attention, planner)
    want_steps, want_losses = default_rows(attention)
    assert steps == want_steps, planner
    np.testing.assert_allclose(losses, want_losses, err_msg=planner, **tol("planner_loss", np.float32))


@pytest.mark.parametrize("planner, extra", [("jaxsb", []), ("skrull", ["parallel.cp=2"])])
def test_sparse_training_plans_budgets_per_step(tmp_path, session_bpe, planner, extra):
    """parallel.budgets=dst: the planner (jaxsb's, or Skrull's layout with SAB + DST around it)
    chooses per-document budgets from the curves the sparse layers measured in earlier steps;
    metrics carry budgets, planned coverage, floor decisions, predicted imbalance before / after
    DST and the executed per-device work."""
    _, records = _run(session_bpe, tmp_path, "dst", "train.steps=5", f"parallel.planner={planner}", *extra,
                      "parallel.background_planning=false", "model.attention=sparse", "model.sparse.block_size=16",
                      "model.sparse.top_k=2", "model.sparse.max_blocks=6", "parallel.budgets=dst")
    assert records[0]["budgets_unmeasured"] > 0 and records[0]["planned_coverage_mean"] is None
    for r in records:
        assert 1 <= r["budget_min"] <= r["budget_mean"] <= r["budget_max"] <= 6
        assert r["predicted_imbalance_base"] >= 1.0 and r["predicted_imbalance_dst"] >= 1.0
        assert r["executed_imbalance"] >= 1.0 and r["executed_pairs_max"] >= r["executed_pairs_mean"] > 0
        assert 0.0 <= r["sparse_floor_overridden"] <= 1.0 and r["sparse_floor_final"] >= 1.0
        # measured in every layer: no document ran below its coverage floor (p = 0.1 by default)
        assert 0.0 <= r["sparse_floor_drop_max"] <= 0.1 + 1e-6 and 0.0 < r["sparse_floor_coverage_min"] <= 1.0
    # step t+1 is planned while step t runs: the curves of step 1 plan step 3 onwards
    later = records[2:]
    assert all(r["planned_coverage_mean"] is not None for r in later)
    rounding = tol("mean_rounding", np.float64)["rtol"]
    assert all(0 < r["planned_coverage_min"] <= r["planned_coverage_mean"] * (1 + rounding) and
               r["planned_coverage_mean"] <= 1 for r in later)
    assert any(r["budget_max"] != 2 or r["budget_min"] != 2 for r in later), "no budget was ever chosen"


def test_sparse_attention_work_is_counted_against_dense_causal(tmp_path, session_bpe):
    """A fixed budget k with the floor off: each document's query block i attends to min(i + 1, k)
    key blocks and each padding block of the devices' buffers to itself, so the executed pairs are
    that count over the step's plan, per layer and kv head; the recorded fraction divides it by
    dense causal's i + 1 over the documents alone (padding counts against sparse, never for it)."""
    k, block = 2, 16
    _, records = _run(session_bpe, tmp_path, "work", "model.attention=sparse", f"model.sparse.block_size={block}",
                      f"model.sparse.top_k={k}", "model.sparse.coverage_drop=1.0", "parallel.background_planning=false")
    cfg = load_config("tiny")
    per_doc = cfg.model.layers * cfg.model.kv_heads
    with open(tmp_path / "work" / "plans.jsonl") as f:
        plans = {p["step"]: p["plan"] for p in map(json.loads, f)}
    for r in records:
        plan = plans[r["step"]]
        blocks = [-(-n // block) for n in plan["lengths"]]
        buffers = sum(plan["num_devices"] * (mb["shard_len"] + mb["local_len"]) // block for mb in plan["microbatches"])
        padding = buffers - sum(blocks)
        assert padding >= 0 and sum(blocks) * block >= r["tokens"]
        sparse = per_doc * (sum(min(i + 1, k) for nb in blocks for i in range(nb)) + padding)
        dense = per_doc * sum(nb * (nb + 1) // 2 for nb in blocks)
        assert (r["executed_pairs_total"], r["dense_causal_pairs"]) == (sparse, dense), r["step"]
        assert r["attention_fraction"] == pytest.approx(sparse / dense)
    with open(tmp_path / "work" / "summary.json") as f:
        summary = json.load(f)
    assert summary["attention_fraction"] == pytest.approx(
        sum(r["executed_pairs_total"] for r in records) / sum(r["dense_causal_pairs"] for r in records))
