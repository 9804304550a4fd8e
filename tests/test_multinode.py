"""Two "nodes" on this machine: two `mindspeed-tp check` launches (each its own torchrun) meeting
on loopback through --nnodes/--node-rank/--rdzv-endpoint, one process each (world 2)."""
import json
import shutil
import socket
import subprocess
import sys

from conftest import ROOT, _env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(per_node_args, env=None, timeout=300, check_timeout=60):
    """Launch node 0 and node 1 (per_node_args[r]: extra flags of node r); returns both results."""
    port = _free_port()
    procs = []
    for rank, extra in enumerate(per_node_args):
        cmd = [sys.executable, "-m", "mindspeed_tp.cli", "check", "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", str(check_timeout), *extra]
        procs.append(subprocess.Popen(cmd, env=_env(env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append((p.returncode, out, err))
    return results


def _explain(results):
    return "\n".join(f"node {i}: exit {rc}\n{out[-2000:]}\n{err[-3000:]}" for i, (rc, out, err) in enumerate(results))


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


def test_a_node_whose_rank_dies_fails_the_other_node():
    """Node 1's rank exits abruptly; node 0 (not stopped by its own torchrun) must notice through
    its collectives and exit 3 with a message naming the cause."""
    res = _two_nodes([["--tp", "2", "--seq-length", "32"]] * 2, env={"MINDSPEED_TP_TEST_FAULT": "exit@forward:1"},
                     check_timeout=15)
    assert res[0][0] == 3 and res[1][0] == 3, _explain(res)
    assert "rank 0" in res[0][2] and "another rank died" in res[0][2], _explain(res)
