"""Checkpoints with orbax: the training state pytree (parameters, optimiser state, step, RNG)
and a JSON record (data iterator position, data counters) saved together, every N steps and
at the end. Restoring reuses the abstract, sharded state so arrays land where they belong.

A checkpoint is written into a temporary directory and committed by a rename, so a write cut
short (a killed process, a full disk) leaves no half checkpoint under a step's name; its
temporary directory is removed when the next run starts (`removed_leftovers`). Older checkpoints are removed
only after a new one is committed. A failed write is retried once (after discarding what it
left); a second failure stops the run with a `CheckpointError` naming the path and the OS
error, the previous checkpoint intact.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's name for a step being written


class CheckpointError(RuntimeError):
    """Writing a checkpoint failed twice; the message names the path and the error."""


class Checkpointer:
    def __init__(self, directory: str, keep: int = 2):
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.removed_leftovers = self._remove_leftovers()
        self._manager = self._open()
        self.last_saved: int | None = self._manager.latest_step()  # the newest complete checkpoint

    def _open(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True))

    def _remove_leftovers(self, step: int | None = None) -> list[str]:
        """Deletes the temporary directories of writes that never committed (all, or `step`'s);
        process 0 does it, at the start of a run and after a failed write."""
        pattern = f"{'*' if step is None else step}{TMP_MARK}*"
        paths = sorted(glob.glob(os.path.join(self.directory, pattern)))
        if jax.process_index() == 0:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
        return [os.path.basename(p) for p in paths]

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, state: Any, meta: dict[str, Any], log: Callable[[str], None] = print) -> None:
        """Writes and commits step `step` (blocking); one retry, then CheckpointError."""
        for attempt in (1, 2):
            try:
                self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                                 meta=ocp.args.JsonSave(meta)))
                self._manager.wait_until_finished()
                self.last_saved = step
                return
            except Exception as e:  # noqa: BLE001 - orbax re-raises the OS error, sometimes wrapped
                error = f"{type(e).__name__}: {e}"
                self._discard(step)
                if attempt == 2:
                    kept = ("no earlier checkpoint" if self.last_saved is None else
                            f"the checkpoint of step {self.last_saved} in {self.directory} is intact")
                    raise CheckpointError(f"{self.step_path(step)}: writing the checkpoint of step {step} failed "
                                          f"twice ({error}); {kept}") from e
                log(f"warning: {self.step_path(step)}: writing the checkpoint of step {step} failed ({error}); "
                    "retrying once")

    def _discard(self, step: int) -> None:
        """Removes what a failed write of `step` left and reopens the manager (it may have
        recorded the step as in progress)."""
        try:
            self._manager.close()
        except Exception:  # noqa: BLE001 - the failure may surface again on close; it is handled above
            pass
        self._remove_leftovers(step)
        self._manager = self._open()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """`abstract_state`: ShapeDtypeStructs carrying the target shardings."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        return restored.state, restored.meta

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self, quiet: bool = False) -> None:
        """Waits for writes in flight and closes. `quiet`: on the way out of a failed run,
        where a second error would hide the first."""
        try:
            self._manager.wait_until_finished()
            self._manager.close()
        except Exception:  # noqa: BLE001
            if not quiet:
                raise


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
