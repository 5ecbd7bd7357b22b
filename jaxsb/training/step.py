"""One training step's update, shared by the rows path, planned steps (and anything that
times a step): `apply_update` is the one place gradients become new parameters.

* `make_train_step(graphdef, rest, tx)`: packed rows, data parallel (parallel.planner=none);
* `make_planned_train_step(graphdef, rest, tx, model_cfg, mesh, template)`: one Plan template
  run by the executor (`jaxsb.parallel.executor.plan_value_and_grad`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxsb.config import ModelConfig
from jaxsb.models.loss import next_token_loss
from jaxsb.models.stats import pop_layer_stats
from jaxsb.parallel.executor import plan_value_and_grad
from jaxsb.plan import Template


def apply_update(tx, state: dict, grads, metrics: dict) -> tuple[dict, dict]:
    """(new state, metrics + grad_norm): the optimiser step on `state` = {params, opt_state, step, rng}."""
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new_state = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
    return new_state, {**metrics, "grad_norm": optax.tree.norm(grads)}


def make_loss_fn(graphdef, rest) -> Callable:
    """(params, batch arrays) -> (mean loss over target tokens, (target count, layer stats))."""

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params, rest)
        logits = model(batch["tokens"], batch["segment_ids"], batch["positions"])
        loss_sum, count = next_token_loss(logits, batch["targets"], batch["loss_mask"])
        return loss_sum / jnp.maximum(count, 1.0), (count, pop_layer_stats(model))

    return loss_fn


def make_train_step(graphdef, rest, tx) -> Callable:
    loss_fn = make_loss_fn(graphdef, rest)

    def train_step(state, batch):
        (loss, (count, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        return apply_update(tx, state, grads, {"loss": loss, "targets": count, **stats})

    return train_step


def make_planned_train_step(graphdef, rest, tx, model_cfg: ModelConfig, mesh: Mesh, template: Template) -> Callable:
    value_and_grad = plan_value_and_grad(graphdef, rest, model_cfg, mesh, template)

    def train_step(state, mb_arrays, num_targets):
        loss, grads, stats = value_and_grad(state["params"], mb_arrays, num_targets)
        return apply_update(tx, state, grads, {"loss": loss, "targets": num_targets, **stats})

    return train_step
