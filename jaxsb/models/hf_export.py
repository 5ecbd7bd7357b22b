"""Writing a jaxsb model as a Hugging Face checkpoint directory that transformers loads.

`write_hf_checkpoint(directory, cfg, params, tokenizer, bos_id, eos_id)` writes
  * config.json: `model_type` "qwen2" for a model with Qwen2's q/k/v biases, "llama" otherwise
    (Llama carries `attention_bias` for q/k/v/o biases); RoPE settings in both layouts
    transformers reads: `rope_theta` + `rope_scaling` (4.x) and `rope_parameters` (5.x);
  * model.safetensors: HF tensor names, [out, in] weights, float32 (or `dtype`);
  * tokenizer.json, tokenizer_config.json (bos/eos tokens, the chat template if given) and
    generation_config.json.
It is the inverse of jaxsb/models/hf_checkpoint.py: reading the directory back gives the same
config fields and parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxsb.config import ModelConfig


def _rope_fields(cfg: ModelConfig) -> dict:
    """The RoPE type's fields under transformers' names (without rope_type and rope_theta)."""
    r = cfg.rope
    if r.scaling == "default":
        return {}
    if r.scaling == "linear":
        return {"factor": r.factor}
    if r.scaling == "llama3":
        return {"factor": r.factor, "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
                "original_max_position_embeddings": r.original_max_positions}
    return {"factor": r.factor, "original_max_position_embeddings": r.original_max_positions,
            "beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "truncate": r.truncate,
            "attention_factor": r.attention_factor}


def hf_config(cfg: ModelConfig, bos_id: int | None, eos_id: int | None, max_positions: int,
              dtype: str = "float32") -> dict:
    """config.json for the model (see the module docstring)."""
    qwen2 = cfg.attention_bias == "qkv"
    rope = _rope_fields(cfg)
    out = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": int(max_positions),
        "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": ({"rope_type": cfg.rope.scaling} | rope) if rope else None,
        "rope_parameters": {"rope_type": cfg.rope.scaling, "rope_theta": cfg.rope_theta} | rope,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": dtype, "dtype": dtype,
    }
    if qwen2:
        out |= {"use_sliding_window": False, "sliding_window": None}
    else:
        out |= {"attention_bias": cfg.attention_bias == "qkvo", "mlp_bias": False}
    return out


def hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The model's params (jaxsb's tree, kernels [in, out]) under HF names ([out, in])."""
    def weight(kernel) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(kernel, np.float32).T)

    out = {"model.embed_tokens.weight": np.asarray(params["embed"]["embedding"], np.float32),
           "model.norm.weight": np.asarray(params["final_norm"]["scale"], np.float32)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = weight(params["lm_head"]["kernel"])
    for i in range(cfg.layers):
        layer, p = params["layers"][i], f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = np.asarray(layer["attn_norm"]["scale"], np.float32)
        out[p + "post_attention_layernorm.weight"] = np.asarray(layer["mlp_norm"]["scale"], np.float32)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{name}.weight"] = weight(layer["attn"][name]["kernel"])
            if "bias" in layer["attn"][name]:
                out[p + f"self_attn.{name}.bias"] = np.asarray(layer["attn"][name]["bias"], np.float32)
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[p + f"mlp.{name}.weight"] = weight(layer["mlp"][name]["kernel"])
    return out


def write_hf_checkpoint(directory: str | Path, cfg: ModelConfig, params: dict, tokenizer, bos_id: int | None,
                        eos_id: int | None, *, max_positions: int = 8192, chat_template: str | None = None,
                        dtype: str = "float32") -> list[Path]:
    """Writes the checkpoint directory (module docstring); returns the files written.
    `tokenizer` is a `tokenizers.Tokenizer`; `dtype` float32 | bfloat16 | float16."""
    import ml_dtypes
    from safetensors.numpy import save_file

    casts = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    if dtype not in casts:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(casts)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(casts[dtype]) for k, v in hf_tensors(params, cfg).items()}
    files = [directory / "config.json", directory / "model.safetensors", directory / "tokenizer.json",
             directory / "tokenizer_config.json", directory / "generation_config.json"]
    files[0].write_text(json.dumps(hf_config(cfg, bos_id, eos_id, max_positions, dtype), indent=2))
    save_file(tensors, str(files[1]), metadata={"format": "pt"})
    tokenizer.save(str(files[2]))

    def token(i):
        return None if i is None else tokenizer.id_to_token(i)

    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token(bos_id), "eos_token": token(eos_id),
               "model_max_length": int(max_positions)}
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    files[3].write_text(json.dumps(tok_cfg, indent=2))
    files[4].write_text(json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=2))
    return files
