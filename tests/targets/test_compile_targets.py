"""The real TPU and GPU compilers on this CPU-only host: libtpu for a TPU v5p slice (compile-only
devices) and XLA's GPU compiler with Triton for an H100 node (deviceless, from a target
description). Nothing runs; the compilers must accept every program.

* every kernel (flash, block-sparse, the ring's chunk op), forward + backward, compiles for both
  targets through its compiled-Pallas path (Mosaic custom calls on TPU, Triton on GPU), although
  the host's own backend is a CPU;
* the default run's train step compiles for tpu-v5p:2x2x2 and gpu-h100:8 (planned for the target
  with its data-sheet cost preset), fits, and its memory per device is what the planner predicted
  within the tolerance table's `planner_memory`;
* `python -m jaxsb.compile` prints its table and exits 0, and exits 1 naming the program and the
  numbers when a program does not fit.

Needs .venv-targets (`bash scripts/setup.sh --targets`); skipped elsewhere. `.ci/run` runs it
there. The full kernel matrix (targets x dtypes x head dims x lengths) is scripts/compile_kernels.py.
"""

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from tolerances import tol

HAVE_COMPILERS = all(importlib.util.find_spec(m) is not None for m in ("libtpu", "jax_plugins.xla_cuda12"))
pytestmark = [pytest.mark.targets, pytest.mark.skipif(
    not HAVE_COMPILERS, reason="the TPU / GPU compilers are in .venv-targets (bash scripts/setup.sh --targets)")]

TARGETS = {"tpu": "tpu-v5p:2x2x2", "gpu": "gpu-h100:8"}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def devices():
    from jaxsb.targets import parse_target, target_devices

    return {p: target_devices(parse_target(t)) for p, t in TARGETS.items()}


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("kernel", ["flash", "block_sparse", "ring_chunk"])
def test_kernel_compiles_forward_and_backward(devices, platform, kernel):
    import jax

    from kernels_pallas.aot import Case, kernel_programs

    assert jax.default_backend() == "cpu"  # the host compiles for a platform it does not have
    case = Case(T=512, D=128, H=8, K=2, dtype="bfloat16")
    (program,) = kernel_programs(case, devices[platform][0], kernels=(kernel,), directions=("fwd+bwd",))
    compiled = program.compile(platform)
    # forward and backward kernels (flash / block-sparse: fwd, dq, dkv) as real kernel calls
    assert compiled.kernel_calls(platform) >= 3, compiled.lowered_text[:2000]
    assert compiled.compiled.memory_analysis() is not None


@pytest.mark.parametrize("platform", sorted(TARGETS))
def test_float32_head_dim_64_compiles(devices, platform):
    from kernels_pallas.aot import Case, kernel_programs

    case = Case(T=256, D=64, H=4, K=4, dtype="float32")
    (program,) = kernel_programs(case, devices[platform][0], kernels=("flash",), directions=("fwd+bwd",))
    assert program.compile(platform).kernel_calls(platform) >= 3


def test_block_sparse_float32_fits_gpu_shared_memory(devices):
    """Float32 block-sparse attention with 128-token routing blocks and head dim 128, forward and
    backward: Triton refused it ("Shared memory size limit exceeded", 394 KB of 227 KB on H100)
    until the kernels split a block into tiles (block_sparse_attention/pallas.py, sub_tile)."""
    from kernels_pallas.aot import Case, kernel_programs

    case = Case(T=512, D=128, H=8, K=2, dtype="float32", block=128)
    (program,) = kernel_programs(case, devices["gpu"][0], kernels=("block_sparse",), directions=("fwd+bwd",))
    assert program.compile("gpu").kernel_calls("gpu") >= 3


def _relayouts(compiled) -> list[str]:
    """The entry computation's bfloat16 copies, reshapes and transposes (TPU relayouts)."""
    text = compiled.compiled.as_text()
    entry = text[text.index("\nENTRY"):]
    return [ln for ln in entry.splitlines() if re.search(r"= bf16\[[^\]]*\]\S* (copy|reshape|transpose)\(", ln)]


