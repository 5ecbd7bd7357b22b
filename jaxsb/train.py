"""`python -m jaxsb.train`: parse the config, set up devices (and join the other processes of a
multi-process run), train, print the summary.

Exit status: 0 done, or stopped by SIGTERM / SIGINT with a checkpoint; 1 the run stopped on a
fault (a checkpoint write failed twice, hosts disagreed on a step, a malformed message);
2 bad configuration or input; 3 a peer process was lost (training/faults.py)."""

from __future__ import annotations

import sys

from jaxsb.cli import base_parser, init_devices, parse_config


def main(argv: list[str] | None = None) -> int:
    args = base_parser("Train a LLaMA-style model with jaxsb.").parse_args(argv)
    cfg = parse_config(args)
    init_devices(cfg.parallel)
    from jaxsb.config import ConfigError
    from jaxsb.data import DataError
    from jaxsb.devices import is_main_process
    from jaxsb.models.pretrained import GGUFError, HFCheckpointError
    from jaxsb.training.checkpoint import CheckpointError
    from jaxsb.training.faults import HostsDisagree
    from jaxsb.training.trainer import train
    from jaxsb.wire import WireError

    try:
        result = train(cfg)
    except (ConfigError, DataError, HFCheckpointError, GGUFError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, HostsDisagree, WireError) as e:  # the run stops; what is on disk is whole
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not is_main_process():
        return 0  # process 0 reports for the whole run
    steps = result.last_step - result.first_step
    print(f"\ntrained {steps} steps ({result.first_step} -> {result.last_step}), {result.tokens:,} tokens "
          f"in {result.seconds:.1f} s ({result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s); "
          f"final loss {result.final_loss if result.final_loss is None else round(result.final_loss, 4)}")
    print(f"compiled programs: {result.compiles}")
    for line in result.plan_summary:
        print(line)
    print(result.data_summary)
    files = ["metrics.jsonl", *(["tensorboard/"] if cfg.train.tensorboard else []),
             *(["pictures *.png"] if cfg.train.report else []), "checkpoints/", "config.json", "summary.json"]
    print(f"outputs: {result.workdir}/ ({', '.join(files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
