"""Shared helpers: launch real torchrun worlds (gloo, several processes) and the CLI."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


def _env(extra=None):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MINDSPEED_TP", None)
    env.pop("MINDSPEED_TP_PROFILE", None)
    env.update(extra or {})
    return env


def run_torchrun(worker: str, nproc: int, *args: str, timeout: float = 600, env=None):
    """Run tests/workers/<worker> under torchrun on this node; returns CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(WORKERS, worker), *args]
    return subprocess.run(cmd, env=_env(env), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run_cli(*args: str, timeout: float = 900, env=None):
    """Run the ``mindspeed-tp`` console entry point with this interpreter."""
    cmd = [sys.executable, "-m", "mindspeed_tp.cli", *args]
    return subprocess.run(cmd, env=_env(env), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run_python(code: str, timeout: float = 300, env=None):
    return subprocess.run([sys.executable, "-c", code], env=_env(env), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def explain(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


@pytest.fixture
def torchrun():
    return run_torchrun


@pytest.fixture
def cli():
    return run_cli
