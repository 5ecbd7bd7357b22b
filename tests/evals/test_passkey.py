"""Passkey retrieval samples (jaxsb.evals.passkey), scoring (jaxsb.evals.scoring) and the stdlib
long-document list (jaxsb.evals.long_docs), with the byte tokenizer and a small trained BPE."""

import os

import pytest

from jaxsb.data.tokenizer import byte_tokenizer, train_bpe
from jaxsb.evals import passkey
from jaxsb.evals.long_docs import longest_stdlib_files
from jaxsb.evals.scoring import accuracy, accuracy_line, contains_answer

LENGTHS = [600, 2000]


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def tokenizer(request):
    if request.param == "bytes":
        return byte_tokenizer()
    texts = [passkey.INTRO, passkey.FILLER * 4, passkey.needle("12345"), passkey.QUESTION, "0123456789"]
    return train_bpe(texts, vocab_size=400)


def _repeats(sample):
    return sample.prompt.count(passkey.FILLER)


def _tokens(tok, text):
    return len(tok.encode(text))


def test_depths_spread_evenly_over_zero_to_one():
    assert passkey.depths(1) == [0.5]
    assert passkey.depths(4) == [0.125, 0.375, 0.625, 0.875]
    with pytest.raises(ValueError, match="n=0"):
        passkey.depths(0)


def test_samples_are_deterministic_from_the_seed(tokenizer):
    a = passkey.make_samples(tokenizer, LENGTHS, samples=3, seed=7)
    assert a == passkey.make_samples(tokenizer, LENGTHS, samples=3, seed=7)
    other = passkey.make_samples(tokenizer, LENGTHS, samples=3, seed=8)
    assert [s.key for s in a] != [s.key for s in other]
    assert [s.id for s in a] == [f"passkey-L{L}-d{d:.2f}" for L in LENGTHS for d in passkey.depths(3)]
    assert all(len(s.key) == 5 and 10000 <= int(s.key) <= 99999 for s in a)


def test_the_needle_holds_the_key_twice_and_starts_at_the_stated_token(tokenizer):
    for s in passkey.make_samples(tokenizer, LENGTHS, samples=5, seed=0):
        assert s.prompt.count(s.key) == 2
        assert s.prompt.count(passkey.needle(s.key)) == 1
        ids = tokenizer.encode(s.prompt)
        assert len(ids) == s.prompt_tokens
        after = tokenizer.decode(ids[s.needle_token_start:])
        assert after.lstrip().startswith(passkey.needle(s.key).lstrip()), (s.id, after[:40])
        assert s.prompt.startswith(passkey.INTRO) and s.prompt.endswith(passkey.QUESTION)


def test_the_needle_sits_at_the_stated_depth_of_the_filler(tokenizer):
    """Depth is measured over the filler: the needle is within one repeat of d * (filler tokens)."""
    per_repeat = _tokens(tokenizer, " " + passkey.FILLER)
    for s in passkey.make_samples(tokenizer, LENGTHS, samples=5, seed=0):
        intro = _tokens(tokenizer, passkey.INTRO)
        filler = s.prompt_tokens - intro - _tokens(tokenizer, passkey.needle(s.key) + passkey.QUESTION)
        assert abs(s.needle_token_start - intro - s.depth * filler) <= per_repeat, s.id


@pytest.mark.parametrize("reserve", [16, 100])
def test_prompts_fill_the_budget_but_one_more_repeat_would_not_fit(tokenizer, reserve):
    for s in passkey.make_samples(tokenizer, LENGTHS, samples=3, seed=1, reserve=reserve):
        assert s.prompt_tokens <= s.length - reserve
        k = _repeats(s)
        assert s.prompt == passkey.build_prompt(s.key, k, s.depth)
        longer = passkey.build_prompt(s.key, k + 1, s.depth)
        assert _tokens(tokenizer, longer) > s.length - reserve, s.id


def test_a_length_too_short_for_one_repeat_is_named():
    with pytest.raises(ValueError, match="length 100 is too short"):
        passkey.make_samples(byte_tokenizer(), [2000, 100], samples=1, seed=0)


def test_largest_fitting_finds_the_edge_from_any_guess():
    for edge in (1, 2, 9, 50):
        for guess in (1, 2, edge, edge + 1, 3 * edge, 1000):
            assert passkey._largest_fitting(lambda k, e=edge: k <= e, guess) == edge, (edge, guess)


def test_scoring_hand_cases():
    assert contains_answer("12345", " 12345. Remember")
    assert not contains_answer("12345", " 1234 5")
    assert contains_answer("  12345\n", "is 12345")
    with pytest.raises(ValueError, match="empty answer"):
        contains_answer("  ", "anything")
    assert accuracy([True, False, True, True]) == 0.75
    assert accuracy_line([True] * 11 + [False]) == "accuracy: 0.9167"
    assert passkey.accuracy_line is accuracy_line
    with pytest.raises(ValueError, match="empty list"):
        accuracy([])


def test_is_correct_takes_a_sample_or_an_answer():
    (s,) = passkey.make_samples(byte_tokenizer(), [600], samples=1, seed=0)
    assert passkey.is_correct(s, f" {s.key}.")
    assert passkey.is_correct(s.key, f"{s.key}")
    assert not passkey.is_correct(s, " 00000.")


def test_summary_and_table():
    samples = passkey.make_samples(byte_tokenizer(), [600, 800], samples=2, seed=0)
    correct = [True, False, True, True]
    summary = passkey.summarize(samples, correct)
    assert summary["accuracy"] == 0.75
    assert summary["by_length"] == {600: 0.5, 800: 1.0}
    assert summary["by_length_depth"] == {600: {0.25: 1.0, 0.75: 0.0}, 800: {0.25: 1.0, 0.75: 1.0}}
    lines = passkey.format_table(summary)
    assert len(lines) == 3
    assert lines[0].split() == ["length", "|", "d=0.25", "|", "d=0.75", "|", "all"]
    assert lines[1].split() == ["600", "|", "1.00", "|", "0.00", "|", "0.5000"]
    with pytest.raises(ValueError, match="4 samples but 3 results"):
        passkey.summarize(samples, correct[:3])


def test_longest_stdlib_files():
    files = longest_stdlib_files(3)
    assert len(files) == 3 and all(f.endswith(".py") and os.path.isfile(f) for f in files)
    sizes = [os.path.getsize(f) for f in files]
    assert sizes == sorted(sizes, reverse=True)
    assert not any(part in f.split(os.sep) for f in files for part in ("site-packages", "__pycache__"))
    with pytest.raises(ValueError, match="n=0"):
        longest_stdlib_files(0)
