"""Typed run configuration: a tree of frozen dataclasses, TOML files, dotted overrides.

A run's config is built in three layers: the dataclass defaults below, a TOML file from
`configs/` (or any path), then `--set section.field=value` overrides. Every value is parsed
to its field's declared type and the whole tree is validated before anything heavy starts;
errors name the dotted field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import typing
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
ATTENTION_IMPLEMENTATIONS = ("xla", "flash", "sparse", "reference", "jax")
SINGLE_DEVICE_ATTENTION = ("reference", "jax")  # oracle / naive baseline: no ring version
PLANNERS = ("none", "static", "batch-adaptive", "flexsp", "skrull", "jaxsb")
CONFIG_DIR = REPO_ROOT / "configs"


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the dotted field."""


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field}: {message}")


def _one_of(value: str, allowed: tuple[str, ...], field: str) -> None:
    _check(value in allowed, field, f"got {value!r}, allowed: {', '.join(allowed)}")


SPARSE_POLICIES = ("fixed", "floor")


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """Dynamic block-sparse attention (model.attention=sparse): each query block attends to
    its budget of best key blocks (MoBA-style routing), the diagonal block always included.

    `top_k` is the base budget (every sequence's unless a planner chooses budgets);
    `max_blocks` the static bound on any budget (0: the row's blocks), so budgets change
    without recompiling; `coverage_drop` is p of the runtime floor (jaxsb.models.router): a
    document whose budget would keep more than p less routing mass than at `top_k` runs at
    the smallest budget within p instead (1 or more switches the floor off).

    `policy` is where budgets start: `fixed` at the planned or base budget (`top_k`); `floor`
    at 1 for every document, so the runtime floor alone raises each to k_min(p) against `top_k`
    (the least attention any budget cut within p can reach; an evaluation setting)."""

    block_size: int = 128
    top_k: int = 8  # base budget per sequence, in key blocks
    max_blocks: int = 0  # static bound on budgets; 0 = the row's blocks
    coverage_drop: float = 0.1  # p of the runtime floor; >= 1: no floor
    policy: str = "fixed"  # fixed | floor: the budget every document starts from (1 with floor)

    @property
    def start_budget(self) -> int:
        """The budget a document starts from unless a planner chooses one: top_k, or 1 (floor)."""
        return 1 if self.policy == "floor" else self.top_k

    def validate(self, prefix: str = "model.sparse") -> None:
        _check(self.block_size >= 1, f"{prefix}.block_size", f"must be >= 1, got {self.block_size}")
        _check(self.top_k >= 1, f"{prefix}.top_k", f"must be >= 1 (the diagonal block), got {self.top_k}")
        _check(self.max_blocks == 0 or self.max_blocks >= self.top_k, f"{prefix}.max_blocks",
               f"must be 0 (no bound) or >= top_k={self.top_k}, got {self.max_blocks}")
        _check(0 <= self.coverage_drop, f"{prefix}.coverage_drop",
               f"must be >= 0 (a coverage share; >= 1 switches the floor off), got {self.coverage_drop}")
        _one_of(self.policy, SPARSE_POLICIES, f"{prefix}.policy")
        _check(self.policy != "floor" or self.coverage_drop < 1, f"{prefix}.policy",
               f"floor starts every document at budget 1 and needs the runtime floor to raise it: "
               f"set {prefix}.coverage_drop < 1 (got {self.coverage_drop})")


