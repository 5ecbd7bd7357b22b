"""Calibration: time the real training step on this machine and fit a cost model (the library
behind `python -m jaxsb.calibrate`).

For each shape of a grid — one group of degree d holding sequences of given lengths (and, for
`model.attention=sparse`, given budgets) in one micro-batch, the other devices idle in empty
degree-1 groups — it builds the Plan, lays the data out and times the jitted forward + backward
of the executor (`jaxsb.parallel.executor.plan_value_and_grad`), exactly what a training step
runs before the optimiser update. Every program is compiled and called once (warm-up) before
any timing; then all shapes are timed side by side, one call each per round, for `--repeats`
rounds, so that load from other jobs hits every shape alike; a shape's time is the fastest round (below).

The fit (`jaxsb.planner.cost.fit_calibrated`) is linear in the work the executor really does
for a plan (`jaxsb.planner.work`: buffer tokens of all devices, attention pairs in the blocks
the kernels compute, ring rounds and tokens, Ulysses tokens; non-negative least squares on
relative errors). On this machine the N devices are simulated on the host's few cores, so a
step costs the sum of all devices' work — idle devices' padding included — not the slowest
group's; counting work exactly as the kernels skip it is what lets one set of constants price
every degree, buffer size and mix of documents.

Timing: contention from other jobs only ever adds time, so a shape's time is its fastest of
`--repeats` rounds (the estimate of the uncontended time that `timeit` also recommends), the
rounds interleaved over all shapes.

Communication is measured, not modeled: its terms are fitted like the others. Memory:
model states at 16 bytes per parameter over the devices, activations per token from the
compiled programs' memory analysis, limit = half the host memory per device.

Grid (`--lengths` are tokens *per device*: a group of degree d holds one sequence of d·n
tokens): the fit shapes are every degree x length plus, per degree, two sequences filling
about 80% of the largest buffer (documents packed in one buffer: the masked work); the
held-out shapes, never fitted, are every degree x `--holdout` length (a buffer size between
the fitted ones) and, per degree, three other sequences filling about 80% of the largest
buffer. With sparse attention, every degree also gets one fit shape and one held-out shape per
`--budgets` entry at the largest length (budgets are data: no new compile). A dense model's
step does not depend on budgets, so a dense calibration is dense-only (the work counts then
price block-sparse plans by their routed blocks).

Prints the table of measured vs fitted ms and the held-out error; writes the preset JSON
(`--out`, default jaxsb/planner/presets/cpu.json; training reads it with
`--set parallel.preset=PATH.json`, and `parallel.preset=cpu` is the shipped file).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import time
from typing import Callable, Sequence

import numpy as np

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "planner", "presets", "cpu.json")
DEGREES = (1, 2, 4, 8)
LENGTHS = (128, 256, 512)  # tokens per device: buffer buckets, compiled once each per degree
HOLDOUT = (384,)
BUDGETS = (2, 4)
REPEATS = 7
QUICK = dict(degrees=(1, 8), lengths=(128, 256, 512), holdout=(384,), budgets=(2,), repeats=7)
FIT_FILL = (0.6, 0.2)  # a fitted mixed shape: two sequences, ~80% of the largest buffer
FILL = (0.45, 0.25, 0.10)  # the held-out mixed shape: three sequences, ~80% of the buffer


@dataclasses.dataclass(frozen=True)
class Shape:
    """One group of `degree` devices holding `lengths` sharded (budgets None = dense)."""

    degree: int
    lengths: tuple[int, ...]
    budgets: tuple[int, ...] | None = None
    held_out: bool = False


@dataclasses.dataclass
class Measurement:
    shape: Shape
    shard_len: int
    ms: float  # fastest of the repeats (see the module docstring)
    all_ms: list[float]
    predicted_ms: float = float("nan")

    @property
    def error(self) -> float:
        return self.predicted_ms / self.ms - 1.0


def make_grid(degrees: Sequence[int], lengths: Sequence[int], holdout: Sequence[int],
              budgets: Sequence[int] = ()) -> list[Shape]:
    """The fit and held-out shapes (see the module docstring)."""
    if not degrees or not lengths:
        raise ValueError("calibration needs at least one degree and one length")
    if any(int(n) < 1 for n in [*lengths, *holdout]):
        raise ValueError(f"lengths must be >= 1 tokens per device, got {list(lengths)} / {list(holdout)}")
    top = max(lengths)
    shapes = []
    for d in degrees:
        shapes += [Shape(d, (d * n,)) for n in lengths]
        shapes.append(Shape(d, tuple(max(1, int(d * top * f)) for f in FIT_FILL)))
        shapes += [Shape(d, (d * top,), (b,)) for b in budgets]
    for d in degrees:
        shapes += [Shape(d, (d * n,), held_out=True) for n in holdout]
        shapes.append(Shape(d, tuple(max(1, int(d * top * f)) for f in FILL), held_out=True))
        shapes += [Shape(d, (d * top // 2, d * top // 4), (b, b + 1), held_out=True) for b in budgets]
    return shapes


class StepTimer:
    """Times the executor's forward + backward of one-group plans on the device mesh."""

    def __init__(self, model_cfg, scheme: str, seed: int = 0):
        import jax
        from flax import nnx

        from jaxsb.mesh import make_mesh
        from jaxsb.models.llama import Llama
        from jaxsb.training.state import split_model

        self.jax = jax
        self.model_cfg, self.scheme = model_cfg, scheme
        self.mesh = make_mesh()
        self.num_devices = self.mesh.size
        self.graphdef, self.params, self.rest = split_model(Llama(model_cfg, rngs=nnx.Rngs(seed)))
        self.num_params = int(sum(np.size(x) for x in jax.tree.leaves(self.params)))
        self.rng = np.random.default_rng(seed)
        self.programs: dict = {}  # template -> compiled
        self.memory: dict = {}  # shard_len -> temp MB of a compiled program (when reported)
        self.compile_seconds = 0.0

    def plan(self, shape: Shape):
        from jaxsb.plan import alignment
        from jaxsb.plan import GroupSpec, build_plan

        scheme = "local" if shape.degree == 1 else self.scheme
        ids = tuple(range(len(shape.lengths)))
        return build_plan(self.num_devices, [[GroupSpec(shape.degree, scheme, ids)]], shape.lengths,
                          budgets=shape.budgets, align=alignment(self.model_cfg), planner="calibrate")

    def prepare(self, shape: Shape) -> tuple[Callable[[], None], int]:
        """(a call running the step once and waiting for it, the plan's shard_len); compiles."""
        import jax.numpy as jnp

        from jaxsb.parallel.executor import layout_plan, plan_value_and_grad
        from jaxsb.plan import check_executable
        from jaxsb.plan.layout import SeqData

        plan = self.plan(shape)
        check_executable(plan.template, self.model_cfg)
        vocab = self.model_cfg.vocab_size
        seqs = []
        for n in shape.lengths:
            t = self.rng.integers(1, vocab, n + 1).astype(np.int32)
            seqs.append(SeqData(t[:-1], t[1:], np.ones(n, np.float32), np.arange(n, dtype=np.int32)))
        arrays = layout_plan(plan, seqs, self.model_cfg, self.mesh)
        targets = jnp.float32(sum(shape.lengths))
        fn = self.programs.get(plan.template)
        if fn is None:
            t0 = time.perf_counter()
            jitted = self.jax.jit(plan_value_and_grad(self.graphdef, self.rest, self.model_cfg, self.mesh,
                                                      plan.template))
            fn = self.programs[plan.template] = jitted.lower(self.params, arrays, targets).compile()
            self.compile_seconds += time.perf_counter() - t0
            self._record_memory(fn, plan.template.microbatches[0].shard_len)
        params, block = self.params, self.jax.block_until_ready
        return (lambda: block(fn(params, arrays, targets))), plan.template.microbatches[0].shard_len

    def _record_memory(self, compiled, shard_len: int) -> None:
        try:
            m = compiled.memory_analysis()
            self.memory[shard_len] = max(self.memory.get(shard_len, 0.0), m.temp_size_in_bytes / 2**20)
        except Exception:  # not every backend reports it; the analytic estimate is used then
            pass

    def measure(self, shapes: Sequence[Shape], repeats: int, log: Callable[[str], None] = print) -> list[Measurement]:
        """Compiles and warms up every shape, then times them side by side, `repeats` rounds."""
        calls = []
        t0 = time.perf_counter()
        for i, shape in enumerate(shapes):
            call, shard_len = self.prepare(shape)
            call()  # warm-up
            calls.append((call, shard_len))
            log(f"  prepared {i + 1}/{len(shapes)}: degree {shape.degree}, lengths {list(shape.lengths)} "
                f"({time.perf_counter() - t0:.0f} s)")
        times = [[] for _ in shapes]
        for _ in range(repeats):
            for (call, _), out in zip(calls, times):
                t = time.perf_counter()
                call()
                out.append((time.perf_counter() - t) * 1e3)
        return [Measurement(s, sl, float(np.min(ts)), ts) for s, (_, sl), ts in zip(shapes, calls, times)]

    def act_per_token_mb(self) -> float:
        """Activation MB per token per device: the slope of the compiled programs' temp memory
        over their buffer size, else a float32 estimate from the model's widths."""
        if len(self.memory) >= 2:
            x = np.array(sorted(self.memory), float)
            y = np.array([self.memory[k] for k in sorted(self.memory)])
            slope = float(np.polyfit(x, y, 1)[0])
            if slope > 0:
                return slope
        c = self.model_cfg
        width = c.layers * (4 * c.hidden + 2 * c.heads * c.head_dim + 3 * c.ffn) + 2 * c.vocab_size
        return width * 4 / 2**20


