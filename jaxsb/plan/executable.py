"""What jaxsb's executor can run: the one check, told to planners before they plan.

Plans may describe any layout (the simulator costs FlexSP's heterogeneous all-to-all
groups). The executor (jaxsb/parallel/) is narrower:

* one scheme per micro-batch; ulysses only when every group of the micro-batch has the same
  degree (one `all_to_all` on a (groups, degree) mesh); ring groups of any degrees mix freely
  with degree-1 groups;
* with routed block-sparse attention (`Runnable.sparse_block` > 0): every sequence starts on a
  block boundary (`align`), a ring micro-batch's zigzag chunks are whole blocks (shard_len a
  multiple of 2·block), and ulysses degrees divide the kv heads (routing pools queries over
  all query heads of a kv head; repeated kv heads would change the routing with the plan).

A planner given a `Runnable` returns only plans it accepts (`jaxsb.planner.base`), so the
trainer never swaps a refused plan for another one silently.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxsb.plan.plan import PlanError, Template


@dataclasses.dataclass(frozen=True)
class Runnable:
    """The executor's limits for one model: `sparse_block` tokens per routed block (0: dense
    attention) and the model's `kv_heads` (0: unknown, no ulysses restriction)."""

    sparse_block: int = 0
    kv_heads: int = 0

    @classmethod
    def for_model(cls, model_cfg) -> "Runnable":
        """From a `jaxsb.config.ModelConfig`."""
        sparse = model_cfg.attention == "sparse"
        return cls(model_cfg.sparse.block_size if sparse else 0, model_cfg.kv_heads)

    @property
    def align(self) -> int:
        """Sequences start on sparse-block boundaries for sparse attention (routing is per block)."""
        return self.sparse_block or 1

    def ulysses_degree_ok(self, degree: int) -> bool:
        return not (self.sparse_block and self.kv_heads and self.kv_heads % degree)

    def problem(self, template: Template) -> str | None:
        """Why the executor cannot run this template as one program, or None if it can."""
        problem = executable_problem(template)
        if problem is not None or not self.sparse_block:
            return problem
        bs = self.sparse_block
        ring = [m for m, mb in enumerate(template.microbatches) if mb.scheme == "ring" and mb.shard_len % (2 * bs)]
        uneven = [m for m, mb in enumerate(template.microbatches)
                  if mb.scheme == "ulysses" and not self.ulysses_degree_ok(mb.groups[0].degree)]
        if ring:
            return (f"micro-batches {ring}: block-sparse ring attention needs zigzag chunks of whole "
                    f"{bs}-token blocks (shard_len a multiple of {2 * bs}); build the plan with align={bs}")
        if uneven:
            return (f"micro-batches {uneven}: sparse routing pools queries over all query heads of a kv "
                    f"head, so ulysses degrees must divide kv_heads={self.kv_heads} (else kv heads "
                    "are repeated and the routing would change with the plan)")
        return None

    def check(self, template: Template) -> None:
        """PlanError naming the problem when the executor cannot run the template."""
        problem = self.problem(template)
        if problem is not None:
            raise PlanError(f"plan {template.summary()!r} cannot be executed: {problem}")


def ulysses_runs(degrees: Sequence[int], runnable: Runnable | None = None, num_devices: int | None = None) -> bool:
    """Whether the executor can run a micro-batch whose groups have these degrees as ulysses:
    one `all_to_all` on a (groups, degree) mesh needs a single degree, and `runnable` (when
    given) must accept it. With `num_devices`, the devices the groups leave out count as the
    idle degree-1 groups build_plan adds."""
    degs = set(degrees)
    if num_devices is not None and sum(degrees) < num_devices:
        degs.add(1)
    return len(degs) == 1 and (runnable is None or runnable.ulysses_degree_ok(degs.pop()))


def executable_problem(template: Template) -> str | None:
    """The executor's rules that hold for every model (see the module docstring)."""
    for m, mb in enumerate(template.microbatches):
        schemes = {grp.scheme for grp in mb.groups if grp.degree > 1}
        if len(schemes) > 1:
            return f"micro-batch {m} (groups {mb.degrees()}) mixes schemes {sorted(schemes)}; one per micro-batch"
        if "ulysses" in schemes and not ulysses_runs([grp.degree for grp in mb.groups]):
            return (f"micro-batch {m} (groups {mb.degrees()}): ulysses needs groups of one degree; "
                    "use ring for groups of different sizes")
    return None


def check_executable(template: Template, model_cfg) -> None:
    """PlanError (a ValueError) when the executor cannot run the template with this model."""
    Runnable.for_model(model_cfg).check(template)


def alignment(model_cfg) -> int:
    return Runnable.for_model(model_cfg).align
