"""The run's workdir: chosen, checked against a resumed run's config, config.json written;
before training, checked to be writable with room for the checkpoints the run keeps."""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

from jaxsb.config import Config, ConfigError, config_from_json, default_workdir

# Sections that must match when a run resumes in an existing workdir (train.* may change,
# e.g. to extend a run).
_FROZEN_SECTIONS = ("model", "tokenizer", "data", "parallel")
# How this launch joined its processes: a resumed run may be launched differently.
_LAUNCH_FIELDS = ("parallel.coordinator", "parallel.num_processes", "parallel.process_id",
                  "parallel.peer_timeout_s")


def prepare_workdir(cfg: Config) -> tuple[Config, str]:
    """Chooses the workdir, checks a resumed run's config agrees, writes config.json."""
    workdir = cfg.train.workdir or default_workdir(cfg)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{workdir}: cannot create the workdir ({e}); choose another --workdir") from None
    saved_path = os.path.join(workdir, "config.json")
    if os.path.exists(saved_path):
        with open(saved_path) as f:
            saved = config_from_json(f.read())
        diffs = [
            f"{section}.{k}: saved {v!r}, now {getattr(getattr(cfg, section), k)!r}"
            for section in _FROZEN_SECTIONS
            for k, v in dataclasses.asdict(getattr(saved, section)).items()
            if _normalise(v) != _normalise(dataclasses.asdict(getattr(cfg, section))[k])
            and f"{section}.{k}" not in _LAUNCH_FIELDS
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


def check_room(workdir: str, checkpoint_bytes: int, keep: int) -> str:
    """Returns `workdir`, or raises ConfigError before training when it cannot be written or
    its disk has less room than `keep` checkpoints plus the one being written."""
    probe = os.path.join(workdir, f".jaxsb-write-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{workdir}: the workdir cannot be written ({e}); choose another --workdir") from None
    need = checkpoint_bytes * (keep + 1)
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise ConfigError(
            f"{workdir}: {free / 1e6:,.1f} MB free on its disk, the run's checkpoints need about {need / 1e6:,.1f} MB "
            f"(train.keep_checkpoints={keep} kept and one being written, {checkpoint_bytes / 1e6:,.1f} MB each); "
            "free some space, lower train.keep_checkpoints or choose another --workdir")
    return workdir


def _normalise(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