def test_model_entry_compiles_no_relayout(devices):
    """kernels_pallas/aot.py's entry layouts: with q, k, v and the output as a layer holds them
    ([B, T, N * D]), the Mosaic kernels at D = 128 read and write them where they are; with
    [B, T, N, D] parameters the TPU compiler relayouts each array (a reshape of different
    tilings), which no model compiles (jaxsb/models/llama.py)."""
    from kernels_pallas.aot import Case, kernel_programs

    case = Case(T=512, D=128, H=8, K=2, dtype="bfloat16")
    found = {}
    for entry in ("model", "bthd"):
        (program,) = kernel_programs(case, devices["tpu"][0], kernels=("ring_chunk",), directions=("fwd",),
                                     entry=entry)
        found[entry] = _relayouts(program.compile("tpu"))
    assert found["model"] == [], found["model"]
    assert len(found["bthd"]) >= 4, found["bthd"]  # q, k, v in, the output out
    with pytest.raises(ValueError, match="entry='bhtd' must be one of"):
        kernel_programs(case, devices["tpu"][0], entry="bhtd")


def test_layer_compiles_no_relayout_around_the_mosaic_kernel(devices):
    """What `entry="model"` stands for: in a layer (q, k, v projections, RoPE, flash attention,
    output projection, as jaxsb/models/llama.py) compiled for TPU at D = 128, nothing copies q, k,
    v or the output between the layouts of [B, T, N, D] and [B, T, N * D]: the RoPE fusion and the
    projections write and read the kernel's own."""
    import jax
    import jax.numpy as jnp

    from jax.sharding import SingleDeviceSharding
    from kernels_pallas.aot import compile_program
    from kernels_pallas.flash_attention import flash_attention
    from jaxsb.models.rope import apply_rope, rope_cos_sin

    B, T, E, H, K, D = 1, 512, 384, 8, 2, 128  # E: no [B, T, E] array looks like q, k or v

    def layer(x, wq, wk, wv, wo, seg, pos, pin_q=False):
        cos, sin = rope_cos_sin(pos, D, 10000.0)
        q = apply_rope((x @ wq).reshape(B, T, H, D), cos, sin)
        # the control: q materialised as [B, T, H, D] before the kernel must show a relayout
        q = jax.lax.optimization_barrier(q) if pin_q else q
        k = apply_rope((x @ wk).reshape(B, T, K, D), cos, sin)
        v = (x @ wv).reshape(B, T, K, D)
        out = flash_attention(q, k, v, seg, implementation="pallas", interpret=False)
        return out.reshape(B, T, H * D) @ wo

    sh = SingleDeviceSharding(devices["tpu"][0])
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh)  # noqa: E731
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sh)
    args = (bf16(B, T, E), bf16(E, H * D), bf16(E, K * D), bf16(E, K * D), bf16(H * D, E), ids, ids)
    heads = [f"[{B},{T},{n * D}]" for n in (H, K)] + [f"[{B},{T},{n},{D}]" for n in (H, K)]
    moved = {}
    for pin_q in (False, True):
        compiled = compile_program(functools.partial(layer, pin_q=pin_q), args, "tpu")
        assert compiled.kernel_calls("tpu") >= 1
        moved[pin_q] = [ln for ln in _relayouts(compiled) if any(f"bf16{h}" in ln for h in heads)]
    assert moved[False] == [], moved[False]
    assert moved[True], "the control compiled no relayout: the check cannot see one"


