"""The launchers start torchrun's agent in a forked copy of themselves (mindspeed_tp/torchrun_process.py):
the same agent and the same ranks as ``python -m torch.distributed.run`` -- each rank a fresh
interpreter in the given environment and directory, its output where it is sent, the world's exit
code torchrun's -- and, with threads running in the launcher, the subprocess it replaces. Each case
runs in a fresh interpreter (a launcher), one without a thread of its own and one with."""
import json
import os
import subprocess
import sys

import pytest

from conftest import explain, full_tier, run_python

# the subprocess path is ``python -m torch.distributed.run`` itself: the CI tier runs it once (the
# environment and output case), the failing-rank case in the full tier
_SUBPROCESS_FULL = full_tier(
    covered_by="tests/test_torchrun_process.py::test_a_world_runs_fresh_ranks_in_the_given_environment_and_directory",
    why="the subprocess path is torchrun's own command, whose exit code the forked case compares against")

LAUNCHER = r"""
import json, os, sys, threading
from mindspeed_tp.torchrun_process import start_torchrun
out, threaded, args = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
stop = threading.Event()
if threaded:
    threading.Thread(target=stop.wait).start()
assert threading.active_count() == 1 + threaded
with open(os.path.join(out, "out"), "w+b") as o, open(os.path.join(out, "err"), "w+b") as e:
    proc = start_torchrun(args, {**os.environ, "MARK": "given"}, cwd=os.path.join(out, "work"), stdout=o, stderr=e)
    code = proc.wait(timeout=120)
stop.set()
print(json.dumps({"code": code, "forked": proc._popen is None, "agent": proc.pid, "launcher": os.getpid()}))
"""

RANK_SCRIPT = """
import json, os, sys
rank = int(os.environ["RANK"])
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "mark": os.environ.get("MARK"),
               "fresh": "mindspeed_tp" not in sys.modules, "ppid": os.getppid(), "cwd": os.getcwd()}, f)
# one write per line: two ranks share the files, and an unbuffered print writes its pieces separately
os.write(1, f"rank {rank} says hello\\n".encode())
os.write(2, f"rank {rank} to stderr\\n".encode())
sys.exit(5 if os.environ.get("FAIL_RANK") == str(rank) else 0)
"""


def _launch(tmp_path, threaded, env=None, nproc=2, script=RANK_SCRIPT):
    (tmp_path / "work").mkdir()
    (tmp_path / "rank.py").write_text(script)
    args = [str(tmp_path), "1" if threaded else "0", "--standalone", f"--nproc-per-node={nproc}",
            str(tmp_path / "rank.py"), str(tmp_path)]
    code = f"import sys; sys.argv = ['launcher'] + {args!r}\n" + LAUNCHER
    proc = run_python(code, env={"MARK": "the launcher's, not the world's", **(env or {})})
    assert proc.returncode == 0, explain(proc)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("threaded", [False, True], ids=["forked", "subprocess"])
def test_a_world_runs_fresh_ranks_in_the_given_environment_and_directory(tmp_path, threaded):
    got = _launch(tmp_path, threaded)
    assert got["code"] == 0 and got["forked"] is (not threaded)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world"] for r in ranks} == {2}
    assert all(r["mark"] == "given" and r["fresh"] and r["cwd"] == str(tmp_path / "work") for r in ranks), ranks
    assert {r["ppid"] for r in ranks} == {got["agent"]} and got["agent"] != got["launcher"]
    said = (tmp_path / "out").read_text().splitlines()
    assert sorted(line for line in said if "says hello" in line) == [f"rank {r} says hello" for r in (0, 1)]
    assert (tmp_path / "err").read_text().count("to stderr") == 2


@pytest.mark.parametrize("threaded", [False, pytest.param(True, marks=_SUBPROCESS_FULL)], ids=["forked", "subprocess"])
def test_a_failing_rank_fails_the_world_with_torchruns_exit_code(tmp_path, threaded):
    got = _launch(tmp_path, threaded, env={"FAIL_RANK": "1"})
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            str(tmp_path / "rank.py"), str(tmp_path)], env={**os.environ, "FAIL_RANK": "1"},
                           capture_output=True)
    assert got["forked"] is (not threaded) and got["code"] == plain.returncode == 1, plain.stderr[-2000:]


def test_terminate_and_wait_behave_as_popens(tmp_path):
    from mindspeed_tp.torchrun_process import start_torchrun

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


def test_every_process_group_worker_ends_through_finish_worker():
    """torch's gloo teardown can abort a rank whose work is done (tests/workers/worker_exit.py); a
    worker that joins a process group and ends with its own destroy_process_group fails its test on
    torchrun's exit code alone (process_groups.py did, once in a CI run). Each such worker ends
    through finish_worker."""
    workers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
    joining, bare = [], []
    for name in sorted(os.listdir(workers)):
        if not name.endswith(".py") or name == "worker_exit.py":
            continue
        with open(os.path.join(workers, name)) as f:
            source = f.read()
        if "init_distributed(" in source or "init_process_group(" in source:
            joining.append(name)
            if "finish_worker()" not in source or "dist.destroy_process_group()" in source:
                bare.append(name)
    assert len(joining) >= 10 and bare == [], bare
