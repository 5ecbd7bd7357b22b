"""Cost models: FlexSP's A100 preset against hand-computed values of its published formula,
the ring and sparse variants, plan-level times, and the calibrated container and fit."""

import math

import numpy as np
import pytest

from jaxsb.planner.cost import (CalibratedCost, CostModel, FlexSPCost, FormulaCost, fit_calibrated, load_preset,
                                plan_memory_mb, sparse_attention_fraction, token_capacity)
from jaxsb.plan import GroupSpec, build_plan

# gpt-7b constants as published (shared/data/cost_presets.json)
A1, A2, B1 = 5.128e-6, 0.1839576, 629.3563
ACT, L, E = 4.480441895, 32, 4096
BW = {2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}


def test_flexsp_gpt7b_group_time_matches_the_published_formula():
    cost = load_preset("flexsp-a100:gpt-7b", num_devices=64, max_len=192000)
    assert isinstance(cost, CostModel) and isinstance(cost, FlexSPCost)
    # 100000 + 5000 tokens on 64 devices, by hand:
    compute = (A1 * 100000**2 + A2 * 100000 + A1 * 5000**2 + A2 * 5000) / 64  # 1105.06 ms
    alltoall = 4 * 2 * L * E * 105000 * 2 / 2**20 / 64 / BW[64]  # 3281.25 MB / 4.87 = 673.77 ms
    assert compute == pytest.approx(1105.0586, abs=1e-3)
    assert alltoall == pytest.approx(673.7680, abs=1e-3)
    assert cost.group_time_ms(64, [100000, 5000]) == pytest.approx(compute + alltoall + B1, rel=1e-12)
    assert cost.group_time_ms(64, [100000, 5000]) == pytest.approx(2408.1828, abs=1e-3)
    # degree 1: no communication, whatever the scheme
    assert cost.group_time_ms(1, [4096]) == pytest.approx(A1 * 4096**2 + A2 * 4096 + B1, rel=1e-12)
    assert cost.group_time_ms(1, [4096], scheme="ring") == cost.group_time_ms(1, [4096])
    # degree 8, two sequences
    t = (A1 * (8192**2 + 1024**2) + A2 * 9216) / 8 + 4 * 2 * L * E * 9216 * 2 / 2**20 / 8 / BW[8] + B1
    assert cost.group_time_ms(8, [8192, 1024]) == pytest.approx(t, rel=1e-12)
    assert cost.group_time_ms(8, []) == 0.0  # an empty group costs nothing


def test_flexsp_memory_and_token_capacity():
    cost = load_preset("flexsp-a100:gpt-7b", num_devices=64, max_len=192000)
    states = 7.1174468994140625 * 16 * 1024 / 64
    assert cost.states_mb == pytest.approx(states)  # 1822.07 MB of ZeRO-3 model states
    assert cost.memory_limit_mb == 30 * 1024
    assert cost.group_memory_mb(16, [32768, 4096]) == pytest.approx(states + ACT * 36864 / 16)
    assert cost.device_token_capacity() == int((30 * 1024 - states) / ACT) == 6449
    assert token_capacity(cost, 64) == 6449 * 64 == 412736
    # the parameter count follows max_len like the solver; params_key overrides it
    assert load_preset("flexsp-a100:gpt-7b", max_len=4000).params_b == 6.51
    assert load_preset("flexsp-a100:gpt-7b", max_len=384000).params_b == 7.8498687744140625
    assert load_preset("flexsp-a100:gpt-7b", max_len=288000).params_b == pytest.approx((7.1174 + 7.8499) / 2, abs=1e-3)
    assert load_preset("flexsp-a100:gpt-7b", params_key="4k").params_b == 6.51
    assert load_preset("flexsp-a100:gpt-13b", num_devices=32).states_mb == pytest.approx(
        13.11605453491211 * 16 * 1024 / 32)
    c30 = load_preset("flexsp-a100:gpt-30b")
    assert c30.group_time_ms(1, [1000]) == pytest.approx(1.54262e-5 * 1e6 + 0.8035742 * 1000 + 2789.3644)


