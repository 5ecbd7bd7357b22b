"""Parquet files and Hugging Face `datasets` directories as sources, written by those tools
themselves (pyarrow's Parquet writer, `Dataset.save_to_disk`) and read back row for row against
what was written; bad input names the file and row, or is skipped and counted."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxsb.config import DataConfig
from jaxsb.data import DataError, DataIterator, DataStats, byte_tokenizer, open_source
from jaxsb.data.sources import render_chat

BYTES = byte_tokenizer()


def small_cfg(**kw) -> DataConfig:
    return DataConfig(**(dict(max_len=256, tokens_per_step=1024, row_buckets=(64, 128, 256), seed=3) | kw))


def read_all(src):
    """Every document of one pass over a source in unit order, and that pass's counters."""
    stats = DataStats()
    return [d for d in (src.read(u, stats) for u in range(len(src))) if d is not None], stats


def texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list("abc xyz\né"), int(rng.integers(5, 300)))) for _ in range(n)]


def chats(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i} " * (i + 1)}]
            for i in range(n)]


def write_parquet(path, columns: dict, row_group_size: int = 7) -> None:
    pq.write_table(pa.table(columns), str(path), row_group_size=row_group_size)


def test_parquet_rows_read_back_as_written_across_files_and_row_groups(tmp_path):
    a, b = texts(30, 0), texts(11, 1)
    (tmp_path / "sub").mkdir()
    write_parquet(tmp_path / "a.parquet", {"text": a, "n": list(range(30))})
    write_parquet(tmp_path / "sub" / "b.parquet", {"text": b})
    src = open_source(small_cfg(kind="parquet", path=str(tmp_path)))
    assert len(src) == 41
    order = np.random.default_rng(0).permutation(41)  # random access across row groups
    stats = read_all(src)[1]
    got = {int(u): src.read(int(u), stats) for u in order}
    assert [got[u].text for u in range(41)] == a + b
    assert got[32].origin == f"{tmp_path / 'sub' / 'b.parquet'}[row 2]"
    assert "parquet" in src.describe() and "41 rows" in src.describe()


def test_parquet_chat_rows_and_training_targets(tmp_path):
    write_parquet(tmp_path / "c.parquet", {"messages": chats(3)})
    cfg = small_cfg(kind="parquet", record="chat", path=str(tmp_path / "c.parquet"))
    docs, _ = read_all(open_source(cfg))
    assert [d.messages for d in docs] == [[("user", f"q{i}"), ("assistant", f"a{i} " * (i + 1))] for i in range(3)]
    batch = DataIterator(cfg, BYTES, 1).next()  # the assistant turns are the only targets
    trained = batch.targets[batch.loss_mask > 0]
    assert BYTES.decode(trained).count("<|im_end|>") >= 1
    assert render_chat(docs[0].messages).startswith("<|im_start|>user\nq0")


BAD_PARQUET = {
    "missing_column": ({"body": ["x"]}, {}, r"no column 'text' \(data.text_field\); the table has columns \['body'\]"),
    "wrong_type": ({"text": [1, 2]}, {}, r"column 'text' must hold strings \(data.record=text\), got int64"),
    "chat_not_list": ({"messages": ["hi"]}, {"record": "chat"},
                      r"column 'messages' must be a list of \{role, content\}"),
}


@pytest.mark.parametrize("case", sorted(BAD_PARQUET))
def test_parquet_bad_columns_name_file_and_column(tmp_path, case):
    columns, kw, message = BAD_PARQUET[case]
    write_parquet(tmp_path / "bad.parquet", columns)
    with pytest.raises(DataError, match=rf"bad\.parquet: {message}"):
        open_source(small_cfg(kind="parquet", path=str(tmp_path / "bad.parquet"), **kw))


def test_parquet_null_and_malformed_rows_error_or_are_counted(tmp_path):
    write_parquet(tmp_path / "t.parquet", {"text": ["good", None, "  ", "also good"]})
    cfg = small_cfg(kind="parquet", path=str(tmp_path / "t.parquet"))
    with pytest.raises(DataError, match=r"t\.parquet\[row 1\]: expected a value in column 'text', got null; "
                                        r"set data.on_malformed=skip"):
        read_all(open_source(cfg))
    docs, stats = read_all(open_source(small_cfg(kind="parquet", path=str(tmp_path / "t.parquet"),
                                                 on_malformed="skip")))
    assert [d.text for d in docs] == ["good", "also good"]
    assert stats["skipped_malformed"] == 1 and stats["skipped_empty"] == 1 and stats["records_read"] == 4
    bad_role = [[{"role": "robot", "content": "x"}], [{"role": "user", "content": "q"}]]
    write_parquet(tmp_path / "c.parquet", {"messages": bad_role})
    with pytest.raises(DataError, match=r"c\.parquet\[row 0\]: expected messages\[0\]\.role in system, user, "
                                        r"assistant, got 'robot'"):
        read_all(open_source(small_cfg(kind="parquet", record="chat", path=str(tmp_path / "c.parquet"))))


