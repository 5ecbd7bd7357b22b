"""Compile targets and hardware presets without the compilers: parsing `--target`, the GPU target
description built from the chip's facts, the data-sheet cost model against hand arithmetic,
`parallel.preset=auto`, and the errors a user meets (bad target, compilers not installed).
The compilers themselves are exercised in tests/targets/ (in .venv-targets)."""

import importlib.util

import pytest

from jaxsb.compile import main as compile_main
from jaxsb.config import ConfigError, ModelConfig
from jaxsb.planner.hardware import CHIPS, activation_bytes_per_token, hardware_cost, matmul_params, model_params
from jaxsb.targets import TargetError, gpu_target_config, parse_target, target_devices
from jaxsb.training.planning import load_cost_model, resolve_preset


@pytest.mark.parametrize("text, chip, devices, per_node", [
    ("tpu-v5p:2x2x2", "tpu-v5p", 8, 8), ("tpu-v5p:4x4x4", "tpu-v5p", 64, 64), ("tpu-v5e:4x4", "tpu-v5e", 16, 16),
    ("tpu-v6e:4x4", "tpu-v6e", 16, 16), ("gpu-h100:8", "gpu-h100", 8, 8), ("gpu-h200:8", "gpu-h200", 8, 8),
    ("gpu-a100:8", "gpu-a100", 8, 8), ("GPU-H100:8x4", "gpu-h100", 32, 8)])
def test_parse_target(text, chip, devices, per_node):
    t = parse_target(text)
    assert (t.chip.name, t.num_devices, t.devices_per_node) == (chip, devices, per_node)
    assert t.platform == CHIPS[chip].platform


@pytest.mark.parametrize("text, message", [
    ("tpu-v9:2x2", "CHIP:SHAPE with CHIP one of"), ("gpu-h100", "CHIP:SHAPE"), ("tpu-v5p:2x2", "3 dimensions"),
    ("tpu-v5e:4x4x4", "2 dimensions"), ("gpu-h100:8x2x2", "DEVICESxNODES"), ("gpu-a100:0", ">= 1")])
def test_bad_targets_say_what_is_expected(text, message):
    with pytest.raises(TargetError, match=message):
        parse_target(text)


def test_compile_cli_refuses_a_bad_target(capsys):
    assert compile_main(["--target", "tpu-v9:2x2"]) == 2
    assert "expected CHIP:SHAPE" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="the compilers are installed here")
def test_missing_compilers_point_to_the_setup():
    with pytest.raises(TargetError, match="scripts/setup.sh --targets"):
        target_devices(parse_target("tpu-v5p:2x2x2"))


def test_gpu_target_description_carries_the_chip_facts():
    a100 = gpu_target_config(CHIPS["gpu-a100"])
    assert "core_count: 108" in a100 and "major: 8 minor: 0" in a100
    assert "shared_memory_per_block_optin: 166912" in a100 and 'device_description_str: "NVIDIA A100' in a100
    h200 = gpu_target_config(CHIPS["gpu-h200"])
    assert "major: 9" in h200 and "device_memory_size: 150754820096" in h200 and "memory_bandwidth: 4800000000000" in h200
    with pytest.raises(TargetError):
        gpu_target_config(CHIPS["tpu-v5p"])


MODEL = ModelConfig(vocab_size=1000, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128,
                    dtype="bfloat16", param_dtype="float32")


def test_model_arithmetic_by_hand():
    # per layer: q,k,v 64*(4+2+2)*16 = 8192, o 4*16*64 = 4096, MLP 3*64*128 = 24576; head 1000*64
    assert matmul_params(MODEL) == 2 * (8192 + 4096 + 24576) + 64000
    assert model_params(MODEL) == matmul_params(MODEL) + 2 * 2 * 64 + 64  # norms; embedding tied
    # bf16: per layer 2*(4*64 + (2*4 + 2*2)*16 + 3*128) + 4*4 (f32 lse); f32 logits and their grad
    assert activation_bytes_per_token(MODEL) == 2 * (2 * (256 + 192 + 384) + 16) + 8 * 1000
    # a TPU pads the per-head arrays' head_dim (16) to 128 lanes: q, k, v, o take 12 * 128
    assert activation_bytes_per_token(MODEL, lanes=128) == 2 * (2 * (256 + 12 * 128 + 384) + 16) + 8 * 1000


