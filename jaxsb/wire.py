"""Messages between the processes of a run: data with a declared schema, never code.

What process 0 decides for everyone (the workdir, the tokenizer, each step's plan, an error
that stops the run) and what every process reports each step (its digests, a stop request)
travels through the coordinator's key-value store as UTF-8 JSON:

    {"jaxsb": "<schema>", "version": <int>, "body": {...}}

`encode(schema, value)` writes one; `decode(key, schema, payload)` reads one back and checks,
before anything else is built from it, that it is JSON, that it is the expected schema and
version, and that every field has the expected type. Anything else — a pickle, another
program's value under our key, a message of a newer version — is a `WireError` naming the key
and the field; nothing received is ever executed or unpickled.

Schemas (`SCHEMAS`): workdir, tokenizer, plan, error, step. Bump a schema's version whenever
its body changes. `share_from_main` is how process 0's decisions reach the others.

A plan's per-sequence columns (lengths, placements, budgets: thousands of numbers at cluster
scale) travel packed (`pack_ints`): little-endian int32, zlib-compressed, base64 text, with
their count; the reader checks the text, the compressed size and the count before it builds
anything (a 4096-sequence plan for 1024 devices: 70 KB as plain JSON, `scripts/bench_plan_wire.py`).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import zlib
from typing import Any, Callable, TypeVar

from jaxsb import devices

T = TypeVar("T")

VERSIONS = {"workdir": 1, "tokenizer": 1, "plan": 3, "error": 1, "step": 1}
_INT32 = (-2**31, 2**31 - 1)
ZLIB_MAX_RATIO = 1032  # deflate's largest expansion: one compressed byte holds at most ~1032 bytes


class WireError(ValueError):
    """A received message that is not what the key's readers expect."""


class _Reader:
    """Typed access to a received body; every failure names the key and the field."""

    def __init__(self, key: str, body: Any, path: str = "body"):
        self.key, self.body, self.path = key, body, path
        if not isinstance(body, dict):
            self.fail(path, f"expected an object, got {type(body).__name__}")

    def fail(self, field: str, what: str):
        raise WireError(f"message {self.key!r}: field {field!r}: {what}")

    def get(self, name: str, *types: type, optional: bool = False) -> Any:
        field = f"{self.path}.{name}"
        if name not in self.body:
            if optional:
                return None
            self.fail(field, "missing")
        value = self.body[name]
        if value is None and optional:
            return None
        # bool is an int in Python; a field typed int must not accept true/false
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            self.fail(field, f"expected {names}, got {type(value).__name__} {str(value)[:40]!r}")
        return value

    def packed_ints(self, name: str, optional: bool = False) -> tuple[int, ...] | None:
        """The ints `pack_ints` wrote under `name`: {"count": n, "int32_zlib": base64 text}."""
        if optional and self.get(name, dict, optional=True) is None:
            return None
        r = self.obj(name)
        count, text = r.get("count", int), r.get("int32_zlib", str)
        field = f"{r.path}.int32_zlib"
        if count < 0:
            self.fail(f"{r.path}.count", f"expected a count >= 0, got {count}")
        try:
            packed = base64.b64decode(text.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as e:
            self.fail(field, f"not base64 ({e})")
        if 4 * count > ZLIB_MAX_RATIO * len(packed) + 64:  # deflate cannot inflate that far
            self.fail(f"{r.path}.count", f"{count} int32 values cannot come from {len(packed)} compressed bytes")
        inflate = zlib.decompressobj()
        try:  # never more than the announced size (itself bounded by the compressed size) is inflated
            raw = inflate.decompress(packed, 4 * count + 1)
        except zlib.error as e:
            self.fail(field, f"not zlib data ({e})")
        if len(raw) > 4 * count:
            self.fail(field, f"expected {count} int32 values ({4 * count} bytes), got more")
        if not inflate.eof:
            self.fail(field, f"the compressed stream ends early: {len(raw)} of {4 * count} bytes")
        if inflate.unused_data or len(raw) != 4 * count:
            self.fail(field, f"expected {count} int32 values ({4 * count} bytes), got {len(raw)} bytes"
                             + (f" and {len(inflate.unused_data)} bytes after the stream" if inflate.unused_data else ""))
        import numpy as np

        return tuple(np.frombuffer(raw, "<i4").tolist())

    def obj(self, name: str) -> "_Reader":
        return _Reader(self.key, self.get(name, dict), f"{self.path}.{name}")

    def objs(self, name: str) -> list["_Reader"]:
        return [_Reader(self.key, v, f"{self.path}.{name}[{i}]") for i, v in enumerate(self.get(name, list))]


def _plain(value: Any, field: str) -> Any:
    """JSON-ready copy of a planner's details: numbers, strings, lists, string-keyed objects."""
    import numpy as np

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None  # JSON has no NaN / inf
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v, f"{field}[{i}]") for i, v in enumerate(list(value))]
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{field}.{k}") for k, v in value.items()}
    raise TypeError(f"{field}: a {type(value).__name__} cannot be sent to the other processes "
                    "(numbers, strings, lists and dicts only)")