def model_config_for(cfg):
    """The model the training step would build (scratch shapes; vocab from the tokenizer size)."""
    mc = cfg.model
    if mc.vocab_size == 0:
        mc = dataclasses.replace(mc, vocab_size=int(cfg.tokenizer.vocab_size or 4096))
    return mc


def usable_degrees(model_cfg, scheme: str, degrees: Sequence[int], num_devices: int) -> list[int]:
    """The degrees a one-group calibration plan can use: dividing the devices and, for sparse
    attention under ulysses, the kv heads. (A group beside idle devices runs as a ring in the
    executor, any degree, block-sparse included: the config's scheme, ring by default.)"""
    usable = [d for d in degrees if 1 <= d <= num_devices and num_devices % d == 0]
    if model_cfg.attention == "sparse" and scheme == "ulysses":
        usable = [d for d in usable if d == 1 or model_cfg.kv_heads % d == 0]
    return usable


def calibration_grid(model_cfg, scheme: str, num_devices: int, degrees, lengths, holdout, budgets):
    """(usable degrees, shapes) of a calibration; ValueError when no degree is usable."""
    usable = usable_degrees(model_cfg, scheme, degrees, num_devices)
    if not usable:
        raise ValueError(f"no executable degree among {list(degrees)}")
    return usable, make_grid(usable, lengths, holdout, budgets if model_cfg.attention == "sparse" else ())


