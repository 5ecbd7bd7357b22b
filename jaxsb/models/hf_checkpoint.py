"""Reading a local Hugging Face checkpoint directory (Llama, Qwen2, Mistral families).

Layout: `config.json` (read by jaxsb/models/hf_config.py), weights in `model.safetensors` or
shards listed by `model.safetensors.index.json` (any `*.safetensors` otherwise), and
`tokenizer.json`. Weights use HF names (`model.layers.0.self_attn.q_proj.weight`, [out, in],
`...q_proj.bias` where the family has biases) and HF's rotate-half q/k row order, which is
jaxsb's own, so only transposes are needed. Any float dtype is read and cast to float32.
Every error names the file and the field or tensor at fault.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxsb.models.hf_config import HFCheckpointError, config_from_hf, read_json

__all__ = ["HFCheckpointError", "chat_template_from_hf", "config_from_hf", "params_from_hf", "tokenizer_from_hf"]


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFCheckpointError(f"{index}: field 'weight_map' is missing or empty")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise HFCheckpointError(f"{f}: missing (listed in {index.name})")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{directory}: no *.safetensors weight files")
    return files


SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                      "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                      "BOOL": np.bool_}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file as a read-only numpy view of the file (bfloat16
    included, which the safetensors package's numpy reader refuses). The format: an 8-byte
    little-endian header size, a JSON header {name: {dtype, shape, data_offsets}}, the data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HFCheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HFCheckpointError(f"{path}: not a safetensors file (unreadable header: {e})") from None
    has_data = path.stat().st_size > 8 + n  # np.memmap refuses an empty region
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if has_data else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise HFCheckpointError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}; jaxsb reads "
                                    f"{', '.join(SAFETENSORS_DTYPES)}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize or end > data.size:
            raise HFCheckpointError(f"{path}: tensor {name!r}: data_offsets {info['data_offsets']} do not hold "
                                    f"{info['dtype']} {list(shape)}")
        out[name] = data[begin:end].view(dtype).reshape(shape)
    return out


def _load_tensors(directory: Path) -> dict[str, tuple[np.ndarray, Path]]:
    out: dict[str, tuple[np.ndarray, Path]] = {}
    for f in _weight_files(directory):
        for name, arr in read_safetensors(f).items():
            if name in out:
                raise HFCheckpointError(f"{f}: tensor {name!r} also appears in {out[name][1]}")
            out[name] = (arr, f)
    return out


def params_from_hf(directory: Path, cfg: dict[str, Any]) -> dict:
    """Nested float32 dict in jaxsb's tree layout (kernels [in, out])."""
    E, H, K, D, F, V = (cfg[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab_size"))
    tensors = _load_tensors(directory)
    used: set[str] = set()
    qkv_bias = cfg.get("attention_bias", "none") != "none"
    o_bias = cfg.get("attention_bias", "none") == "qkvo"

    def get(name: str, shape: tuple[int, ...], transpose: bool = False) -> np.ndarray:
        if name not in tensors:
            raise HFCheckpointError(f"{directory}: tensor {name!r} is missing from the *.safetensors files")
        arr, f = tensors[name]
        if tuple(arr.shape) != shape:
            raise HFCheckpointError(f"{f}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape} "
                                    f"from config.json")
        used.add(name)
        if arr.dtype not in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16):
            raise HFCheckpointError(f"{f}: tensor {name!r} has dtype {arr.dtype}, expected a float type")
        arr = np.asarray(arr, dtype=np.float32)
        return np.ascontiguousarray(arr.T) if transpose else arr

    def linear(name: str, dout: int, din: int, bias: bool) -> dict[str, np.ndarray]:
        out = {"kernel": get(name + ".weight", (dout, din), transpose=True)}
        if bias:
            out["bias"] = get(name + ".bias", (dout,))
        return out

    params: dict[str, Any] = {
        "embed": {"embedding": get("model.embed_tokens.weight", (V, E))},
        "final_norm": {"scale": get("model.norm.weight", (E,))},
        "layers": {},
    }
    if cfg["tie_embeddings"]:
        used.add("lm_head.weight")  # some exporters save the tied copy too; it is ignored
    else:
        params["lm_head"] = {"kernel": get("lm_head.weight", (V, E), transpose=True)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        params["layers"][i] = {
            "attn_norm": {"scale": get(p + "input_layernorm.weight", (E,))},
            "attn": {
                "q_proj": linear(p + "self_attn.q_proj", H * D, E, qkv_bias),
                "k_proj": linear(p + "self_attn.k_proj", K * D, E, qkv_bias),
                "v_proj": linear(p + "self_attn.v_proj", K * D, E, qkv_bias),
                "o_proj": linear(p + "self_attn.o_proj", E, H * D, o_bias),
            },
            "mlp_norm": {"scale": get(p + "post_attention_layernorm.weight", (E,))},
            "mlp": {
                "gate_proj": {"kernel": get(p + "mlp.gate_proj.weight", (F, E), True)},
                "up_proj": {"kernel": get(p + "mlp.up_proj.weight", (F, E), True)},
                "down_proj": {"kernel": get(p + "mlp.down_proj.weight", (E, F), True)},
            },
        }
    extra = sorted(n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        shown = ", ".join(extra[:5]) + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
        raise HFCheckpointError(f"{directory}: unexpected tensors for a {cfg['layers']}-layer model with "
                                f"attention_bias={cfg.get('attention_bias', 'none')!r}: {shown}")
    return params


def chat_template_from_hf(directory: Path) -> str | None:
    """The Jinja chat template: chat_template.jinja (transformers 5) or tokenizer_config.json's
    `chat_template` (a string, or a list of {name, template} whose "default" is taken)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tc = directory / "tokenizer_config.json"
    if not tc.is_file():
        return None
    value = read_json(tc).get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise HFCheckpointError(f"{tc}: chat_template lists {sorted(named)} but no 'default'")
        value = named["default"]
    if value is not None and not isinstance(value, str):
        raise HFCheckpointError(f"{tc}: chat_template={value!r}: expected a string")
    return value


def max_positions_from_hf(directory: Path) -> int | None:
    """config.json's max_position_embeddings (the trained context), None when absent."""
    path = directory / "config.json"
    value = read_json(path).get("max_position_embeddings")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HFCheckpointError(f"{path}: max_position_embeddings={value!r}: expected a positive integer")
    return value


def tokenizer_from_hf(directory: Path):
    """(tokenizers.Tokenizer, bos_id, eos_id) from tokenizer.json and the config files."""
    from tokenizers import Tokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        raise HFCheckpointError(f"{path}: missing (jaxsb reads the fast-tokenizer file)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise HFCheckpointError(f"{path}: not a readable tokenizers file: {e}") from e
    ids: dict[str, int | None] = {"bos": None, "eos": None}
    sources = [directory / "config.json", directory / "generation_config.json"]
    for which in ids:
        for src in sources:
            if ids[which] is None and src.is_file():
                value = read_json(src).get(f"{which}_token_id")
                if isinstance(value, list):
                    value = value[0] if value else None
                ids[which] = None if value is None else int(value)
        tc = directory / "tokenizer_config.json"
        if ids[which] is None and tc.is_file():
            token = read_json(tc).get(f"{which}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str):
                ids[which] = tok.token_to_id(token)
    return tok, ids["bos"], ids["eos"]
