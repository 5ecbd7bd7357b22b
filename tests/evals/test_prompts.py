"""`--prompts FILE.jsonl` (jaxsb.evals.prompts): loading, every error path naming file:line,
the context-length check and the results file."""

import json

import pytest

from jaxsb.data.tokenizer import byte_tokenizer
from jaxsb.evals.prompts import (
    PromptRecord,
    PromptsError,
    check_lengths,
    load_prompts,
    write_results,
)


def _write(tmp_path, text, name="p.jsonl", mode="w"):
    path = tmp_path / name
    if mode == "wb":
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def test_loads_records_skipping_blank_lines(tmp_path):
    path = _write(tmp_path, '{"prompt": "Q1", "answer": "A1", "id": 7}\n\n  \n'
                            '{"prompt": "Q2 \u2028 x", "answer": "A2"}\r\n{"prompt": "Q3", "answer": "A3", "id": "x"}')
    assert load_prompts(path) == [PromptRecord("7", "Q1", "A1", 1), PromptRecord("line4", "Q2 \u2028 x", "A2", 4),
                                  PromptRecord("x", "Q3", "A3", 5)]


BAD_FILES = {
    "missing prompt": ('{"prompt": "q", "answer": "a"}\n{"answer": "a"}\n', 2, 'missing "prompt"'),
    "missing answer": ('{"prompt": "q"}\n', 1, 'missing "answer"'),
    "bad json": ('{"prompt": "q", "answer": "a"}\n{"prompt": "q",\n', 2, "bad JSON"),
    "not an object": ('["q", "a"]\n', 1, "not a JSON object \\(got list\\)"),
    "non-string prompt": ('{"prompt": 3, "answer": "a"}\n', 1, '"prompt" must be a string, got int'),
    "non-string answer": ('{"prompt": "q", "answer": null}\n', 1, '"answer" must be a string, got NoneType'),
    "empty prompt": ('{"prompt": "", "answer": "a"}\n', 1, '"prompt" is empty'),
    "empty answer": ('{"prompt": "q", "answer": "  "}\n', 1, '"answer" is empty'),
    "bad id": ('{"prompt": "q", "answer": "a", "id": true}\n', 1, '"id" must be a string or an integer'),
    "duplicate id": ('{"prompt": "q", "answer": "a", "id": 1}\n\n{"prompt": "r", "answer": "b", "id": "1"}\n', 3,
                     "duplicate id '1' \\(first on line 1\\)"),
    "default id taken": ('{"prompt": "q", "answer": "a", "id": "line2"}\n{"prompt": "r", "answer": "b"}\n', 2,
                         "duplicate id 'line2'"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_each_bad_record_names_file_and_line(tmp_path, case):
    text, line, what = BAD_FILES[case]
    path = _write(tmp_path, text)
    with pytest.raises(PromptsError, match=f"^{path}:{line}: {what}"):
        load_prompts(path)


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_a_file_without_records_is_an_error(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(PromptsError, match=f'^{path}: no records \\(expected JSON lines with "prompt" and "answer"\\)'):
        load_prompts(path)


def test_unreadable_and_non_utf8_files_are_named(tmp_path):
    missing = str(tmp_path / "absent.jsonl")
    with pytest.raises(PromptsError, match=f"^{missing}: cannot read"):
        load_prompts(missing)
    path = _write(tmp_path, b'{"prompt": "q", "answer": "a"}\n{"prompt": "\xff"}\n', mode="wb")
    with pytest.raises(PromptsError, match=f"^{path}: not valid UTF-8 at byte offset 43 \\(line 2"):
        load_prompts(path)
    with pytest.raises(PromptsError, match=f"^{tmp_path}: cannot read"):
        load_prompts(str(tmp_path))  # a directory


def test_check_lengths_returns_ids_and_names_an_over_long_prompt(tmp_path):
    tok = byte_tokenizer()
    records = [PromptRecord("a", "x" * 10, "y", 1), PromptRecord("b", "x" * 20, "y", 3)]
    ids = check_lengths(records, tok, max_tokens=28, max_new_tokens=8, path="p.jsonl")
    assert ids == [tok.encode("x" * 10), tok.encode("x" * 20)]
    with pytest.raises(PromptsError, match="^p.jsonl:3: prompt is 20 tokens; with --max-new-tokens 9 it needs "
                                           "29 > the model's context 28$"):
        check_lengths(records, tok, max_tokens=28, max_new_tokens=9, path="p.jsonl")


def test_check_lengths_rejects_a_prompt_with_no_tokens():
    class Empty:
        def encode(self, text):
            return []

    with pytest.raises(PromptsError, match="^p.jsonl:4: prompt encodes to no tokens"):
        check_lengths([PromptRecord("a", "q", "a", 4)], Empty(), max_tokens=10, max_new_tokens=1, path="p.jsonl")


def test_write_results_round_trip(tmp_path):
    records = load_prompts(_write(tmp_path, '{"prompt": "Q1", "answer": "A1"}\n{"prompt": "Q2", "answer": "é"}\n'))
    out = str(tmp_path / "results.jsonl")
    write_results(out, records, [" A1 yes", " no"], [True, False])
    with open(out, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert rows == [{"id": "line1", "answer": "A1", "continuation": " A1 yes", "correct": True},
                    {"id": "line2", "answer": "é", "continuation": " no", "correct": False}]
    with pytest.raises(ValueError, match="2 records, 1 continuations"):
        write_results(out, records, ["x"], [True])