def test_kernels_follow_the_target_not_the_host(devices):
    """Without the target named, compiled Pallas on this CPU host is refused; with it, the
    same call lowers to the target's kernels."""
    import jax

    from kernels_pallas import compile_platform, flash_attention

    from jax.sharding import SingleDeviceSharding

    q = jax.ShapeDtypeStruct((1, 256, 2, 64), np.float32, sharding=SingleDeviceSharding(devices["tpu"][0]))
    fn = jax.jit(lambda q: flash_attention(q, q, q, implementation="pallas", interpret=False))
    with pytest.raises(ValueError, match="compiled Pallas needs a target platform"):
        fn.lower(q)
    with compile_platform("tpu"):
        text = fn.lower(q).as_text()
    assert "tpu_custom_call" in text


def _default_cfg(tmp_path, session_bpe, *overrides):
    from jaxsb.config import load_config

    cfg = load_config("default", [f"train.workdir={tmp_path}", *overrides])
    return session_bpe.seed(cfg)


@pytest.mark.parametrize("target", sorted(TARGETS.values()))
def test_default_train_step_compiles_and_fits(tmp_path, session_bpe, target):
    from jaxsb.compile import compile_for_target
    from jaxsb.targets import parse_target

    cfg = _default_cfg(tmp_path, session_bpe)
    reports = compile_for_target(cfg, parse_target(target), steps=2, log=lambda _m: None)
    assert reports
    for r in reports:
        assert r.error is None, r.error
        assert r.fits and 0 < r.peak_mb < r.limit_mb < r.hbm_mb
        assert r.memory["alias_bytes"] > 0  # the state is donated
        np.testing.assert_allclose(r.predicted_mb, r.peak_mb, err_msg=f"{target} {r.name} {r.template}",
                                   **tol("planner_memory", "float32"))


def _compile_cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "jaxsb.compile", "--workdir", str(tmp_path), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=900)


def test_flash_attention_train_step_compiles_for_gpu(tmp_path, session_bpe):
    """`model.attention=flash` on a GPU target runs the Triton kernels with their own tiles:
    the model's attention_block (256, the XLA kernel's) as a Triton tile asked an H100 for
    576 KB of shared memory and did not compile."""
    _default_cfg(tmp_path, session_bpe)
    proc = _compile_cli(tmp_path, "--target", "gpu-h100:8", "--steps", "1",
                        "--set", "model.attention=flash", "--set", "data.tokens_per_step=2048")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "gpu-h100:8: 1 programs, 1 fit" in proc.stdout


def test_compile_cli_prints_the_table(tmp_path, session_bpe):
    """docs/compile.md's command (tiny settings: the sparse model, its block-sparse kernels)."""
    _default_cfg(tmp_path, session_bpe)  # the session's BPE in the workdir
    out = tmp_path / "reports.json"
    proc = _compile_cli(tmp_path, "--target", "tpu-v5e:2x2", "--steps", "1", "--json", str(out),
                        "--set", "model.attention=sparse", "--set", "data.tokens_per_step=2048")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiler MB" in proc.stdout and "planner MB" in proc.stdout
    assert "tpu-v5e:2x2: 1 programs, 1 fit" in proc.stdout
    (report,) = json.loads(out.read_text())["tpu-v5e:2x2"]
    assert report["fits"] and report["error"] is None


HUGE = ["--set", "tokenizer.kind=bytes", "--set", "model.layers=1", "--set", "model.hidden=16384",
        "--set", "model.heads=128", "--set", "model.kv_heads=128", "--set", "model.head_dim=128",
        "--set", "model.ffn=65536", "--set", "data.max_len=256", "--set", "data.tokens_per_step=512"]


def test_compile_cli_fails_when_a_program_does_not_fit(tmp_path):
    """A 4B-parameter layer on 4 v5e chips (16 GB each): model states alone are ~17 GB a chip.
    Packed rows (no planner): the compiler's own memory analysis says it does not fit."""
    proc = _compile_cli(tmp_path, "--target", "tpu-v5e:2x2", "--steps", "1", *HUGE, "--set", "parallel.planner=none")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "DOES NOT FIT" in proc.stdout
    assert "error: tpu-v5e:2x2 rows 1" in proc.stderr and "MB per device, over the" in proc.stderr


