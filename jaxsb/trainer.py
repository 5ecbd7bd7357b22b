"""The training loop: state from abstract shapes, sharded init or pretrained load, one
compiled program per batch-shape bucket, asynchronous dispatch, metrics, checkpoints, resume.

State is a plain pytree `{"params", "opt_state", "step", "rng"}`; the NNX graph definition
is static and closed over by the step function. The loss is the mean over every target token
of the global batch, whatever the packing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxsb import mesh as mesh_lib
from jaxsb.checkpoint import Checkpointer, abstract_with_shardings
from jaxsb.config import Config, ConfigError, ModelConfig, config_from_json, default_workdir
from jaxsb.data import Batch, DataIterator, Tokenizer, build_tokenizer
from jaxsb.metrics import MetricsWriter, Progress, peak_flops_per_device, useful_train_flops
from jaxsb.models import Llama
from jaxsb.models.loss import next_token_loss
from jaxsb.optim import learning_rate_schedule, make_optimizer

BATCH_FIELDS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
# Sections that must match when a run resumes in an existing workdir (train.* may change,
# e.g. to extend a run).
_FROZEN_SECTIONS = ("model", "tokenizer", "data", "parallel")


@dataclasses.dataclass
class RunResult:
    workdir: str
    first_step: int
    last_step: int
    final_loss: float | None
    tokens: int
    seconds: float
    compiles: int
    data_summary: str


# --------------------------------------------------------------------------- setup pieces


def prepare_workdir(cfg: Config) -> tuple[Config, str]:
    """Chooses the workdir, checks a resumed run's config agrees, writes config.json."""
    workdir = cfg.train.workdir or default_workdir(cfg)
    os.makedirs(workdir, exist_ok=True)
    saved_path = os.path.join(workdir, "config.json")
    if os.path.exists(saved_path):
        with open(saved_path) as f:
            saved = config_from_json(f.read())
        diffs = [
            f"{section}.{k}: saved {v!r}, now {getattr(getattr(cfg, section), k)!r}"
            for section in _FROZEN_SECTIONS
            for k, v in dataclasses.asdict(getattr(saved, section)).items()
            if _normalise(v) != _normalise(dataclasses.asdict(getattr(cfg, section))[k])
        ]
        if diffs:
            raise ConfigError(
                f"{workdir} holds a run with a different config; resume with the same settings "
                "or choose another --workdir. Differences:\n  " + "\n  ".join(diffs)
            )
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, workdir=workdir))
    with open(saved_path, "w") as f:
        f.write(cfg.to_json())
    return cfg, workdir


def _normalise(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def load_model_and_tokenizer(cfg: Config, workdir: str | None):
    """(ModelConfig with vocab filled in, Tokenizer, pretrained numpy params or None)."""
    if cfg.model.init != "scratch":
        from jaxsb.models.pretrained import load_pretrained

        pre = load_pretrained(cfg.model.init)
        model_cfg = dataclasses.replace(cfg.model, **pre.config)
        tokenizer = Tokenizer(pre.tokenizer, bos_id=pre.bos_id if pre.bos_id is not None else pre.eos_id,
                              eos_id=pre.eos_id, name=cfg.model.init)
        model_cfg.validate()
        return model_cfg, tokenizer, pre.params
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.data, workdir)
    vocab = cfg.model.vocab_size or tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer.vocab_size}")
    return dataclasses.replace(cfg.model, vocab_size=vocab), tokenizer, None