def _finite_or_nan(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


# ------------------------------------------------------------------------------ schemas


def _workdir_out(path: str) -> dict:
    return {"path": path}


def _workdir_in(r: _Reader) -> str:
    return r.get("path", str)


def _tokenizer_out(tok) -> dict:
    return {"tokenizer_json": tok.hf.to_str(), "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id,
            "name": tok.name, "chat_template": tok.chat_template, "byte_ids": tok._byte_ids}


def _tokenizer_in(r: _Reader):
    import tokenizers

    from jaxsb.data.tokenizer import Tokenizer

    text = r.get("tokenizer_json", str)
    try:
        hf = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        r.fail(f"{r.path}.tokenizer_json", f"not a tokenizers JSON document ({str(e)[:200]})")
    try:
        return Tokenizer(hf, bos_id=r.get("bos_id", int), eos_id=r.get("eos_id", int),
                         pad_id=r.get("pad_id", int), name=r.get("name", str),
                         chat_template=r.get("chat_template", str, optional=True),
                         _byte_ids=r.get("byte_ids", bool))
    except ValueError as e:
        r.fail(r.path, str(e))


def plan_to_json(plan) -> dict:
    """A Plan as plain, readable JSON (reports, and what the per-step plan digest hashes); the
    plan message between processes is the packed plan_to_wire."""
    t = plan.template
    return {
        "num_devices": t.num_devices,
        "microbatches": [{"shard_len": mb.shard_len, "local_len": mb.local_len,
                          "groups": [[g.start, g.degree, g.scheme] for g in mb.groups]} for mb in t.microbatches],
        "lengths": list(plan.lengths),
        "placements": [[p.microbatch, p.group, p.rank] for p in plan.placements],
        "budgets": None if plan.budgets is None else list(plan.budgets),
        "planner": plan.planner, "predicted_ms": _finite_or_nan(plan.predicted_ms),
        **({} if plan.parts is None else {"parts": [[p.document, p.start] for p in plan.parts]}),
    }


def pack_ints(values, field: str) -> dict:
    """Ints as {"count", "int32_zlib"} (module doc); TypeError naming `field` for anything but
    ints (a bool or a float is refused, never rounded) or an int outside int32."""
    import numpy as np

    values = list(values)
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{field}[{i}]: expected an int, got {type(v).__name__} {v!r}")
        if not _INT32[0] <= v <= _INT32[1]:
            raise TypeError(f"{field}[{i}]: values must fit int32 to be sent, got {v}")
    a = np.asarray(values, dtype=np.int64)
    packed = zlib.compress(a.astype("<i4").tobytes(), 9)
    return {"count": int(a.size), "int32_zlib": base64.b64encode(packed).decode("ascii")}


def plan_to_wire(plan) -> dict:
    """A Plan for the other processes, its columns packed (pack_ints): per micro-batch the
    groups' starts, degrees and schemes (as indices into jaxsb.plan.SCHEMES); per sequence its
    length, budget and placement (microbatch, group and rank columns one after another)."""
    from jaxsb.plan import SCHEMES, PlanError

    if plan.parts is not None:
        raise PlanError("a plan with split documents (parts: the pipeline simulator's Seq1F1B layouts) has no "
                        "wire form: the executor runs whole documents only")
    cols = [p.microbatch for p in plan.placements] + [p.group for p in plan.placements] + \
        [p.rank for p in plan.placements]
    mbs = [{"shard_len": mb.shard_len, "local_len": mb.local_len,
            "groups": pack_ints([g.start for g in mb.groups] + [g.degree for g in mb.groups]
                                + [SCHEMES.index(g.scheme) for g in mb.groups], "plan.groups")}
           for mb in plan.template.microbatches]
    return {"num_devices": plan.template.num_devices, "microbatches": mbs,
            "lengths": pack_ints(plan.lengths, "plan.lengths"),
            "placements": pack_ints(cols, "plan.placements"),
            "budgets": None if plan.budgets is None else pack_ints(plan.budgets, "plan.budgets"),
            "planner": plan.planner, "predicted_ms": _finite_or_nan(plan.predicted_ms)}


def plan_from_wire(r: _Reader):
    """The Plan `plan_to_wire` wrote, checked field by field and then as a plan (validate)."""
    from jaxsb.plan import SCHEMES, Group, MicroBatch, Placement, Plan, PlanError, Template, validate

    mbs = []
    for m in r.objs("microbatches"):
        cols = m.packed_ints("groups")
        k = len(cols) // 3
        if len(cols) != 3 * k:
            m.fail(f"{m.path}.groups", f"expected start, degree and scheme columns of equal length, "
                                       f"got {len(cols)} values")
        bad = [c for c in cols[2 * k:] if not 0 <= c < len(SCHEMES)]
        if bad:
            m.fail(f"{m.path}.groups", f"scheme code {bad[0]} out of range (0..{len(SCHEMES) - 1}: "
                                       f"{', '.join(SCHEMES)})")
        groups = tuple(Group(a, d, SCHEMES[c]) for a, d, c in zip(cols[:k], cols[k:2 * k], cols[2 * k:]))
        mbs.append(MicroBatch(groups, m.get("shard_len", int), m.get("local_len", int)))
    lengths = r.packed_ints("lengths")
    cols = r.packed_ints("placements")
    n = len(lengths)
    if len(cols) != 3 * n:
        r.fail(f"{r.path}.placements", f"expected 3 columns of {n} (one placement per length), got {len(cols)} values")
    placements = tuple(map(Placement, cols[:n], cols[n:2 * n], cols[2 * n:]))
    predicted = r.get("predicted_ms", int, float, optional=True)
    plan = Plan(Template(r.get("num_devices", int), tuple(mbs)), lengths, placements,
                r.packed_ints("budgets", optional=True), r.get("planner", str),
                float("nan") if predicted is None else float(predicted))
    try:
        return validate(plan)
    except PlanError as e:
        r.fail(r.path, f"not a valid plan: {e}")


def _plan_out(value) -> dict:
    """(Plan, solve seconds, SolveInfo) of one step, planned by process 0 (version 2: the data
    digest left the message, every process's digests are compared per step, faults.py;
    version 3: the per-sequence columns packed, plan_to_wire)."""
    plan, solve_s, info = value
    return {"plan": plan_to_wire(plan), "solve_s": float(solve_s),
            "info": {"solve_seconds": float(info.solve_seconds), "message": info.message,
                     "fell_back": bool(info.fell_back), "lower_bound_ms": _finite_or_nan(info.lower_bound_ms),
                     "details": _plain(dict(info.details), "details")}}


def _plan_in(r: _Reader):
    from jaxsb.planner.base import SolveInfo

    i = r.obj("info")
    info = SolveInfo(float(i.get("solve_seconds", int, float)), i.get("message", str), i.get("fell_back", bool),
                     i.get("lower_bound_ms", int, float, optional=True), i.get("details", dict))
    return plan_from_wire(r.obj("plan")), float(r.get("solve_s", int, float)), info


# Errors process 0 hits while deciding for everyone are raised again on the others as the
# same type when it is one of these, else as RuntimeError; only the name and text travel.
def _error_types() -> dict[str, type]:
    from jaxsb.config import ConfigError
    from jaxsb.data import DataError
    from jaxsb.models.pretrained import GGUFError, HFCheckpointError
    from jaxsb.plan import PlanError

    return {t.__name__: t for t in (ConfigError, DataError, GGUFError, HFCheckpointError, PlanError,
                                    ValueError, OSError, TimeoutError, RuntimeError)}


def _error_out(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e)}


