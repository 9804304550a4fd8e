"""A rank that dies or hangs makes the check fail clearly (exit 3, a message naming the cause)
within a bound, never a silent hang. Faults come from MINDSPEED_TP_TEST_FAULT (test-only, see
tests/support/fault_injection.py); the subprocess timeout is the bound: a hang fails the test."""
import json
import time

import pytest

from conftest import explain, explain_nodes, full_tier, run_cli, run_python, run_two_nodes

FAULT = "MINDSPEED_TP_TEST_FAULT"


@full_tier(covered_by="tests/test_robustness.py::test_a_rank_that_hangs_fails_the_others_after_the_timeout",
           why="a peer lost mid-collective ends the run within --timeout however it was lost (the hang test); "
               "two nodes meeting through the launcher's rendezvous run in tests/test_multinode.py")
def test_a_rank_that_dies_on_another_node_fails_this_node():
    """Two "nodes" on loopback; node 1's only rank exits abruptly. Node 0's torchrun does not stop
    its rank (its own ranks are healthy): the rank must notice through its collectives and exit 3
    naming the cause, within --timeout."""
    res = run_two_nodes([["--tp", "2", "--seq-length", "32"]] * 2, env={FAULT: "exit@forward:1"}, check_timeout=15)
    assert res[0][0] == 3 and res[1][0] == 3, explain_nodes(res)
    assert "rank 0" in res[0][2] and "another rank died" in res[0][2], explain_nodes(res)
    assert "exited without a report" in res[1][2], explain_nodes(res)


def test_a_rank_that_hangs_fails_the_others_after_the_timeout():
    """Rank 1 sleeps before its forward; rank 0's next collective gives up after --timeout and
    reports it; torchrun then stops the hung rank."""
    proc = run_cli("check", "--tp", "2", "--seq-length", "32", "--timeout", "10", timeout=240,
                   env={FAULT: "hang@forward:1"})
    assert proc.returncode == 3, explain(proc)
    assert "rank 0" in proc.stderr and "--timeout=10s" in proc.stderr, explain(proc)
    assert "local rank(s) [1]" in proc.stderr, explain(proc)


def test_timeout_must_be_positive():
    proc = run_cli("check", "--timeout", "0")
    assert proc.returncode == 2 and "--timeout" in proc.stderr, explain(proc)


@pytest.mark.parametrize("module", ["mindspeed_tp.check", "mindspeed_tp.check.train", "mindspeed_tp.check.rl"])
def test_a_checker_process_ends_without_the_interpreters_teardown(module):
    """Issue #43, item 12: after its verdict a checker rank aborted in torch's gloo teardown at
    interpreter exit (SIGABRT after check --bisect). The checkers' entries end as the test workers do:
    flushed, then out without destructors or atexit handlers, with their exit code."""
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('TEARDOWN RAN'))\n"
            f"sys.argv = ['{module}', '--model', 'no-such-model']\n"
            f"runpy.run_module('{module}', run_name='__main__')\n")
    proc = run_python(code, timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert "no-such-model" in proc.stderr and "TEARDOWN RAN" not in proc.stdout, explain(proc)


def test_a_segfault_in_native_code_prints_every_threads_python_and_native_stack():
    """A rank dying of SIGSEGV (a native library's bug: gloo's worker threads have no Python frame) leaves
    its Python stacks (faulthandler) and every thread's C++ frames (torch's fatal-signal handler) in the
    log, and the check fails with exit 3 naming the rank."""
    proc = run_cli("check", "--model", "tiny-dense", "--layouts", "tp1", "--seq-length", "16", "--batch-size", "1",
                   env={FAULT: "segv@start:0"}, timeout=300)
    assert proc.returncode == 3, explain(proc)
    assert "Fatal Python error: Segmentation fault" in proc.stderr, explain(proc)
    assert "SIGSEGV(11), PID:" in proc.stderr and "frame #0:" in proc.stderr, explain(proc)
    assert "fault_injection.py" in proc.stderr and "exited without a report" in proc.stderr, explain(proc)


@full_tier(covered_by="tests/test_robustness.py::test_a_rank_that_hangs_fails_the_others_after_the_timeout",
           why="the same bounded wait for peers that are elsewhere, met by a hang instead of a refusal")
def test_a_refusal_only_one_rank_meets_exits_2_long_before_the_timeout():
    """Rank 1 meets a ConfigError at its forward while rank 0 runs on into the forward's collectives:
    rank 1 waits REFUSAL_BARRIER_S for the others to meet it too, then reports and leaves (it used to
    wait in a barrier for --timeout); the check exits 2 naming the refusal."""
    from mindspeed_tp.check.main import REFUSAL_BARRIER_S

    start = time.monotonic()
    proc = run_cli("check", "--tp", "2", "--seq-length", "32", "--timeout", "600", timeout=400,
                   env={FAULT: "refuse@forward:1"})
    assert proc.returncode == 2 and "injected: a refusal only rank 1 meets" in proc.stderr, explain(proc)
    assert time.monotonic() - start < REFUSAL_BARRIER_S + 120, explain(proc)


def test_a_vanilla_arm_that_cannot_run_is_a_row_and_the_check_goes_on(tmp_path):
    """Issue #44, item 5: vanilla megatron-core raising in a layout on every rank (an install it cannot
    run on: no Transformer Engine, no apex) is a row "cannot run (<reason>)"; the other layouts and
    mindspeed-tp's rows run, and the exit code is mindspeed-tp's verdict."""
    path = tmp_path / "r.json"
    proc = run_cli("check", "--layouts", "tp2,tp2-sp", "--seq-length", "32", "--compare-vanilla", "--json", str(path),
                   env={FAULT: "raise-vanilla:tp2-sp"}, timeout=300)
    assert proc.returncode == 0, explain(proc)
    rows = {(r["layout"]["name"], r["vanilla"]): r for r in json.loads(path.read_text())["results"]}
    assert rows[("tp2-sp", True)]["unsupported"] == "cannot run (RuntimeError: injected: vanilla cannot run tp2-sp)"
    assert "bitwise_equal_fraction" in rows[("tp2", True)] and rows[("tp2-sp", False)]["bitwise_equal_fraction"] == 1.0
    assert "tp2-sp                vanilla       n/a: cannot run (RuntimeError: injected" in proc.stdout, proc.stdout


def test_a_vanilla_arm_failing_on_one_rank_only_fails_the_check_within_a_bound():
    """The same failure on rank 1 alone cannot be agreed on: the check fails (exit 3) as a crash does,
    not a hang (the subprocess timeout is the bound)."""
    proc = run_cli("check", "--layouts", "tp2-sp", "--seq-length", "32", "--compare-vanilla", "--timeout", "15",
                   env={FAULT: "raise-vanilla:tp2-sp:1"}, timeout=400)
    assert proc.returncode == 3, explain(proc)
    assert "injected: vanilla cannot run tp2-sp" in proc.stderr + proc.stdout, explain(proc)
