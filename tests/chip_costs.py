"""A chip's data-sheet cost model for the default model, built from the planner package alone
(what `python -m jaxsb.simulate --preset gpu-h100` prices), for planner tests whose Bazel target
depends on the planner library only."""

import dataclasses

from jaxsb.config import load_config
from jaxsb.planner.hardware import CHIPS, hardware_cost


def default_model_cost(chip: str, num_devices: int):
    cfg = load_config("default", [])
    model = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or cfg.tokenizer.vocab_size)
    return hardware_cost(CHIPS[chip], model, num_devices, fsdp=cfg.parallel.fsdp, block=model.sparse.block_size)
