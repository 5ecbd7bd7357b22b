"""Data pipeline: sources, bad-input policies, tokenizers, packing invariants, no silent loss, resume."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import tokenizers

from jaxsb.config import DataConfig, TokenizerConfig
from jaxsb.data import (
    ATTENTION_COST_C, DataError, DataIterator, DataStats, Document, Tokenizer, build_tokenizer, byte_tokenizer,
    StepPieces, cost, cut_pieces, encode_document, open_source, pack_rows,
)
from jaxsb.data.sources import render_chat

BYTES = byte_tokenizer()


# ----------------------------------------------------------------------------- helpers


def small_cfg(**kw) -> DataConfig:
    base = dict(max_len=256, tokens_per_step=1024, row_buckets=(64, 128, 256), seed=3)
    base.update(kw)
    return DataConfig(**base)


def write_corpus(root, n=40, seed=0, ext=".txt") -> list[str]:
    """Files of long-tailed lengths (a few bytes to a few thousand), deterministic."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    texts = []
    for i in range(n):
        size = int(min(4000, max(1, rng.lognormal(4.5, 1.3))))
        text = "".join(rng.choice(list("abcdefgh ijk\nxyzé"), size))
        texts.append(text)
        sub = os.path.join(root, f"d{i % 3}")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"f{i:03d}{ext}"), "w", encoding="utf-8") as f:
            f.write(text)
    return texts


def read_all(src):
    """Every document of one pass over a source, and the counters of that pass."""
    stats = DataStats()
    docs = [d for d in (src.read(u, stats) for u in range(len(src))) if d is not None]
    return docs, stats


def check_batch(batch, num_rows, buckets):
    """Packing invariants of one Batch."""
    R, T = batch.tokens.shape
    assert R == num_rows and T in buckets
    for a in (batch.tokens, batch.targets, batch.segment_ids, batch.positions):
        assert a.dtype == np.int32 and a.shape == (R, T)
    assert batch.loss_mask.dtype == np.float32
    assert batch.num_targets == int(batch.loss_mask.sum())
    lengths = []
    for r in range(R):
        seg = batch.segment_ids[r]
        used = int((seg > 0).sum())
        assert (seg[used:] == 0).all(), "padding only at the end of a row"
        assert (batch.loss_mask[r, used:] == 0).all()
        k = int(seg.max()) if used else 0
        assert sorted(set(seg[:used].tolist())) == list(range(1, k + 1))
        for s in range(1, k + 1):
            idx = np.flatnonzero(seg == s)
            assert (np.diff(idx) == 1).all(), "a document is contiguous within one row"
            n = idx.size
            lengths.append((r, n))
            assert (batch.positions[r, idx] == np.arange(n)).all()
            assert (batch.targets[r, idx[:-1]] == batch.tokens[r, idx[1:]]).all()
            assert batch.loss_mask[r, idx[-1]] == 0, "last token of a document has no target"
    assert sorted(lengths) == sorted(zip(batch.doc_rows, batch.doc_lengths))
    assert sum(batch.doc_lengths) == int((batch.segment_ids > 0).sum())


def assert_no_loss(it: DataIterator):
    s = it.stats
    tok_in_flight, tgt_in_flight = it.in_flight()
    assert s["targets_produced"] == (s["targets_packed"] + s["truncated_targets"] + s["dropped_long_targets"]
                                     + tgt_in_flight)
    overlap = s["split_pieces"] - s["split_docs"]  # split pieces share one token with their predecessor
    assert s["tokens_produced"] + overlap == (s["tokens_packed"] + s["truncated_tokens"] + s["dropped_long_tokens"]
                                              + tok_in_flight)


