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
    paths = {m: p for m, p in _sources().items() if m != "mindspeed_tp_autoload"}
    graph = {m: {t for t in _module_level_imports(m, p, paths) if t in paths and t != m} for m, p in paths.items()}
    assert _cycles(graph) == []


def _cycles(graph, allowed=frozenset()):
    """Every import circle a depth-first walk of ``graph`` meets, but the edges within ``allowed``."""
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if {m, t} == allowed:
                continue
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_all_modules_in_random_orders():
    modules = _modules()
    for seed in range(3):
        order = modules[:]
        random.Random(seed).shuffle(order)
        proc = run_python("import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in order))
        assert proc.returncode == 0, f"seed {seed}: " + explain(proc)


# The package's layers, lowest first: a module may import (at any level, inside functions too) only
# modules of its own layer or of a lower one. Units are the top-level modules and packages of
# mindspeed_tp ("mindspeed_tp" is the package's own __init__). docs/DEVELOPING.md holds the same list.
LAYERS = [
    ("errors", "compat", "torchrun_process"),  # exceptions; megatron-core version differences; the launchers'
                                               # torchrun (import nothing of ours)
    ("patching",),              # the patch registry (raises errors)
    ("contract",),              # the profile, the canonical tree, the refusals (numerics registers its engines here)
    ("state",),                 # the process's profile and vocab size (a contract Profile)
    ("devices",),               # accelerator detection, CPU shims (patch registries)
    ("families",),              # one module per Hugging Face family: config.json <-> spec fields (the refusals)
    ("models",),                # model description: specs, layouts, weights, marks (read the contract)
    ("kernels",),               # the kernel interface and backends (dispatch reads devices)
    ("numerics",),              # the strategies, one package per mode/engine (kernels, models, state)
    ("reference", "hf"),        # the one-device model and engine (the rollout layout's engine math); HF checkpoints
    ("patches",),               # megatron-core adapters calling the active strategy
    ("switch",),                # enable() / disable(): applies patches, resolves numerics
    ("integrations",),          # verl, MindSpeed, Megatron-LM flags (attach to switch); vLLM launch (hf, numerics)
    ("mindspeed_tp",),          # the package's __init__: installs the integrations, re-exports the switch
    ("check",),                 # the checkers (enable the package, drive megatron-core)
    ("registries",),            # names every patch set, the checker's included
    ("cli",),                   # the command line over the checkers and the registries
    ("verl", "verl_cpu", "megatron_adaptor"),  # entry points: importing them enables (verl_cpu: verl runs on a CPU)
]

# The one documented import circle: the package imports its interpreter-start hook
# (mindspeed_tp_autoload.when_imported), whose hooks import the package.
AUTOLOAD_PAIR = {"mindspeed_tp", "mindspeed_tp_autoload"}


def _sources():
    """Module name -> path: every module of the package, and the autoload hook beside it."""
    paths = {"mindspeed_tp_autoload": os.path.join(ROOT, "mindspeed_tp_autoload.py")}
    for directory, _, files in os.walk(os.path.join(ROOT, "mindspeed_tp")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                paths[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return paths


def _all_imports(module: str, path: str, modules):
    """(imported module, name or None, line) of every import in ``module``, at any level: a name
    that is a submodule counts as that module."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                full = f"{target}.{a.name}"
                yield (full, None, node.lineno) if full in modules else (target, a.name, node.lineno)


def _graph():
    paths = _sources()
    graph = {m: set() for m in paths}
    for m, p in paths.items():
        for target, _, _ in _all_imports(m, p, paths):
            if target in paths and target != m:
                graph[m].add(target)
    return paths, graph


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_private_name_is_imported_across_modules():
    paths = _sources()
    found = []
    for m, p in sorted(paths.items()):
        for target, name, line in _all_imports(m, p, paths):
            if name and name.startswith("_") and not name.startswith("__") and target != m \
                    and target.startswith("mindspeed_tp"):
                found.append(f"{os.path.relpath(p, ROOT)}:{line}: from {target} import {name}")
    assert found == []


def test_the_layer_list_names_every_unit_once_and_docs_hold_it():
    units = [u for layer in LAYERS for u in layer]
    assert len(units) == len(set(units))
    paths = _sources()
    assert {_unit(m) for m in paths if m != "mindspeed_tp_autoload"} == set(units)
    with open(os.path.join(ROOT, "docs", "DEVELOPING.md")) as f:
        doc = f.read()
    assert " → ".join("/".join(layer) for layer in LAYERS) in doc


def test_no_module_imports_a_higher_layer():
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    paths, graph = _graph()
    found = [f"{m} ({_unit(m)}) imports {t} ({_unit(t)})" for m in sorted(graph) for t in sorted(graph[m])
             if "mindspeed_tp_autoload" not in (m, t) and rank[_unit(t)] > rank[_unit(m)]]
    assert found == []


def test_no_import_cycle_counting_function_level_imports():
    _, graph = _graph()
    assert _cycles(graph, AUTOLOAD_PAIR) == []


def test_the_checkers_and_benchmarks_drive_megatron_through_one_driver():
    """check/driver.py is the only module of check/ that sets up megatron's parallel state, wraps
    models in its DDP, builds its optimizer or calls its schedules; the checkers and the benchmarks
    that run megatron-core import it."""
    calls = ("initialize_model_parallel(", "DistributedDataParallel(", "get_megatron_optimizer(", "forward_step_func=")
    check = os.path.join(ROOT, "mindspeed_tp", "check")
    drivers = []
    for directory, _, files in os.walk(check):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(directory, name)) as f:
                    text = f.read()
                if any(c in text for c in calls):
                    drivers.append(os.path.relpath(os.path.join(directory, name), check))
    assert drivers == ["driver.py"]
    users = ["main.py", "harness.py", os.path.join("train", "loop.py"), os.path.join("rl", "loop.py"),
             os.path.join("rl", "step.py")]
    for rel in users:
        with open(os.path.join(check, rel)) as f:
            text = f.read()
        assert "from .driver import" in text or "from ..driver import" in text, rel
    for bench in ("scale_bench.py", "gpu_bench.py", "module_shares.py"):
        with open(os.path.join(ROOT, "benchmarks", bench)) as f:
            assert "from mindspeed_tp.check.driver import" in f.read(), bench
