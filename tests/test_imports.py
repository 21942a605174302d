"""The import graph of the package (ast only: nothing is imported, no GPU): no module of flamia/
imports itself through others (a cycle, counting imports inside functions too), and no module
uses another module's private names (a leading underscore, dunders aside), imported or as an
attribute of an imported module: what modules share is public in the module that owns it."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "flamia"


def _modules() -> dict:
    """{dotted name: path} of every module under flamia/ (a package by its __init__)."""
    mods = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _target(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module name an ImportFrom reads from."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _scan():
    """(edges {module: imported flamia modules}, [private uses (module, owner, name)])."""
    mods = _modules()
    edges, private = {}, []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        out, aliases = set(), {}       # aliases: local name -> flamia module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        out.add(a.name)
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                            a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                owner = _target(mod, path.name == "__init__.py", node)
                if owner not in mods:
                    continue
                for a in node.names:
                    sub = f"{owner}.{a.name}"
                    if sub in mods:                      # a submodule
                        out.add(sub)
                        aliases[a.asname or a.name] = sub
                    else:                                # a name defined in owner
                        out.add(owner)
                        if _private(a.name) and owner != mod:
                            private.append((mod, owner, a.name))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and _private(node.attr)
                    and aliases[node.value.id] != mod):
                private.append((mod, aliases[node.value.id], node.attr))
        edges[mod] = {m for m in out if m != mod}
    return edges, private


def _cycles(edges) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, comps, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return comps


def test_the_scan_sees_the_package():
    edges, _ = _scan()
    assert {"flamia.interface", "flamia.ops.forward", "flamia.ops.backward"} <= edges.keys()
    assert "flamia.ops.config" in edges["flamia.ops.forward"]       # from .config import ...
    assert "flamia.kernel_path" in edges["flamia.custom_ops"]


def test_no_import_cycles():
    edges, _ = _scan()
    assert _cycles(edges) == []


def test_cycle_detection_works():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


KNOWN: set = set()     # (module, owner, name) exceptions; none


def test_no_private_names_across_modules():
    _, private = _scan()
    unknown = [x for x in private if x not in KNOWN]
    assert unknown == [], "private names used across modules: " + ", ".join(
        f"{m} uses {o}.{n}" for m, o, n in unknown)
    # flamia/ops shares nothing private at all, and flamia/bench, flamia/train take nothing
    # private from it
    assert not [x for x in private if x[0].startswith("flamia.ops") or x[1].startswith("flamia.ops")]


# The environment variables the package may read, and where (README: no switch changes results):
# the two documented user switches, the interpreter's own flag, and the commit label that bench /
# train-check write into their results.
ALLOWED_ENV = {"FLAMIA_KERNELS", "FLAMIA_CHECK_FINITE", "TRITON_INTERPRET", "FLAMIA_GIT_COMMIT",
               "FLAMIA_GIT_DIRTY"}


def _env_reads(tree: ast.AST) -> set:
    """Names of os.environ[...] / os.environ.get(...) / os.getenv(...) reads with a literal key."""
    names = set()
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get",
                                                                        "os.getenv"):
            key = node.args[0] if node.args else None
        if key is not None:
            names.add(key.value if isinstance(key, ast.Constant) else ast.unparse(key))
    return names


def test_only_documented_environment_switches():
    found = {}
    for mod, path in _modules().items():
        for name in _env_reads(ast.parse(path.read_text())):
            found.setdefault(name, []).append(mod)
    assert "FLAMIA_KERNELS" in found and "TRITON_INTERPRET" in found       # the scan sees them
    extra = {n: m for n, m in found.items() if n not in ALLOWED_ENV}
    assert not extra, f"environment variables outside the documented switches: {extra}"


def test_no_history_narration_or_diagnostic_switches_in_the_package():
    """Comments state the present design; timing diagnostics live in benchmarks/."""
    import re
    bad = re.compile(r"FLAMIA_\w*DIAG|session [0-9]")
    hits = [f"{p.relative_to(PKG.parent)}:{i}" for p in sorted(PKG.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not hits, hits
