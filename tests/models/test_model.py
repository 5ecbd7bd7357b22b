"""The jaxsb Llama against an independent numpy forward, plus packing, remat, bf16 and loss.

Weights are tiny and random but deliberately large (std ~0.3, norm scales != 1) so that
attention patterns and RoPE phases matter: with the init std of 0.02 nearly everything
would look uniform and a wrong mask or rotation could hide.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import llama_numpy_reference as ref
from jaxsb.config import ModelConfig
from jaxsb.models import Llama, next_token_loss
from jaxsb.models.pretrained import apply_pretrained, export_params
from tiny_models import TINY, make_model
from tolerances import tol


def _hp(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def packed_batch(T: int = 20, vocab: int = 61, seed: int = 1):
    """Two rows: [doc 7 tokens | doc 9 | pad 4] and [doc 13 | doc 5 | pad 2]."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(2, T)).astype(np.int32)
    seg = np.zeros((2, T), np.int32)
    pos = np.zeros((2, T), np.int32)
    for r, lens in enumerate([(7, 9), (13, 5)]):
        start = 0
        for d, n in enumerate(lens):
            seg[r, start:start + n] = d + 1
            pos[r, start:start + n] = np.arange(n)
            start += n
    return tokens, seg, pos


@nnx.jit
def forward(model, tokens, seg, pos):
    return model(tokens, seg, pos)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_forward_matches_numpy_reference(tie):
    cfg = dataclasses.replace(TINY, tie_embeddings=tie)
    model, params = make_model(cfg)
    assert ("lm_head" in params) == (not tie)
    tokens, seg, pos = packed_batch()
    logits = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos)))
    assert logits.dtype == np.float32 and logits.shape == (2, 20, cfg.vocab_size)
    g = ref.gguf_tensors_from_model_tree(params, _hp(cfg))
    for r in range(2):
        expected = ref.forward_row(g, _hp(cfg), tokens[r], seg[r], pos[r])
        real = seg[r] > 0  # padding outputs are ignored by contract
        assert np.abs(expected[real]).max() > 1.0, "logits too small for the comparison to mean much"
        np.testing.assert_allclose(logits[r][real], expected[real], **tol("model_logits", "float32"))


def test_loss_matches_numpy():
    model, params = make_model()
    tokens, seg, pos = packed_batch()
    targets = np.roll(tokens, -1, axis=1)
    mask = ((seg > 0) & (np.roll(seg, -1, axis=1) == seg)).astype(np.float32)
    logits = forward(model, jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos))
    total, count = next_token_loss(logits, jnp.asarray(targets), jnp.asarray(mask))
    g = ref.gguf_tensors_from_model_tree(params, _hp(TINY))
    expected = 0.0
    for r in range(2):
        lg = ref.forward_row(g, _hp(TINY), tokens[r], seg[r], pos[r])
        log_z = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
        nll = log_z - lg[np.arange(20), targets[r]]
        expected += float((nll * mask[r]).sum())
    assert float(count) == mask.sum()
    np.testing.assert_allclose(float(total), expected, **tol("model_loss", "float32"))


def test_next_token_loss_masks_and_counts():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 5)), jnp.float32)
    targets = jnp.asarray([[1, 4, -1], [0, 2, 99]])  # out-of-range targets only where masked
    mask = jnp.asarray([[1, 1, 0], [1, 0, 0]], jnp.float32)
    total, count = next_token_loss(logits, targets, mask)
    lp = jax.nn.log_softmax(logits, axis=-1)
    expected = -(lp[0, 0, 1] + lp[0, 1, 4] + lp[1, 0, 0])
    assert float(count) == 3.0 and total.dtype == jnp.float32
    np.testing.assert_allclose(float(total), float(expected), **tol("model_loss", "float32"))


