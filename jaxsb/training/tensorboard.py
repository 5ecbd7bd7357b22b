"""TensorBoard event files of a run: the scalars of `metrics.jsonl`, step by step, in
`<workdir>/tensorboard/` (`tensorboard --logdir <workdir>`; `train.tensorboard=false` turns it
off). Written with TensorBoard's own event-file writer and protocol buffers (the `tensorboard`
package; no TensorFlow).

Every number of a step's record becomes a scalar of the same name (`loss`, `tokens_per_s`,
`load_imbalance`, `sparse_coverage`, ...); strings, lists, booleans and missing values are
left to `metrics.jsonl`. A resumed run writes a new event file that starts with a
SessionLog.START at the first step it runs again, so TensorBoard drops the earlier launch's
events from that step on (as `metrics.jsonl` drops its records) instead of drawing them twice.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers: what TensorBoard shows (booleans and non-finite values excluded)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardWriter:
    def __init__(self, logdir: str, first_step: int = 1):
        """`first_step`: the first step this launch runs (> 1 when it resumes)."""
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = logdir
        os.makedirs(logdir, exist_ok=True)
        self._event_pb2 = event_pb2
        self._writer = EventFileWriter(logdir)
        if first_step > 1:  # steps >= first_step of earlier launches are superseded
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=first_step,
                                                   session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

    def write(self, record: dict[str, Any]) -> None:
        from tensorboard.compat.proto import summary_pb2

        values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in scalars(record).items()]
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=int(record["step"]),
                                                     summary=summary_pb2.Summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
