"""The executor: runs a Plan as one compiled SPMD program.

For each micro-batch of the plan's template, the model runs under `jax.shard_map` with one
token buffer per device (jaxsb/plan/layout.py). Everything but attention is token-local,
so the model code is unchanged; attention is replaced for the trace
(`jaxsb.models.attention.attention_override`) by the device's share of its group's
sequence-parallel attention:

  * ring micro-batches (groups of any degrees side by side, degree-1 groups included) run on
    the 1-D mesh: `jaxsb.parallel.ring.ring_attention` with one `ppermute` per round whose
    permutation is the union of the groups' cycles; each round is one call of the chunk op
    (kernels_pallas/ring_chunk/): its Pallas kernels on GPU with
    `model.attention=flash`, its XLA version otherwise (`ring_sparse.ring_sparse_attention`
    for routed block-sparse attention: pooled key blocks go round first, then only the
    selected blocks of each visiting K/V shard are computed, by the chunk op's Pallas kernels
    with a block selection on GPU and ring_sparse's XLA code elsewhere, like sparse_attend);
  * ulysses micro-batches (every group of one degree d) run on the same devices viewed as a
    (N/d, d) mesh: `jaxsb.parallel.ulysses.ulysses_attention` (all-to-all over "sp");
  * local micro-batches (all groups of degree 1) need no communication;
  * the local region of every buffer (Skrull's whole sequences) is attended to on its device.

Parameters enter each micro-batch's shard_map replicated (`P()`), so XLA all-gathers the
FSDP-sharded parameters at its start and the gradient of that broadcast is the sum over
devices (shard_map's transpose); gradients are accumulated over micro-batches and, with the
loss, divided by the global number of target tokens — the same loss and gradients whatever
the plan. The optimiser update (jaxsb/training/step.py) runs on the FSDP-sharded state
outside the shard_maps.

Compiled programs are cached by the plan's template (`jaxsb.training.steps.PlanCompiler`); the
step's data are arrays, so a new step with a known template does not compile.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsb.config import ModelConfig
from jaxsb.mesh import AXIS
from jaxsb.models.attention import attend, attention_override, ring_implementation, sparse_attend, sparse_options
from jaxsb.models.loss import next_token_loss
from jaxsb.models.stats import MAX_STATS, MIN_STATS, PER_DEVICE_STATS, SUMMED_STATS, combine_stat, pop_layer_stats
from jaxsb.plan.layout import FIELDS, SeqData, layout_microbatch
from jaxsb.plan import MicroBatch, Plan, Template
from jaxsb.plan.executable import alignment, check_executable

SP_AXIS, GROUPS_AXIS = "sp", "groups"


def microbatch_mesh(mesh: Mesh, mb: MicroBatch) -> tuple[Mesh, Any]:
    """(mesh, the partition of a [devices, tokens] buffer's first dimension) for one micro-batch."""
    if mb.scheme == "ulysses":
        d = mb.groups[0].degree
        devices = mesh.devices.reshape(-1, d)
        return Mesh(devices, (GROUPS_AXIS, SP_AXIS)), (GROUPS_AXIS, SP_AXIS)
    return mesh, AXIS


def _local_attention(model_cfg: ModelConfig, stats: list):
    """Whole-sequence attention on one device's rows (dense or routed block-sparse)."""

    def fn(q, k, v, seg, budgets_BxT, head_sum=None):
        if model_cfg.attention == "sparse":
            out, layer = sparse_attend(q, k, v, seg, budgets_BxT, **sparse_options(model_cfg), head_sum=head_sum)
            stats.append((layer, jnp.sum(seg > 0)))
            return out
        return attend(q, k, v, seg, implementation=model_cfg.attention, block=model_cfg.attention_block)

    return fn


def _device_attention(model_cfg: ModelConfig, mb: MicroBatch, pos_BxT, budgets_BxT):
    """The attention override for one device's buffer of micro-batch `mb` (traced in shard_map)."""
    S = mb.shard_len

    def fn(q, k, v, seg, _budgets_B):
        stats: list = []
        local = _local_attention(model_cfg, stats)
        qa, ka, va, sa = q[:, :S], k[:, :S], v[:, :S], seg[:, :S]
        if S == 0:  # no sharded sequence anywhere (e.g. Skrull kept every one whole): no stream to attend
            out = qa
        elif mb.scheme == "ring" and model_cfg.attention == "sparse":
            from jaxsb.parallel.ring_sparse import ring_sparse_attention

            groups = tuple((g.start, g.degree) for g in mb.groups)
            opts = sparse_options(model_cfg)
            stream = 2 * max(g.degree for g in mb.groups) * (S // (2 * opts["block_size"]))
            max_blocks = None if opts["max_blocks"] is None else min(opts["max_blocks"], stream)
            out, layer = ring_sparse_attention(
                qa, ka, va, sa, pos_BxT[:, :S], budgets_BxT[:, :S], axis_name=AXIS, groups=groups,
                block_size=opts["block_size"], max_blocks=max_blocks, floor=opts["floor"],
                curve_bins=opts["curve_bins"], implementation=ring_implementation(model_cfg))
            stats.append((layer, jnp.sum(sa > 0)))
        elif mb.scheme == "ring":
            from jaxsb.parallel.ring import ring_attention

            groups = tuple((g.start, g.degree) for g in mb.groups)
            out = ring_attention(qa, ka, va, sa, pos_BxT[:, :S], axis_name=AXIS, groups=groups,
                                 block=model_cfg.attention_block, implementation=ring_implementation(model_cfg))
        elif mb.scheme == "ulysses":
            from jaxsb.parallel.ulysses import ulysses_attention

            full_budgets = jax.lax.all_gather(budgets_BxT[:, :S], SP_AXIS, axis=1, tiled=True)
            # heads are spread over the group: the floor's document curves add up over it
            out = ulysses_attention(qa, ka, va, sa, axis_name=SP_AXIS, degree=mb.groups[0].degree,
                                    attention_fn=lambda q_, k_, v_, s_: local(
                                        q_, k_, v_, s_, full_budgets, head_sum=lambda x: jax.lax.psum(x, SP_AXIS)))
        else:
            out = local(qa, ka, va, sa, budgets_BxT[:, :S])
        if mb.local_len:
            out_local = local(q[:, S:], k[:, S:], v[:, S:], seg[:, S:], budgets_BxT[:, S:])
            out = jnp.concatenate([out, out_local], axis=1)
        layer_stats = {}
        if stats:  # token-weighted means over the calls of this layer; counts, sums and extremes by combine_stat
            w = jnp.maximum(sum(n for _, n in stats), 1)
            layer_stats = {key: combine_stat(key, jnp.stack([layer[key] for layer, _ in stats]))
                           if key in SUMMED_STATS + MAX_STATS + MIN_STATS
                           else sum(layer[key] * n for layer, n in stats) / w for key in stats[0][0]}
        return out, layer_stats

    return fn


def reduce_device_stat(name: str, per_device):
    """A sown statistic over the devices [N, ...]: per device for PER_DEVICE_STATS, else
    combined by `combine_stat`."""
    if name in PER_DEVICE_STATS:
        return per_device
    return combine_stat(name, per_device)


def microbatch_loss_fn(graphdef, rest, model_cfg: ModelConfig, mesh: Mesh, mb: MicroBatch) -> Callable:
    """(params, {field: [N, T] array}) -> (sum of token losses, (target count, stats)) for one
    micro-batch; stats are device means of the sown sparse statistics (empty when dense)."""
    mb_mesh, spec = microbatch_mesh(mesh, mb)

    def body(params, tokens, targets, loss_mask, seg, pos, budgets):
        model = nnx.merge(graphdef, params, rest)
        with attention_override(_device_attention(model_cfg, mb, pos, budgets)):
            logits = model(tokens, seg, pos)
        loss_sum, count = next_token_loss(logits, targets, loss_mask)
        stats = pop_layer_stats(model)
        # Per-device values, reduced outside: no collective in the body but attention's own.
        return loss_sum[None], count[None], {k: v[None] for k, v in stats.items()}

    row = P(spec, None)
    # check_vma=False: the kernels' loop carries start replicated and become per-device; the
    # replicated parameters' cotangents are still summed over devices by the transpose.
    sharded = jax.shard_map(body, mesh=mb_mesh, in_specs=(P(), row, row, row, row, row, row),
                            out_specs=(P(spec), P(spec), P(spec)), check_vma=False)

    def loss(params, arrays):
        loss_N, count_N, stats_N = sharded(params, *(arrays[f] for f in (
            "tokens", "targets", "loss_mask", "segment_ids", "positions", "budgets")))
        return loss_N.sum(), (count_N.sum(), {k: reduce_device_stat(k, v) for k, v in stats_N.items()})

    return loss


def plan_value_and_grad(graphdef, rest, model_cfg: ModelConfig, mesh: Mesh, template: Template) -> Callable:
    """(params, [per micro-batch arrays], num_targets) -> (loss, grads, stats): the mean token
    loss over the whole step and its gradient, accumulated over the micro-batches."""
    check_executable(template, model_cfg)
    fns = [jax.value_and_grad(microbatch_loss_fn(graphdef, rest, model_cfg, mesh, mb), has_aux=True)
           for mb in template.microbatches]

    def run(params, mb_arrays, num_targets):
        total, grads, stats_acc = 0.0, None, {}
        for fn, arrays in zip(fns, mb_arrays):
            (loss_sum, (count, stats)), g = fn(params, arrays)
            total = total + loss_sum
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            for k, v in stats.items():
                stats_acc.setdefault(k, []).append(v)
        scale = 1.0 / jnp.maximum(num_targets, 1.0)
        grads = jax.tree.map(lambda x: x * scale.astype(x.dtype), grads)
        stats = {k: combine_stat(k, jnp.stack(v)) for k, v in stats_acc.items()}
        return total * scale, grads, stats

    return run


def plan_host_buffers(plan: Plan, seqs: Sequence[SeqData], model_cfg: ModelConfig) -> list[dict[str, np.ndarray]]:
    """Every micro-batch's host buffers ([N, T] per field, FIELDS)."""
    return [layout_microbatch(plan, m, seqs, alignment(model_cfg), default_budget=model_cfg.sparse.start_budget)
            for m in range(len(plan.template.microbatches))]


def microbatch_sharding(mesh: Mesh) -> NamedSharding:
    """A micro-batch buffer's [N, T] rows split over the devices, one row each."""
    return NamedSharding(mesh, P(AXIS, None))


def layout_plan(plan: Plan, seqs: Sequence[SeqData], model_cfg: ModelConfig, mesh: Mesh) -> list[dict]:
    """Host buffers of every micro-batch, placed on the devices ([N, T] split by rows). With
    several processes each builds the same host buffers and places only its own devices' rows."""
    from jaxsb.devices import global_array

    sharding = microbatch_sharding(mesh)
    return [{f: global_array(host[f], sharding) for f in FIELDS} for host in plan_host_buffers(plan, seqs, model_cfg)]