def _error_in(r: _Reader) -> Exception:
    name, message = r.get("type", str), r.get("message", str)
    known = _error_types().get(name)
    if known is None:
        return RuntimeError(f"on process 0: {name}: {message}")
    return known(f"on process 0: {message}")


def _step_out(value: dict) -> dict:
    return {"process": int(value["process"]), "step": int(value["step"]), "digest": str(value["digest"]),
            "stop": value.get("stop")}


def _step_in(r: _Reader) -> dict:
    return {"process": r.get("process", int), "step": r.get("step", int), "digest": r.get("digest", str),
            "stop": r.get("stop", str, optional=True)}


SCHEMAS: dict[str, tuple[Callable[[Any], dict], Callable[[_Reader], Any]]] = {
    "workdir": (_workdir_out, _workdir_in),
    "tokenizer": (_tokenizer_out, _tokenizer_in),
    "plan": (_plan_out, _plan_in),
    "error": (_error_out, _error_in),
    "step": (_step_out, _step_in),
}


def encode(schema: str, value: Any) -> bytes:
    """One message of `schema` holding `value`, as UTF-8 JSON bytes."""
    body = SCHEMAS[schema][0](value)
    return json.dumps({"jaxsb": schema, "version": VERSIONS[schema], "body": body},
                      separators=(",", ":"), allow_nan=False).encode("utf-8")