def test_parquet_missing_empty_and_not_parquet(tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        open_source(small_cfg(kind="parquet", path=str(tmp_path / "nope")))
    with pytest.raises(DataError, match="no files ending in .parquet"):
        open_source(small_cfg(kind="parquet", path=str(tmp_path)))
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"x\.parquet: not a readable Parquet file"):
        open_source(small_cfg(kind="parquet", path=str(tmp_path)))


def test_datasets_save_to_disk_dataset_and_dataset_dict(tmp_path):
    a = texts(25, 2)
    ds = datasets.Dataset.from_dict({"text": a, "id": list(range(25))})
    ds.save_to_disk(str(tmp_path / "one"), max_shard_size=2000)  # several Arrow shards
    src = open_source(small_cfg(kind="datasets", path=str(tmp_path / "one")))
    assert len(src.parts) > 1
    assert [d.text for d in read_all(src)[0]] == a
    reference = datasets.load_from_disk(str(tmp_path / "one"))  # the tool's own reader agrees
    assert [reference[i]["text"] for i in range(len(reference))] == a
    # shuffled: save_to_disk stores the rows in the shuffled order
    shuffled = ds.shuffle(seed=1)
    shuffled.save_to_disk(str(tmp_path / "shuffled"))
    docs = read_all(open_source(small_cfg(kind="datasets", path=str(tmp_path / "shuffled"))))[0]
    assert [d.text for d in docs] == shuffled["text"]

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"messages": chats(4)}),
                               "test": datasets.Dataset.from_dict({"messages": chats(2)})})
    dd.save_to_disk(str(tmp_path / "dict"))
    cfg = small_cfg(kind="datasets", record="chat", path=str(tmp_path / "dict"), split="test")
    docs = read_all(open_source(cfg))[0]
    assert [d.messages for d in docs] == [[("user", f"q{i}"), ("assistant", f"a{i} " * (i + 1))] for i in range(2)]
    assert "test" in docs[0].origin and docs[1].origin.endswith("[row 1]")
    with pytest.raises(DataError, match=r"a DatasetDict without split 'validation' \(data.split\); "
                                        r"it has \['train', 'test'\]"):
        open_source(small_cfg(kind="datasets", record="chat", path=str(tmp_path / "dict"), split="validation"))
    with pytest.raises(DataError, match=r"no column 'text' \(data.text_field\); the table has columns \['messages'\]"):
        open_source(small_cfg(kind="datasets", path=str(tmp_path / "dict")))


def test_datasets_not_a_saved_dataset(tmp_path):
    with pytest.raises(DataError, match="no such directory"):
        open_source(small_cfg(kind="datasets", path=str(tmp_path / "nope")))
    with pytest.raises(DataError, match="no state.json; data.kind=datasets expects a directory written by"):
        open_source(small_cfg(kind="datasets", path=str(tmp_path)))
    (tmp_path / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    (tmp_path / "data-00000-of-00001.arrow").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"data-00000-of-00001\.arrow: not a readable Arrow stream file"):
        open_source(small_cfg(kind="datasets", path=str(tmp_path)))
    (tmp_path / "state.json").write_text('{"files": []}')
    with pytest.raises(DataError, match=r"state\.json: expected '_data_files'"):
        open_source(small_cfg(kind="datasets", path=str(tmp_path)))


def test_table_source_resumes_exactly(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": texts(60, 3)})
    cfg = small_cfg(kind="parquet", path=str(tmp_path / "a.parquet"))
    it = DataIterator(cfg, BYTES, 2)
    for _ in range(3):
        it.next()
    state = it.state()
    want = [it.next().tokens for _ in range(3)]
    again = DataIterator(cfg, BYTES, 2)
    again.restore(state)
    for w in want:
        np.testing.assert_array_equal(again.next().tokens, w)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_the_documented_train_commands_on_tables(tmp_path, kind):
    """docs/data.md's commands with tiny settings: a chat table trains (loss on the assistant
    turns), through the CLI as a user runs it."""
    from jaxsb.train import main

    rows = chats(40)
    if kind == "parquet":
        write_parquet(tmp_path / "chats.parquet", {"messages": rows})
        path = tmp_path / "chats.parquet"
    else:
        saved = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"messages": rows})})
        saved.save_to_disk(str(tmp_path / "saved"))
        path = tmp_path / "saved"
    work = tmp_path / "run"
    assert main(["--config", "tiny", "--workdir", str(work), "--set", f"data.kind={kind}", "--set", f"data.path={path}",
                 "--set", "data.record=chat", "--set", "train.steps=2", "--set", "tokenizer.kind=bytes",
                 "--set", "data.tokens_per_step=512", "--set", "parallel.planner=none",
                 "--set", "train.report=false"]) == 0
    records = [json.loads(line) for line in open(work / "metrics.jsonl")]
    assert len(records) == 2 and all(0 < r["targets"] < r["tokens"] for r in records)