def test_ring_and_local_and_sparse_terms():
    cost = load_preset("flexsp-a100:gpt-7b")
    tokens = 65536
    ring = 6 * L * E * 2 / 2**20 / BW[8] * (tokens / 8) * 7  # K,V fwd + K,V,dK,dV bwd, d-1 hops
    compute = (A1 * tokens**2 + A2 * tokens) / 8
    assert cost.group_time_ms(8, [tokens], scheme="ring") == pytest.approx(compute + ring + B1, rel=1e-12)
    # Skrull-style local sequences: the slowest rank's own compute, no communication for them
    local = [[1000, 2000], [500]]
    expect = cost.group_time_ms(8, [tokens]) + A1 * (1000**2 + 2000**2) + A2 * 3000
    assert cost.group_time_ms(8, [tokens], local) == pytest.approx(expect, rel=1e-12)
    assert cost.group_memory_mb(8, [tokens], local) == pytest.approx(cost.states_mb + ACT * (tokens / 8 + 3000))
    # sparse budget: kept fraction of the causal block triangle
    assert sparse_attention_fraction(1024, None, 128) == 1.0
    assert sparse_attention_fraction(1024, 8, 128) == 1.0  # 8 blocks: everything
    assert sparse_attention_fraction(1024, 2, 128) == pytest.approx((3 + 6 * 2) / 36)
    t_sparse = cost.group_time_ms(64, [131072], budgets=[16])
    frac = (16 * 17 / 2 + (1024 - 16) * 16) / (1024 * 1025 / 2)
    assert t_sparse == pytest.approx(cost.group_time_ms(64, [131072]) - A1 * 131072**2 * (1 - frac) / 64, rel=1e-12)
    with pytest.raises(ValueError, match="degree 3"):
        cost.group_time_ms(3, [100])


def test_plan_time_is_the_sum_of_slowest_groups():
    cost = load_preset("flexsp-a100:gpt-7b", num_devices=8)
    lengths = [4096, 2048, 1024, 512, 8192]
    plan = build_plan(8, [[GroupSpec(4, "ulysses", (0, 1)), GroupSpec(2, "ulysses", (2,)), GroupSpec(1, "local", (3,))],
                          [GroupSpec(8, "ulysses", (4,))]], lengths)
    mb0 = [cost.group_time_ms(4, [4096, 2048]), cost.group_time_ms(2, [1024]), cost.group_time_ms(1, [512])]
    times = cost.group_times_ms(plan)
    assert times[0][:3] == pytest.approx(mb0) and times[0][3:] == [0.0] * 1  # padding group, idle
    assert cost.plan_time_ms(plan) == pytest.approx(max(mb0) + cost.group_time_ms(8, [8192]))
    assert plan_memory_mb(cost, plan) == pytest.approx(cost.group_memory_mb(4, [4096, 2048]))  # 1536 tokens


def test_calibrated_roundtrip_and_fit(tmp_path):
    """Timings made from known coefficients through the work counts, with 0.1% noise: the fit
    recovers the coefficients; the saved file loads back equal; negative slopes are clamped."""
    rng = np.random.default_rng(0)
    truth = dict(microbatches=40.0, tokens=0.2, pairs=4e-4, ring_rounds=3.0, ring_tokens=0.05, ulysses_tokens=0.0)
    probe = CalibratedCost(name="t", a1=0, a2=0, b1=0, memory_limit_mb=1e3, states_mb=1.0, act_per_token_mb=0.1,
                           coef=truth)
    samples = []
    for _ in range(30):
        d = int(rng.choice([1, 2, 4]))
        lens = rng.integers(64, 1024, size=int(rng.integers(1, 4))).tolist()
        plan = build_plan(8, [[GroupSpec(d, "local" if d == 1 else "ring", tuple(range(len(lens))))]], lens)
        samples.append((plan, probe.plan_time_ms(plan) * (1 + rng.normal(0, 1e-3))))
    fit = fit_calibrated(samples, memory_limit_mb=1000.0, act_per_token_mb=0.01, states_mb=10.0, source="test")
    for term in ("microbatches", "tokens", "pairs", "ring_tokens"):
        assert fit.coef[term] == pytest.approx(truth[term], rel=0.1), term
    assert fit.coef["ulysses_tokens"] == 0.0  # no Ulysses sample: nothing to fit, nothing invented
    path = tmp_path / "cal.json"
    fit.save(str(path))
    back = load_preset(str(path))
    assert isinstance(back, CalibratedCost) and back == fit
    assert load_preset(f"calibrated:{path}").group_time_ms(2, [1000, 300]) == fit.group_time_ms(2, [1000, 300])
    # measured data with time decreasing in length would need negative slopes: clamped to 0
    plans = [build_plan(8, [[GroupSpec(1, "local", (0,))]], [n]) for n in (128, 256, 384, 512)]
    neg = fit_calibrated([(p, 10.0 - n / 1000) for p, n in zip(plans, (128, 256, 384, 512))])
    assert min(neg.coef.values()) >= 0 and neg.coef["microbatches"] > 0


