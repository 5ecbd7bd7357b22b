"""The dependency rules of the codebase, checked on every import statement (AST scan, imports
inside functions included): data flows data -> planner -> Plan -> executor -> model -> kernels.

* kernels_pallas imports nothing of jaxsb;
* the Plan package (jaxsb.plan) imports only numpy and itself;
* planners (jaxsb.planner) import the Plan package, the config and each other, never the
  executor, the models or training, and no jax (they run on the host with numpy / python-mip;
  the simulator's plots use matplotlib);
* the executor (jaxsb.parallel) imports the Plan package, models and kernels, never planners
  or training;
* data imports neither models nor parallel nor planners; models never import training,
  planners or parallel;
* no import cycles between files.
"""

from __future__ import annotations

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxsb", "kernels_pallas")


def _modules() -> dict[str, str]:
    """{dotted module name: path} of every .py file of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _imports(module: str, path: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file; `from a import b` counts as a.b when
    a.b is a module of the project, else as a."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = module.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in MODULES else base, node.lineno))
    return out


IMPORTS = {m: _imports(m, p) for m, p in MODULES.items()}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(of: str, allowed_internal=None, forbidden=(), third_party=None) -> list[str]:
    """Imports of modules under `of` that break a rule: project imports outside
    `allowed_internal` (when given) or under `forbidden`; third-party imports outside
    `third_party` (when given; the standard library is always allowed)."""
    bad = []
    for m, imports in IMPORTS.items():
        if not _under(m, of):
            continue
        for name, line in imports:
            where = f"{MODULES[m]}:{line} imports {name}"
            top = name.split(".")[0]
            if top in PACKAGES:
                if allowed_internal is not None and not any(_under(name, a) for a in allowed_internal):
                    bad.append(where)
                elif any(_under(name, f) for f in forbidden):
                    bad.append(where)
            elif third_party is not None and top not in sys.stdlib_module_names and top not in third_party \
                    and top != "__future__":
                bad.append(where)
    return bad


RULES = {
    "kernels_pallas": dict(allowed_internal=("kernels_pallas",)),
    "jaxsb.plan": dict(allowed_internal=("jaxsb.plan",), third_party=("numpy",)),
    "jaxsb.planner": dict(allowed_internal=("jaxsb.plan", "jaxsb.planner", "jaxsb.config"),
                          third_party=("numpy", "mip", "matplotlib")),
    "jaxsb.parallel": dict(forbidden=("jaxsb.planner", "jaxsb.training", "jaxsb.data")),
    "jaxsb.data": dict(forbidden=("jaxsb.models", "jaxsb.parallel", "jaxsb.planner", "jaxsb.training")),
    "jaxsb.models": dict(forbidden=("jaxsb.training", "jaxsb.planner", "jaxsb.parallel")),
}


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_follow_the_rules(package):
    assert any(_under(m, package) for m in MODULES), f"no modules under {package}: the rule checks nothing"
    bad = _violations(package, **RULES[package])
    assert not bad, f"{package} breaks its dependency rule:\n" + "\n".join(bad)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    graph = {m: sorted({n for n, _ in IMPORTS[m] if n in MODULES and n != m}) for m in MODULES}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_files():
    cycles = _cycles()
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_scan_sees_function_level_imports_and_cycles():
    """The checks can fail: a function-level import is seen, and a planted cycle is found."""
    work = dict(IMPORTS["jaxsb.planner.work"])
    assert "jaxsb.plan.layout" in work  # imported inside a function in work.py
    saved = IMPORTS["jaxsb.plan.plan"]
    IMPORTS["jaxsb.plan.plan"] = saved + [("jaxsb.plan.layout", 0)]  # layout imports plan: a cycle
    try:
        assert ["jaxsb.plan.layout", "jaxsb.plan.plan"] in _cycles()
        IMPORTS["jaxsb.plan.plan"] = saved + [("jaxsb.parallel.executor", 0)]
        assert _violations("jaxsb.plan", **RULES["jaxsb.plan"])
    finally:
        IMPORTS["jaxsb.plan.plan"] = saved
