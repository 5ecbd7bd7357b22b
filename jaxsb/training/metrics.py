"""Per-step metrics: the `metrics.jsonl` writer, useful-FLOP accounting for MFU, the console
progress bar, and the end-of-run tally of plans and budgets.

MFU counts only useful FLOPs: the matmuls of the real (non-padding) tokens, and attention
inside each document under the causal mask (s·(s+1)/2 query-key pairs for a document of s
tokens), never padding or cross-document pairs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from typing import Any, Iterable

import numpy as np

from jaxsb.config import ModelConfig
from jaxsb.planner.hardware import matmul_params  # noqa: F401  (one count for MFU and the cost models)

# Dense peak FLOP/s per chip for bf16 matmul (vendor data sheets); CPUs are measured.
_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
}


def useful_train_flops(cfg: ModelConfig, doc_lengths: Iterable[int], sparse_blocks: float | None = None) -> float:
    """Forward + backward FLOPs (3 × forward) for one step over these packed documents.

    With block-sparse attention, `sparse_blocks` (mean key blocks selected per query block)
    caps each document's attended pairs at about s · sparse_blocks · block_size."""
    lengths = list(doc_lengths)
    tokens = sum(lengths)
    linear = 2.0 * matmul_params(cfg) * tokens
    # QK^T and PV: 2 matmuls × 2 FLOPs per multiply-add, over causal pairs within documents.
    if sparse_blocks is None:
        pairs = sum(s * (s + 1) / 2 for s in lengths)
    else:
        per_query = sparse_blocks * cfg.sparse.block_size
        pairs = sum(min(s * (s + 1) / 2, s * per_query) for s in lengths)
    attention = 4.0 * pairs * cfg.heads * cfg.head_dim * cfg.layers
    return 3.0 * (linear + attention)


def measure_matmul_flops(size: int = 1024, repeats: int = 3) -> float:
    """This host's matmul FLOP/s on one device (the CPU's practical peak)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def peak_flops_per_device() -> tuple[float, str]:
    """(FLOP/s, where the figure comes from). Simulated CPU devices share the host's cores,
    so for CPU the measured matmul rate is divided among this process's devices."""
    import jax

    dev = jax.devices()[0]
    if dev.platform != "cpu":
        kind = getattr(dev, "device_kind", "")
        for name, peak in _PEAK_FLOPS.items():
            if name.lower() in kind.lower():
                return peak, f"data sheet ({kind})"
        return 0.0, f"unknown device kind {kind!r}: MFU not reported"
    host, n = measure_matmul_flops(), jax.local_device_count()
    return host / n, f"measured host matmul {host / 1e9:.0f} GFLOP/s shared by {n} CPU devices"


