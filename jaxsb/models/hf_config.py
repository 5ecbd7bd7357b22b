"""Hugging Face `config.json` -> ModelConfig fields, for the Llama, Qwen2 and Mistral families.

Both layouts transformers writes are read: 4.x (`rope_theta` and `rope_scaling` at the top) and
5.x (`rope_parameters`, which carries `rope_theta`, possibly per layer type). Nothing is guessed:
every field that changes what the model computes is honoured or refused with the file, the field
and its value (`HFCheckpointError`); fields that do not change it (`use_cache`, `dtype`,
`initializer_range`, ...) are ignored. Defaults for absent fields are transformers' own for the
family (rope_theta 10000, rms_norm_eps 1e-6, untied embeddings).

Honoured: the shape; RoPE `default`, `linear`, `llama3` and `yarn` scaling; Llama's
`attention_bias` (q, k, v and o biases) and Qwen2's q/k/v biases; tied or untied embeddings.
Refused: other activations and RoPE types, partial rotary dimensions, sliding-window attention
(Mistral's `sliding_window`, Qwen2's `use_sliding_window`, non-full `layer_types`), MLP biases,
attention dropout, logit soft-capping and multipliers, quantized weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jaxsb.config import RopeConfig

FAMILIES = ("llama", "qwen2", "mistral")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Fields of each RoPE type (transformers' names), besides rope_type/type and rope_theta.
ROPE_FIELDS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"},
}
# Fields that would change the computation if set to anything but the value given here.
MUST_BE = {
    "hidden_act": "silu",
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "partial_rotary_factor": 1.0,
    "use_sliding_window": False,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "logits_scaling": None,
    "embedding_multiplier": None,
    "residual_multiplier": None,
    "attention_multiplier": None,
    "quantization_config": None,  # except a GGUF file transformers dequantized (see config_from_hf)
}


class HFCheckpointError(ValueError):
    """A checkpoint directory is missing a file, field or tensor, or has one jaxsb cannot use."""


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFCheckpointError(f"{path}: missing (a Hugging Face checkpoint directory needs it)")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise HFCheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _rope_dict(c: dict[str, Any], path: Path) -> dict[str, Any]:
    """The RoPE settings as one 5.x-style dict, from either layout."""
    theta = c.get("rope_theta")
    if "rope_parameters" in c and c["rope_parameters"] is not None:
        rp = c["rope_parameters"]
        if not isinstance(rp, dict):
            raise HFCheckpointError(f"{path}: rope_parameters={rp!r}: expected an object")
        if rp and all(isinstance(v, dict) for v in rp.values()):  # per layer type
            distinct = {json.dumps(v, sort_keys=True) for v in rp.values()}
            if len(distinct) > 1:
                raise HFCheckpointError(f"{path}: rope_parameters={rp!r}: different RoPE per layer type is not "
                                        "supported")
            rp = next(iter(rp.values()))
        rope = dict(rp)
        scaling = c.get("rope_scaling")
        if scaling not in (None, {}):
            old = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": scaling.get("rope_type",
                                                                                              scaling.get("type"))}
            if any(rope.get(k) != v for k, v in old.items()):
                raise HFCheckpointError(f"{path}: rope_scaling={scaling!r} disagrees with rope_parameters={rp!r}")
        if "rope_theta" not in rope and theta is not None:
            rope["rope_theta"] = theta
        if theta is not None and rope.get("rope_theta") != theta:
            raise HFCheckpointError(f"{path}: rope_theta={theta!r} disagrees with rope_parameters={rp!r}")
    else:
        scaling = c.get("rope_scaling")
        if scaling is None or scaling == {}:
            scaling = {"rope_type": "default"}
        if not isinstance(scaling, dict):
            raise HFCheckpointError(f"{path}: rope_scaling={scaling!r}: expected an object or null")
        rope = dict(scaling)
        if theta is not None:
            rope["rope_theta"] = theta
    if "type" in rope:  # the older name of rope_type
        legacy = rope.pop("type")
        rope.setdefault("rope_type", legacy)
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", 10000.0)
    return rope


def _number(value: Any, field: str, path: Path, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        raise HFCheckpointError(f"{path}: {field}={value!r}: expected a {'positive ' if positive else ''}number")
    return float(value)


def rope_from_hf(c: dict[str, Any], path: Path) -> tuple[float, RopeConfig]:
    """(rope_theta, RopeConfig) from a config dict; refuses what it cannot honour."""
    rope = _rope_dict(c, path)
    kind = rope.pop("rope_type")
    where = "rope_parameters" if "rope_parameters" in c else "rope_scaling"
    if kind not in ROPE_TYPES:
        raise HFCheckpointError(f"{path}: {where}.rope_type={kind!r} is not supported "
                                f"(jaxsb implements {', '.join(ROPE_TYPES)})")
    theta = _number(rope.pop("rope_theta"), f"{where}.rope_theta", path)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFCheckpointError(f"{path}: {where}.partial_rotary_factor={rope['partial_rotary_factor']!r} is not "
                                "supported (jaxsb rotates the whole head)")
    rope.pop("partial_rotary_factor", None)
    unknown = sorted(set(rope) - ROPE_FIELDS[kind])
    if unknown:
        raise HFCheckpointError(f"{path}: {where} field(s) {unknown} are not understood for rope_type={kind!r} "
                                f"(values {[rope[k] for k in unknown]!r})")
    if kind == "default":
        return theta, RopeConfig()
    max_pos = c.get("max_position_embeddings")
    original = rope.get("original_max_position_embeddings", c.get("original_max_position_embeddings", max_pos))
    factor = rope.get("factor")
    if kind == "yarn" and factor is None and max_pos and original:
        factor = max_pos / original  # transformers' rule for a yarn config without a factor
    factor = _number(factor, f"{where}.factor", path)
    if kind == "linear":
        return theta, RopeConfig(scaling="linear", factor=factor)
    original = int(_number(original, f"{where}.original_max_position_embeddings", path))
    if kind == "llama3":
        low = _number(rope.get("low_freq_factor"), f"{where}.low_freq_factor", path)
        high = _number(rope.get("high_freq_factor"), f"{where}.high_freq_factor", path)
        if high <= low:
            raise HFCheckpointError(f"{path}: {where}.high_freq_factor={high} must exceed low_freq_factor={low}")
        return theta, RopeConfig(scaling="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                                 original_max_positions=original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise HFCheckpointError(f"{path}: {where}.truncate={truncate!r}: expected true or false")
    return theta, RopeConfig(scaling="yarn", factor=factor, original_max_positions=original,
                             beta_fast=_number(rope.get("beta_fast") or 32, f"{where}.beta_fast", path),
                             beta_slow=_number(rope.get("beta_slow") or 1, f"{where}.beta_slow", path),
                             truncate=truncate,
                             attention_factor=_number(attention, f"{where}.attention_factor", path))


def config_from_hf(directory: Path) -> dict[str, Any]:
    """ModelConfig field values from `directory/config.json`."""
    path = directory / "config.json"
    c = read_json(path)

    def need(key: str) -> int:
        if key not in c:
            raise HFCheckpointError(f"{path}: field {key!r} is missing")
        value = c[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HFCheckpointError(f"{path}: {key}={value!r}: expected a positive integer")
        return value

    family = c.get("model_type")
    if family not in FAMILIES:
        raise HFCheckpointError(f"{path}: model_type={family!r} is not supported (jaxsb loads {', '.join(FAMILIES)})")
    quant = c.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "gguf":
        # transformers dequantizes a GGUF file when it loads it: what it saves is plain float
        # tensors (params_from_hf refuses any other dtype), so the field describes the origin only.
        c = {k: v for k, v in c.items() if k != "quantization_config"}
    for field, allowed in MUST_BE.items():
        if field in c and c[field] != allowed and not (allowed is None and c[field] in ({}, [])):
            raise HFCheckpointError(f"{path}: {field}={c[field]!r} is not supported (jaxsb computes {field}="
                                    f"{json.dumps(allowed)})")
    if c.get("sliding_window") is not None and (family == "mistral" or c.get("use_sliding_window")):
        raise HFCheckpointError(f"{path}: sliding_window={c['sliding_window']!r} is not supported: jaxsb attends "
                                "over the whole document (a checkpoint with sliding_window=null loads)")
    layer_types = c.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise HFCheckpointError(f"{path}: layer_types={layer_types!r}: only full_attention layers are supported")
    if family == "qwen2":
        bias = "qkv"  # Qwen2 always has q/k/v biases and none on o_proj
    else:
        flag = c.get("attention_bias", False)
        if not isinstance(flag, bool):
            raise HFCheckpointError(f"{path}: attention_bias={flag!r}: expected true or false")
        bias = "qkvo" if flag else "none"
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    if c.get("head_dim") is None and hidden % heads:
        raise HFCheckpointError(f"{path}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                                "and head_dim is not given")
    theta, rope = rope_from_hf(c, path)
    tie = c.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise HFCheckpointError(f"{path}: tie_word_embeddings={tie!r}: expected true or false")
    return dict(
        vocab_size=need("vocab_size"),
        hidden=hidden,
        layers=need("num_hidden_layers"),
        heads=heads,
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        ffn=need("intermediate_size"),
        rope_theta=theta,
        rope=rope,
        attention_bias=bias,
        norm_eps=_number(c.get("rms_norm_eps", 1e-6), "rms_norm_eps", path),
        tie_embeddings=tie,
    )
