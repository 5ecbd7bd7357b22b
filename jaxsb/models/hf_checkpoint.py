"""Reading a local Hugging Face Llama checkpoint directory.

Layout: `config.json`, weights in `model.safetensors` or shards listed by
`model.safetensors.index.json` (any `*.safetensors` otherwise), and `tokenizer.json`.
Weights use HF names (`model.layers.0.self_attn.q_proj.weight`, [out, in]) and HF's
rotate-half q/k row order, which is jaxsb's own, so only transposes are needed.
Every error names the file and the field or tensor at fault.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


class HFCheckpointError(ValueError):
    """A checkpoint directory is missing a file, field or tensor, or has one jaxsb cannot use."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFCheckpointError(f"{path}: missing (a Hugging Face Llama checkpoint needs it)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path}: not valid JSON: {e}") from None


def config_from_hf(directory: Path) -> dict[str, Any]:
    """ModelConfig field values from `config.json`."""
    path = directory / "config.json"
    c = _read_json(path)

    def need(key: str) -> Any:
        if key not in c:
            raise HFCheckpointError(f"{path}: field {key!r} is missing")
        return c[key]

    model_type = c.get("model_type", "llama")
    if model_type != "llama":
        raise HFCheckpointError(f"{path}: model_type is {model_type!r}; only 'llama' is supported")
    if c.get("rope_scaling") not in (None, {}):
        raise HFCheckpointError(f"{path}: rope_scaling={c['rope_scaling']!r} is not supported (use null)")
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise HFCheckpointError(f"{path}: {flag}=true is not supported (jaxsb's Llama has no biases)")
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    if c.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{path}: hidden_act={c['hidden_act']!r} is not supported (only 'silu')")
    return dict(
        vocab_size=int(need("vocab_size")),
        hidden=hidden,
        layers=int(need("num_hidden_layers")),
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        ffn=int(need("intermediate_size")),
        rope_theta=float(c.get("rope_theta", 10000.0)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
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


def _load_tensors(directory: Path) -> dict[str, tuple[np.ndarray, Path]]:
    from safetensors import safe_open

    out: dict[str, tuple[np.ndarray, Path]] = {}
    for f in _weight_files(directory):
        try:
            with safe_open(str(f), framework="numpy") as st:
                for name in st.keys():
                    if name in out:
                        raise HFCheckpointError(f"{f}: tensor {name!r} also appears in {out[name][1]}")
                    out[name] = (st.get_tensor(name), f)
        except HFCheckpointError:
            raise
        except Exception as e:
            raise HFCheckpointError(f"{f}: not a readable safetensors file: {e}") from e
    return out


def params_from_hf(directory: Path, cfg: dict[str, Any]) -> dict:
    """Nested float32 dict in jaxsb's tree layout (kernels [in, out])."""
    E, H, K, D, F, V = (cfg[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab_size"))
    tensors = _load_tensors(directory)
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...], transpose: bool = False) -> np.ndarray:
        if name not in tensors:
            raise HFCheckpointError(f"{directory}: tensor {name!r} is missing from the *.safetensors files")
        arr, f = tensors[name]
        if tuple(arr.shape) != shape:
            raise HFCheckpointError(f"{f}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape} "
                                    f"from config.json")
        used.add(name)
        arr = np.asarray(arr, dtype=np.float32)
        return np.ascontiguousarray(arr.T) if transpose else arr

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
                "q_proj": {"kernel": get(p + "self_attn.q_proj.weight", (H * D, E), True)},
                "k_proj": {"kernel": get(p + "self_attn.k_proj.weight", (K * D, E), True)},
                "v_proj": {"kernel": get(p + "self_attn.v_proj.weight", (K * D, E), True)},
                "o_proj": {"kernel": get(p + "self_attn.o_proj.weight", (E, H * D), True)},
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
        raise HFCheckpointError(f"{directory}: unexpected tensors for a {cfg['layers']}-layer Llama: {shown}")
    return params


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
                value = _read_json(src).get(f"{which}_token_id")
                if isinstance(value, list):
                    value = value[0] if value else None
                ids[which] = None if value is None else int(value)
        tc = directory / "tokenizer_config.json"
        if ids[which] is None and tc.is_file():
            token = _read_json(tc).get(f"{which}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str):
                ids[which] = tok.token_to_id(token)
    return tok, ids["bos"], ids["eos"]
