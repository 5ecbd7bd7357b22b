"""Shared command-line handling: --config, --set, and device setup before JAX is imported."""

from __future__ import annotations

import argparse
import sys

from jaxsb.devices import init_distributed, setup_host_devices


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default="default", help="a name from configs/ or a path to a TOML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, dotted and typed, e.g. --set train.steps=20 (repeatable)")
    parser.add_argument("--workdir", default=None, help="output directory (same as --set train.workdir=DIR)")
    return parser


def parse_config(args: argparse.Namespace):
    """Loads the config; exits with the message (no traceback) when it is invalid."""
    from jaxsb.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.workdir:
        overrides.append(f"train.workdir={args.workdir}")
    try:
        return load_config(args.config, overrides)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


def init_devices(parallel=None) -> None:
    """Simulated CPU devices when there is no accelerator; then, given the run's
    ParallelConfig with a coordinator, joins the other processes (before any device is used)."""
    setup_host_devices()
    if parallel is not None:
        init_distributed(parallel.coordinator, parallel.num_processes, parallel.process_id, parallel.peer_timeout_s)


def load_model(args: argparse.Namespace):
    """For the CLIs that read a model (eval, export): `--workdir` names a trained run (its last
    checkpoint, its saved config with the `--set` overrides on top), else the config's
    `model.init`. Returns (model, tokenizer, config); exits with
    status 2 and the message when the run or checkpoint cannot be read."""
    workdir = args.workdir
    args.workdir = None  # here --workdir names the run to read, not an output directory
    cfg = parse_config(args)
    init_devices()
    from jaxsb.config import ConfigError
    from jaxsb.models.pretrained import GGUFError, HFCheckpointError
    from jaxsb.training.evaluation import load_for_eval

    try:
        return load_for_eval(cfg, workdir, args.overrides)
    except (ConfigError, HFCheckpointError, GGUFError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
