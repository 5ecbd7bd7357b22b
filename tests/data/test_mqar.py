"""MQAR examples (jaxsb/data/mqar.py) and the data.kind=mqar source, checked by brute force."""

import dataclasses

import numpy as np
import pytest

from jaxsb.config import ConfigError, DataConfig, MqarConfig, load_config
from jaxsb.data import byte_tokenizer, encode_document
from jaxsb.data.mqar import example, examples, pairs_for, recall_accuracy
from jaxsb.data.catalog import open_source
from jaxsb.data.sources import DataError
from jaxsb.data.stats import DataStats


@pytest.mark.parametrize("length, fraction, vocab", [(64, 0.125, 16), (257, 0.25, 256), (1023, 0.125, 256), (5, 0.5, 4)])
def test_every_key_is_queried_once_after_the_context_and_only_values_are_targets(length, fraction, vocab):
    tokens, targets = example(np.random.default_rng(1), length, fraction, vocab)
    P = pairs_for(length, fraction, vocab)
    assert tokens.shape == targets.shape == (length,) and 0 <= tokens.min() and tokens.max() < vocab
    keys, values = tokens[0:2 * P:2], tokens[1:2 * P:2]
    assert len(set(keys.tolist())) == P and keys.max() < vocab // 2 and values.min() >= vocab // 2
    at = np.flatnonzero(targets)
    assert len(at) == P and at.min() > 2 * P
    context = dict(zip(keys.tolist(), values.tolist()))
    assert sorted(tokens[at - 1].tolist()) == sorted(keys.tolist())  # each key once as a query
    assert (tokens < vocab // 2).sum() == 2 * P  # and nowhere else
    assert all(context[int(tokens[j - 1])] == tokens[j] for j in at)  # followed by its own value


@pytest.mark.parametrize("length, vocab, pairs", [(64, 16, 0), (64, 16, 9), (64, 256, 17), (16, 64, 5)])
def test_an_explicit_pairs_count_that_does_not_fit_is_refused(length, vocab, pairs):
    # the bound is min(vocab // 2 distinct keys, length // 4: the context and the queries)
    with pytest.raises(ValueError, match=f"{pairs} pairs do not fit an MQAR example of {length} tokens and {vocab} ids"):
        example(np.random.default_rng(0), length, 0.125, vocab, pairs=pairs)
    fits = min(vocab // 2, length // 4)
    tokens, targets = example(np.random.default_rng(0), length, 0.125, vocab, pairs=fits)
    assert targets.sum() == fits and tokens.shape == (length,)


def test_examples_are_a_function_of_the_seed():
    a, b = examples(3, [64, 128], 2, 0.25, 32), examples(3, [64, 128], 2, 0.25, 32)
    assert all((x[0] == y[0]).all() for x, y in zip(a, b))
    assert not (examples(4, [64], 1, 0.25, 32)[0][0] == a[0][0]).all()
    assert [len(t) for t, _ in a] == [64, 64, 128, 128]


def test_recall_accuracy_on_hand_cases():
    tokens = np.array([[1, 5, 1, 5, 9]])
    targets = np.array([[False, False, False, True, False]])
    assert recall_accuracy(np.array([[0, 0, 5, 0, 0]]), tokens, targets) == (1, 1)
    assert recall_accuracy(np.array([[5, 5, 0, 5, 5]]), tokens, targets) == (0, 1)


def test_source_documents_train_only_the_recalled_values():
    cfg = DataConfig(kind="mqar", max_len=128, mqar=MqarConfig(lengths=(64, 128), vocab=32))
    tok = byte_tokenizer()
    source = open_source(cfg, vocab_size=tok.vocab_size, eos_id=tok.eos_id)
    for unit, length in ((0, 64), (1, 128)):
        doc = source.read(unit, DataStats())
        ids, flags = encode_document(doc, tok)
        assert len(ids) == length and ids[-1] == tok.eos_id
        assert flags.sum() == pairs_for(length, 0.125, 32)  # the evaluation's pairs, one token less
        assert (flags == np.append(doc.targets, False)).all()


def test_source_refuses_a_vocabulary_that_does_not_fit():
    tok = byte_tokenizer()
    cfg = DataConfig(kind="mqar", max_len=64, mqar=MqarConfig(lengths=(64,), vocab=512))
    with pytest.raises(DataError, match="data.mqar.vocab=512"):
        open_source(cfg, vocab_size=tok.vocab_size, eos_id=tok.eos_id)
    cfg = dataclasses.replace(cfg, mqar=MqarConfig(lengths=(64,), vocab=260))
    with pytest.raises(DataError, match="eos id 258 lies inside"):
        open_source(cfg, vocab_size=tok.vocab_size, eos_id=tok.eos_id)


@pytest.mark.parametrize("override, field", [
    ("data.mqar.lengths=2048", "data.mqar.lengths"),  # longer than data.max_len
    ("data.mqar.vocab=15", "data.mqar.vocab"),
    ("data.mqar.kv_fraction=0.9", "data.mqar.kv_fraction"),
])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config("mqar", [override])


def test_mqar_config_needs_a_token_tokenizer():
    from jaxsb.data.tokenizer import build_tokenizer

    cfg = load_config("mqar", ["tokenizer.kind=bpe"])
    with pytest.raises(DataError, match="tokenizer.kind=bytes"):
        build_tokenizer(cfg.tokenizer, cfg.data, None)
