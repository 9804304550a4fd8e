"""The checker's entry points: raw torchrun, reference files, JSON written by rank 0."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, _env, explain, run_cli


def test_python_m_check_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "mindspeed_tp.check", "--tp", "2", "--sp", "--dtype", "bf16", "--json", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, explain(proc)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["bitwise_equal_fraction"] == 1.0 and report["vanilla"] is False
    assert report["layout"] == {"tp": 2, "pp": 1, "sp": True, "ep": 1, "etp": 1, "name": "tp2-sp"}


def test_reference_file_round_trip_and_mismatch(tmp_path):
    ref = str(tmp_path / "ref.safetensors")
    proc = run_cli("check", "--tp", "2", "--dtype", "bf16", "--seq-length", "64", "--save-reference", ref)
    assert proc.returncode == 0, explain(proc)
    assert os.path.exists(ref)
    proc = run_cli("check", "--tp", "2", "--pp", "2", "--dtype", "bf16", "--seq-length", "64", "--reference", ref)
    assert proc.returncode == 0, explain(proc)
    proc = run_cli("check", "--tp", "2", "--dtype", "bf16", "--seq-length", "64", "--seed", "99", "--reference", ref)
    assert proc.returncode == 2, explain(proc)
    assert "inputs" in proc.stderr


@pytest.mark.parametrize("name", ["ref.pt", "ref.safetensors"])
def test_reference_must_be_safetensors(tmp_path, name):
    """Refused by the launcher, before any worker starts (no progress bar: no rank ran)."""
    bad = tmp_path / name
    bad.write_bytes(b"not a safetensors file")
    proc = run_cli("check", "--reference", str(bad))
    assert proc.returncode == 2, explain(proc)
    assert "safetensors" in proc.stderr and "check [" not in proc.stderr, explain(proc)


def test_vanilla_only_run_exits_1(tmp_path):
    """`check --vanilla` alone: vanilla megatron-core's layout against one device, a verdict that fails."""
    proc = run_cli("check", "--tp", "2", "--sp", "--dtype", "bf16", "--vanilla", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, explain(proc)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["vanilla"] is True and report["bitwise_equal_fraction"] < 1.0
    assert report["layout"]["tp"] == 2 and report["layout"]["sp"] is True
