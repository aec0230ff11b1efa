"""The package's layer rules, read from the source: every module under rlspec/ is imported, its
import statements (module level and inside functions alike) are read, and

- no two rlspec modules import each other, directly or through others (no cycles);
- each room imports only what its layer may (RULES);
- config/ is a leaf: it imports no rlspec package but itself (the checks needing the plan, the
  memory model or a registry are rlspec/checks.py's);
- the top of the package holds only the entry point, config, its checks, messages and model loading."""
import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "rlspec"
TOP = {"rlspec", "rlspec.train", "rlspec.config", "rlspec.checks", "rlspec.messages", "rlspec.models"}
THIRD_PARTY_RUNTIME = ("ray", "vllm", "deepspeed")

# room -> imports it must not make (rlspec rooms as "rlspec.x", third-party packages by name)
RULES = {
    "rlspec.algo": {"ray", "vllm", "deepspeed", "rlspec.workers", "rlspec.engines", "rlspec.cluster",
                    "rlspec.loops", "rlspec.speculation", "rlspec.draft", "rlspec.data", "rlspec.rewards",
                    "rlspec.sim"},
    "rlspec.data": {"ray", "vllm", "deepspeed", "rlspec.workers", "rlspec.engines", "rlspec.cluster", "rlspec.loops"},
    "rlspec.rewards": {"ray", "vllm", "deepspeed", "rlspec.workers", "rlspec.engines", "rlspec.cluster",
                       "rlspec.loops"},
    "rlspec.sim": {"ray", "vllm", "deepspeed", "rlspec.workers", "rlspec.engines", "rlspec.cluster",
                   "rlspec.loops"},
    "rlspec.draft": {"rlspec.workers", "rlspec.cluster", "rlspec.loops"},
    "rlspec.tracking": {"ray", "vllm", "deepspeed", "rlspec.workers", "rlspec.engines", "rlspec.cluster",
                        "rlspec.loops", "rlspec.speculation", "rlspec.draft"},
    "rlspec.engines": {"rlspec.workers", "rlspec.cluster", "rlspec.loops", "rlspec.speculation"},
    "rlspec.speculation": {"rlspec.workers", "rlspec.cluster", "rlspec.loops"},
    "rlspec.workers": {"rlspec.cluster", "rlspec.loops", "rlspec.refit.driver"},
    "rlspec.cluster": {"rlspec.loops"},
    # the refit: the driver's Refit calls the actors; the rest runs inside them
    "rlspec.refit": {"rlspec.loops"},
    **{f"rlspec.refit.{m}": {"rlspec.workers", "rlspec.cluster", "rlspec.loops", "rlspec.engines",
                             "rlspec.refit.driver"} for m in ("engine", "group", "receiver", "sender", "source")},
    "rlspec.messages": {"rlspec.workers", "rlspec.engines", "rlspec.cluster", "rlspec.loops"},
    "rlspec.models": {"rlspec.workers", "rlspec.engines", "rlspec.cluster", "rlspec.loops"},
}
PURE = {"rlspec.cluster.plan", "rlspec.refit"}  # modules that import nothing from rlspec
LEAVES = {"rlspec.config"}  # rooms that import nothing from rlspec but themselves


def modules(pkg_dir: Path = PKG) -> dict[str, Path]:
    """Dotted name -> file of every module in the package."""
    out = {}
    for f in sorted(pkg_dir.rglob("*.py")):
        rel = f.relative_to(pkg_dir.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = f
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Everything `name` imports, anywhere in the file: rlspec modules resolved to the module
    (`from rlspec.a import b` is rlspec.a.b when that is a module, else rlspec.a), others by
    their top-level package. Imports only a type checker reads (if TYPE_CHECKING) are skipped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = name.split(".")[: len(name.split(".")) - node.level
                                      + (name in known and path.name == "__init__.py")]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.startswith("rlspec"):
                while t not in known and "." in t:
                    t = t.rsplit(".", 1)[0]
                out.add(t)
            else:
                out.add(t.split(".")[0])
    return out - {name}


def graph(pkg_dir: Path = PKG) -> dict[str, set[str]]:
    mods = modules(pkg_dir)
    return {m: imports_of(m, f, set(mods)) for m, f in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def violations(g: dict[str, set[str]], pkg_dir: Path = PKG) -> list[str]:
    out = []
    for mod, deps in sorted(g.items()):
        for room, banned in RULES.items():
            if mod == room or mod.startswith(room + "."):
                for d in sorted(deps):
                    hit = [b for b in banned if d == b or d.startswith(b + ".")]
                    if hit:
                        out.append(f"{mod} imports {d} ({room} may not import {hit[0]})")
        for leaf in LEAVES:
            if mod == leaf or mod.startswith(leaf + "."):
                out += [f"{mod} imports {d} ({leaf} is a leaf)" for d in sorted(deps)
                        if d.startswith("rlspec") and not (d == leaf or d.startswith(leaf + "."))]
        if mod in PURE and any(d.startswith("rlspec") for d in deps):
            out.append(f"{mod} must import nothing from rlspec, imports "
                       f"{sorted(d for d in deps if d.startswith('rlspec'))}")
    tops = {m for m in g if m.count(".") == 1 and not (pkg_dir / m.split(".")[1]).is_dir()}
    out += [f"{m}: only {sorted(TOP - {'rlspec'})} stay at the top of the package" for m in sorted(tops - TOP)]
    return out


@pytest.mark.parametrize("name", [m for m in modules() if not m.endswith(("__main__", "sandbox_boot"))])
def test_every_module_imports(name):
    importlib.import_module(name)


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_every_room_keeps_its_layer():
    assert violations(graph()) == []


def test_the_checks_see_a_cycle_and_a_layer_breach(tmp_path):
    """The checker itself: a two-module cycle, algo importing ray, config importing another room
    (inside a function too), and a loose top-level module."""
    pkg = tmp_path / "rlspec"
    (pkg / "algo").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "algo" / "__init__.py").write_text("")
    (pkg / "algo" / "a.py").write_text("def f():\n    import ray\n    from rlspec.algo import b\n")
    (pkg / "algo" / "b.py").write_text("from rlspec.algo.a import f\n")
    (pkg / "sync_loop.py").write_text("")
    (pkg / "config").mkdir()
    (pkg / "config" / "__init__.py").write_text("from rlspec.config import checks\n")
    (pkg / "config" / "checks.py").write_text("def f():\n    from rlspec.algo.a import f\n")
    g = graph(pkg)
    assert cycles(g) == [["rlspec.algo.a", "rlspec.algo.b"]]
    v = violations(g, pkg)
    assert "rlspec.algo.a imports ray (rlspec.algo may not import ray)" in v
    assert "rlspec.config.checks imports rlspec.algo.a (rlspec.config is a leaf)" in v
    assert not any(x.startswith("rlspec.config imports") for x in v)   # config importing its own module
    assert any(x.startswith("rlspec.sync_loop: only") for x in v)


def test_the_package_lists_every_module_pkgutil_finds():
    import rlspec

    found = {m.name for m in pkgutil.walk_packages(rlspec.__path__, "rlspec.")}
    assert found <= set(modules())


def test_the_driver_imports_no_vllm():
    """A run's driver imports every actor's class (rlspec.cluster.launch) but starts no engine:
    vLLM (with what it pulls in, ~10 s of CPU a process) loads only in the actors that use it."""
    import subprocess
    import sys

    code = ("import sys, rlspec.train, rlspec.cluster.launch, rlspec.loops.sync\n"
            "print(sorted(m for m in ('vllm', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
