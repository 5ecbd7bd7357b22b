"""Reading a llama.cpp GGUF file into jaxsb's parameter tree, config fields and tokenizer.

Two quirks of llama.cpp's converter are undone here:
- Matrices are stored [out, in] (PyTorch order); jaxsb kernels are [in, out].
- q/k projection rows are permuted per head so that llama.cpp's RoPE, which rotates adjacent
  pairs (x[2i], x[2i+1]), reproduces Hugging Face's rotate-half RoPE, which rotates
  (x[i], x[i + D/2]). jaxsb uses rotate-half, so the rows are put back in HF order.
The tokenizer is rebuilt as a Hugging Face byte-level BPE from the vocabulary and merges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jaxsb.config import RopeConfig

# GGUF token types (llama.cpp's llama_token_type): 1 normal, 2 unknown, 3 control,
# 4 user defined, 5 unused, 6 byte.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


class GGUFError(ValueError):
    """A GGUF file lacks a field or tensor jaxsb needs, or has one it cannot use."""


def undo_llamacpp_permute(w_OxI: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's `permute`: interleaved pairs back to halves, per head."""
    out = w_OxI.shape[0]
    return w_OxI.reshape(n_head, out // n_head // 2, 2, *w_OxI.shape[1:]).swapaxes(1, 2).reshape(w_OxI.shape)


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, tensors): metadata values as Python objects, tensors dequantized to float32
    in their stored [out, in] numpy order."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises assorted errors on bad files
        raise GGUFError(f"{path}: not a readable GGUF file: {e}") from e
    meta = {}
    for name, field in reader.fields.items():
        try:
            meta[name] = field.contents()
        except Exception:  # unusual field types are not needed; keep the file readable
            continue
    tensors = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.ascontiguousarray(data, dtype=np.float32)
    return meta, tensors


def _need(meta: dict[str, Any], key: str, where: Path | str) -> Any:
    if key not in meta:
        raise GGUFError(f"{where}: metadata field {key!r} is missing")
    return meta[key]


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, np.ndarray], where: Path | str) -> dict[str, Any]:
    """ModelConfig field values from a llama-architecture GGUF."""
    arch = _need(meta, "general.architecture", where)
    if arch != "llama":
        raise GGUFError(f"{where}: general.architecture is {arch!r}; only 'llama' is supported")
    hidden = int(_need(meta, "llama.embedding_length", where))
    heads = int(_need(meta, "llama.attention.head_count", where))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"{where}: llama.rope.dimension_count={rope_dim} != head_dim={head_dim}; "
                        "partial rotary embeddings are not supported")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"{where}: llama.rope.scaling.type={scaling!r} is not supported")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{where}: tensor 'token_embd.weight' is missing")
    vocab = int(meta.get("llama.vocab_size", tensors["token_embd.weight"].shape[0]))
    eps = float(_need(meta, "llama.attention.layer_norm_rms_epsilon", where))
    return dict(
        vocab_size=vocab,
        hidden=hidden,
        layers=int(_need(meta, "llama.block_count", where)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=int(_need(meta, "llama.feed_forward_length", where)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rope=RopeConfig(),  # scaling refused above
        attention_bias="none",
        norm_eps=float(f"{eps:.7g}"),  # stored as float32: 9.99999975e-06 -> 1e-05
        tie_embeddings="output.weight" not in tensors,
    )


def params_from_gguf(tensors: dict[str, np.ndarray], cfg: dict[str, Any], where: Path | str) -> dict:
    """Nested dict in jaxsb's tree layout (float32, kernels [in, out])."""
    E, H, K, D, F, V = (cfg[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab_size"))

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise GGUFError(f"{where}: tensor {name!r} is missing")
        arr = tensors[name]
        if arr.shape != shape:
            raise GGUFError(f"{where}: tensor {name!r} has shape {arr.shape}, expected {shape}")
        return arr

    params: dict[str, Any] = {
        "embed": {"embedding": get("token_embd.weight", (V, E))},
        "final_norm": {"scale": get("output_norm.weight", (E,))},
        "layers": {},
    }
    if not cfg["tie_embeddings"]:
        params["lm_head"] = {"kernel": get("output.weight", (V, E)).T.copy()}
    for i in range(cfg["layers"]):
        b = f"blk.{i}."
        params["layers"][i] = {
            "attn_norm": {"scale": get(b + "attn_norm.weight", (E,))},
            "attn": {
                "q_proj": {"kernel": undo_llamacpp_permute(get(b + "attn_q.weight", (H * D, E)), H).T.copy()},
                "k_proj": {"kernel": undo_llamacpp_permute(get(b + "attn_k.weight", (K * D, E)), K).T.copy()},
                "v_proj": {"kernel": get(b + "attn_v.weight", (K * D, E)).T.copy()},
                "o_proj": {"kernel": get(b + "attn_output.weight", (E, H * D)).T.copy()},
            },
            "mlp_norm": {"scale": get(b + "ffn_norm.weight", (E,))},
            "mlp": {
                "gate_proj": {"kernel": get(b + "ffn_gate.weight", (F, E)).T.copy()},
                "up_proj": {"kernel": get(b + "ffn_up.weight", (F, E)).T.copy()},
                "down_proj": {"kernel": get(b + "ffn_down.weight", (E, F)).T.copy()},
            },
        }
    return params


def tokenizer_from_gguf(meta: dict[str, Any], where: Path | str):
    """(tokenizers.Tokenizer, bos_id, eos_id) for a GGUF with tokenizer.ggml.model == 'gpt2'."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _need(meta, "tokenizer.ggml.model", where)
    if kind != "gpt2":
        raise GGUFError(f"{where}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) is supported")
    tokens = list(_need(meta, "tokenizer.ggml.tokens", where))
    merges = [tuple(m.split(" ", 1)) for m in _need(meta, "tokenizer.ggml.merges", where)]
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{where}: tokenizer.ggml.tokens has duplicate entries")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "qwen2", "llama3", "deepseek-llm"):
        # these split numbers into single digits before GPT-2's regex (llama.cpp's "\p{N}" rule)
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt-2", "gpt2"):
        tok.pre_tokenizer = byte_level
    else:
        raise GGUFError(f"{where}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer jaxsb can rebuild")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # control tokens (e.g. <|im_start|>) are matched whole before BPE and skipped by
    # decode(skip_special_tokens=True); user-defined ones are matched whole but kept
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _TOKEN_CONTROL]
    user = [AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return tok, None if bos is None else int(bos), None if eos is None else int(eos)
