"""Useful-FLOP accounting: only real tokens and causal pairs inside documents count."""

import pytest

from jaxsb.config import ModelConfig, SparseConfig
from jaxsb.training.metrics import matmul_params, useful_train_flops

CFG = ModelConfig(vocab_size=100, hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, ffn=16,
                  sparse=SparseConfig(block_size=4, top_k=1))


def test_matmul_params_by_hand():
    per_layer = 8 * 2 * 4 + 2 * 8 * 1 * 4 + 2 * 4 * 8 + 3 * 8 * 16  # q, k+v, o, gate/up/down
    assert matmul_params(CFG) == 2 * per_layer + 8 * 100


def test_attention_counts_causal_pairs_within_documents_only():
    one_doc = useful_train_flops(CFG, [8])
    two_docs = useful_train_flops(CFG, [4, 4])
    linear = 3 * 2.0 * matmul_params(CFG) * 8
    per_pair = 3 * 4.0 * CFG.heads * CFG.head_dim * CFG.layers
    assert one_doc == pytest.approx(linear + per_pair * 36)  # 8·9/2 pairs
    assert two_docs == pytest.approx(linear + per_pair * 20)  # 2 × 4·5/2 pairs


def test_sparse_attention_caps_pairs_at_the_selected_blocks():
    per_pair = 3 * 4.0 * CFG.heads * CFG.head_dim * CFG.layers
    linear = 3 * 2.0 * matmul_params(CFG) * 16
    # one selected block of 4 keys per query: at most 16 · 4 pairs instead of 16·17/2
    assert useful_train_flops(CFG, [16], sparse_blocks=1.0) == pytest.approx(linear + per_pair * 64)
    # a budget covering everything falls back to the causal count
    assert useful_train_flops(CFG, [16], sparse_blocks=8.0) == useful_train_flops(CFG, [16])
