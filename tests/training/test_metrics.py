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


def test_plan_tally_counts_layouts_and_compares_steps_that_compiled_nothing():
    from jaxsb.training.metrics import PlanTally

    tally = PlanTally()
    assert tally.lines() == []  # a rows-path run: no plans, no lines
    records = [
        dict(plan="4,2,1,1", compiled_now=True, predicted_step_ms=100.0, measured_step_ms=5000.0),
        dict(plan="4,2,1,1", compiled_now=False, predicted_step_ms=100.0, measured_step_ms=150.0),
        dict(plan="4,4", compiled_now=False, predicted_step_ms=200.0, measured_step_ms=200.0),
        dict(plan="4,4", compiled_now=False, predicted_step_ms=100.0, measured_step_ms=400.0),
        dict(plan="4,4|1,1,1,1,1,1,1,1", compiled_now=False, predicted_step_ms=300.0, measured_step_ms=300.0,
             sparse_blocks=3.0, sparse_floor_planned=2.0, sparse_floor_final=3.0, sparse_floor_overridden=0.25,
             sparse_floor_drop_max=0.0625, executed_pairs_total=30.0, dense_causal_pairs=40.0),
        dict(plan="4,4", compiled_now=True, sparse_floor_drop_max=0.09375,  # the run's largest drop
             executed_pairs_total=10.0, dense_causal_pairs=60.0),
    ]
    records.insert(3, dict(plan="4,4", compiled_now=False, predicted_step_ms=None, measured_step_ms=900.0))
    for r in records:
        tally.add(r)
    d = tally.as_dict()
    assert d["layouts"] == {"4,2,1,1": 2, "4,4": 4, "4,4|1,1,1,1,1,1,1,1": 1}
    assert d["steps_compared"] == 4  # the compiling step and the one without a prediction are left out
    assert d["predicted_step_ms_mean"] == pytest.approx(175.0) and d["measured_step_ms_mean"] == pytest.approx(262.5)
    assert d["measured_over_predicted_median"] == pytest.approx(1.25)  # median of 1.5, 1, 4, 1
    assert d["sparse_floor_overridden_mean"] == 0.25 and d["sparse_blocks_mean"] == 3.0
    assert d["sparse_floor_drop_max"] == 0.09375
    lines = tally.lines(shown=2)
    assert lines[0].endswith("over 7 steps: 4,4 x4, 4,2,1,1 x2, and 1 more")
    assert "over the 4 steps that compiled nothing: mean 175 ms vs 262 ms (median measured / predicted 1.25)" in lines[1]
    assert "from 2.00 planned to 3.00 blocks, raising 25.0% of query blocks" in lines[2]
    assert "no document lost more than 0.094 of its coverage against the base budget" in lines[2]
    assert d["attention_fraction"] == pytest.approx(0.4)  # pairs over steps: (30 + 10) / (40 + 60)
    assert lines[3] == "attention work: 0.4000 of dense causal block pairs over the run (40 of 100, summed over layers and kv heads)"


def test_plan_tally_of_a_rows_run_shows_only_its_attention_work():
    from jaxsb.training.metrics import PlanTally

    tally = PlanTally()
    tally.add(dict(sparse_blocks=2.0, executed_pairs_total=12.0, dense_causal_pairs=16.0))
    assert tally.lines() == ["attention work: 0.7500 of dense causal block pairs over the run "
                             "(12 of 16, summed over layers and kv heads)"]