def test_hardware_cost_by_hand():
    h100 = CHIPS["gpu-h100"]
    cost = hardware_cost(h100, MODEL, num_devices=16)
    ms_per_flop = 1e3 / 989e12
    assert cost.a2 == pytest.approx(6 * matmul_params(MODEL) * ms_per_flop / 0.5)
    assert cost.a1 == pytest.approx(7 * 2 * 4 * 16 * ms_per_flop / 0.35)
    # param, grad, Adam's two moments split over the 16 devices; the whole parameters and their
    # gradient while a micro-batch runs (gathered by the executor)
    assert cost.states_mb == pytest.approx((model_params(MODEL) * 16 / 16 + model_params(MODEL) * 8) / 2**20)
    assert hardware_cost(h100, MODEL, 16, fsdp=False).states_mb == pytest.approx(model_params(MODEL) * 16 / 2**20)
    tpu = hardware_cost(CHIPS["tpu-v5p"], MODEL, 16)
    assert tpu.act_per_token_mb == pytest.approx(activation_bytes_per_token(MODEL, lanes=128) / 2**20)
    assert cost.memory_limit_mb == pytest.approx(80e9 * 0.75 / 2**20)
    # a group inside one 8-GPU node talks over NVLink (450 GB/s), a bigger one over InfiniBand (50)
    per_token = 2 * 2 * (2 * 4 + 2 * 2) * 16 * 2  # layers * (fwd + bwd) * (q, o, k, v widths) * bf16
    assert cost.ulysses_ms_per_token[8] == pytest.approx(per_token * 7 / 8 / 450e9 * 1e3)
    assert cost.ulysses_ms_per_token[16] == pytest.approx(per_token * 15 / 16 / 50e9 * 1e3)
    assert cost.ring_ms_per_token[16] / cost.ring_ms_per_token[8] == pytest.approx(9.0)
    # a TPU slice is one ICI domain: no inter-node step; float32 compute at the f32 peak
    v5p = hardware_cost(CHIPS["tpu-v5p"], ModelConfig(**{**MODEL.__dict__, "dtype": "float32"}), 64)
    assert v5p.ulysses_ms_per_token[64] / v5p.ulysses_ms_per_token[32] == pytest.approx((63 / 64) / (31 / 32))
    assert v5p.a2 == pytest.approx(6 * matmul_params(MODEL) * 1e3 / (459e12 / 6) / 0.5)


def test_presets_auto_and_by_name():
    assert resolve_preset("auto", "cpu") == "cpu"
    assert resolve_preset("auto", "TPU v5 lite") == "tpu-v5e"
    assert resolve_preset("auto", "NVIDIA H200") == "gpu-h200"
    assert resolve_preset("flexsp-a100:gpt-7b", "NVIDIA H200") == "flexsp-a100:gpt-7b"
    with pytest.raises(ConfigError, match="no data-sheet preset for devices of kind 'TPU v9'"):
        resolve_preset("auto", "TPU v9")
    assert load_cost_model("gpu-a100", 8, 4096, MODEL).name == "gpu-a100:8"
    with pytest.raises(ValueError, match="prices a model"):
        load_cost_model("gpu-a100", 8, 4096)


def test_simulate_plans_on_a_chip_preset(capsys):
    from jaxsb.simulate import main as simulate_main

    args = ["--dist", "chatqa2", "--devices", "16", "--global-batch", "32", "--max-len", "16384", "--steps", "1",
            "--planner", "jaxsb"]
    assert simulate_main(["--preset", "gpu-h100", "--model", "tiny", *args]) == 0
    out = capsys.readouterr().out
    assert "cost model gpu-h100:16" in out and "memory limit 55.9 GB" in out
    assert simulate_main(["--preset", "gpu-h100", "--preset-option", "pp=2", *args]) == 2
    assert "not supported" in capsys.readouterr().err