def test_calibrated_group_view_on_a_serial_host():
    """The planners' view: on a host whose devices share its cores sharding saves nothing, and a
    ring of degree d adds d rounds and its tokens; Ulysses its tokens per device."""
    cost = CalibratedCost(name="t", a1=0, a2=0, b1=0, memory_limit_mb=1e3, states_mb=1.0, act_per_token_mb=0.1,
                          coef=dict(microbatches=5.0, tokens=1.0, pairs=0.0, ring_rounds=2.0, ring_tokens=0.5,
                                    ulysses_tokens=0.25))
    assert cost.group_time_ms(1, [100]) == pytest.approx(100 + 5)
    assert cost.group_time_ms(2, [100], scheme="ring") == pytest.approx(100 + 5 + 2 * 2 + 0.5 * 100)
    assert cost.group_time_ms(4, [100], scheme="ulysses") == pytest.approx(100 + 5 + 0.25 * 25)
    assert cost.group_time_ms(2, []) == 0.0
    parallel = CalibratedCost(name="t", a1=0, a2=0, b1=0, memory_limit_mb=1e3, states_mb=1.0, act_per_token_mb=0.1,
                              coef=dict(tokens=1.0), serial_devices=False)
    assert parallel.group_time_ms(4, [100], scheme="ulysses") == pytest.approx(25)
    with pytest.raises(ValueError, match="unknown terms"):
        CalibratedCost(name="t", a1=0, a2=0, b1=0, memory_limit_mb=1, states_mb=0, act_per_token_mb=0,
                       coef=dict(flops=1.0))
    with pytest.raises(ValueError, match=">= 0"):
        CalibratedCost(name="t", a1=0, a2=0, b1=0, memory_limit_mb=1, states_mb=0, act_per_token_mb=0,
                       coef=dict(tokens=-1.0))


def test_bad_names_and_files(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        load_preset("nope")
    with pytest.raises(ValueError, match="flexsp-a100:gpt-7b"):
        load_preset("flexsp-a100:gpt-99b")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "a1": 1}')
    with pytest.raises(ValueError, match="missing fields"):
        load_preset(str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        load_preset(str(tmp_path / "absent.json"))


def test_token_capacity_bisects_models_without_their_own():
    base = FormulaCost(name="toy", a1=0, a2=1, b1=0, memory_limit_mb=100.0, states_mb=20.0, act_per_token_mb=0.5)

    class NoCap:  # a cost model with only the protocol's methods
        name, memory_limit_mb = "nocap", 100.0

        def group_memory_mb(self, degree, sharded, local=()):
            return base.group_memory_mb(degree, sharded, local)

    assert token_capacity(NoCap(), 4) == 640 == token_capacity(base, 4)
    assert math.isfinite(base.group_time_ms(1, [10]))


def test_gpu_nodes_groups_stay_inside_a_node_and_pay_infiniband_beyond():
    """On 8-GPU nodes (gpu-h100: NVLink inside, InfiniBand between, data-sheet figures) a group
    of up to 8 devices communicates at NVLink's bandwidth and one of 16 or more at InfiniBand's,
    and the jaxsb planner's groups of up to 8 never straddle a node boundary."""
    from jaxsb.planner.hardware import CHIPS
    from jaxsb.planner.joint import JaxsbPlanner
    from jaxsb.planner.simulation import make_batches, synthetic_lengths
    from tests.chip_costs import default_model_cost

    n, chip = 32, CHIPS["gpu-h100"]
    node = chip.devices_per_node
    cost = default_model_cost("gpu-h100", n)
    for table in (cost.ulysses_ms_per_token, cost.ring_ms_per_token):
        # per token: bytes x (d-1)/d (ulysses) or bytes (ring hop) over the link it spans
        scale = {d: (d - 1) / d if table is cost.ulysses_ms_per_token else 1.0 for d in (8, 16)}
        ratio = (table[16] / scale[16]) / (table[8] / scale[8])
        assert ratio == pytest.approx(chip.intra_gbs / chip.inter_gbs)
    batches, _, _ = make_batches(synthetic_lengths("bimodal", 1), n, 96, 65536, 2, align=2 * n)
    batches.append([1 << 20] + [4096] * 31 + [64] * 64)  # one 1M-token sequence: sharded past a node
    spanning = 0
    for batch in batches:
        plan = JaxsbPlanner(cost, n, scheme="ring").plan(batch)
        for mb in plan.template.microbatches:
            for g in mb.groups:
                first, last = g.start // node, (g.start + g.degree - 1) // node
                if g.degree <= node:
                    assert first == last, (g, plan.summary())
                else:
                    assert g.start % node == 0 and g.degree % node == 0
                    spanning += 1
    assert spanning, "no group spans nodes: the check above saw no large group"
