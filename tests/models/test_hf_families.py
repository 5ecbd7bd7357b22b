"""Hugging Face checkpoints of the Llama, Qwen2 and Mistral families, made by transformers itself
(scripts/make_hf_fixtures.py: random float16 weights saved with `save_pretrained`, in the 4.x
and the 5.x config layouts, and transformers' own float32 logits): jaxsb loads each and gets the
same logits, past the original context for scaled RoPE; config fields it cannot honour are
refused with the file, the field and the value; the safetensors reader matches the safetensors
package's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jaxsb.config import ModelConfig
from jaxsb.models import Llama
from jaxsb.models.generate import sequence_logits
from jaxsb.models.hf_checkpoint import read_safetensors
from jaxsb.models.hf_config import HFCheckpointError, config_from_hf
from jaxsb.models.pretrained import apply_pretrained, load_pretrained
from tolerances import tol

FIXTURES = Path(__file__).parent / "hf_fixtures"
CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


def load(directory: Path) -> Llama:
    pre = load_pretrained(f"hf:{directory}")
    model = Llama(ModelConfig(**pre.config), rngs=nnx.Rngs(0))
    apply_pretrained(model, pre.params)
    return model


def test_every_family_and_layout_is_shipped():
    families = {c.rsplit("-hf", 1)[0] for c in CASES}
    assert {"llama", "llama-bias", "llama-linear", "llama3", "llama-yarn", "qwen2", "qwen2-untied",
            "mistral"} <= families
    assert all({f"{f}-hf4", f"{f}-hf5"} <= set(CASES) for f in families), "both config layouts"


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case):
    ref = np.load(FIXTURES / case / "reference.npz")
    logits = sequence_logits(load(FIXTURES / case), ref["ids"].tolist())
    np.testing.assert_allclose(logits[ref["rows"]], ref["logits"], **tol("model_logits", np.float32))


@pytest.mark.parametrize("family", sorted({c.rsplit("-hf", 1)[0] for c in CASES}))
def test_both_config_layouts_read_the_same(family):
    assert config_from_hf(FIXTURES / f"{family}-hf4") == config_from_hf(FIXTURES / f"{family}-hf5")


def test_what_each_family_gets():
    c = {f: config_from_hf(FIXTURES / f"{f}-hf5") for f in ("llama", "llama-bias", "qwen2", "llama3", "llama-yarn")}
    assert c["llama"]["attention_bias"] == "none" and not c["llama"]["tie_embeddings"]
    assert c["llama-bias"]["attention_bias"] == "qkvo" and c["qwen2"]["attention_bias"] == "qkv"
    assert c["qwen2"]["rope_theta"] == 1e6 and c["llama"]["rope"].scaling == "default"
    r = c["llama3"]["rope"]
    assert (r.scaling, r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_positions) == \
        ("llama3", 8.0, 1.0, 4.0, 64)
    y = c["llama-yarn"]["rope"]
    assert y.scaling == "yarn" and y.factor == 4.0 and y.attention_factor == pytest.approx(0.1 * np.log(4) + 1)


# ----------------------------------------------------------------------------- refusals

# (case whose config.json is edited, field, unsupported value, words the error must contain)
REFUSED = [
    ("llama-hf5", "model_type", "gemma2", "model_type='gemma2'"),
    ("llama-hf5", "hidden_act", "gelu", "hidden_act='gelu'"),
    ("llama-hf5", "mlp_bias", True, "mlp_bias=True"),
    ("llama-hf5", "attention_dropout", 0.1, "attention_dropout=0.1"),
    ("llama-hf5", "attention_bias", "yes", "attention_bias='yes'"),
    ("llama-hf5", "partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ("llama-hf5", "final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
    ("llama-hf5", "quantization_config", {"quant_method": "gptq"}, "quantization_config="),
    ("llama-hf5", "layer_types", ["full_attention", "sliding_attention"], "layer_types="),
    ("llama-hf5", "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
     "rope_type='dynamic'"),
    ("llama-hf5", "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "rope_type='longrope'"),
    ("llama-hf5", "rope_parameters", {"rope_type": "linear", "rope_theta": 1e4}, "factor=None"),
    ("llama-hf5", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2]},
     "mrope_section"),
    ("llama-hf5", "rope_parameters", {"rope_type": "default", "rope_theta": -1.0}, "rope_theta=-1.0"),
    ("llama-hf5", "rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}},
     "different RoPE per layer type"),
    ("llama3-hf5", "rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                       "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                                       "original_max_position_embeddings": 64}, "high_freq_factor=1.0"),
    ("llama-hf4", "rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
    ("llama-hf4", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "beta_fast": "fast"}, "beta_fast='fast'"),
    ("llama-hf5", "rope_scaling", {"rope_type": "linear", "factor": 2.0}, "disagrees with rope_parameters"),
    ("llama-hf4", "rope_theta", "big", "rope_theta='big'"),
    ("mistral-hf5", "sliding_window", 4096, "sliding_window=4096"),
    ("qwen2-hf5", "use_sliding_window", True, "use_sliding_window=True"),
    ("llama-hf5", "num_hidden_layers", 0, "num_hidden_layers=0"),
    ("llama-hf5", "tie_word_embeddings", "no", "tie_word_embeddings='no'"),
]


@pytest.mark.parametrize("case, field, value, words", REFUSED, ids=[f"{c}-{f}-{w[:20]}" for c, f, _, w in REFUSED])
def test_unsupported_fields_are_refused_with_file_field_and_value(tmp_path, case, field, value, words):
    directory = tmp_path / case
    shutil.copytree(FIXTURES / case, directory)
    config = json.loads((directory / "config.json").read_text())
    config[field] = value
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError) as e:
        config_from_hf(directory)
    message = str(e.value)
    assert str(directory / "config.json") in message and words in message, message


def test_qwen2_sliding_window_without_use_sliding_window_is_full_attention():
    """Qwen2 configs carry a sliding_window value that transformers ignores while
    use_sliding_window is false: the model attends fully, and so does jaxsb."""
    config = json.loads((FIXTURES / "qwen2-hf4" / "config.json").read_text())
    assert config["use_sliding_window"] is False
    assert config_from_hf(FIXTURES / "qwen2-hf4")["attention_bias"] == "qkv"


def test_missing_bias_tensor_is_named(tmp_path):
    from safetensors.numpy import save_file

    directory = tmp_path / "qwen2"
    shutil.copytree(FIXTURES / "qwen2-hf5", directory)
    tensors = {k: np.asarray(v) for k, v in read_safetensors(directory / "model.safetensors").items()}
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="model.layers.1.self_attn.k_proj.bias"):
        load_pretrained(f"hf:{directory}")


# ----------------------------------------------------------------------------- safetensors


def test_safetensors_reader_matches_the_safetensors_package(tmp_path):
    import ml_dtypes
    from safetensors import safe_open
    from safetensors.numpy import save_file

    path = FIXTURES / "qwen2-hf5" / "model.safetensors"
    mine = read_safetensors(path)
    with safe_open(str(path), framework="numpy") as st:
        theirs = {k: st.get_tensor(k) for k in st.keys()}
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert mine[k].dtype == theirs[k].dtype and np.array_equal(mine[k], theirs[k]), k
    rng = np.random.default_rng(0)
    written = {"bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
               "f32": rng.standard_normal(7).astype(np.float32), "i64": np.arange(4)}
    save_file(written, str(tmp_path / "x.safetensors"))  # bfloat16: the safetensors package writes it
    back = read_safetensors(tmp_path / "x.safetensors")
    for k, v in written.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k].astype(np.float64), v.astype(np.float64)), k


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    path = tmp_path / "model.safetensors"
    data = (FIXTURES / "llama-hf5" / "model.safetensors").read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(HFCheckpointError, match="data_offsets"):
        read_safetensors(path)
    path.write_bytes(b"\x01")
    with pytest.raises(HFCheckpointError, match="not a safetensors file"):
        read_safetensors(path)


def test_transformers_5_smollm2_config_reads_rope_theta_from_rope_parameters(tmp_path):
    """transformers 5.24.0's config.json for SmolLM2-135M-Instruct (loaded from its GGUF):
    rope_theta 100000 only inside rope_parameters, and a quantization_config that names the GGUF
    transformers dequantized (its saved tensors are plain floats), which is accepted; any other
    quantization is refused (REFUSED above)."""
    shipped = FIXTURES / "smollm2-135m-instruct.transformers-5.24.0.config.json"
    config = json.loads(shipped.read_text())
    assert "rope_theta" not in config and config["quantization_config"]["quant_method"] == "gguf"
    shutil.copy(shipped, tmp_path / "config.json")
    c = config_from_hf(tmp_path)
    assert c["rope_theta"] == 100000.0 and c["layers"] == 30 and c["tie_embeddings"] is True
