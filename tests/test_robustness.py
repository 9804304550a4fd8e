"""A rank that dies or hangs makes the check fail clearly (exit 3, a message naming the cause)
within a bound, never a silent hang. Faults come from MINDSPEED_TP_TEST_FAULT (test-only, see
mindspeed_tp/check/faults.py); the subprocess timeout is the bound: a hang fails the test."""
import os

from conftest import explain, run_cli

FAULT = "MINDSPEED_TP_TEST_FAULT"


def test_a_rank_that_exits_fails_the_check():
    proc = run_cli("check", "--tp", "2", "--seq-length", "32", "--timeout", "60", timeout=240,
                   env={FAULT: "exit@forward:1"})
    assert proc.returncode == 3, explain(proc)
    assert "exited without a report" in proc.stderr, explain(proc)


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
