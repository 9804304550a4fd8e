"""torchrun's agent in a forked copy of the launching process.

``mindspeed-tp check`` / ``train-check`` / ``rl-check`` start one torchrun world (train-check: one
per world size) per run. A ``python -m torch.distributed.run`` child spends ~1.5 s starting an
interpreter and importing torch before its agent starts the ranks; the launcher has torch imported
already, so a fork runs the same agent (``torch.distributed.run.main`` with the same arguments, in
the given environment) without that start. The ranks themselves are started by the agent exactly as
before (fresh interpreters), so nothing they compute changes. A launcher that has started threads
(forking would copy their locks in whatever state) or a platform without ``fork`` starts torchrun as
a subprocess instead: the same agent either way.
"""
import os
import subprocess
import sys
import threading
import time
import traceback
from typing import Dict, List, Optional

_POLL_S = 0.05


class TorchrunProcess:
    """A started torchrun agent: ``wait`` / ``terminate`` / ``kill`` as ``subprocess.Popen``'s."""

    def __init__(self, args: List[str], env: Dict[str, str], cwd: Optional[str] = None, stdout=None, stderr=None):
        self.args = list(args)
        self.returncode: Optional[int] = None
        self._popen = None
        if hasattr(os, "fork") and threading.active_count() == 1:
            sys.stdout.flush()
            sys.stderr.flush()
            self.pid = os.fork()
            if self.pid == 0:
                _agent(self.args, env, cwd, stdout, stderr)  # never returns
        else:
            self._popen = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *self.args], env=env,
                                           cwd=cwd, stdout=stdout, stderr=stderr)
            self.pid = self._popen.pid

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            if self._popen is not None:
                self.returncode = self._popen.poll()
            else:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["torchrun", *self.args], timeout)
            time.sleep(_POLL_S)
        return self.returncode

    def terminate(self) -> None:
        self._signal("terminate")

    def kill(self) -> None:
        self._signal("kill")

    def _signal(self, how: str) -> None:
        if self.poll() is not None:
            return
        if self._popen is not None:
            getattr(self._popen, how)()
        else:
            import signal

            os.kill(self.pid, signal.SIGTERM if how == "terminate" else signal.SIGKILL)


def _agent(args: List[str], env: Dict[str, str], cwd: Optional[str], stdout, stderr) -> None:
    """The forked child: torchrun's ``main`` with ``args``, then exit with its status as
    ``python -m torch.distributed.run`` would (1 on a failed world, after printing the error). Its
    output (and its ranks', which inherit the descriptors) goes to ``stdout`` / ``stderr`` (files)
    when given; ``sys.stdout`` / ``sys.stderr`` are rebound to descriptors 1 and 2, whatever object
    the launching process had put there (pytest's capture, say)."""
    code = 1
    try:
        for target, given in ((1, stdout), (2, stderr)):
            if given is not None:
                os.dup2(given.fileno(), target)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        if cwd is not None:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["torchrun", *args]
        from torch.distributed.run import main

        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # what the interpreter would print for an uncaught error, then its exit status
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def start_torchrun(args: List[str], env: Dict[str, str], cwd: Optional[str] = None, stdout=None,
                   stderr=None) -> TorchrunProcess:
    """torchrun with ``args`` (what follows ``python -m torch.distributed.run``), started now, in
    ``cwd`` with its output to the files ``stdout`` / ``stderr`` when given (else this process's)."""
    return TorchrunProcess(args, env, cwd, stdout, stderr)