ROPE_SCALINGS = ("default", "linear", "llama3", "yarn")
ATTENTION_BIASES = ("none", "qkv", "qkvo")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """How RoPE frequencies are scaled for long context (Hugging Face's `rope_type` names and
    fields; formulas in jaxsb/models/rope.py). `default` is plain RoPE."""

    scaling: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0  # linear, llama3, yarn: context extension factor
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_positions: int = 0  # llama3, yarn: the pretraining context
    beta_fast: float = 32.0  # yarn: ramp bounds, in rotations
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the ramp bounds to whole dimensions
    attention_factor: float = 1.0  # yarn: cos/sin scale (resolved from factor/mscale when loading)

    def validate(self, prefix: str = "model.rope") -> None:
        _one_of(self.scaling, ROPE_SCALINGS, f"{prefix}.scaling")
        if self.scaling != "default":
            _check(self.factor > 0, f"{prefix}.factor", f"must be > 0, got {self.factor}")
        if self.scaling in ("llama3", "yarn"):
            _check(self.original_max_positions > 0, f"{prefix}.original_max_positions",
                   f"must be > 0 for scaling={self.scaling!r}, got {self.original_max_positions}")
        if self.scaling == "llama3":
            _check(self.high_freq_factor > self.low_freq_factor > 0, f"{prefix}.high_freq_factor",
                   f"must exceed low_freq_factor > 0, got {self.high_freq_factor} and {self.low_freq_factor}")
        _check(self.attention_factor > 0, f"{prefix}.attention_factor", f"must be > 0, got {self.attention_factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """LLaMA-family decoder shape and numerics (ignored fields are taken from `init` weights)."""

    vocab_size: int = 0  # 0: the tokenizer's vocabulary size
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 384
    rope_theta: float = 10000.0
    rope: RopeConfig = RopeConfig()
    attention_bias: str = "none"  # none | qkv (Qwen2) | qkvo (Llama with attention_bias=true)
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    remat: bool = False
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    # xla: blocked online-softmax XLA flash attention | flash: kernels_pallas.flash_attention
    # "auto" (Pallas on GPU, XLA elsewhere) | sparse: routed block-sparse (see `sparse`) |
    # reference: dense jnp oracle | jax: jax.nn.dot_product_attention (the naive baseline)
    attention: str = "xla"
    attention_block: int = 256  # the XLA kernel's q / k block ("flash" on GPU: the kernels' own)
    sparse: SparseConfig = SparseConfig()
    init: str = "scratch"  # scratch | smollm2-135m | hf:/path/to/dir
    init_std: float = 0.02

    def validate(self, prefix: str = "model") -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "attention_block"):
            _check(getattr(self, name) > 0, f"{prefix}.{name}", f"must be > 0, got {getattr(self, name)}")
        _check(self.vocab_size >= 0, f"{prefix}.vocab_size", "must be >= 0 (0 = from tokenizer)")
        _check(self.heads % self.kv_heads == 0, f"{prefix}.kv_heads",
               f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        _check(self.head_dim % 2 == 0, f"{prefix}.head_dim", f"must be even for RoPE, got {self.head_dim}")
        _one_of(self.dtype, ("float32", "bfloat16"), f"{prefix}.dtype")
        _one_of(self.param_dtype, ("float32", "bfloat16"), f"{prefix}.param_dtype")
        _one_of(self.attention, ATTENTION_IMPLEMENTATIONS, f"{prefix}.attention")
        self.sparse.validate(f"{prefix}.sparse")
        self.rope.validate(f"{prefix}.rope")
        _one_of(self.attention_bias, ATTENTION_BIASES, f"{prefix}.attention_bias")
        _check(self.init in ("scratch", "smollm2-135m") or self.init.startswith("hf:"), f"{prefix}.init",
               f"got {self.init!r}, allowed: scratch, smollm2-135m, hf:/path/to/checkpoint_dir")
        _check(self.rope_theta > 0 and self.norm_eps > 0 and self.init_std > 0, prefix,
               "rope_theta, norm_eps and init_std must be > 0")


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer turns text into ids."""

    kind: str = "auto"  # auto | bpe | bytes | hf | model
    path: str = ""  # tokenizer.json for kind=hf
    vocab_size: int = 4096  # for kind=bpe (trained on the run's own corpus, cached in workdir)
    train_bytes: int = 4_000_000  # text sampled from the corpus to train the BPE

    def validate(self, prefix: str = "tokenizer") -> None:
        _one_of(self.kind, ("auto", "bpe", "bytes", "hf", "model"), f"{prefix}.kind")
        _check(self.kind != "hf" or bool(self.path), f"{prefix}.path", "required when tokenizer.kind=hf")
        _check(self.vocab_size >= 300, f"{prefix}.vocab_size", f"must be >= 300, got {self.vocab_size}")
        _check(self.train_bytes > 0, f"{prefix}.train_bytes", "must be > 0")


DATA_KINDS = ("stdlib", "text", "jsonl", "chat", "parquet", "datasets", "tokens", "mqar")


@dataclasses.dataclass(frozen=True)
class MqarConfig:
    """Synthetic multi-query associative recall examples for data.kind=mqar (jaxsb/data/mqar.py):
    example i has length lengths[i % len(lengths)] (one token of it the eos), kv_fraction of it
    key-value pairs; ids lie in [0, vocab), which the tokenizer's vocabulary must cover
    (tokenizer.kind=bytes: 256 ids and its specials)."""

    lengths: tuple[int, ...] = (256, 512, 1024)
    kv_fraction: float = 0.125
    vocab: int = 256
    examples: int = 100_000  # units of one epoch

    def validate(self, prefix: str = "data.mqar") -> None:
        _check(len(self.lengths) > 0 and all(n >= 5 for n in self.lengths), f"{prefix}.lengths",
               f"must list lengths >= 5, got {list(self.lengths)}")
        _check(0 < self.kv_fraction <= 0.5, f"{prefix}.kv_fraction", f"must be in (0, 0.5], got {self.kv_fraction}")
        _check(self.vocab >= 4 and self.vocab % 2 == 0, f"{prefix}.vocab", f"must be even and >= 4, got {self.vocab}")
        _check(self.examples >= 1, f"{prefix}.examples", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where documents come from, how bad input is treated, and how a step's batch is cut."""

    kind: str = "stdlib"  # stdlib | text | jsonl | chat | parquet | datasets | tokens | mqar
    # directory (text), file or directory of .jsonl (jsonl, chat) or .parquet (parquet), a
    # save_to_disk directory (datasets: Hugging Face datasets), .npy/.npz (tokens)
    path: str = ""
    extensions: tuple[str, ...] = (".py",)  # files read by kind=stdlib|text ("*" = all)
    holdout_largest: int = 0  # kind=stdlib|text: the N largest files are not trained on (eval --long-docs N)
    text_field: str = "text"  # kind=jsonl, and parquet / datasets with record=text
    record: str = "text"  # kind=parquet|datasets: a row's text_field column | chat: its 'messages'
    split: str = "train"  # kind=datasets: the split of a saved DatasetDict
    max_len: int = 2048  # longest document piece, in tokens
    long_policy: str = "split"  # split | truncate | drop, for documents longer than max_len
    on_malformed: str = "error"  # error | skip, for bad JSON lines / records
    on_undecodable: str = "skip"  # error | skip | replace, for files that are not valid UTF-8
    tokens_per_step: int = 8192  # global batch token budget
    row_buckets: tuple[int, ...] = (256, 512, 1024, 2048, 4096)  # allowed packed row lengths
    rows_per_device: int = 1
    seed: int = 0
    mqar: MqarConfig = MqarConfig()  # kind=mqar

    def validate(self, prefix: str = "data") -> None:
        _one_of(self.kind, DATA_KINDS, f"{prefix}.kind")
        _check(self.kind in ("stdlib", "mqar") or bool(self.path), f"{prefix}.path",
               f"required when data.kind={self.kind}")
        self.mqar.validate(f"{prefix}.mqar")
        _check(self.kind != "mqar" or max(self.mqar.lengths) <= self.max_len, f"{prefix}.mqar.lengths",
               f"longest {max(self.mqar.lengths)} must be <= data.max_len={self.max_len} (examples are never split)")
        _one_of(self.record, ("text", "chat"), f"{prefix}.record")
        _one_of(self.long_policy, ("split", "truncate", "drop"), f"{prefix}.long_policy")
        _one_of(self.on_malformed, ("error", "skip"), f"{prefix}.on_malformed")
        _one_of(self.on_undecodable, ("error", "skip", "replace"), f"{prefix}.on_undecodable")
        _check(self.max_len >= 2, f"{prefix}.max_len", f"must be >= 2, got {self.max_len}")
        _check(len(self.row_buckets) > 0 and all(b > 0 for b in self.row_buckets), f"{prefix}.row_buckets",
               f"must be a non-empty list of positive lengths, got {list(self.row_buckets)}")
        _check(list(self.row_buckets) == sorted(set(self.row_buckets)), f"{prefix}.row_buckets",
               f"must be strictly increasing, got {list(self.row_buckets)}")
        _check(max(self.row_buckets) >= self.max_len, f"{prefix}.row_buckets",
               f"largest bucket {max(self.row_buckets)} must be >= data.max_len={self.max_len}")
        _check(self.tokens_per_step >= self.max_len, f"{prefix}.tokens_per_step",
               f"must be >= data.max_len={self.max_len}, got {self.tokens_per_step}")
        _check(self.rows_per_device >= 1, f"{prefix}.rows_per_device", "must be >= 1")
        _check(len(self.extensions) > 0, f"{prefix}.extensions", "must list at least one suffix or '*'")
        _check(self.holdout_largest >= 0, f"{prefix}.holdout_largest", f"must be >= 0, got {self.holdout_largest}")
        _check(self.holdout_largest == 0 or self.kind in ("stdlib", "text"), f"{prefix}.holdout_largest",
               f"holds out files of data.kind=stdlib|text only, not data.kind={self.kind}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimiser, schedule, loop length, checkpointing and logging."""

    steps: int = 300
    seed: int = 0
    lr: float = 3e-3
    warmup_steps: int = 20  # a run shorter than this warms up over all its steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    workdir: str = ""  # default: runs/<config name>-<timestamp>
    progress: bool = True
    tensorboard: bool = True  # TensorBoard event files of the metrics in <workdir>/tensorboard
    report: bool = True  # the run's pictures (python -m jaxsb.report) drawn into the workdir at the end

    def validate(self, prefix: str = "train") -> None:
        _check(self.steps >= 1, f"{prefix}.steps", f"must be >= 1, got {self.steps}")
        _check(self.lr > 0, f"{prefix}.lr", f"must be > 0, got {self.lr}")
        _check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, f"{prefix}.min_lr_ratio", "must be in [0, 1]")
        _check(self.weight_decay >= 0, f"{prefix}.weight_decay", "must be >= 0")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, prefix, "beta1 and beta2 must be in [0, 1)")
        _check(self.grad_clip > 0, f"{prefix}.grad_clip", "must be > 0")
        _check(self.checkpoint_every >= 1, f"{prefix}.checkpoint_every", "must be >= 1")
        _check(self.keep_checkpoints >= 1, f"{prefix}.keep_checkpoints", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device mesh: how many devices and how parameters are sharded."""

    devices: int = 0  # 0: all visible devices
    fsdp: bool = True  # shard parameters and optimiser state over all devices
    # Per-step layout of the sequences over the devices (jaxsb/planner/, executed by
    # jaxsb/parallel/): none = packed rows, plain data parallelism, no plan | static |
    # batch-adaptive | flexsp | skrull | jaxsb
    planner: str = "jaxsb"
    scheme: str = "ring"  # attention of multi-device groups: ring | ulysses (uneven groups: ring)
    # cost model: auto (the devices' data-sheet preset, jaxsb.planner.hardware; "cpu" on CPU) | a
    # chip (tpu-v5p, gpu-h100, ...) | "cpu" | a published profile (jaxsb.planner.cost) | a calibrated JSON
    preset: str = "auto"
    # memory the planner gives each simulated CPU device, MB (CPU devices only; accelerators have
    # their chip's HBM): 0 = the calibrated preset's share of the host; smaller makes long
    # sequences too big for one device, as on a real cluster
    cpu_device_memory_mb: float = 0.0
    sp_degree: int = 0  # the static planner's degree (0 = all devices)
    cp: int = 0  # skrull's context-parallel group size (0 = all devices; dp = devices / cp)
    max_programs: int = 8  # compiled step programs at most; later plans reuse or fall back
    plan_time_limit_s: float = 1.0
    # Sparse budgets (model.attention=sparse): fixed = every sequence at model.sparse.top_k |
    # dst = the planner chooses them per document each step (its layout at SAB's budget estimates,
    # then DST over it, from the coverage curves the sparse layers measured in earlier steps;
    # any planner but none; needs model.sparse.max_blocks)
    budgets: str = "fixed"
    background_planning: bool = True  # plan step t+1 while step t runs
    # Several processes (one per host) joined by jax.distributed.initialize: "" = one process |
    # "auto" = the cluster says (TPU pod slice, SLURM, Open MPI) | "host:port" of process 0,
    # with num_processes and this process's process_id (0 .. num_processes-1)
    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0
    # A peer process silent this long (killed, hung, its host gone) stops the run
    # (jaxsb/training/faults.py); JAX's own heartbeat timeout is set above it
    peer_timeout_s: float = 60.0

    def validate(self, prefix: str = "parallel") -> None:
        _check(self.devices >= 0, f"{prefix}.devices", "must be >= 0 (0 = all)")
        _one_of(self.planner, PLANNERS, f"{prefix}.planner")
        _one_of(self.scheme, ("ring", "ulysses"), f"{prefix}.scheme")
        _check(self.cpu_device_memory_mb >= 0, f"{prefix}.cpu_device_memory_mb",
               f"must be >= 0 (0 = the calibrated preset's), got {self.cpu_device_memory_mb}")
        _check(self.sp_degree >= 0 and self.cp >= 0, prefix, "sp_degree and cp must be >= 0 (0 = all devices)")
        _check(self.max_programs >= 2, f"{prefix}.max_programs",
               f"must be >= 2 (one slot is kept for the fallback plan), got {self.max_programs}")
        _check(self.plan_time_limit_s > 0, f"{prefix}.plan_time_limit_s", "must be > 0")
        _one_of(self.budgets, ("fixed", "dst"), f"{prefix}.budgets")
        _check(self.peer_timeout_s >= 2, f"{prefix}.peer_timeout_s",
               f"must be >= 2 seconds (peers beat once a second), got {self.peer_timeout_s}")
        _check(self.budgets == "fixed" or self.planner != "none", f"{prefix}.budgets",
               "budgets=dst is chosen by a planner (static, batch-adaptive, flexsp, skrull, jaxsb); "
               "parallel.planner=none packs rows without one")
        self._validate_processes(prefix)

    def _validate_processes(self, prefix: str) -> None:
        c, n, i = self.coordinator, self.num_processes, self.process_id
        if c in ("", "auto"):
            _check(n == 1 and i == 0, f"{prefix}.num_processes",
                   f"got num_processes={n}, process_id={i} with coordinator={c!r}: "
                   + ("one process needs no coordinator; set parallel.coordinator=HOST:PORT of process 0"
                      if not c else "coordinator=auto takes both from the cluster; leave them unset"))
            return
        host, _, port = c.rpartition(":")
        _check(bool(host) and port.isdigit() and 0 < int(port) < 65536, f"{prefix}.coordinator",
               f"got {c!r}, expected HOST:PORT of process 0 (e.g. 10.0.0.1:1234), auto, or empty")
        _check(n >= 1, f"{prefix}.num_processes", f"must be >= 1, got {n}")
        _check(0 <= i < n, f"{prefix}.process_id", f"must be in [0, {n - 1}] (num_processes={n}), got {i}")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run."""

    name: str = "default"
    model: ModelConfig = ModelConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):
                section.validate(f.name)
        pretrained = self.model.init != "scratch"
        _check(not pretrained or self.tokenizer.kind in ("auto", "model"), "tokenizer.kind",
               f"got {self.tokenizer.kind!r} with model.init={self.model.init!r}: a pretrained model uses "
               "its own tokenizer (kind=auto or model)")
        _check(pretrained or self.tokenizer.kind != "model", "tokenizer.kind",
               "kind=model needs a pretrained model.init (smollm2-135m or hf:DIR)")
        if self.parallel.budgets == "dst":
            _check(self.model.attention == "sparse", "parallel.budgets",
                   f"budgets=dst needs model.attention=sparse, got {self.model.attention!r}")
            _check(self.model.sparse.max_blocks > 0, "model.sparse.max_blocks",
                   "parallel.budgets=dst needs a static bound on the budgets (e.g. 2 x top_k)")
            _check(self.model.sparse.coverage_drop < 1, "model.sparse.coverage_drop",
                   "parallel.budgets=dst needs the runtime floor (coverage_drop < 1): it measures the curves")
            _check(self.model.sparse.policy == "fixed", "model.sparse.policy",
                   "parallel.budgets=dst chooses every document's budget; policy=floor would start them at 1")
        _check(self.parallel.planner == "none" or self.model.attention not in SINGLE_DEVICE_ATTENTION,
               "model.attention", f"{self.model.attention!r} has no sequence-parallel (ring) version; with "
               f"parallel.planner={self.parallel.planner!r} use one of xla, flash, sparse (or parallel.planner=none)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# --------------------------------------------------------------------------- parsing


def _parse_scalar(text: str, typ: Any, field: str) -> Any:
    if typ is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{field}: expected a boolean (true/false), got {text!r}")
    if typ is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{field}: expected an integer, got {text!r}") from None
    if typ is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{field}: expected a number, got {text!r}") from None
    return text


def _coerce(value: Any, typ: Any, field: str) -> Any:
    """Turns a TOML value or an override string into the field's declared type."""
    origin = typing.get_origin(typ)
    if origin is tuple:
        (elem,) = {a for a in typing.get_args(typ) if a is not Ellipsis}
        if isinstance(value, str):
            items = [v for v in value.strip().strip("[]()").split(",") if v.strip()]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise ConfigError(f"{field}: expected a list, got {value!r}")
        return tuple(_coerce(v, elem, field) for v in items)
    if isinstance(value, str):
        return _parse_scalar(value.strip() if typ is not str else value, typ, field)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"{field}: expected a boolean, got {value!r}")
    if typ in (int, float, str) and (not isinstance(value, typ) or isinstance(value, bool) and typ is not bool):
        raise ConfigError(f"{field}: expected {typ.__name__}, got {value!r}")
    return value


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _replace_path(node: Any, path: list[str], value: Any, full: str) -> Any:
    if not dataclasses.is_dataclass(node):
        raise ConfigError(f"{full}: {'.'.join(path)} is not a config section")
    types = _field_types(type(node))
    key = path[0]
    if key not in types:
        allowed = ", ".join(sorted(types))
        where = full[: len(full) - len(".".join(path))].rstrip(".") or "config"
        raise ConfigError(f"{full}: unknown key {key!r} in {where}; allowed: {allowed}")
    if len(path) == 1:
        if dataclasses.is_dataclass(types[key]):
            raise ConfigError(f"{full}: is a section; set one of its fields, e.g. {full}.<field>=...")
        return dataclasses.replace(node, **{key: _coerce(value, types[key], full)})
    child = _replace_path(getattr(node, key), path[1:], value, full)
    return dataclasses.replace(node, **{key: child})


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.extend(_flatten(v, key + "."))
        else:
            out.append((key, v))
    return out


def apply_overrides(cfg: Config, overrides: dict[str, Any] | list[str]) -> Config:
    """Applies `{"a.b": value}` or `["a.b=value", ...]` overrides, typed by the fields."""
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = []
        for text in overrides:
            if "=" not in text:
                raise ConfigError(f"override {text!r}: expected key=value, e.g. train.steps=20")
            key, value = text.split("=", 1)
            items.append((key.strip(), value))
    for key, value in items:
        cfg = _replace_path(cfg, key.split("."), value, key)
    return cfg


def resolve_config_path(name_or_path: str) -> Path:
    """A name from configs/ (with or without .toml) or a path to a TOML file."""
    candidates = [Path(name_or_path), CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.toml"]
    for path in candidates:
        if path.is_file():
            return path
    shipped = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
    raise ConfigError(f"--config {name_or_path!r}: no such file; shipped configs: {shipped}")


def load_config(name_or_path: str | None = "default", overrides: list[str] | None = None) -> Config:
    """Defaults ← TOML file ← overrides, validated."""
    cfg = Config()
    if name_or_path:
        path = resolve_config_path(name_or_path)
        try:
            tree = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        tree.setdefault("name", path.stem)
        cfg = apply_overrides(cfg, dict(_flatten(tree)))
    cfg = apply_overrides(cfg, overrides or [])
    return cfg.validate()


def config_from_json(text: str) -> Config:
    """Inverse of Config.to_json (used to read a run's saved config)."""
    return apply_overrides(Config(), dict(_flatten(json.loads(text)))).validate()


def default_workdir(cfg: Config) -> str:
    import time

    return os.path.join("runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