def calibrate(cfg, *, degrees: Sequence[int] = DEGREES, lengths: Sequence[int] = LENGTHS,
              holdout: Sequence[int] = HOLDOUT, budgets: Sequence[int] = BUDGETS, repeats: int = REPEATS,
              command: str = "", log: Callable[[str], None] = print):
    """Measures the grid and fits; returns (CalibratedCost, [Measurement]) with predictions."""
    import jax

    from jaxsb.planner.cost import fit_calibrated

    mc = model_config_for(cfg)
    sparse = mc.attention == "sparse"
    scheme = cfg.parallel.scheme
    timer = StepTimer(mc, scheme)
    n = timer.num_devices
    usable, shapes = calibration_grid(mc, scheme, n, degrees, lengths, holdout, budgets)
    if set(usable) != set(degrees):
        log(f"degrees {sorted(set(degrees) - set(usable))} skipped: not executable with {n} devices, "
            f"scheme {scheme}{f', kv_heads={mc.kv_heads}' if sparse else ''}")
    log(f"calibrating {len(shapes)} shapes ({sum(not s.held_out for s in shapes)} fit, "
        f"{sum(s.held_out for s in shapes)} held out), degrees {usable}, scheme {scheme}, "
        f"attention {mc.attention}, {timer.num_params:,} parameters, {n} devices, {repeats} repeats")
    t0 = time.perf_counter()
    rows = timer.measure(shapes, repeats, log)
    host_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    source = (f"{command or 'jaxsb.calibrate'} on {platform.node()} ({os.cpu_count()} CPU cores, "
              f"{platform.machine()}, {jax.devices()[0].platform} x {n} devices, jax {jax.__version__}), "
              f"config {cfg.name}: hidden {mc.hidden}, layers {mc.layers}, vocab {mc.vocab_size}, "
              f"attention {mc.attention}, scheme {scheme}; {datetime.date.today().isoformat()}")
    from jaxsb.plan import alignment

    fit = fit_calibrated([(timer.plan(m.shape), m.ms) for m in rows if not m.shape.held_out],
                         name=f"calibrated:{cfg.name}", attention_block=mc.attention_block,
                         sparse_block=mc.sparse.block_size if sparse else 0, align=alignment(mc),
                         block=mc.sparse.block_size, memory_limit_mb=0.5 * host_mb / n,
                         states_mb=timer.num_params * 16 / n / 2**20, act_per_token_mb=timer.act_per_token_mb(),
                         source=source, num_devices=n, serial_devices=True,
                         measurements=[dict(degree=m.shape.degree, lengths=list(m.shape.lengths),
                                            budgets=None if m.shape.budgets is None else list(m.shape.budgets),
                                            held_out=m.shape.held_out, ms=m.ms,
                                            all_ms=[round(t, 3) for t in m.all_ms]) for m in rows])
    for m in rows:
        m.predicted_ms = fit.plan_time_ms(timer.plan(m.shape))
    log(f"measured in {time.perf_counter() - t0:.0f} s ({timer.compile_seconds:.0f} s compiling "
        f"{len(timer.programs)} programs)")
    return fit, rows


def held_out_errors(rows: Sequence[Measurement]) -> np.ndarray:
    return np.array([abs(m.error) for m in rows if m.shape.held_out])


def format_table(rows: Sequence[Measurement]) -> str:
    lines = [f"{'set':<8} {'degree':>6} {'buffer':>6}  {'lengths':<22} {'budgets':<8} {'measured ms':>11} "
             f"{'fitted ms':>9} {'error':>7}"]
    for m in rows:
        lens = ",".join(map(str, m.shape.lengths))
        bud = "dense" if m.shape.budgets is None else ",".join(map(str, m.shape.budgets))
        lines.append(f"{'held-out' if m.shape.held_out else 'fit':<8} {m.shape.degree:>6} {m.shard_len:>6}  "
                     f"{lens:<22} {bud:<8} {m.ms:>11.1f} {m.predicted_ms:>9.1f} {m.error:>+7.1%}")
    return "\n".join(lines)