def decode(key: str, expected: str | tuple[str, ...], payload: bytes) -> tuple[str, Any]:
    """(schema, value) of a message received under `key`, checked to be one of `expected`."""
    expected = (expected,) if isinstance(expected, str) else expected
    try:
        message = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"message {key!r}: not a jaxsb message (expected UTF-8 JSON with fields jaxsb, version, "
                        f"body; got {len(payload)} bytes starting {payload[:16]!r}): {e}") from None
    head = _Reader(key, message, "message")
    schema = head.get("jaxsb", str)
    if schema not in expected:
        head.fail("jaxsb", f"expected {' or '.join(map(repr, expected))}, got {schema!r}")
    version = head.get("version", int)
    if version != VERSIONS[schema]:
        head.fail("version", f"this jaxsb reads {schema} messages of version {VERSIONS[schema]}, got {version} "
                             "(are all processes running the same jaxsb?)")
    return schema, SCHEMAS[schema][1](head.obj("body"))


# ------------------------------------------------------------------ between processes


def share_from_main(key: str, schema: str, make: Callable[[], T], timeout_s: float = devices.SHARE_TIMEOUT_S) -> T:
    """`make()` run on process 0 only; every process returns its result, sent as a `schema`
    message (jaxsb/wire.py), or raises process 0's exception (its type and text). `key` must
    be unique within the run. One process: `make()`."""
    client = devices._client()
    if client is None:
        return make()
    if devices.is_main_process():
        try:
            value = make()
        except Exception as e:
            devices._publish(client, key, encode("error", e))
            raise
        devices._publish(client, key, encode(schema, value))
        return value
    return receive(client, key, schema, timeout_s)


def receive(client, key: str, schema: str, timeout_s: float = devices.SHARE_TIMEOUT_S):
    """The `schema` value process 0 published under `key` (raising the error it published
    instead); a payload that is not such a message is a wire.WireError, never executed."""
    kind, value = decode(key, (schema, "error"), devices._fetch(client, key, timeout_s))
    if kind == "error":
        raise value
    return value


def forget(key: str) -> None:
    """Frees a `share_from_main` value once every process has read it (process 0 deletes)."""
    client = devices._client()
    if client is not None and devices.is_main_process():
        client.key_value_delete(key)  # deletes the key and everything under "key/"
