"""Scoring a model: the library behind `python -m jaxsb.eval`.

`load_for_eval` gives (model, tokenizer, config) from a trained run's latest checkpoint or from
`model.init`, and `model_context` the positions it may use. `window_nll` sums next-token negative
log-likelihoods over non-overlapping windows; `generate_all` runs greedy KV-cache generation over
many prompts in length-sorted batches (jaxsb/models/decode.py). Both add what their forward
passes computed to an `AttentionWork`: block pairs against dense causal attention, and the
sparse router's coverage and floor decisions.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass
class AttentionWork:
    """Attention computed by a task's forward passes (prefills and scoring windows; decode steps
    are dense and not counted), with the sparse layers' routing statistics weighted by prompts."""

    pairs: float = 0.0  # (query block, key block) pairs, summed over layers, kv heads and prompts
    dense_pairs: float = 0.0  # the same for dense causal attention over the same prompts
    weight: float = 0.0
    stat_sums: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, pairs: float, dense_pairs: float, stats: dict[str, float], weight: float) -> None:
        self.pairs += pairs
        self.dense_pairs += dense_pairs
        self.weight += weight
        for name in ("sparse_coverage", "sparse_blocks", "floor_planned", "floor_final", "floor_overridden"):
            if name in stats:
                self.stat_sums[name] = self.stat_sums.get(name, 0.0) + stats[name] * weight

    @property
    def fraction(self) -> float:
        return self.pairs / self.dense_pairs if self.dense_pairs else 1.0

    def mean(self, name: str) -> float | None:
        return self.stat_sums[name] / self.weight if name in self.stat_sums and self.weight else None

    def summary(self) -> dict:
        out = {"attention_fraction": self.fraction, "attention_pairs": self.pairs, "dense_pairs": self.dense_pairs}
        return out | {name: self.mean(name) for name in self.stat_sums}

    def lines(self) -> list[str]:
        out = [f"attention work: {self.fraction:.4f} of dense causal block pairs "
               f"({self.pairs:.0f} of {self.dense_pairs:.0f})"]
        if (coverage := self.mean("sparse_coverage")) is not None:
            out.append(f"routing coverage: {coverage:.4f} (mean over layers, kv heads and query blocks)")
        if (final := self.mean("floor_final")) is not None:
            out.append(f"floor: budget {self.mean('floor_planned'):.2f} planned -> {final:.2f} final blocks "
                       f"(token-weighted), {100 * self.mean('floor_overridden'):.1f}% of query blocks raised")
        return out


def window_nll(model, ids: list[int], window: int, work: AttentionWork | None = None) -> tuple[float, int]:
    """Sum of next-token negative log-likelihoods over non-overlapping windows, and count."""
    from jaxsb.models.decode import dense_causal_pairs, work_block
    from jaxsb.models.generate import scored_nll

    cfg = model.cfg
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        piece = ids[start:start + window + 1]  # >= 2 tokens by the range
        s, n, stats = scored_nll(model, piece)
        total += s
        count += n
        if work is not None:
            dense = dense_causal_pairs([len(piece)], work_block(cfg), cfg.kv_heads, cfg.layers)
            work.add(stats.get("attn_block_pairs", dense), dense, stats, 1.0)
    return total, count


def mqar_recall(model, examples: list[tuple], batch_size: int, work: AttentionWork | None = None) -> tuple[int, int]:
    """(correct, total) recalled values over MQAR examples [(tokens, targets)] of equal length
    per batch (jaxsb/data/mqar.py), teacher-forced: the argmax at each query key."""
    import numpy as np

    from jaxsb.data.mqar import recall_accuracy
    from jaxsb.models.decode import dense_causal_pairs, work_block
    from jaxsb.models.generate import predicted_tokens

    cfg = model.cfg
    correct = total = 0
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        if len({len(t) for t, _ in batch}) != 1:
            raise ValueError("mqar_recall: a batch's examples must have one length")
        tokens, targets = np.stack([t for t, _ in batch]), np.stack([g for _, g in batch])
        pred, stats = predicted_tokens(model, tokens)
        c, n = recall_accuracy(pred, tokens, targets)
        correct, total = correct + c, total + n
        if work is not None:
            dense = dense_causal_pairs([tokens.shape[1]] * len(batch), work_block(cfg), cfg.kv_heads, cfg.layers)
            work.add(stats.get("attn_block_pairs", dense), dense, stats, len(batch))
    return correct, total


def generate_all(model, prompts: list[list[int]], max_new_tokens: int, *, eos_id: int | None,
                 batch_size: int, work: AttentionWork | None = None) -> list[list[int]]:
    """Greedy continuations of every prompt (in the given order), generated in batches of
    similar length so that little padding is computed."""
    from jaxsb.models.decode import generate

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        gen = generate(model, [prompts[i] for i in batch], max_new_tokens, eos_id=eos_id)
        for i, tokens in zip(batch, gen.tokens):
            out[i] = tokens
        if work is not None:
            work.add(gen.attention_pairs, gen.dense_pairs, gen.stats, len(batch))
    return out


def model_context(cfg) -> int:
    """Positions an evaluation may use: the longest of the run's `data.max_len` and the
    pretrained model's trained context (GGUF context_length, HF max_position_embeddings)."""
    from jaxsb.models.pretrained import pretrained_context

    return max(cfg.data.max_len, pretrained_context(cfg.model.init) or 0)


def load_for_eval(cfg, workdir: str | None, overrides: list[str] = ()):
    """(model, tokenizer, config) from a trained workdir's latest checkpoint (and its saved
    config with `overrides` applied: e.g. evaluate a dense-trained run with sparse attention) or
    from `cfg.model.init`."""
    import jax
    from flax import nnx

    from jaxsb import mesh as mesh_lib
    from jaxsb.training.checkpoint import Checkpointer, abstract_with_shardings
    from jaxsb.config import ConfigError, apply_overrides, config_from_json
    from jaxsb.training.state import build_model_fns, load_model_and_tokenizer

    if workdir:
        path = os.path.join(workdir, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"--workdir {workdir}: no config.json there (not a jaxsb run directory)")
        with open(path) as f:
            cfg = apply_overrides(config_from_json(f.read()), list(overrides)).validate()
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