def same_batch(a, b):
    """Two steps hold the same data: packed rows (Batch) or a planned step's pieces (StepPieces)."""
    if isinstance(a, StepPieces):
        assert [p.ref for p in a.pieces] == [p.ref for p in b.pieces]
        for p, q in zip(a.pieces, b.pieces):
            np.testing.assert_array_equal(p.ids, q.ids)
            np.testing.assert_array_equal(p.flags, q.flags)
    else:
        for name in ("tokens", "targets", "segment_ids", "positions", "loss_mask"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.doc_lengths == b.doc_lengths and a.doc_origins == b.doc_origins and a.num_targets == b.num_targets


def iterator(cfg, layout: str, rows: int) -> tuple[DataIterator, object]:
    """An iterator and its step function: the rows path ("rows") or a planned step's pieces."""
    if layout == "rows":
        it = DataIterator(cfg, BYTES, rows)
        return it, it.next
    it = DataIterator(cfg, BYTES)
    return it, it.next_pieces


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_specials_are_text():
    s = "héllo wörld\n\tx = 1  # 🎉 <|endoftext|>"
    ids = BYTES.encode(s)
    assert ids == list(s.encode("utf-8")), "literal special-token text is encoded as bytes"
    assert BYTES.decode(ids) == s
    assert BYTES.vocab_size == 261 and BYTES.eos_id >= 256 and BYTES.bos_id >= 256 and BYTES.pad_id >= 256
    assert BYTES.decode([104, BYTES.eos_id]) == "h<|endoftext|>"


def test_bpe_trains_round_trips_and_reloads_from_workdir(tmp_path):
    write_corpus(tmp_path / "corpus", n=30)
    data = small_cfg(kind="text", path=str(tmp_path / "corpus"), extensions=(".txt",))
    tcfg = TokenizerConfig(kind="bpe", vocab_size=400, train_bytes=20_000)
    work = tmp_path / "run"
    tok = build_tokenizer(tcfg, data, str(work))
    assert (work / "tokenizer.json").is_file()
    assert 300 <= tok.vocab_size <= 400
    s = "abc défg\n  hijk xyz 🎉"
    assert tok.decode(tok.encode(s)) == s
    assert build_tokenizer(tcfg, data, None).hf.to_str() == tok.hf.to_str(), "training is deterministic"
    assert len(tok.encode("abc abc abc")) < len("abc abc abc".encode()), "merges compress"
    # Resume: the corpus changes, the saved tokenizer is used as is.
    write_corpus(tmp_path / "corpus", n=30, seed=9)
    again = build_tokenizer(dataclasses.replace(tcfg, kind="auto"), data, str(work))
    assert again.hf.to_str() == tok.hf.to_str()
    assert again.encode(s) == tok.encode(s) and (again.eos_id, again.bos_id) == (tok.eos_id, tok.bos_id)


def test_hf_tokenizer_from_path_and_errors(tmp_path):
    path = tmp_path / "tok"
    path.mkdir()
    BYTES.save(str(path / "tokenizer.json"))
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(path)), DataConfig(), None)
    assert tok.encode("ab") == [97, 98] and tok.eos_id == BYTES.eos_id
    with pytest.raises(DataError, match=r"missing\.json: no such tokenizer file"):
        build_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path / "missing.json")), DataConfig(), None)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=r"bad\.json: not a readable tokenizers JSON"):
        Tokenizer.from_file(str(bad))
    with pytest.raises(DataError, match="tokenizer.kind=model"):
        build_tokenizer(TokenizerConfig(kind="model"), DataConfig(), None)
    with pytest.raises(DataError, match="data.kind=tokens holds token ids, not text"):
        build_tokenizer(TokenizerConfig(kind="bpe"), DataConfig(kind="tokens", path="x.npz"), None)


def test_wraps_any_hf_tokenizer_with_given_ids():
    hf = tokenizers.Tokenizer.from_str(BYTES.hf.to_str())
    tok = Tokenizer(hf, bos_id=BYTES.bos_id, eos_id=BYTES.eos_id)
    assert tok.encode("hi") == [104, 105] and tok.pad_id == tok.eos_id
    assert not hf.encode_special_tokens, "the caller's tokenizer object is not modified"
    with pytest.raises(ValueError, match="eos_id=99999 outside"):
        Tokenizer(hf, bos_id=0, eos_id=99999)


# ----------------------------------------------------------------------------- sources