def split_model(model: nnx.Module):
    """(graphdef, params as a pure dict, the rest of the model's state)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params.to_pure_dict(), rest


def build_model_fns(model_cfg: ModelConfig, train_cfg, mesh, fsdp: bool, pretrained_params=None):
    """Returns (graphdef, rest, tx, state, state_shardings): state created sharded from its
    abstract shape, either freshly initialised or from pretrained weights."""
    tx = make_optimizer(train_cfg)

    def init_state(key):
        model = Llama(model_cfg, rngs=nnx.Rngs(params=key))
        _, params, _ = split_model(model)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(key)}

    key = jax.random.PRNGKey(train_cfg.seed)
    abstract = jax.eval_shape(init_state, key)
    shardings = mesh_lib.state_shardings(mesh, abstract, fsdp)
    graphdef, _, rest = split_model(nnx.eval_shape(lambda: Llama(model_cfg, rngs=nnx.Rngs(0))))
    if pretrained_params is None:
        state = jax.jit(init_state, out_shardings=shardings)(key)
    else:
        params = jax.device_put(_cast_like(pretrained_params, abstract["params"]), shardings["params"])
        opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])(params)
        state = {"params": params, "opt_state": opt_state,
                 "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"]),
                 "rng": jax.device_put(jax.random.key_data(key), shardings["rng"])}
    return graphdef, rest, tx, state, shardings


def _cast_like(numpy_tree, abstract_tree):
    def one(x, a):
        x = np.asarray(x)
        if x.shape != a.shape:
            raise ValueError(f"pretrained tensor has shape {x.shape}, model expects {a.shape}")
        return x.astype(a.dtype)

    return jax.tree.map(one, numpy_tree, abstract_tree)


def pop_layer_stats(model: nnx.Module) -> dict[str, jax.Array]:
    """Means over layers of the values the model sowed as nnx.Intermediate (e.g. the sparse
    router's selected blocks and coverage); empty for dense attention."""
    sown = nnx.pop(model, nnx.Intermediate).to_pure_dict()
    by_name: dict[str, list] = {}
    for path, value in jax.tree_util.tree_leaves_with_path(sown):
        names = [getattr(k, "key", None) for k in path]
        name = next(n for n in reversed(names) if isinstance(n, str))
        by_name.setdefault(name, []).append(value)
    return {name: jnp.mean(jnp.stack(values)) for name, values in sorted(by_name.items())}


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
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "targets": count, **stats}

    return train_step


class StepCompiler:
    """Compiles the train step once per batch shape (ahead of time) and counts programs."""

    def __init__(self, step_fn, state_shardings, batch_sharding):
        self._jitted = jax.jit(step_fn, donate_argnums=(0,),
                               out_shardings=(state_shardings, None))
        self._batch_sharding = batch_sharding
        self._compiled: dict[tuple, Any] = {}
        self.compile_seconds = 0.0

    @property
    def count(self) -> int:
        return len(self._compiled)

    def get(self, state, batch_arrays) -> tuple[Any, bool]:
        key = tuple((k, v.shape, str(v.dtype)) for k, v in sorted(batch_arrays.items()))
        if key in self._compiled:
            return self._compiled[key], False
        t0 = time.perf_counter()
        self._compiled[key] = self._jitted.lower(state, batch_arrays).compile()
        self.compile_seconds += time.perf_counter() - t0
        return self._compiled[key], True


def batch_to_device(batch: Batch, sharding) -> dict[str, jax.Array]:
    return {name: jax.device_put(np.asarray(getattr(batch, name)), sharding) for name in BATCH_FIELDS}


# --------------------------------------------------------------------------- the loop