def test_compile_cli_fails_when_the_planner_finds_no_layout(tmp_path):
    """The same model planned: the planner's memory model refuses it before any compile."""
    proc = _compile_cli(tmp_path, "--target", "tpu-v5e:2x2", "--steps", "1", *HUGE)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error: tpu-v5e:2x2 step 1 (no plan) cannot be planned" in proc.stderr
    assert "does not fit in memory" in proc.stderr


def test_auto_preset_recognises_the_target_devices(devices):
    """parallel.preset=auto maps jax's device_kind of the compiled-for devices to their chip."""
    from jaxsb.training.planning import resolve_preset

    assert resolve_preset("auto", devices["tpu"][0].device_kind) == "tpu-v5p"
    assert resolve_preset("auto", devices["gpu"][0].device_kind) == "gpu-h100"


def test_compile_kernels_script_prints_the_table():
    """scripts/compile_kernels.py, as the kernel READMEs show it, with tiny settings: float32 at
    head dim 128, where JAX's own GPU kernel does not fit its default tile and is compiled at a
    smaller one (the cell says which); the median of two compiles; the summary table."""
    proc = subprocess.run([sys.executable, "scripts/compile_kernels.py", "--targets", "tpu-v5e:2x2,gpu-a100:8",
                           "--lengths", "256", "--head-dims", "128", "--dtypes", "float32", "--kernels",
                           "block_sparse", "--directions", "fwd", "--repeats", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| block_sparse | fwd |")]
    assert len(rows) == 2 and all("FAILED" not in r for r in rows), proc.stdout
    assert "(64x64) |" in rows[1] and "x64)" not in rows[0], rows  # GPU: mha at 64 x 64; TPU: splash
    assert "| gpu-a100:8 | block_sparse | fwd |" in proc.stdout and "within 2x:" in proc.stdout
    assert "2 programs (entry layout model), 0 failed" in proc.stdout


# the in-process sweep compiles for a deviceless GPU: the test session's persistent cache
# cannot load such executables back, and says so
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
def test_compile_kernels_script_passes_the_entry_layout_on(monkeypatch, capsys):
    """The script's --entry reaches both sides: jaxsb's programs get [B, T, N, D] parameters in
    the default layout under bthd, and so does JAX's own kernel (the GPU one; splash always
    takes its [B, N, T, D])."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "scripts"))
    import compile_kernels

    from kernels_pallas import aot

    seen = []

    def recording(programs):
        def wrapped(*args, **kwargs):
            out = programs(*args, **kwargs)
            seen.extend(("jaxsb", p.args[0].shape, p.free_layouts) for p in out)
            return out
        return wrapped

    reference = compile_kernels._reference

    def recording_reference(*args, **kwargs):
        fn, ref_args, free = reference(*args, **kwargs)
        seen.append(("reference", ref_args[0].shape, free))
        return fn, ref_args, free

    monkeypatch.setattr(aot, "kernel_programs", recording(aot.kernel_programs))
    monkeypatch.setattr(compile_kernels, "_reference", recording_reference)
    for entry, q_shape, free in (("bthd", (1, 256, 8, 128), ()), ("model", (1, 256, 8 * 128), (0, 1, 2))):
        seen.clear()
        assert compile_kernels.main(["--targets", "gpu-h100:8", "--lengths", "256", "--head-dims", "128",
                                     "--dtypes", "bfloat16", "--kernels", "ring_chunk", "--directions", "fwd",
                                     "--repeats", "1", "--entry", entry]) == 0
        assert f"1 programs (entry layout {entry}), 0 failed" in capsys.readouterr().out
        assert {side for side, _, _ in seen} == {"jaxsb", "reference"}, seen
        assert all(shape == q_shape and f == free for _, shape, f in seen), seen
