"""Scoring a model on text: the library behind `python -m jaxsb.eval`.

`load_for_eval` gives (model, tokenizer, config) from a trained run's latest checkpoint or from
`model.init`; `window_nll` sums next-token negative log-likelihoods over non-overlapping windows.
"""

from __future__ import annotations

import os


def window_nll(model, ids: list[int], window: int) -> tuple[float, int]:
    """Sum of next-token negative log-likelihoods over non-overlapping windows, and count."""
    from jaxsb.models.generate import next_token_nll

    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        s, n = next_token_nll(model, ids[start:start + window + 1])  # >= 2 tokens by the range
        total += s
        count += n
    return total, count


def load_for_eval(cfg, workdir: str | None):
    """(model, tokenizer, config) from a trained workdir's latest checkpoint (and its saved
    config) or from `cfg.model.init`."""
    import jax
    from flax import nnx

    from jaxsb import mesh as mesh_lib
    from jaxsb.training.checkpoint import Checkpointer, abstract_with_shardings
    from jaxsb.config import ConfigError, config_from_json
    from jaxsb.training.state import build_model_fns, load_model_and_tokenizer

    if workdir:
        path = os.path.join(workdir, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"--workdir {workdir}: no config.json there (not a jaxsb run directory)")
        with open(path) as f:
            cfg = config_from_json(f.read())
    elif cfg.model.init == "scratch":
        raise ConfigError("nothing to evaluate: pass --workdir DIR (a trained run) or --set model.init=...")
    mesh = mesh_lib.make_mesh(1)
    model_cfg, tokenizer, pretrained = load_model_and_tokenizer(cfg, workdir)
    graphdef, rest, _, state, shardings = build_model_fns(model_cfg, cfg.train, mesh, False, pretrained)
    if workdir:
        ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
        step = ckpt.latest_step()
        if step is None:
            raise ConfigError(f"--workdir {workdir}: no checkpoint in {ckpt.directory}")
        state, _ = ckpt.restore(step, abstract_with_shardings(state, shardings))
        ckpt.close()
    return nnx.merge(graphdef, jax.device_get(state["params"]), rest), tokenizer, cfg
