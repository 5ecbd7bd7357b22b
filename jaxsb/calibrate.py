"""`python -m jaxsb.calibrate`: time the real training step on this machine and fit a cost-model
preset. The method, the grid and the timing rules: jaxsb/training/calibration.py."""

from __future__ import annotations

import sys

import numpy as np

from jaxsb.cli import base_parser, init_devices, parse_config
from jaxsb.training.calibration import (BUDGETS, DEFAULT_OUT, DEGREES, HOLDOUT, LENGTHS, QUICK, REPEATS,
                                        calibrate, format_table, held_out_errors)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("Time the jaxsb training step on this machine and fit a cost-model preset.")
    parser.add_argument("--degrees", type=_ints, default=None, help=f"group degrees (default {DEGREES})")
    parser.add_argument("--lengths", type=_ints, default=None,
                        help=f"tokens per device of the fit shapes (default {LENGTHS})")
    parser.add_argument("--holdout", type=_ints, default=None,
                        help=f"tokens per device of the held-out single-sequence shapes (default {HOLDOUT})")
    parser.add_argument("--budgets", type=_ints, default=None,
                        help=f"sparse budgets in key blocks, model.attention=sparse only (default {BUDGETS})")
    parser.add_argument("--repeats", type=int, default=None, help=f"timed rounds (default {REPEATS})")
    parser.add_argument("--out", default=DEFAULT_OUT, help="the preset JSON to write")
    parser.add_argument("--quick", action="store_true", help=f"a small grid for tests: {QUICK}")
    args = parser.parse_args(argv)
    cfg = parse_config(args)
    init_devices()
    base = QUICK if args.quick else dict(degrees=DEGREES, lengths=LENGTHS, holdout=HOLDOUT, budgets=BUDGETS,
                                        repeats=REPEATS)
    opts = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    if opts["repeats"] < 1:
        raise SystemExit(f"--repeats must be >= 1, got {opts['repeats']}")
    command = "python -m jaxsb.calibrate " + " ".join(sys.argv[1:] if argv is None else argv)
    fit, rows = calibrate(cfg, command=command.strip(), **opts)
    print(format_table(rows))
    err = held_out_errors(rows)
    print(f"held-out error: median {np.median(err):.1%}, max {err.max():.1%} over {len(err)} shapes")
    fit.save(args.out)
    print(f"wrote {args.out} (use it with --set parallel.preset={args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
