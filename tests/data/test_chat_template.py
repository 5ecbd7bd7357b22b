"""Chat documents through a checkpoint's own Jinja chat template (jaxsb/data/chat.py): the
rendering is the template's, and exactly the assistant turns (content and end-of-turn markup)
are trained; templates that cannot be split into turns, or that fail, are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import tokenizers

from jaxsb.data import DataError, Document, Tokenizer, encode_document
from jaxsb.data.chat import render_with_spans

# ChatML as Qwen2.5 writes it, default system message included (written here, not copied).
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [("user", "What is 2+2?"), ("assistant", "4."), ("user", "And 3+3?"), ("assistant", "6, of course.")]


def bpe_with_specials() -> Tokenizer:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                             "<|im_end|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is two plus two? Four. You are a helpful assistant."] * 20, trainer)
    return Tokenizer(tok, bos_id=0, eos_id=0, chat_template=CHATML)


def test_template_rendering_and_assistant_spans():
    text, spans = render_with_spans(CHATML, MESSAGES)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert [text[s:e] for s, e in spans] == ["4.<|im_end|>\n", "6, of course.<|im_end|>\n"]


def test_only_assistant_tokens_train_and_specials_are_single_ids():
    tok = bpe_with_specials()
    ids, flags = encode_document(Document(origin="x.jsonl:1", messages=MESSAGES), tok)
    assert ids[-1] == tok.eos_id and not flags[-1]
    start, end = tok.special_id("<|im_start|>"), tok.special_id("<|im_end|>")
    assert list(ids).count(start) == 5 and list(ids).count(end) == 5, "markup tokens are the special ids"
    trained = tok.decode(ids[flags])
    assert trained == "4.<|im_end|>\n6, of course.<|im_end|>\n"
    runs = np.flatnonzero(np.diff(flags.astype(int)) != 0)
    assert len(runs) == 4, "two trained runs, one per assistant turn"


def test_without_a_template_chatml_by_id_is_kept():
    tok = bpe_with_specials()
    plain = Tokenizer(tok.hf, bos_id=0, eos_id=0)
    ids, flags = encode_document(Document(origin="x", messages=MESSAGES), plain)
    assert plain.decode(ids[flags]) == "4.<|im_end|>6, of course.<|im_end|>"


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>>{% endif %}",
     "does not render conversations incrementally at message 1"),
    ("{{ raise_exception('only user/assistant alternation') }}", "only user/assistant alternation"),
    ("{% for m in messages %}{{ m.nope }}{% endfor %}", "chat template failed"),
    ("{% for m in messages %}", "does not parse"),
])
def test_bad_templates_are_refused_with_the_document(template, words):
    tok = Tokenizer(bpe_with_specials().hf, bos_id=0, eos_id=0, chat_template=template)
    with pytest.raises(DataError) as e:
        encode_document(Document(origin="chats.jsonl:7", messages=MESSAGES), tok)
    assert "chats.jsonl:7" in str(e.value) and words in str(e.value), str(e.value)
