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
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, TypeVar

from jaxsb import devices

T = TypeVar("T")

VERSIONS = {"workdir": 1, "tokenizer": 1, "plan": 2, "error": 1, "step": 1}


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

    def ints(self, name: str, optional: bool = False) -> tuple[int, ...] | None:
        values = self.get(name, list, optional=optional)
        if values is None:
            return None
        for i, v in enumerate(values):
            if not isinstance(v, int) or isinstance(v, bool):
                self.fail(f"{self.path}.{name}[{i}]", f"expected int, got {type(v).__name__} {str(v)[:40]!r}")
        return tuple(values)

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
    """A Plan as plain JSON (also what the per-step plan digest hashes)."""
    t = plan.template
    return {
        "num_devices": t.num_devices,
        "microbatches": [{"shard_len": mb.shard_len, "local_len": mb.local_len,
                          "groups": [[g.start, g.degree, g.scheme] for g in mb.groups]} for mb in t.microbatches],
        "lengths": list(plan.lengths),
        "placements": [[p.microbatch, p.group, p.rank] for p in plan.placements],
        "budgets": None if plan.budgets is None else list(plan.budgets),
        "planner": plan.planner, "predicted_ms": _finite_or_nan(plan.predicted_ms),
    }


def plan_from_json(r: _Reader):
    from jaxsb.plan import Group, MicroBatch, Placement, Plan, PlanError, Template, validate

    mbs = []
    for m in r.objs("microbatches"):
        groups = []
        for i, g in enumerate(m.get("groups", list)):
            if not (isinstance(g, list) and len(g) == 3 and all(isinstance(x, int) for x in g[:2])
                    and isinstance(g[2], str)):
                m.fail(f"{m.path}.groups[{i}]", f"expected [start, degree, scheme], got {str(g)[:60]!r}")
            groups.append(Group(*g))
        mbs.append(MicroBatch(tuple(groups), m.get("shard_len", int), m.get("local_len", int)))
    placements = []
    for i, p in enumerate(r.get("placements", list)):
        if not (isinstance(p, list) and len(p) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in p)):
            r.fail(f"{r.path}.placements[{i}]", f"expected [microbatch, group, rank], got {str(p)[:60]!r}")
        placements.append(Placement(*p))
    predicted = r.get("predicted_ms", int, float, optional=True)
    plan = Plan(Template(r.get("num_devices", int), tuple(mbs)), r.ints("lengths"), tuple(placements),
                r.ints("budgets", optional=True), r.get("planner", str),
                float("nan") if predicted is None else float(predicted))
    try:
        return validate(plan)
    except PlanError as e:
        r.fail(r.path, f"not a valid plan: {e}")


def _plan_out(value) -> dict:
    """(Plan, solve seconds, SolveInfo) of one step, planned by process 0 (version 2: the data
    digest left the message; every process's digests are compared per step, faults.py)."""
    plan, solve_s, info = value
    return {"plan": plan_to_json(plan), "solve_s": float(solve_s),
            "info": {"solve_seconds": float(info.solve_seconds), "message": info.message,
                     "fell_back": bool(info.fell_back), "lower_bound_ms": _finite_or_nan(info.lower_bound_ms),
                     "details": _plain(dict(info.details), "details")}}


def _plan_in(r: _Reader):
    from jaxsb.planner.base import SolveInfo

    i = r.obj("info")
    info = SolveInfo(float(i.get("solve_seconds", int, float)), i.get("message", str), i.get("fell_back", bool),
                     i.get("lower_bound_ms", int, float, optional=True), i.get("details", dict))
    return plan_from_json(r.obj("plan")), float(r.get("solve_s", int, float)), info


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
