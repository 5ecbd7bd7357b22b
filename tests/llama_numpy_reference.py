"""An independent plain-numpy LLaMA forward, the oracle for the JAX model.

It deliberately shares no code with `jaxsb.models` and works in a different layout: the
GGUF / llama.cpp one. Weights are [out, in] matrices named like `blk.3.attn_q.weight`, the
q/k rows are in llama.cpp's permuted order, and RoPE rotates ADJACENT pairs (x[2i], x[2i+1])
as llama.cpp's "normal" rope does. The JAX model instead un-permutes q/k at load time and
uses rotate-half RoPE; the two agree only if that un-permutation is right. Everything here is
computed in float64 with explicit per-head loops and an explicit mask.
"""

from __future__ import annotations

import numpy as np


def llamacpp_permute(w_OxI: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to HF q_proj / k_proj rows (per head:
    first half / second half of the head dim become interleaved)."""
    out = w_OxI.shape[0]
    return w_OxI.reshape(n_head, 2, out // n_head // 2, *w_OxI.shape[1:]).swapaxes(1, 2).reshape(w_OxI.shape)


def gguf_tensors_from_model_tree(params: dict, hp: dict) -> dict[str, np.ndarray]:
    """jaxsb model tree (kernels [in, out]) -> GGUF-named [out, in] tensors, q/k permuted."""
    g = {"token_embd.weight": np.asarray(params["embed"]["embedding"]),
         "output_norm.weight": np.asarray(params["final_norm"]["scale"])}
    if "lm_head" in params:
        g["output.weight"] = np.asarray(params["lm_head"]["kernel"]).T
    for i in range(hp["layers"]):
        layer = params["layers"][i]
        a, m = layer["attn"], layer["mlp"]
        g[f"blk.{i}.attn_norm.weight"] = np.asarray(layer["attn_norm"]["scale"])
        g[f"blk.{i}.ffn_norm.weight"] = np.asarray(layer["mlp_norm"]["scale"])
        g[f"blk.{i}.attn_q.weight"] = llamacpp_permute(np.asarray(a["q_proj"]["kernel"]).T, hp["heads"])
        g[f"blk.{i}.attn_k.weight"] = llamacpp_permute(np.asarray(a["k_proj"]["kernel"]).T, hp["kv_heads"])
        g[f"blk.{i}.attn_v.weight"] = np.asarray(a["v_proj"]["kernel"]).T
        g[f"blk.{i}.attn_output.weight"] = np.asarray(a["o_proj"]["kernel"]).T
        g[f"blk.{i}.ffn_gate.weight"] = np.asarray(m["gate_proj"]["kernel"]).T
        g[f"blk.{i}.ffn_up.weight"] = np.asarray(m["up_proj"]["kernel"]).T
        g[f"blk.{i}.ffn_down.weight"] = np.asarray(m["down_proj"]["kernel"]).T
    return g


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_adjacent_pairs(x_TxD, pos_T, theta):
    """llama.cpp normal rope: (x[2i], x[2i+1]) rotated by pos * theta^(-2i/D)."""
    D = x_TxD.shape[-1]
    freqs = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = pos_T[:, None].astype(np.float64) * freqs[None, :]
    c, s = np.cos(ang), np.sin(ang)
    x0, x1 = x_TxD[:, 0::2], x_TxD[:, 1::2]
    out = np.empty_like(x_TxD)
    out[:, 0::2] = x0 * c - x1 * s
    out[:, 1::2] = x0 * s + x1 * c
    return out


def forward_row(g: dict[str, np.ndarray], hp: dict, tokens_T, segment_ids_T=None, positions_T=None) -> np.ndarray:
    """Logits [T, V] (float64) for ONE packed row.

    hp: layers, heads, kv_heads, head_dim, rope_theta, norm_eps.
    """
    tokens_T = np.asarray(tokens_T)
    T = len(tokens_T)
    seg = np.ones(T, np.int64) if segment_ids_T is None else np.asarray(segment_ids_T)
    pos = np.arange(T) if positions_T is None else np.asarray(positions_T)
    H, K, D, eps = hp["heads"], hp["kv_heads"], hp["head_dim"], hp["norm_eps"]
    f64 = lambda name: np.asarray(g[name], np.float64)  # noqa: E731

    allowed_TxT = (seg[:, None] == seg[None, :]) & (np.arange(T)[None, :] <= np.arange(T)[:, None])
    x = f64("token_embd.weight")[tokens_T]
    for i in range(hp["layers"]):
        h = _rms_norm(x, f64(f"blk.{i}.attn_norm.weight"), eps)
        q = h @ f64(f"blk.{i}.attn_q.weight").T
        k = h @ f64(f"blk.{i}.attn_k.weight").T
        v = h @ f64(f"blk.{i}.attn_v.weight").T
        heads_out = []
        for hi in range(H):
            kv = hi // (H // K)
            qh = _rope_adjacent_pairs(q[:, hi * D:(hi + 1) * D], pos, hp["rope_theta"])
            kh = _rope_adjacent_pairs(k[:, kv * D:(kv + 1) * D], pos, hp["rope_theta"])
            vh = v[:, kv * D:(kv + 1) * D]
            scores = qh @ kh.T / np.sqrt(D)
            scores = np.where(allowed_TxT, scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            heads_out.append(p @ vh)
        x = x + np.concatenate(heads_out, axis=-1) @ f64(f"blk.{i}.attn_output.weight").T
        h = _rms_norm(x, f64(f"blk.{i}.ffn_norm.weight"), eps)
        gate = h @ f64(f"blk.{i}.ffn_gate.weight").T
        up = h @ f64(f"blk.{i}.ffn_up.weight").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ f64(f"blk.{i}.ffn_down.weight").T
    x = _rms_norm(x, f64("output_norm.weight"), eps)
    head = f64("output.weight") if "output.weight" in g else f64("token_embd.weight")
    return x @ head.T


def mean_nll(logits_TxV: np.ndarray, tokens_T) -> float:
    """Mean next-token negative log-likelihood of tokens[1:] given the logits (float64)."""
    logits = np.asarray(logits_TxV, np.float64)[:-1]
    targets = np.asarray(tokens_T)[1:]
    m = logits.max(axis=-1, keepdims=True)
    log_z = (m[:, 0] + np.log(np.exp(logits - m).sum(axis=-1)))
    return float(np.mean(log_z - logits[np.arange(len(targets)), targets]))
