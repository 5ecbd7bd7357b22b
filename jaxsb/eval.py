"""`python -m jaxsb.eval`: perplexity of a pretrained or trained model on a text file.

    python -m jaxsb.eval --set model.init=smollm2-135m --text FILE
    python -m jaxsb.eval --workdir runs/default-... --text FILE

The text is tokenized as one document and cut into windows of `data.max_len` tokens; every
token after the first of its window is predicted. Prints the token count and, last,
`perplexity: X`.
"""

from __future__ import annotations

import math
import os
import sys

from jaxsb.cli import base_parser, init_devices, parse_config


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
    """(model, tokenizer) from a trained workdir's latest checkpoint or from model.init."""
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


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("Perplexity of a jaxsb model on a text file.")
    parser.add_argument("--text", required=True, help="UTF-8 text file to score")
    args = parser.parse_args(argv)
    workdir = args.workdir
    args.workdir = None  # here --workdir names the run to read, not an output directory
    cfg = parse_config(args)
    init_devices()
    from jaxsb.config import ConfigError

    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: --text {args.text}: {e}", file=sys.stderr)
        return 2
    try:
        model, tokenizer, cfg = load_for_eval(cfg, workdir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        print(f"error: --text {args.text}: {len(ids)} tokens; need at least 2", file=sys.stderr)
        return 2
    total, count = window_nll(model, ids, cfg.data.max_len)
    print(f"tokens: {len(ids)} (scored {count})")
    print(f"perplexity: {math.exp(total / count):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
