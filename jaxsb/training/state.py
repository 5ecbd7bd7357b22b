"""Training state from abstract shapes: the model config and tokenizer (from scratch or a
pretrained checkpoint), then `{"params", "opt_state", "step", "rng"}` created sharded — freshly
initialised under jit, or the pretrained weights placed on their shardings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsb import mesh as mesh_lib
from jaxsb.config import Config, ConfigError, ModelConfig
from jaxsb.data import Tokenizer, build_tokenizer
from jaxsb.wire import share_from_main
from jaxsb.models import Llama
from jaxsb.training.optim import make_optimizer


def load_model_and_tokenizer(cfg: Config, workdir: str | None):
    """(ModelConfig with vocab filled in, Tokenizer, pretrained numpy params or None)."""
    if cfg.model.init != "scratch":
        from jaxsb.models.pretrained import load_pretrained

        pre = load_pretrained(cfg.model.init)
        model_cfg = dataclasses.replace(cfg.model, **pre.config)
        tokenizer = Tokenizer(pre.tokenizer, bos_id=pre.bos_id if pre.bos_id is not None else pre.eos_id,
                              eos_id=pre.eos_id, name=cfg.model.init, chat_template=pre.chat_template)
        model_cfg.validate()
        return model_cfg, tokenizer, pre.params
    # Process 0 trains (or reloads) the BPE; the others get the very same one.
    tokenizer = share_from_main("jaxsb/tokenizer", "tokenizer",
                                lambda: build_tokenizer(cfg.tokenizer, cfg.data, workdir))
    vocab = cfg.model.vocab_size or tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer.vocab_size}")
    return dataclasses.replace(cfg.model, vocab_size=vocab), tokenizer, None


def split_model(model: nnx.Module):
    """(graphdef, params as a pure dict, the rest of the model's state)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), rest


def _state_fns(model_cfg: ModelConfig, train_cfg, mesh, fsdp: bool):
    """(init_state(key) -> state, tx, key, abstract state, its shardings, graphdef, rest)."""
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
    return init_state, tx, key, abstract, shardings, graphdef, rest


def abstract_model_fns(model_cfg: ModelConfig, train_cfg, mesh, fsdp: bool):
    """(graphdef, rest, tx, state as ShapeDtypeStructs with their shardings, state_shardings):
    what compiling a step needs, without creating any array (the mesh may be of compile-only
    devices)."""
    _, tx, _, abstract, shardings, graphdef, rest = _state_fns(model_cfg, train_cfg, mesh, fsdp)
    structs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return graphdef, rest, tx, structs, shardings


def build_model_fns(model_cfg: ModelConfig, train_cfg, mesh, fsdp: bool, pretrained_params=None):
    """Returns (graphdef, rest, tx, state, state_shardings): state created sharded from its
    abstract shape, either freshly initialised or from pretrained weights."""
    init_state, tx, key, abstract, shardings, graphdef, rest = _state_fns(model_cfg, train_cfg, mesh, fsdp)
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
