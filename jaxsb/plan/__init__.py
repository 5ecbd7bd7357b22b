"""The Plan package: the one interface between planning and execution (numpy and config only).

* `plan.py`: the Plan (frozen template + per-step data), its building and validation, and the
  buffer arithmetic every layout follows;
* `layout.py`: a Plan plus the step's sequences -> per-device token buffers (host numpy);
* `executable.py`: what the executor can run (`Runnable`), told to planners before they plan.
"""

from jaxsb.plan.plan import (BUFFER_BUCKETS, SCHEMES, SHARDED, Group, GroupSpec, MicroBatch, Part, Placement,
                             Plan, PlanError, Template, bucket, build_plan, local_needed, padded_length,
                             ring_shard_len, shard_needed, validate)
from jaxsb.plan.executable import Runnable, alignment, check_executable, executable_problem, ulysses_runs

__all__ = ["BUFFER_BUCKETS", "SCHEMES", "SHARDED", "Group", "GroupSpec", "MicroBatch", "Part", "Placement", "Plan",
           "PlanError", "Runnable", "Template", "alignment", "bucket", "build_plan", "check_executable",
           "executable_problem", "local_needed", "padded_length", "ring_shard_len", "shard_needed", "ulysses_runs",
           "validate"]
