"""Every module of the package imports on its own, in a fresh interpreter, in a random order:
no import cycle hides behind the order the package happens to load its modules in."""
import ast
import os
import random

from conftest import ROOT, explain, run_python

# Modules that need an optional package (their import is the point of them).
OPTIONAL = {"mindspeed_tp.verl", "mindspeed_tp.megatron_adaptor", "mindspeed_tp.check.__main__",
            "mindspeed_tp.check.train.__main__"}


def _modules():
    out = []
    for directory, _, files in os.walk(os.path.join(ROOT, "mindspeed_tp")):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(directory, name), ROOT)[:-3].replace(os.sep, ".")
                out.append(rel[: -len(".__init__")] if rel.endswith(".__init__") else rel)
    return sorted(m for m in out if m not in OPTIONAL)


def _module_level_imports(module: str, path: str, modules):
    """mindspeed_tp modules ``module`` needs fully imported at module level: ``from X import name``
    needs X's namespace unless ``name`` is a submodule (Python imports a submodule of a package
    that is still initialising); imports inside functions do not count."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
    return {m for m in found if m.startswith("mindspeed_tp")}


def test_no_module_level_import_cycle():
    paths = {}
    for directory, _, files in os.walk(os.path.join(ROOT, "mindspeed_tp")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                paths[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    graph = {m: {t for t in _module_level_imports(m, p, paths) if t in paths and t != m} for m, p in paths.items()}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_all_modules_in_random_orders():
    modules = _modules()
    for seed in range(3):
        order = modules[:]
        random.Random(seed).shuffle(order)
        proc = run_python("import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in order))
        assert proc.returncode == 0, f"seed {seed}: " + explain(proc)
