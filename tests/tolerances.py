"""The one table of numerical tolerances for every comparison in the test suite.

Keyed by (what is compared, dtype). Values are (rtol, atol). They are set from the dtype's
precision and the reduction length of the quantity, and are never loosened to make a test
pass: a failure means a bug or a real change in numerics, to be understood first.
"""

import numpy as np

TOLERANCES: dict[tuple[str, str], tuple[float, float]] = {
    # attention outputs and their gradients vs the dense jnp reference
    ("attention_out", "float32"): (2e-5, 2e-5),
    ("attention_grad", "float32"): (1e-4, 1e-4),
    ("attention_out", "bfloat16"): (2e-2, 2e-2),
    ("attention_grad", "bfloat16"): (5e-2, 5e-2),
    # whole-model logits and loss: jaxsb model vs an independent numpy implementation
    ("model_logits", "float32"): (1e-4, 1e-3),
    ("model_loss", "float32"): (1e-5, 1e-5),
    # bf16 compute vs f32 compute of the same tiny model (8-bit mantissa over a 2-layer stack)
    ("model_logits", "bfloat16"): (2e-2, 2e-1),
    # jax.checkpoint recomputes the same ops: bit-identical on CPU
    ("remat_grad", "float32"): (1e-6, 0.0),
    # router coverage (softmax mass of selected blocks) vs a numpy brute force; jit vs eager
    ("router_coverage", "float32"): (1e-5, 1e-6),
    # the same step under different device counts / shardings (reduction order differs)
    ("sharded_loss", "float32"): (1e-5, 1e-6),
    ("sharded_grad", "float32"): (1e-4, 1e-6),
    # a fixed-seed training run under different planners (issue 4: 1e-4 relative per step)
    ("planner_loss", "float32"): (1e-4, 0.0),
    # resumed vs uninterrupted training, same device count: identical programs
    ("resume_loss", "float32"): (1e-6, 0.0),
    # a metrics.jsonl number stored as TensorBoard's float32 simple_value: rounding only (2^-24)
    ("tensorboard_scalar", "float32"): (1e-7, 0.0),
    # log-sum-exp of an attention chunk (always float32 arithmetic, whatever the input dtype)
    ("attention_lse", "float32"): (2e-5, 2e-5),
    # a float64 mean against the smallest of its values: equal values may average an ulp lower
    ("mean_rounding", "float64"): (1e-15, 0.0),
    # the planner's predicted memory per device vs the compiler's memory analysis of the same
    # program (a formula of activations per token against XLA's buffer assignment): within 50%
    ("planner_memory", "float32"): (0.5, 0.0),
    # python-mip's (CBC's) bound on a plan's time vs the exact optimum of the same tables:
    # count_bound takes CBC's cutoff increment (1e-5 absolute, 1e-7 relative) off CBC's bound, so
    # a bound equal to an optimum lands that far below it; CBC's primal tolerance is 1e-7
    ("mip_bound", "float64"): (1e-6, 2e-5),
}


def tol(what: str, dtype) -> dict[str, float]:
    """kwargs for np.testing.assert_allclose."""
    rtol, atol = TOLERANCES[(what, np.dtype(dtype).name)]
    return {"rtol": rtol, "atol": atol}