class MetricsWriter:
    """Appends one JSON object per step to a JSONL file (`metrics.jsonl`, `plans.jsonl`), kept
    across resumes: records of the steps a resumed run runs again are dropped."""

    def __init__(self, path: str, resume_from_step: int = 0):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.dropped_partial = 0  # a last line cut short by a killed process (the step runs again)
        if os.path.exists(path):
            # Drop records past the checkpoint we resume from: those steps run again.
            with open(path) as f:
                lines = [line for line in f if line.strip()]
            kept = []
            for i, line in enumerate(lines):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    if i == len(lines) - 1 and not line.endswith("\n"):
                        self.dropped_partial = 1  # written in part when the process died
                        continue
                    raise ValueError(f"{path}:{i + 1}: not a JSON record ({e}); this file holds one "
                                     "JSON object per line") from None
                if record.get("step", 0) <= resume_from_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, path)  # a kill while rewriting leaves the old file, not half of it
        self._file = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """A one-line progress bar with loss, tokens/s and ETA (tqdm), or plain lines when off."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self._bar = None
        self._enabled = enabled
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                             file=sys.stderr, smoothing=0.1)

    def update(self, step: int, loss: float, tokens_per_s: float, plan: str | None = None) -> None:
        """`plan`: the step's groups per micro-batch (e.g. "4,2,1,1"), shown after the loss."""
        if self._bar is not None:
            shown = f" | plan {plan}" if plan else ""
            self._bar.set_postfix_str(f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s{shown}", refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class PlanTally:
    """The end-of-run summary of a planned run, from its metrics records: how often each layout
    ran, the cost model's predicted step time against the measured one, and the sparse budgets.

    Predicted and measured are compared per step, on the steps that compiled nothing (a compile
    stalls the pipeline around it)."""

    def __init__(self) -> None:
        self.layouts: Counter = Counter()
        self.predicted_ms: list[float] = []
        self.measured_ms: list[float] = []
        self.budgets: list[float] = []  # mean key blocks selected per query block
        self.floor: dict[str, list[float]] = {"planned": [], "final": [], "overridden": []}  # the runtime floor
        self.drop_max: float | None = None  # the largest coverage drop of any document in the run (measured)
        self.pairs = self.dense_pairs = 0.0  # attention block pairs computed / of dense causal, summed over steps

    def add(self, record: dict) -> None:
        if "plan" in record:
            self.layouts[record["plan"]] += 1
        if record.get("predicted_step_ms") is not None and not record.get("compiled_now"):
            self.predicted_ms.append(float(record["predicted_step_ms"]))
            self.measured_ms.append(float(record["measured_step_ms"]))
        if record.get("sparse_blocks") is not None:
            self.budgets.append(float(record["sparse_blocks"]))
        for key, values in self.floor.items():
            if record.get(f"sparse_floor_{key}") is not None:
                values.append(float(record[f"sparse_floor_{key}"]))
        if record.get("sparse_floor_drop_max") is not None:
            self.drop_max = max(self.drop_max or 0.0, float(record["sparse_floor_drop_max"]))
        if record.get("dense_causal_pairs"):
            self.pairs += float(record["executed_pairs_total"])
            self.dense_pairs += float(record["dense_causal_pairs"])

    def as_dict(self) -> dict:
        out: dict[str, Any] = {"layouts": dict(self.layouts.most_common())}
        if self.predicted_ms:
            ratio = np.asarray(self.measured_ms) / np.maximum(np.asarray(self.predicted_ms), 1e-9)
            out |= {"predicted_step_ms_mean": float(np.mean(self.predicted_ms)),
                    "measured_step_ms_mean": float(np.mean(self.measured_ms)),
                    "measured_over_predicted_median": float(np.median(ratio)),
                    "steps_compared": len(ratio)}
        if self.budgets:
            out["sparse_blocks_mean"] = float(np.mean(self.budgets))
        out |= {f"sparse_floor_{key}_mean": float(np.mean(v)) for key, v in self.floor.items() if v}
        if self.drop_max is not None:
            out["sparse_floor_drop_max"] = self.drop_max
        if self.attention_fraction is not None:
            out["attention_fraction"] = self.attention_fraction
        return out

    @property
    def attention_fraction(self) -> float | None:
        """The run's attention block pairs over dense causal's; None for a run with no sparse steps."""
        return self.pairs / self.dense_pairs if self.dense_pairs else None

    def lines(self, shown: int = 6) -> list[str]:
        """The summary's lines; for a run without plans, only its sparse attention work."""
        if not self.layouts:
            return self._work_lines()
        d, total = self.as_dict(), sum(self.layouts.values())
        top = ", ".join(f"{plan} x{n}" for plan, n in self.layouts.most_common(shown))
        more = len(self.layouts) - min(shown, len(self.layouts))
        out = [f"layouts (groups per micro-batch, | between micro-batches) over {total} steps: {top}"
               + (f", and {more} more" if more else "")]
        if "steps_compared" in d:
            n = d["steps_compared"]
            out.append(f"step time, predicted by the cost model vs measured, over the {n} step{'s' * (n != 1)} "
                       f"that compiled nothing: mean {d['predicted_step_ms_mean']:,.0f} ms vs "
                       f"{d['measured_step_ms_mean']:,.0f} ms (median measured / predicted "
                       f"{d['measured_over_predicted_median']:.2f})")
        if "sparse_blocks_mean" in d:
            floor = (f"; the runtime floor took budgets from {d['sparse_floor_planned_mean']:.2f} planned to "
                     f"{d['sparse_floor_final_mean']:.2f} blocks, raising "
                     f"{100 * d['sparse_floor_overridden_mean']:.1f}% of query blocks"
                     if "sparse_floor_overridden_mean" in d else "")
            if "sparse_floor_drop_max" in d:
                floor += (f"; no document lost more than {d['sparse_floor_drop_max']:.3f} of its coverage "
                          "against the base budget")
            out.append(f"sparse budgets: {d['sparse_blocks_mean']:.2f} key blocks per query block on average{floor}")
        return out + self._work_lines()

    def _work_lines(self) -> list[str]:
        if self.attention_fraction is None:
            return []
        return [f"attention work: {self.attention_fraction:.4f} of dense causal block pairs over the run "
                f"({self.pairs:,.0f} of {self.dense_pairs:,.0f}, summed over layers and kv heads)"]
