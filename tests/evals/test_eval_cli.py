"""`python -m jaxsb.eval`'s tasks end to end on a tiny Hugging Face checkpoint (main() in this
process): passkey, --prompts, --long-docs, their error paths, and the attention-work report."""

import json
import os

import pytest

from jaxsb.eval import main

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "hf_fixtures", "llama-hf5")
TINY = ["--set", f"model.init=hf:{FIXTURE}", "--set", "data.max_len=256"]
SPARSE = ["--set", "model.attention=sparse", "--set", "model.sparse.block_size=32"]


def _run(capsys, *args):
    code = main([*TINY, *args])
    out, err = capsys.readouterr()
    return code, out.strip().splitlines(), err


def test_passkey_prints_the_table_work_and_accuracy(capsys, tmp_path):
    out = tmp_path / "results.jsonl"
    summary = tmp_path / "summary.json"
    code, lines, err = _run(capsys, "--task", "passkey", "--lengths", "512,768", "--samples", "2",
                            "--context", "1024", "--max-new-tokens", "4", "--out", str(out), "--summary", str(summary))
    assert code == 0, err
    assert lines[0].split()[0] == "length" and lines[1].split()[0] == "512" and lines[2].split()[0] == "768"
    assert lines[-2].startswith("attention work: 1.0000 of dense")
    assert lines[-1].startswith("accuracy: ")
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == 4 and all(len(r["answer"]) == 5 for r in records)
    s = json.loads(summary.read_text())
    assert s["accuracy"] == float(lines[-1].split()[-1]) and set(s["by_length"]) == {"512", "768"}


def test_sparse_passkey_reports_less_work_and_the_floor(capsys):
    code, lines, err = _run(capsys, *SPARSE, "--set", "model.sparse.top_k=4", "--set", "model.sparse.policy=floor",
                            "--set", "model.sparse.coverage_drop=0.1", "--task", "passkey", "--lengths", "512",
                            "--samples", "1", "--context", "1024", "--max-new-tokens", "2")
    assert code == 0, err
    work = next(x for x in lines if x.startswith("attention work:"))
    assert float(work.split()[2]) < 1.0
    assert any(x.startswith("routing coverage: ") for x in lines)
    assert any(x.startswith("floor: budget 1.00 planned") for x in lines)


def test_passkey_longer_than_the_context_is_refused(capsys):
    code, _, err = _run(capsys, "--task", "passkey", "--lengths", "512")
    assert code == 2 and "[512] exceed the model's context 256" in err


def test_prompts_counts_answers_in_continuations(capsys, tmp_path):
    """A first run finds the (deterministic, greedy) continuations; a second asks for part of one
    of them as the answer, and for a string no continuation has."""
    prompts = ["def f(x):\n    return", "import os\nimport"]
    path, out = tmp_path / "p.jsonl", tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "never-said"}) + "\n" for p in prompts))
    code, lines, err = _run(capsys, "--prompts", str(path), "--max-new-tokens", "4", "--out", str(out))
    assert code == 0 and lines[-1] == "accuracy: 0.0000", err
    said = json.loads(out.read_text().splitlines()[1])["continuation"].strip()
    assert said, "the tiny model generated only whitespace"
    path.write_text(json.dumps({"prompt": prompts[0], "answer": "never-said", "id": "a"}) + "\n\n"
                    + json.dumps({"prompt": prompts[1], "answer": said[:2]}) + "\n")
    code, lines, err = _run(capsys, "--prompts", str(path), "--max-new-tokens", "4", "--out", str(out))
    assert code == 0, err
    assert lines[0].startswith("a: wrong") and lines[-1] == "accuracy: 0.5000"
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "line3"] and [r["correct"] for r in rows] == [False, True]


