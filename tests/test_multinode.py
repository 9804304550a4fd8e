"""Two "nodes" on this machine: two `mindspeed-tp check` launches (each its own torchrun) meeting
on loopback through --nnodes/--node-rank/--rdzv-endpoint, one process each (world 2)."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import explain, explain_nodes as _explain, run_cli, run_two_nodes as _two_nodes


def test_two_nodes_save_then_ship_the_reference(tmp_path):
    common = ["--tp", "2", "--sp", "--seq-length", "64"]
    ref = tmp_path / "node0" / "ref.safetensors"
    report = tmp_path / "r.json"
    res = _two_nodes([common + ["--save-reference", str(ref), "--json", str(report)], common])
    assert [r[0] for r in res] == [0, 0], _explain(res)
    assert json.loads(report.read_text())["bitwise_equal_fraction"] == 1.0
    assert "RESULT: bitwise equal" in res[0][1]
    # The reference, computed once, is shipped to the other node and used by both.
    shipped = tmp_path / "node1" / "ref.safetensors"
    shipped.parent.mkdir()
    shutil.copy(ref, shipped)
    res = _two_nodes([common + ["--reference", str(ref)], common + ["--reference", str(shipped)]])
    assert [r[0] for r in res] == [0, 0], _explain(res)
    # A reference that differs on one node is refused by every rank, naming it and the rank.
    data = bytearray(shipped.read_bytes())
    data[-1] ^= 1
    shipped.write_bytes(bytes(data))
    res = _two_nodes([common + ["--reference", str(ref)], common + ["--reference", str(shipped)]])
    assert [r[0] for r in res] == [2, 2], _explain(res)
    assert "ranks disagree on reference file: rank(s) [1]" in res[0][2], _explain(res)


@pytest.mark.parametrize("args, needle", [
    (["--nnodes", "2", "--tp", "2"], "--rdzv-endpoint"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1", "--tp", "2"], "--node-rank=2"),
    (["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "127.0.0.1:1", "--tp", "4"], "--nproc=1"),
    (["--nnodes", "x"], "--nnodes=x"),
])
def test_bad_launcher_flags_exit_2_before_launching(args, needle):
    proc = run_cli("check", *args)
    assert proc.returncode == 2 and needle in proc.stderr, explain(proc)


def test_the_launcher_stops_torchrun_left_waiting_after_its_ranks_reported(tmp_path, capsys):
    """torchrun's agent waits in its exit barrier for every other node's agent (300 s; seen in CI when
    the other node's launcher had already left): once every local rank has reported, the launcher gives
    torchrun --timeout more, then stops it. A stand-in for torchrun (a process that reports, then waits
    for ever) shows the bound; one that exits by itself keeps its own exit code."""
    from mindspeed_tp.cli import _run_torchrun

    status = tmp_path / "status.0"
    waits = [sys.executable, "-c", f"open({str(status)!r}, 'w').write('{{}}'); import time; time.sleep(600)"]
    assert _run_torchrun(subprocess.Popen(waits), [str(status)], grace_s=1.0) == -signal.SIGTERM
    assert "stopping it" in capsys.readouterr().err
    exits = [sys.executable, "-c", "import sys; sys.exit(7)"]
    assert _run_torchrun(subprocess.Popen(exits), [str(tmp_path / "never")], grace_s=1.0) == 7
