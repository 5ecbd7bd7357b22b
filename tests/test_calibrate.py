"""`jaxsb.calibrate`: the quick calibration of a tiny model on this machine predicts held-out
shapes' step times; presets round-trip through JSON; the shipped cpu preset loads; bad files fail
with their name.

The timing test measures the real executor step on the 8 simulated CPU devices (medians over
repeats, fit and held-out shapes timed side by side), so its tolerance is set for a noisy shared
2-core machine: the median held-out error within 15%, none worse than 40%."""

import json

import numpy as np
import pytest

from jaxsb.calibrate import QUICK, calibrate, format_table, held_out_errors, main
from jaxsb.config import load_config
from jaxsb.planner.cost import CalibratedCost, load_preset

TINY = ["model.layers=1", "model.vocab_size=512"]


@pytest.fixture(scope="module")
def quick():
    cfg = load_config("tiny", TINY)
    return calibrate(cfg, log=lambda _: None, **QUICK)


def test_quick_calibration_predicts_held_out_step_times(quick):
    fit, rows = quick
    table = format_table(rows)
    err = held_out_errors(rows)
    assert len(err) >= 2 and any(not m.shape.held_out for m in rows)
    assert np.median(err) <= 0.15, f"median held-out error {np.median(err):.1%}\n{table}"
    assert err.max() <= 0.40, f"worst held-out error {err.max():.1%}\n{table}"
    for d in QUICK["degrees"]:
        a1, a2, b1 = fit.constants(d)
        assert min(a1, a2, b1) >= 0 and a1 + a2 > 0, (d, a1, a2, b1)
    assert fit.pad_to_buffers and fit.num_devices == 8 and "jaxsb.calibrate" in fit.source


def test_saved_preset_round_trips(quick, tmp_path):
    fit, rows = quick
    path = tmp_path / "cal.json"
    fit.save(str(path))
    back = load_preset(str(path))
    assert isinstance(back, CalibratedCost) and back == fit
    assert set(back.a1_by_degree) == set(QUICK["degrees"])
    assert json.loads(path.read_text())["kind"] == "calibrated"


def test_shipped_cpu_preset_loads_with_positive_constants():
    from jaxsb.parallel.steps import load_cost_model

    cost = load_cost_model("cpu", 8, 1024)
    assert isinstance(cost, CalibratedCost) and cost.pad_to_buffers
    assert "jaxsb.calibrate" in cost.source
    for d in (1, 2, 4, 8):
        a1, a2, b1 = cost.constants(d)
        assert a1 > 0 or a2 > 0, d
        assert min(a1, a2, b1) >= 0, d
    assert cost.memory_limit_mb > cost.states_mb > 0 and cost.act_per_token_mb > 0
    assert cost.group_time_ms(8, [4096]) > cost.group_time_ms(8, [1024]) > 0


def test_per_degree_constants_override_the_scalars():
    cost = CalibratedCost(name="t", a1=0.0, a2=1.0, b1=5.0, memory_limit_mb=1e3, states_mb=1.0,
                          act_per_token_mb=0.1, a2_by_degree={"2": 3.0}, b1_by_degree={2: 7.0})
    assert cost.group_time_ms(1, [100]) == pytest.approx(100 + 5)
    assert cost.group_time_ms(2, [100]) == pytest.approx(3 * 100 / 2 + 7)
    assert cost.group_time_ms(2, []) == 0.0


@pytest.mark.parametrize("text, match", [
    ("{not json", "cannot read calibrated cost model"),
    ('{"name": "x", "a1": 1}', "missing fields"),
    ('{"name": "x", "a1": 1, "a2": 1, "b1": 1, "memory_limit_mb": 1, "states_mb": 0, '
     '"act_per_token_mb": 1, "a1_by_degree": {"two": 1}}', "malformed"),
])
def test_malformed_preset_names_the_file(tmp_path, text, match):
    path = tmp_path / "broken-preset.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        load_preset(str(path))
    assert "broken-preset.json" in str(e.value)


def test_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        main(["--config", "tiny", "--degrees", "one"])
    with pytest.raises(SystemExit):
        main(["--config", "tiny", "--repeats", "0"])