def test_no_attention_across_documents_by_gradient():
    """d(loss on doc A) / d(input embeddings of doc B) is exactly zero; B comes first, so a
    missing document mask (plain causal) would make it non-zero."""
    model, _ = make_model()
    tokens, seg, pos = packed_batch()
    tokens, seg, pos = map(jnp.asarray, (tokens, seg, pos))
    x = model.embed_tokens(tokens)
    doc_a = (seg == 2).astype(jnp.float32)  # the second document of each row
    targets = jnp.roll(tokens, -1, axis=1)
    loss_mask = doc_a * (jnp.roll(seg, -1, axis=1) == 2)

    @nnx.jit
    def grad_x(model, x):
        def f(x):
            return next_token_loss(model.from_embeddings(x, seg, pos), targets, loss_mask)[0]
        return jax.grad(f)(x)

    g = np.asarray(grad_x(model, x))
    seg_np = np.asarray(seg)
    assert np.all(g[seg_np == 1] == 0.0), "loss on document 2 depends on document 1's tokens"
    assert np.all(g[seg_np == 0] == 0.0), "loss on document 2 depends on padding"
    assert np.abs(g[seg_np == 2]).min(axis=-1).max() > 0.0 and np.abs(g[seg_np == 2]).sum() > 1e-3


def test_positions_restart_per_document():
    """doc2 inside a packed row [doc1, doc2] gives the same logits as doc2 alone at the row start."""
    model, _ = make_model()
    rng = np.random.default_rng(5)
    doc1, doc2 = rng.integers(0, 61, 9), rng.integers(0, 61, 8)
    T = 20
    packed = np.zeros((1, T), np.int32)
    packed[0, :17] = np.concatenate([doc1, doc2])
    seg_p = np.array([[1] * 9 + [2] * 8 + [0] * 3], np.int32)
    pos_p = np.array([list(range(9)) + list(range(8)) + [0] * 3], np.int32)
    alone = np.zeros((1, T), np.int32)
    alone[0, :8] = doc2
    seg_a = np.array([[1] * 8 + [0] * 12], np.int32)
    pos_a = np.array([list(range(8)) + [0] * 12], np.int32)
    lp = np.asarray(forward(model, *map(jnp.asarray, (packed, seg_p, pos_p))))
    la = np.asarray(forward(model, *map(jnp.asarray, (alone, seg_a, pos_a))))
    np.testing.assert_allclose(lp[0, 9:17], la[0, :8], **tol("model_logits", "float32"))
    # RoPE is relative, so that equality holds for any per-document offset; what must not
    # be ignored is the spacing: positions stretched x2 inside doc2 change its logits
    pos_stretch = pos_p.copy()
    pos_stretch[0, 9:17] = 2 * np.arange(8)
    ls = np.asarray(forward(model, *map(jnp.asarray, (packed, seg_p, pos_stretch))))
    assert np.abs(ls[0, 10:17] - la[0, 1:8]).max() > 1e-2


def test_given_positions_are_used():
    """Irregular (non-contiguous) positions agree with the numpy reference given the same ones."""
    model, params = make_model()
    tokens, seg, _ = packed_batch()
    rng = np.random.default_rng(3)
    pos = np.cumsum(rng.integers(1, 4, size=(2, 20)), axis=1).astype(np.int32)
    logits = np.asarray(forward(model, *map(jnp.asarray, (tokens, seg, pos))))
    g = ref.gguf_tensors_from_model_tree(params, _hp(TINY))
    for r in range(2):
        expected = ref.forward_row(g, _hp(TINY), tokens[r], seg[r], pos[r])
        real = seg[r] > 0
        np.testing.assert_allclose(logits[r][real], expected[real], **tol("model_logits", "float32"))


def _loss_and_grads(model, tokens, seg, pos):
    targets = jnp.roll(tokens, -1, axis=1)
    mask = (seg > 0).astype(jnp.float32)

    def f(model):
        total, count = next_token_loss(model(tokens, seg, pos), targets, mask)
        return total / count

    return nnx.value_and_grad(f)(model)


def test_remat_same_loss_and_grads():
    model, params = make_model()
    remat_model = Llama(dataclasses.replace(TINY, remat=True), rngs=nnx.Rngs(0))
    apply_pretrained(remat_model, params)
    batch = tuple(map(jnp.asarray, packed_batch()))
    graphdef, state = nnx.split(remat_model)
    jaxpr = str(jax.make_jaxpr(lambda s, *b: nnx.merge(graphdef, s)(*b))(state, *batch))
    assert "checkpoint" in jaxpr or "remat" in jaxpr, "cfg.remat=True did not rematerialise anything"
    loss, grads = nnx.jit(_loss_and_grads)(model, *batch)
    loss_r, grads_r = nnx.jit(_loss_and_grads)(remat_model, *batch)
    np.testing.assert_allclose(float(loss_r), float(loss), **tol("model_loss", "float32"))
    flat, flat_r = jax.tree.leaves(grads), jax.tree.leaves(grads_r)
    assert len(flat) == len(flat_r) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    for a, b in zip(flat, flat_r):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), **tol("remat_grad", "float32"))


