"""KV-cache generation (jaxsb/models/decode.py) against re-running the full forward.

Every decode step's logits must equal the full model's logits at that position over prompt +
tokens generated so far (float32), for dense prefill and for sparse prefill. For the sparse
case the reference gives the prompt's tokens the prompt budget and the generated tokens every
block (per-token budgets; the prompt is a whole number of blocks, so generated tokens start
their own query block): that is what "sparse prefill, dense decode" means.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsb.config import SparseConfig
from jaxsb.models.decode import dense_causal_pairs, generate
from jaxsb.models.generate import greedy_generate
from tiny_models import TINY, make_model
from tolerances import tol

SPARSE = dataclasses.replace(TINY, attention="sparse", sparse=SparseConfig(block_size=4, top_k=1, coverage_drop=1.0))


@nnx.jit
def _forward(model, tokens_1xT, segment_ids_1xT, positions_1xT, budgets):
    logits = model(tokens_1xT, segment_ids_1xT, positions_1xT, budgets)
    nnx.pop(model, nnx.Intermediate)  # the sparse layers' statistics: not left on the model
    return logits


def _full_logits(model, tokens: list[int], budgets_T=None) -> np.ndarray:
    T = len(tokens)
    args = (jnp.asarray([tokens], jnp.int32), jnp.ones((1, T), jnp.int32), jnp.arange(T, dtype=jnp.int32)[None])
    budgets = None if budgets_T is None else jnp.asarray([budgets_T], jnp.int32)
    return np.asarray(_forward(model, *args, budgets))[0]


def _prompts(lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, n).tolist() for n in lengths]


def _check_against_full(model, prompts, new, budgets_for=None):
    gen = generate(model, prompts, new, keep_logits=True)
    assert len(gen.step_logits) == new
    for b, prompt in enumerate(prompts):
        seq = prompt + gen.tokens[b]
        budgets = None if budgets_for is None else budgets_for(len(prompt), len(seq))
        full = _full_logits(model, seq, budgets)
        for i in range(new):
            np.testing.assert_allclose(gen.step_logits[i][b], full[len(prompt) - 1 + i], **tol("model_logits", "float32"))
        assert gen.tokens[b] == [int(np.argmax(full[len(prompt) - 1 + i])) for i in range(new)]
    return gen


def test_dense_decode_equals_full_forward_batched_ragged():
    model, _ = make_model(TINY)
    gen = _check_against_full(model, _prompts([13, 21, 5]), 7)
    assert gen.stats == {} and gen.attention_pairs == gen.dense_pairs


def test_sparse_prefill_dense_decode_equals_full_forward():
    model, _ = make_model(SPARSE)
    nb_all = 64

    def budgets(n_prompt, n_total):  # prompt at top_k, generated tokens dense
        return [SPARSE.sparse.top_k] * n_prompt + [nb_all] * (n_total - n_prompt)

    prompts = _prompts([16, 24])
    gen = _check_against_full(model, prompts, 6, budgets)
    # the prefill really was sparse: fewer pairs than dense, and other logits than a dense prefill
    assert gen.attention_pairs < gen.dense_pairs
    assert 0 < gen.stats["sparse_coverage"] < 1
    dense_model, _ = make_model(dataclasses.replace(SPARSE, attention="xla"))
    dense = generate(dense_model, prompts, 1, keep_logits=True)
    assert not np.allclose(dense.step_logits[0], gen.step_logits[0], **tol("model_logits", "float32"))


def test_sparse_pairs_count_the_kernel_tables():
    """top_k=1 routes only the diagonal: pairs = one per query block, per kv head and layer."""
    model, _ = make_model(SPARSE)
    gen = generate(model, _prompts([16, 24]), 1)
    blocks = 16 // 4 + 24 // 4 + (24 - 16) // 4  # the 16-token row is padded to 24: two pad blocks
    assert gen.attention_pairs == SPARSE.layers * SPARSE.kv_heads * blocks
    assert gen.dense_pairs == dense_causal_pairs([16, 24], 4, SPARSE.kv_heads, SPARSE.layers)


def test_floor_policy_starts_at_one_and_the_floor_raises():
    cfg = dataclasses.replace(SPARSE, sparse=SparseConfig(block_size=4, top_k=4, coverage_drop=0.05, policy="floor"))
    model, _ = make_model(cfg)
    gen = generate(model, _prompts([32]), 1)
    assert gen.stats["floor_planned"] == 1.0
    assert 1.0 < gen.stats["floor_final"] <= 4.0


def test_greedy_generate_stops_after_eos():
    model, _ = make_model(TINY)
    prompt = _prompts([9])[0]
    free = greedy_generate(model, prompt, 6)
    stopped = greedy_generate(model, prompt, 6, eos_id=free[2])
    assert stopped == free[: free.index(free[2]) + 1]


@pytest.mark.parametrize("bad", [[], [[]]])
def test_generate_refuses_empty_prompts(bad):
    model, _ = make_model(TINY)
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, bad, 3)
