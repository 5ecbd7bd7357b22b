"""Per-step metrics: the `metrics.jsonl` writer, useful-FLOP accounting for MFU, and the
console progress bar.

MFU counts only useful FLOPs: the matmuls of the real (non-padding) tokens, and attention
inside each document under the causal mask (s·(s+1)/2 query-key pairs for a document of s
tokens), never padding or cross-document pairs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Iterable

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

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s", refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