@pytest.mark.parametrize("content, expected", [
    ("", ":"),
    ('{"prompt": "x"}\n', ":1: missing \"answer\""),
    ('{"prompt": "x", "answer": "y"}\n{bad\n', ":2: bad JSON"),
    ('{"prompt": "' + "x" * 400 + '", "answer": "y"}\n', ":1: prompt is"),
])
def test_prompts_errors_name_the_file_and_line(capsys, tmp_path, content, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    code, _, err = _run(capsys, "--prompts", str(path))
    assert code == 2 and f"{path}{expected}" in err, err


def test_long_docs_scores_the_longest_stdlib_files_and_counts_the_cut(capsys):
    code, lines, err = _run(capsys, "--long-docs", "1", "--max-doc-tokens", "300")
    assert code == 0, err
    assert ".py: tokens 300 (scored 299; " in lines[0] and "more not scored), perplexity " in lines[0]
    assert lines[-1].startswith("perplexity: ")


def test_text_error_names_the_file(capsys, tmp_path):
    code, _, err = _run(capsys, "--text", str(tmp_path / "missing.txt"))
    assert code == 2 and "missing.txt" in err


def test_mqar_accuracy_is_the_brute_force_recall(capsys, tmp_path):
    """--task mqar's accuracy equals argmax-of-logits recall counted here, one example at a time."""
    import numpy as np

    from jaxsb.data.mqar import EVAL_SEED_OFFSET, examples, recall_accuracy
    from jaxsb.models.generate import sequence_logits
    from jaxsb.training.evaluation import load_for_eval
    from jaxsb.config import load_config

    sets = ["data.mqar.vocab=64", "data.mqar.lengths=64,96"]
    summary = tmp_path / "s.json"
    code, lines, err = _run(capsys, *[a for s in sets for a in ("--set", s)], "--task", "mqar", "--samples", "3",
                            "--batch-size", "2", "--summary", str(summary))
    assert code == 0, err
    assert lines[0].startswith("length 64: recalled ") and lines[-1].startswith("accuracy: ")
    cfg = load_config("default", [f"model.init=hf:{FIXTURE}", "data.max_len=256", *sets])
    model, _, _ = load_for_eval(cfg, None)
    correct = total = 0
    for tokens, targets in examples(cfg.data.seed + EVAL_SEED_OFFSET, [64, 96], 3, 0.125, 64):
        pred = np.argmax(sequence_logits(model, tokens.tolist()), axis=-1)
        c, n = recall_accuracy(pred, tokens, targets)
        correct, total = correct + c, total + n
    assert json.loads(summary.read_text())["accuracy"] == correct / total


def test_mqar_vocabulary_must_fit_the_model(capsys):
    code, _, err = _run(capsys, "--task", "mqar", "--set", "data.mqar.lengths=64")
    assert code == 2 and "data.mqar.vocab=256 ids do not fit the model's vocabulary of 96" in err


@pytest.mark.slow
def test_smollm2_finds_the_passkey_densely(capsys):
    """docs/evaluation.md's passkey command on the real model, at a short length: dense SmolLM2 retrieves
    every key (greedy decoding is deterministic)."""
    pytest.importorskip("gguf")
    from jaxsb.models.pretrained import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except Exception as e:  # the wheel is installed by scripts/setup.sh
        pytest.skip(f"SmolLM2 GGUF not installed: {e}")
    code = main(["--set", "model.init=smollm2-135m", "--task", "passkey", "--lengths", "512", "--samples", "2",
                 "--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.strip().splitlines()[-1] == "accuracy: 1.0000", out


@pytest.mark.slow
def test_mqar_config_trains_and_its_run_evaluates(tmp_path, capsys):
    """`python -m jaxsb.train --config mqar` (shrunk) and `eval --workdir RUN --task mqar`."""
    from jaxsb.train import main as train_main

    small = ["--set", "train.steps=2", "--set", "data.mqar.lengths=64,128", "--set", "data.max_len=128",
             "--set", "data.row_buckets=64,128", "--set", "data.tokens_per_step=1024", "--set", "parallel.planner=none"]
    assert train_main(["--config", "mqar", "--workdir", str(tmp_path), *small]) == 0
    capsys.readouterr()
    code = main(["--workdir", str(tmp_path), "--task", "mqar", "--samples", "2"])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert code == 0, err
    assert [x.split(":")[0] for x in lines[:2]] == ["length 64", "length 128"] and lines[-1].startswith("accuracy: ")


@pytest.mark.slow
def test_a_tiny_mqar_run_learns_the_task(tmp_path, capsys):
    """The MQAR config, shrunk to 64-token examples (4 key-value pairs, values from 32 ids) and
    300 steps of 4,096 tokens at a constant lr of 2e-3 (about a minute on 2 cores), leaves the
    "bag of values" plateau: recall at least 0.6 on held-out examples, where guessing a value gives
    1/32 and guessing one of the context's values gives 1/4. (It lands at 0.86; 400 steps at 1e-3
    reach 1.0. Under the config's cosine over the same 300 steps it stays on the plateau: 0.29.)"""
    from jaxsb.train import main as train_main

    tiny = ["train.steps=300", "train.checkpoint_every=300", "train.lr=2e-3", "train.warmup_steps=20",
            "train.min_lr_ratio=1.0", "data.mqar.lengths=64", "data.max_len=64", "data.row_buckets=512",
            "data.tokens_per_step=4096", "parallel.planner=none"]
    assert train_main(["--config", "mqar", "--workdir", str(tmp_path), *[a for s in tiny for a in ("--set", s)]]) == 0
    capsys.readouterr()
    summary = tmp_path / "eval.json"
    code = main(["--workdir", str(tmp_path), "--task", "mqar", "--samples", "32", "--summary", str(summary)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(summary.read_text())["accuracy"] >= 0.6, out