@pytest.mark.parametrize("other", ["reference", "jax"])
def test_attention_implementations_agree(other):
    model, params = make_model()
    ref_model = Llama(dataclasses.replace(TINY, attention=other), rngs=nnx.Rngs(0))
    apply_pretrained(ref_model, params)
    batch = tuple(map(jnp.asarray, packed_batch()))
    real = np.asarray(batch[1]) > 0
    a = np.asarray(forward(model, *batch))[real]
    b = np.asarray(forward(ref_model, *batch))[real]
    np.testing.assert_allclose(a, b, **tol("model_logits", "float32"))


def test_bfloat16_compute_runs_and_is_close():
    cfg16 = dataclasses.replace(TINY, dtype="bfloat16")
    model, params = make_model()
    model16 = Llama(cfg16, rngs=nnx.Rngs(0))
    apply_pretrained(model16, params)
    assert model16.layers[0].attn.q_proj.kernel[...].dtype == jnp.float32  # params stay f32
    batch = tuple(map(jnp.asarray, packed_batch()))
    real = np.asarray(batch[1]) > 0
    l32 = np.asarray(forward(model, *batch))[real]
    l16 = np.asarray(forward(model16, *batch))
    assert l16.dtype == np.float32 and np.all(np.isfinite(l16))
    l16 = l16[real]
    # bf16 keeps ~3 significant digits; after 2 layers logits should still agree closely
    agree = np.mean(np.argmax(l16, -1) == np.argmax(l32, -1))
    assert agree >= 0.9, f"bf16 changes the argmax of {1 - agree:.0%} of tokens"
    np.testing.assert_allclose(l16, l32, **tol("model_logits", "bfloat16"))
    # all-bf16 parameters also run
    model_p16 = Llama(dataclasses.replace(cfg16, param_dtype="bfloat16"), rngs=nnx.Rngs(0))
    apply_pretrained(model_p16, params)
    assert model_p16.embed.embedding[...].dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(forward(model_p16, *batch))))


def test_param_tree_names_and_shapes():
    model, params = make_model(dataclasses.replace(TINY, tie_embeddings=False))
    c = TINY
    layer = params["layers"][1]
    assert params["embed"]["embedding"].shape == (c.vocab_size, c.hidden)
    assert layer["attn"]["q_proj"]["kernel"].shape == (c.hidden, c.heads * c.head_dim)
    assert layer["attn"]["k_proj"]["kernel"].shape == (c.hidden, c.kv_heads * c.head_dim)
    assert layer["attn"]["o_proj"]["kernel"].shape == (c.heads * c.head_dim, c.hidden)
    assert layer["mlp"]["down_proj"]["kernel"].shape == (c.ffn, c.hidden)
    assert layer["attn_norm"]["scale"].shape == layer["mlp_norm"]["scale"].shape == (c.hidden,)
    assert params["final_norm"]["scale"].shape == (c.hidden,)
    assert params["lm_head"]["kernel"].shape == (c.hidden, c.vocab_size)
    tied = export_params(Llama(TINY, rngs=nnx.Rngs(0)))
    assert "lm_head" not in tied
    std = np.std(tied["layers"][0]["mlp"]["up_proj"]["kernel"])
    assert abs(std - TINY.init_std) < 0.2 * TINY.init_std
    with pytest.raises(ValueError, match="q_proj.kernel has shape"):
        bad = export_params(model)
        bad["layers"][0]["attn"]["q_proj"]["kernel"] = np.zeros((3, 3), np.float32)
        apply_pretrained(model, bad)
    with pytest.raises(ValueError, match="missing.*lm_head"):
        apply_pretrained(model, tied)
