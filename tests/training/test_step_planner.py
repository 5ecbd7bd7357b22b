"""The step planner as the default run uses it: CPU devices planned with
`parallel.cpu_device_memory_mb` cannot hold a long piece whole, so it is sharded over a ring
while short pieces stay whole beside it; accelerators keep their chip's memory; a memory below
the model states is refused naming the field."""

import dataclasses

import numpy as np
import pytest

from jaxsb.config import ConfigError, load_config
from jaxsb.data import Piece, StepPieces
from jaxsb.training.planning import StepPlanner

LENGTHS = [2048, 1100, 300, 300, 200, 148]  # one step of the default run: 4,096 tokens


def _step(lengths):
    return StepPieces([Piece(np.ones(n, np.int32), np.ones(n, bool), (0, i, 0), f"doc{i}")
                       for i, n in enumerate(lengths)])


def _planner(device_kind="cpu", *overrides):
    cfg = load_config("default", list(overrides))
    return StepPlanner(cfg, dataclasses.replace(cfg.model, vocab_size=4096), 8, device_kind)


def _degrees_by_length(plan):
    """{length: degree of the group that holds it} (the lengths of LENGTHS are distinct but 300)."""
    return {n: plan.template.microbatches[p.microbatch].groups[p.group].degree
            for n, p in zip(plan.lengths, plan.placements)}


def test_default_run_shards_long_pieces_and_keeps_short_ones_whole():
    planner = _planner()
    planned = planner.plan(_step(LENGTHS))
    degrees = _degrees_by_length(planned.plan)
    capacity = planner.cost.device_token_capacity()
    assert 512 <= capacity < 1024  # 64 MB per device holds ~590 tokens of activations
    assert degrees[2048] == 4 and degrees[1100] == 2  # the smallest ring each fits
    assert all(degrees[n] == 1 for n in LENGTHS if n <= capacity)
    assert planner.cost.plan_memory_mb(planned.plan) <= planner.cost.memory_limit_mb
    # the calibrated host share (1.5 GB per device) holds every piece whole: nothing is sharded
    whole = _planner("cpu", "parallel.cpu_device_memory_mb=0").plan(_step(LENGTHS))
    assert set(_degrees_by_length(whole.plan).values()) == {1}


def test_accelerators_plan_with_their_chip_memory():
    planner = _planner("TPU v5p")
    assert planner.preset == "tpu-v5p" and planner.cost.memory_limit_mb > 50_000


def test_memory_below_the_model_states_is_refused():
    with pytest.raises(ConfigError, match=r"parallel.cpu_device_memory_mb=1: the model states alone take 2.5 MB"):
        _planner("cpu", "parallel.cpu_device_memory_mb=1")
    with pytest.raises(ConfigError, match="parallel.cpu_device_memory_mb"):
        load_config("default", ["parallel.cpu_device_memory_mb=-5"])
