"""Shared command-line handling: --config, --set, and device setup before JAX is imported."""

from __future__ import annotations

import argparse
import sys

from jaxsb.devices import setup_host_devices


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


def init_devices() -> None:
    setup_host_devices()
