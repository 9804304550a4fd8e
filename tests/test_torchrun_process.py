"""The launchers start torchrun's agent in a forked copy of themselves (mindspeed_tp/torchrun_process.py):
the same agent and the same ranks as ``python -m torch.distributed.run`` -- each rank a fresh
interpreter in the given environment, the world's exit code torchrun's -- and, with threads
running in the launcher, the subprocess it replaces."""
import json
import os
import subprocess
import sys
import threading

import pytest

from mindspeed_tp.torchrun_process import start_torchrun

RANK_SCRIPT = """
import json, os, sys
out = sys.argv[1]
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "mark": os.environ.get("MARK"),
               "fresh": "mindspeed_tp" not in sys.modules, "pid": os.getpid(), "ppid": os.getppid()}, f)
sys.exit(int(os.environ.get("FAIL_RANK", "-1") == str(rank)) * 5)
"""


def _world(tmp_path, env_extra, threaded):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "MARK"}
    env.update(env_extra)
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait) if threaded else None
    if helper:
        helper.start()
    try:
        proc = start_torchrun(["--standalone", "--nproc-per-node=2", str(script), str(tmp_path)], env)
        forked = proc._popen is None
        code = proc.wait(timeout=120)
    finally:
        stop.set()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    return code, forked, ranks, proc.pid


@pytest.mark.parametrize("threaded", [False, True], ids=["forked", "subprocess"])
def test_a_world_runs_fresh_ranks_in_the_given_environment(tmp_path, threaded):
    os.environ["MARK"] = "the launcher's, not the world's"
    try:
        code, forked, ranks, agent = _world(tmp_path, {"MARK": "given"}, threaded)
    finally:
        del os.environ["MARK"]
    assert code == 0 and forked is (not threaded)
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world"] for r in ranks} == {2}
    assert all(r["mark"] == "given" and r["fresh"] for r in ranks), ranks
    assert {r["ppid"] for r in ranks} == {agent} and os.getpid() not in {r["pid"] for r in ranks}


@pytest.mark.parametrize("threaded", [False, True], ids=["forked", "subprocess"])
def test_a_failing_rank_fails_the_world_with_torchruns_exit_code(tmp_path, threaded):
    code, forked, _, _ = _world(tmp_path, {"FAIL_RANK": "1"}, threaded)
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            str(tmp_path / "rank.py"), str(tmp_path)], env={**os.environ, "FAIL_RANK": "1"},
                           capture_output=True)
    assert forked is (not threaded) and code == plain.returncode == 1, plain.stderr[-2000:]


def test_terminate_and_wait_behave_as_popens(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time; time.sleep(600)\n")
    proc = start_torchrun(["--standalone", "--nproc-per-node=1", str(script)], dict(os.environ))
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    proc.terminate()
    code = proc.wait(timeout=60)
    assert code != 0 and proc.poll() == code
    proc.kill()  # already ended: a no-op, as Popen's
    assert proc.returncode == code


@pytest.mark.parametrize("threaded", [False, True], ids=["forked", "subprocess"])
def test_output_goes_to_the_given_files_in_the_given_directory(tmp_path, capsys, threaded):
    """Under pytest's capture (sys.stdout replaced in this process) the agent's and the ranks' output
    still reach the files, and the ranks run in ``cwd``."""
    script = tmp_path / "say.py"
    script.write_text("import os, sys; print('rank', os.environ['RANK'], 'in', os.getcwd()); "
                      "print('to stderr', file=sys.stderr)\n")
    workdir = tmp_path / "work"
    workdir.mkdir()
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait) if threaded else None
    if helper:
        helper.start()
    try:
        with open(tmp_path / "out", "w+b") as out, open(tmp_path / "err", "w+b") as err:
            proc = start_torchrun(["--standalone", "--nproc-per-node=2", str(script)], dict(os.environ),
                                  cwd=str(workdir), stdout=out, stderr=err)
            assert proc.wait(timeout=120) == 0 and (proc._popen is None) is (not threaded)
    finally:
        stop.set()
    said = (tmp_path / "out").read_text().splitlines()
    assert sorted(said) == [f"rank {r} in {workdir}" for r in (0, 1)], said
    assert (tmp_path / "err").read_text().count("to stderr") == 2
    assert capsys.readouterr().out == ""