def test_stdlib_source_is_a_long_tailed_mix():
    src = open_source(DataConfig())
    assert len(src) > 500
    assert not any(part in f.split(os.sep) for f in src.files for part in ("site-packages", "__pycache__"))
    sizes = np.array([os.path.getsize(f) for f in src.files])
    assert sizes.max() > 100_000 and np.median(sizes) < 20_000 and sizes.max() / np.median(sizes) > 20
    stats = DataStats()
    lengths = []
    for unit in range(0, len(src), max(1, len(src) // 150)):
        doc = src.read(unit, stats)
        if doc is not None:
            lengths.append(len(encode_document(doc, BYTES)[0]))
    lengths = np.array(lengths)
    assert lengths.min() < 500 and lengths.max() > 20_000
    assert stats["files_read"] == len(range(0, len(src), max(1, len(src) // 150)))


def test_bpe_on_stdlib_sample(tmp_path):
    tok = build_tokenizer(TokenizerConfig(kind="auto", vocab_size=1024, train_bytes=300_000), DataConfig(),
                          str(tmp_path))
    src = open_source(DataConfig())
    text = src.read(0, DataStats()).text
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(text.encode()) / len(ids) > 2.0, "a BPE trained on Python code compresses Python code"


def test_stdlib_iterator_packs_long_tailed_batches():
    it = DataIterator(DataConfig(), BYTES, num_rows=4)
    for _ in range(5):
        check_batch(it.next(), 4, DataConfig().row_buckets)
    assert it.stats["split_docs"] + it.stats["docs_accepted"] > 0
    assert_no_loss(it)


def test_text_source_reads_tree_with_extension_filter(tmp_path):
    write_corpus(tmp_path, n=6)
    (tmp_path / "skip.md").write_text("not me")
    src = open_source(small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",)))
    assert len(src) == 6 and all(f.endswith(".txt") for f in src.files)
    assert len(open_source(small_cfg(kind="text", path=str(tmp_path), extensions=("*",)))) == 7


def test_holdout_largest_leaves_out_exactly_the_long_docs_evaluation_files(tmp_path):
    from jaxsb.evals.long_docs import longest_stdlib_files
    from jaxsb.config import ConfigError

    full, held = open_source(small_cfg(kind="stdlib")), open_source(small_cfg(kind="stdlib", holdout_largest=2))
    evaluated = longest_stdlib_files(2)
    assert held.held_out == evaluated and len(held) == len(full) - 2
    assert set(full.files) - set(held.files) == set(evaluated) and "the 2 largest held out" in held.describe()
    for i, name in enumerate(["a", "b", "c"]):  # text trees too; ties by path
        (tmp_path / f"{name}.txt").write_text("x" * (10 if name == "a" else 5))
    tree = open_source(small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",), holdout_largest=2))
    assert [os.path.basename(f) for f in tree.files] == ["c.txt"]
    with pytest.raises(DataError, match="holdout_largest=3 leaves none of its 3 files"):
        open_source(small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",), holdout_largest=3))
    with pytest.raises(ConfigError, match="data.holdout_largest"):
        DataConfig(kind="jsonl", path="x.jsonl", holdout_largest=1).validate()
    with pytest.raises(ConfigError, match="data.holdout_largest"):
        DataConfig(holdout_largest=-1).validate()


def test_text_source_errors_name_path_and_what_was_looked_for(tmp_path):
    (tmp_path / "a.md").write_text("x")
    with pytest.raises(DataError, match=rf"{tmp_path}: no files ending in \.txt, \.rst found"):
        open_source(small_cfg(kind="text", path=str(tmp_path), extensions=(".txt", ".rst")))
    with pytest.raises(DataError, match="nope: no such file or directory"):
        open_source(small_cfg(kind="text", path=str(tmp_path / "nope")))


def test_directory_without_usable_text_is_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\n")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    it = DataIterator(small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",)), BYTES, 2)
    with pytest.raises(DataError, match=r"files ending in \.txt \(3 found\): a whole pass found no usable"):
        it.next()
    assert it.stats["skipped_empty"] == 2 and it.stats["skipped_undecodable"] == 1


@pytest.mark.parametrize("policy", ["error", "skip", "replace"])
def test_undecodable_files(tmp_path, policy):
    (tmp_path / "good.txt").write_text("good text here")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 latin-1")
    (tmp_path / "empty.txt").write_bytes(b"")
    cfg = small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",), on_undecodable=policy)
    it = DataIterator(cfg, BYTES, 2)
    if policy == "error":
        with pytest.raises(DataError, match=r"bad\.txt: not valid UTF-8 at byte offset 3"):
            it.next()
        return
    docs, s = read_all(open_source(cfg))
    assert s["skipped_empty"] == 1 and s["files_read"] == 3
    if policy == "skip":
        assert s["skipped_undecodable"] == 1 and len(docs) == 1
        assert "bad.txt" in s.summary()
    else:
        assert s["replaced_undecodable"] == 1 and len(docs) == 2
        batch = it.next()
        assert "\ufffd" in BYTES.decode(batch.tokens[batch.segment_ids > 0])
    it.next()
    assert it.stats["skipped_undecodable" if policy == "skip" else "replaced_undecodable"] > 0


def write_jsonl(path, lines: list[str | bytes]):
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")


BAD_JSONL = {
    "invalid": ('{"text": "x"', r"expected a JSON object per line, got invalid JSON"),
    "not_object": ('["text"]', r"expected a JSON object, got list"),
    "missing": ('{"body": "x"}', r"expected a string field 'text'; the record has keys \['body'\]"),
    "wrong_type": ('{"text": 5}', r"expected field 'text' to be a string, got int"),
}


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_jsonl_malformed_error_names_path_line_and_expectation(tmp_path, case):
    line, message = BAD_JSONL[case]
    path = tmp_path / "d.jsonl"
    write_jsonl(path, ['{"text": "fine"}', "", line])
    it = DataIterator(small_cfg(kind="jsonl", path=str(path)), BYTES, 1)
    with pytest.raises(DataError, match=rf"d\.jsonl:3: {message}"):
        for _ in range(3):
            it.next()


def test_jsonl_skips_are_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    good = [json.dumps({"text": f"document number {i}", "id": i}) for i in range(5)]
    write_jsonl(path, good + ["", "   ", *(v[0] for v in BAD_JSONL.values()), '{"text": ""}', b'{"text": "\xff"}'])
    cfg = small_cfg(kind="jsonl", path=str(path), on_malformed="skip", on_undecodable="skip")
    docs, s = read_all(open_source(cfg))
    assert s["records_read"] == 13 and len(docs) == 5
    assert s["skipped_blank_lines"] == 2 and s["skipped_malformed"] == 4
    assert s["skipped_empty"] == 1 and s["skipped_undecodable"] == 1
    assert sorted(d.text for d in docs) == [f"document number {i}" for i in range(5)]
    assert [d.origin for d in docs] == [f"{path}:{i}" for i in range(1, 6)]
    it = DataIterator(cfg, BYTES, 1)
    it.next()
    assert it.stats["skipped_malformed"] >= 4 and "d.jsonl:" in it.stats.summary()


def test_jsonl_undecodable_error_gives_byte_offset(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, ['{"text": "ok"}', b'{"text": "\xff"}'])
    it = DataIterator(small_cfg(kind="jsonl", path=str(path), on_undecodable="error"), BYTES, 1)
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid UTF-8 at byte offset 25"):
        it.next()


def test_jsonl_directory_and_missing(tmp_path):
    (tmp_path / "a").mkdir()
    write_jsonl(tmp_path / "a" / "x.jsonl", ['{"text": "one"}'])
    write_jsonl(tmp_path / "y.jsonl", ['{"text": "two"}', '{"text": "three"}'])
    assert len(open_source(small_cfg(kind="jsonl", path=str(tmp_path)))) == 3
    with pytest.raises(DataError, match=r"missing: no such file or directory \(data.path for data.kind=jsonl\)"):
        open_source(small_cfg(kind="jsonl", path=str(tmp_path / "missing")))
    (tmp_path / "e").mkdir()
    with pytest.raises(DataError, match=r"e: no files ending in \.jsonl found"):
        open_source(small_cfg(kind="jsonl", path=str(tmp_path / "e")))


def chat_record(*turns):
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})


def test_chat_loss_only_on_assistant_tokens(tmp_path):
    path = tmp_path / "chat.jsonl"
    write_jsonl(path, [chat_record(("system", "be brief"), ("user", "hi?"), ("assistant", "hello!"),
                                   ("user", "2+2?"), ("assistant", "4")),
                       chat_record(("user", "no answer here"))])
    cfg = small_cfg(kind="chat", path=str(path), max_len=128, tokens_per_step=128, row_buckets=(128,))
    it = DataIterator(cfg, BYTES, 1)
    batch = it.next()
    check_batch(batch, 1, (128,))
    assert len(batch.doc_lengths) == 1
    assert it.stats["skipped_no_targets"] >= 1 and "chat.jsonl:2" in it.stats.summary()
    row = 0
    idx = np.flatnonzero(batch.segment_ids[row] == 1)
    tokens = batch.tokens[row, idx]
    text = BYTES.decode(tokens[:-1])
    assert text == render_chat([("system", "be brief"), ("user", "hi?"), ("assistant", "hello!"),
                                ("user", "2+2?"), ("assistant", "4")])
    assert tokens[-1] == BYTES.eos_id
    trained = batch.targets[row, idx][batch.loss_mask[row, idx] > 0]
    assert BYTES.decode(trained) == "hello!<|im_end|>4<|im_end|>"
    assert batch.num_targets == len("hello!") + 1 + 1 + 1


BAD_CHAT = {
    "no_messages": ('{"text": "x"}', "a 'messages' list of {'role', 'content'} objects, got no 'messages' key"),
    "bad_role": (chat_record(("robot", "x")), "messages\\[0\\].role in system, user, assistant, got 'robot'"),
    "bad_content": ('{"messages": [{"role": "user", "content": 3}]}', "messages\\[0\\].content to be a string"),
    "not_dict": ('{"messages": ["hi"]}', "messages\\[0\\] to be an object, got str"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_chat_malformed(tmp_path, case):
    line, message = BAD_CHAT[case]
    path = tmp_path / "c.jsonl"
    write_jsonl(path, [line])
    with pytest.raises(DataError, match=rf"c\.jsonl:1: expected {message}"):
        DataIterator(small_cfg(kind="chat", path=str(path)), BYTES, 1).next()
    write_jsonl(path, [line, chat_record(("user", "q"), ("assistant", "a"))])
    docs, stats = read_all(open_source(small_cfg(kind="chat", path=str(path), on_malformed="skip")))
    assert stats["skipped_malformed"] == 1 and len(docs) == 1
    assert docs[0].messages == [("user", "q"), ("assistant", "a")]


def test_tokens_source_npz_and_npy(tmp_path):
    eos = BYTES.eos_id
    tokens = np.array([5, 6, 7, 8, 9, 10, 11, eos, 12], dtype=np.int64)
    np.savez(tmp_path / "t.npz", tokens=tokens, offsets=np.array([0, 3, 3, 8, 9]))
    cfg = DataConfig(kind="tokens", path=str(tmp_path / "t.npz"), max_len=11, tokens_per_step=11, row_buckets=(11,))
    _, s = read_all(open_source(cfg, BYTES.vocab_size, eos))
    assert s["records_read"] == 4 and s["skipped_empty"] == 1
    it = DataIterator(cfg, BYTES, 1)
    batch = it.next()
    # docs: [5 6 7], [], [8 9 10 11 eos], [12]; eos appended unless already last, [12]+eos has 2 tokens.
    assert sorted(batch.doc_lengths) == [2, 4, 5]
    docs = sorted(batch.tokens[0][batch.segment_ids[0] == k].tolist() for k in range(1, 4))
    assert docs == sorted([[5, 6, 7, eos], [8, 9, 10, 11, eos], [12, eos]])
    np.save(tmp_path / "t.npy", np.array([1, 2, eos, eos, 3], dtype=np.int32))
    it = DataIterator(DataConfig(kind="tokens", path=str(tmp_path / "t.npy"), max_len=5, tokens_per_step=5,
                                 row_buckets=(5,)), BYTES, 1)
    batch = it.next()
    assert sorted(batch.doc_lengths) == [2, 3]  # [1 2 eos], [eos] (short), [3 eos]
    assert it.stats["skipped_short"] >= 1  # [eos] alone has no target
    assert "t.npy[doc 1]" in it.stats.summary()


@pytest.mark.parametrize("arrays,message", [
    (dict(tokens=np.array([1, 2, 999]), offsets=np.array([0])), r"token id 999 at index 2 is outside the vocab"),
    (dict(tokens=np.array([1, 2, 3]), offsets=np.array([0, 2, 1])), r"'offsets' must be non-decreasing; offsets\[1\]=2"),
    (dict(tokens=np.array([1, 2, 3]), offsets=np.array([0, 5])), r"'offsets' must lie in \[0, 3\]"),
    (dict(tokens=np.array([1, 2, 3])), r"expected arrays 'tokens' and 'offsets', found \['tokens'\]"),
    (dict(tokens=np.ones((2, 2), int), offsets=np.array([0])), r"expected 'tokens' to be a 1-D integer array"),
    (dict(tokens=np.array([1.0]), offsets=np.array([0])), r"1-D integer array, got shape \(1,\) dtype float64"),
])
def test_tokens_source_validation(tmp_path, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DataError, match=rf"bad\.npz: (expected .tokens. to be a )?{message}"):
        DataIterator(small_cfg(kind="tokens", path=str(tmp_path / "bad.npz")), BYTES, 1)


# ----------------------------------------------------------------------------- long documents


@pytest.mark.parametrize("policy", ["split", "truncate", "drop"])
def test_long_policy(policy):
    ids = np.arange(100, 100 + 23, dtype=np.int32)
    flags = np.ones(23, bool)
    flags[0] = False
    stats = DataStats()
    pieces = cut_pieces(ids, flags, "x", (0, 0), 8, policy, stats)
    if policy == "split":
        assert [len(p) for p in pieces] == [8, 8, 8, 2]
        assert stats["split_docs"] == 1 and stats["split_pieces"] == 4
        # Every next-token target of the document is trained exactly once.
        pairs = [(int(p.ids[i]), int(p.ids[i + 1])) for p in pieces for i in range(len(p) - 1) if p.flags[i + 1]]
        assert pairs == [(int(ids[i]), int(ids[i + 1])) for i in range(22)]
        assert [p.ref for p in pieces] == [(0, 0, k) for k in range(4)]
    elif policy == "truncate":
        assert [len(p) for p in pieces] == [8]
        assert stats["truncated_docs"] == 1 and stats["truncated_tokens"] == 15 and stats["truncated_targets"] == 15
    else:
        assert pieces == [] and stats["dropped_long_docs"] == 1 and stats["dropped_long_targets"] == 22


@pytest.mark.parametrize("policy", ["split", "truncate", "drop"])
def test_no_token_lost_across_epochs(tmp_path, policy):
    write_corpus(tmp_path, n=25)
    (tmp_path / "d0" / "empty.txt").write_text("")
    cfg = small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",), long_policy=policy)
    it = DataIterator(cfg, BYTES, num_rows=3)
    while it.stats["epochs_completed"] < 2:
        batch = it.next()
        check_batch(batch, 3, cfg.row_buckets)
        assert batch.num_tokens <= cfg.tokens_per_step
        assert all(n <= cfg.max_len for n in batch.doc_lengths)
        assert_no_loss(it)
    assert it.stats["skipped_empty"] == 2
    key = {"split": "split_docs", "truncate": "truncated_docs", "drop": "dropped_long_docs"}[policy]
    assert it.stats[key] > 0


@pytest.mark.parametrize("rows", [1, 3])
def test_one_epoch_trains_every_target_exactly_once(tmp_path, rows):
    texts = write_corpus(tmp_path, n=20)
    cfg = small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",), max_len=128)
    it = DataIterator(cfg, BYTES, num_rows=rows)
    trained: dict[str, list[tuple[int, list[int]]]] = {}
    while it.stats["epochs_completed"] < 2:  # by then every epoch-0 piece has been packed
        batch = it.next()
        for k, (r, ref, origin) in enumerate(zip(batch.doc_rows, batch.doc_refs, batch.doc_origins)):
            if ref[0] != 0:
                continue
            seg = 1 + sum(1 for rr in batch.doc_rows[:k] if rr == r)
            idx = np.flatnonzero(batch.segment_ids[r] == seg)
            pairs = [int(t) for t, m in zip(batch.targets[r, idx], batch.loss_mask[r, idx]) if m]
            trained.setdefault(origin, []).append((ref[2], pairs))
    by_name = {os.path.basename(o): sorted(v) for o, v in trained.items()}
    for i, text in enumerate(texts):
        name = f"f{i:03d}.txt"
        if not text.strip():
            assert name not in by_name
            continue
        pieces = by_name[name]
        assert [p for p, _ in pieces] == list(range(len(pieces))), "each piece exactly once"
        assert sum((t for _, t in pieces), []) == list(text.encode())[1:] + [BYTES.eos_id]


# ----------------------------------------------------------------------------- packing


def test_pack_rows_picks_the_smallest_bucket_that_fits_then_carries():
    p = pack_rows([3, 3, 3], 2, (4, 8, 16))
    assert p.row_len == 8 and p.unplaced == [] and sorted(map(len, p.rows)) == [1, 2]
    p = pack_rows([5, 5, 5], 2, (4, 8, 16))  # 8 is the lower bound but cannot hold three 5s in two rows
    assert p.row_len == 16 and p.unplaced == []
    p = pack_rows([5, 5, 5, 5, 3], 2, (12, 24))  # 20 of 24 slots filled at T=12: carry the 3
    assert p.row_len == 12 and p.unplaced == [4]
    p = pack_rows([5, 5, 5, 5, 3], 2, (12, 24), min_fill=0.9)  # not full enough: longer bucket
    assert p.row_len == 24 and p.unplaced == []
    p = pack_rows([5, 5, 5], 2, (8,))
    assert p.unplaced == [2] and p.row_len == 8
    p = pack_rows([5, 5, 5], 2, (8,), priority=[0, 0, 1])
    assert p.unplaced == [1], "carried (priority) items are placed first"


def test_cost_balance_beats_count_round_robin():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.0, 1.4, 64).astype(int), 2, 2048).tolist()
    R = 8
    p = pack_rows(lengths, R, (4096, 8192, 16384))
    assert p.unplaced == []
    lpt = [sum(cost(lengths[i]) for i in row) for row in p.rows]
    rr = [sum(cost(lengths[i]) for i in range(r, len(lengths), R)) for r in range(R)]
    assert max(lpt) / np.mean(lpt) < 1.1
    assert max(lpt) / np.mean(lpt) < max(rr) / np.mean(rr) - 0.2
    assert ATTENTION_COST_C == 2048 and cost(2048) == 4096


def test_stdlib_lengths_balance_better_than_round_robin():
    src = open_source(DataConfig())
    stats = DataStats()
    lengths = []
    for unit in range(0, len(src), 7):
        doc = src.read(unit, stats)
        if doc is not None:
            lengths.append(min(len(doc.text.encode()) + 1, 2048))
        if len(lengths) == 48:
            break
    R = 8
    p = pack_rows(lengths, R, (2048, 4096, 8192, 16384))
    lpt = [sum(cost(lengths[i]) for i in row) for row in p.rows]
    rr = [sum(cost(lengths[i]) for i in range(r, len(lengths), R)) for r in range(R)]
    assert max(lpt) < max(rr)


def test_carry_when_pieces_do_not_fit_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [json.dumps({"text": chr(97 + i % 26) * 39}) for i in range(12)])  # 40 tokens each
    cfg = DataConfig(kind="jsonl", path=str(path), max_len=64, tokens_per_step=128, row_buckets=(64,), seed=1)
    it = DataIterator(cfg, BYTES, num_rows=2)  # 3 documents per step by budget, 2 rows of 64 hold only 2
    first = it.next()
    assert len(first.doc_lengths) == 2 and it.stats["carried_pieces"] == 1
    carried = it.state()["carry"]
    assert len(carried) == 1 and tuple(carried[0]) not in first.doc_refs
    second = it.next()
    assert tuple(carried[0]) in second.doc_refs, "the carried piece is packed first in the next step"
    assert len(second.doc_lengths) == 2
    for _ in range(20):
        check_batch(it.next(), 2, (64,))
        assert_no_loss(it)


def test_planned_steps_take_pieces_unpacked_and_lose_none(tmp_path):
    """next_pieces(): a planned step gets the pieces in reading order up to data.tokens_per_step
    (never the rows' capacity), nothing is carried, every target of an epoch comes exactly once,
    and where the rows path carries nothing both paths hand out the same pieces."""
    texts = write_corpus(tmp_path, n=20)
    cfg = small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",), max_len=128, tokens_per_step=512)
    it = DataIterator(cfg, BYTES)
    with pytest.raises(ValueError, match="num_rows"):
        it.next()
    seen: dict[str, list[tuple[int, list[int]]]] = {}
    steps = []
    while it.stats["epochs_completed"] < 1:
        step = it.next_pieces()
        steps.append(step)
        assert step.num_tokens <= cfg.tokens_per_step or len(step.pieces) == 1
        assert it.state()["carry"] == [] and it.stats["carried_pieces"] == 0
        assert_no_loss(it)
        for p in step.pieces:
            if p.ref[0] == 0:
                seen.setdefault(os.path.basename(p.origin), []).append(
                    (p.ref[2], [int(t) for t, m in zip(p.ids[1:], p.flags[1:]) if m]))
    refs = [p.ref for s in steps for p in s.pieces]
    assert refs == sorted(refs), "reading order"
    for i, text in enumerate(texts):
        pieces = sorted(seen.get(f"f{i:03d}.txt", []))
        if text.strip():
            assert sum((t for _, t in pieces), []) == list(text.encode())[1:] + [BYTES.eos_id]
    # 8 rows of 512 hold any 512 tokens: the rows path carries nothing and takes the same pieces
    rows = DataIterator(dataclasses.replace(cfg, row_buckets=(512,)), BYTES, 8)
    for step in steps[:6]:
        batch = rows.next()
        assert sorted(batch.doc_refs) == step.doc_refs and batch.num_targets == step.num_targets
    assert rows.stats["carried_pieces"] == 0


# ----------------------------------------------------------------------------- determinism and resume


def test_deterministic_and_reshuffled_per_epoch(tmp_path):
    write_corpus(tmp_path, n=15)
    cfg = small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",))
    a, b = DataIterator(cfg, BYTES, 2), DataIterator(cfg, BYTES, 2)
    for _ in range(6):
        same_batch(a.next(), b.next())
    c = DataIterator(dataclasses.replace(cfg, seed=4), BYTES, 2)
    a = DataIterator(cfg, BYTES, 2)
    assert a.next().doc_origins != c.next().doc_origins
    src = open_source(cfg)
    from jaxsb.data.sources import epoch_permutation
    assert epoch_permutation(len(src), 3, 0).tolist() != epoch_permutation(len(src), 3, 1).tolist()


@pytest.mark.parametrize("kind, layout", [("text", "rows"), ("carry", "rows"), ("text", "pieces")])
def test_resume_is_exact_mid_epoch_and_across_epoch_boundary(tmp_path, kind, layout):
    if kind == "text":
        write_corpus(tmp_path, n=12)
        cfg = small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",), max_len=128,
                        tokens_per_step=384, row_buckets=(64, 128))
        rows = 2
    else:
        path = tmp_path / "d.jsonl"
        write_jsonl(path, [json.dumps({"text": "x" * (34 + i % 11)}) for i in range(9)])
        cfg = DataConfig(kind="jsonl", path=str(path), max_len=64, tokens_per_step=128, row_buckets=(64,), seed=2)
        rows = 2
    ref, step = iterator(cfg, layout, rows)
    batches, states = [], []
    while ref.stats["epochs_completed"] < 3:
        states.append(json.loads(json.dumps(ref.state())))
        batches.append(step())
    boundary = [i for i in range(1, len(states)) if states[i]["position"][0] != states[i - 1]["position"][0]]
    assert boundary, "the run crosses an epoch boundary"
    if kind == "carry":
        assert any(s["carry"] for s in states), "some saved states hold carried pieces"
    for start in sorted({1, len(states) // 2, boundary[0], boundary[0] - 1, len(states) - 2}):
        it, step = iterator(cfg, layout, rows)
        it.restore(states[start])
        for i in range(start, min(start + 4, len(batches))):
            same_batch(step(), batches[i])
            assert it.state()["stats"] == (states[i + 1]["stats"] if i + 1 < len(states) else ref.state()["stats"])
    assert len(json.dumps(states[-1])) < 4000, "state is small"


def test_restore_rejects_different_data(tmp_path):
    write_corpus(tmp_path, n=5)
    cfg = small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",))
    it = DataIterator(cfg, BYTES, 2)
    it.next()
    state = it.state()
    other = DataIterator(dataclasses.replace(cfg, seed=99), BYTES, 2)
    with pytest.raises(DataError, match="seed: saved 3 now 99"):
        other.restore(state)


def test_stats_summary_and_as_dict(tmp_path):
    write_corpus(tmp_path, n=10)
    (tmp_path / "e.txt").write_text("")
    it = DataIterator(small_cfg(kind="text", path=str(tmp_path), extensions=(".txt",)), BYTES, 2)
    for _ in range(3):
        it.next()
    text = it.stats.summary()
    assert text.count("\n") >= 5
    for word in ("read:", "accepted:", "skipped:", "long documents:", "packed:"):
        assert word in text
    d = it.stats.as_dict()
    assert d["steps"] == 3 and all(isinstance(v, int) for v in d.values())
    json.dumps(it.state())


def test_encode_document_flags():
    ids, flags = encode_document(Document(origin="x", text="ab"), BYTES)
    assert ids.tolist() == [97, 98, BYTES.eos_id] and flags.tolist() == [False, True, True]
    ids, flags = encode_document(Document(origin="x", ids=np.array([1, BYTES.eos_id], np.int32)), BYTES)
    assert ids.tolist() == [1, BYTES.eos_id]