def train(cfg: Config, log: Callable[[str], None] = print) -> RunResult:
    cfg, workdir = prepare_workdir(cfg)
    mesh = mesh_lib.make_mesh(cfg.parallel.devices)
    num_devices = mesh.devices.size
    model_cfg, tokenizer, pretrained = load_model_and_tokenizer(cfg, workdir)
    graphdef, rest, tx, state, shardings = build_model_fns(model_cfg, cfg.train, mesh, cfg.parallel.fsdp, pretrained)
    num_rows = num_devices * cfg.data.rows_per_device
    data = DataIterator(cfg.data, tokenizer, num_rows)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.train.keep_checkpoints)

    start = 0
    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(latest, abstract_with_shardings(state, shardings))
        data.restore(meta["data"])
        start = latest
        log(f"resumed from {ckpt.directory} at step {start}")
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    log(f"jaxsb: {n_params / 1e6:.2f}M parameters, {num_devices} {jax.devices()[0].platform} devices, "
        f"{num_rows} rows per step, tokenizer vocab {tokenizer.vocab_size}, workdir {workdir}")

    compiler = StepCompiler(make_train_step(graphdef, rest, tx), shardings, mesh_lib.batch_sharding(mesh))
    schedule = learning_rate_schedule(cfg.train)
    peak, peak_source = peak_flops_per_device()
    writer = MetricsWriter(os.path.join(workdir, "metrics.jsonl"), resume_from_step=start)
    progress = Progress(cfg.train.steps, start, cfg.train.progress)

    t_start = time.perf_counter()
    tokens_total, final_loss, pending = 0, None, None
    last_done = time.perf_counter()
    paused_s = 0.0

    def finish(p) -> None:
        """Blocks on a dispatched step's metrics and logs them."""
        nonlocal last_done, tokens_total, final_loss, paused_s
        metrics = jax.device_get(p["metrics"])
        now = time.perf_counter()
        # Compiling and checkpointing done inside this interval are not step time.
        step_time = now - last_done - paused_s
        last_done, paused_s = now, 0.0
        batch: Batch = p["batch"]
        tokens = int(sum(batch.doc_lengths))
        sparse_blocks = float(metrics["sparse_blocks"]) if "sparse_blocks" in metrics else None
        flops = useful_train_flops(model_cfg, batch.doc_lengths, sparse_blocks)
        record = {
            "step": p["step"], "loss": float(metrics["loss"]), "tokens": tokens,
            "targets": int(metrics["targets"]), "step_time_s": step_time,
            "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
            "lr": float(schedule(p["step"] - 1)), "grad_norm": float(metrics["grad_norm"]),
            "rows": int(batch.tokens.shape[0]), "row_len": int(batch.tokens.shape[1]),
            "docs": len(batch.doc_lengths),
            "padding_frac": 1.0 - tokens / batch.tokens.size,
            "compiles": compiler.count, "compiled_now": p["compiled"], "compile_s": p["compile_s"],
            "useful_tflops": flops / 1e12,
            "mfu": flops / (step_time * peak * num_devices) if peak and step_time > 0 else None,
        }
        if model_cfg.attention == "sparse":
            record["sparse_budget"] = model_cfg.sparse.top_k
            record["sparse_blocks"] = sparse_blocks  # mean selected per query block
            record["sparse_coverage"] = float(metrics["sparse_coverage"])
        writer.write(record)
        progress.update(p["step"], record["loss"], record["tokens_per_s"])
        tokens_total += tokens
        final_loss = record["loss"]

    for step in range(start + 1, cfg.train.steps + 1):
        batch = data.next()
        arrays = batch_to_device(batch, mesh_lib.batch_sharding(mesh))
        c0 = compiler.compile_seconds
        compiled, is_new = compiler.get(state, arrays)
        paused_s += compiler.compile_seconds - c0
        state, metrics = compiled(state, arrays)
        if pending is not None:
            finish(pending)
        pending = {"step": step, "metrics": metrics, "batch": batch, "compiled": is_new,
                   "compile_s": compiler.compile_seconds - c0}
        if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
            jax.block_until_ready(state)  # the step's own compute is step time
            t0 = time.perf_counter()
            ckpt.save(step, state, {"data": data.state(), "step": step})
            ckpt.wait()
            paused_s += time.perf_counter() - t0
    if pending is not None:
        finish(pending)
    progress.close()
    writer.close()
    ckpt.close()
    seconds = time.perf_counter() - t_start
    result = RunResult(workdir, start, cfg.train.steps, final_loss, tokens_total, seconds,
                       compiler.count, data.stats.summary())
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(dataclasses.asdict(result) | {"peak_flops_source": peak_source}, f, indent=2)
    return result
