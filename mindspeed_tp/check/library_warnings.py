"""Library warnings in the checkers' processes: recorded, not printed.

megatron-core and torch warn about optional packages and settings that do not concern the check
(Apex, Transformer Engine, CUDA_DEVICE_MAX_CONNECTIONS, ...), once per rank: dozens of lines around
the result. The launchers (``mindspeed-tp check``, ``train-check``, ``rl-check``) run inside
``recorded()``: their own process records, and ``ENV`` names the directory to their torchrun workers,
which install ``Recorder`` when ``mindspeed_tp.check`` is imported (before megatron-core is). Each
process keeps its distinct warnings in a JSON file there; after the run ``report`` merges the files,
adds them to the --json report and a log file it names, and with ``-v`` lists them. mindspeed-tp's
own warnings (text starting with ``OWN``) are printed once, always.

Nothing here is installed in any other process: ``enable()`` in a user's training process, or a
worker started by the user's own torchrun, keeps Python's warning display.
"""
import contextlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from typing import Dict, Iterator, List

ENV = "MINDSPEED_TP_WARNINGS_DIR"
OWN = "mindspeed-tp:"  # the prefix of mindspeed-tp's own warnings: something the user must act on
_FILE_PREFIX = "warnings."


class Recorder:
    """A ``warnings.showwarning`` replacement: each distinct (category, text, source) is written to this
    process's file, replaced whole at every new one (a rank that dies or is killed keeps what it saw).
    ``show_own``: the launcher's one process shows mindspeed-tp's own warnings at once, with it."""

    def __init__(self, directory: str, show_own=None):
        self.path = os.path.join(directory, f"{_FILE_PREFIX}{os.getpid()}.json")
        self.show_own = show_own
        self.seen: List[Dict[str, str]] = []

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        if self.show_own is not None and str(message).startswith(OWN):
            return self.show_own(message, category, filename, lineno, file, line)
        record = {"category": category.__name__, "message": str(message), "source": f"{filename}:{lineno}"}
        if record in self.seen:
            return None
        self.seen.append(record)
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"rank": os.environ.get("RANK"), "warnings": self.seen}, f)
            os.replace(tmp, self.path)
        except OSError:  # the launcher's directory is gone (it was stopped): nothing left to report to
            pass
        return None


def install_from_env() -> None:
    """In a launcher's torchrun worker (``ENV`` set): record instead of printing."""
    directory = os.environ.get(ENV)
    if directory:
        warnings.showwarning = Recorder(directory)


@contextlib.contextmanager
def recorded() -> Iterator[str]:
    """A launcher's run: this process and the workers it starts (``ENV``, inherited) record their
    warnings in a new directory, yielded; the display and the environment are restored after."""
    with tempfile.TemporaryDirectory(prefix="mindspeed-tp-warnings-") as directory:
        shown, before = warnings.showwarning, os.environ.get(ENV)
        warnings.showwarning, os.environ[ENV] = Recorder(directory, show_own=shown), directory
        try:
            yield directory
        finally:
            warnings.showwarning = shown
            if before is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = before


def record_this_run() -> str:
    """A benchmark started by the user (its own torchrun, or one process that launches torchrun workers
    itself): every process records in one directory, named by torchrun's run id (with its port when the
    id is torchrun's default "none") or by this process (its workers inherit ``ENV``);
    ``report_after_run`` lists them on rank 0. Call it before megatron-core is imported."""
    directory = os.environ.get(ENV)
    if directory:  # a worker of a launcher of ours: it reports what this process records
        install_from_env()
        return directory
    run = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"
    if run == "none":  # plain torchrun's default id: two launches on one host would share (and delete) a
        run = f"none-port{os.environ.get('MASTER_PORT', os.getppid())}"  # directory; their ports differ
    directory = os.path.join(tempfile.gettempdir(), f"mindspeed-tp-warnings-{run}")
    os.makedirs(directory, exist_ok=True)
    os.environ[ENV] = directory
    warnings.showwarning = Recorder(directory, show_own=warnings.showwarning)
    return directory


def report_after_run(verbose: bool, prog: str) -> None:
    """The end of a ``record_this_run`` benchmark: after every rank got here, rank 0 reports (nothing
    when this process records for a launcher of ours, or not at all)."""
    import torch.distributed as dist

    directory = os.environ.get(ENV)
    if not directory or not isinstance(warnings.showwarning, Recorder) or warnings.showwarning.show_own is None:
        return  # nothing recorded here, or a worker whose launcher reports
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        if dist.get_rank() != 0:
            return
    from types import SimpleNamespace

    report(directory, SimpleNamespace(json=None, verbose=verbose), prog, finished=False)
    shutil.rmtree(directory, ignore_errors=True)  # the log file keeps what it held


def add_verbose_flag(parser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=None,
                        help="after the result, list the library warnings (megatron-core, torch) the run raised, "
                             "once each; hidden by default, always in the --json report and a log file")


def collect(directory: str) -> List[Dict]:
    """Every distinct warning of the processes' files, with ``processes``: how many raised it."""
    counts: Dict[tuple, int] = {}
    for name in sorted(os.listdir(directory)):
        if not (name.startswith(_FILE_PREFIX) and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                found = json.load(f)["warnings"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for w in found:
            key = (w["category"], w["message"], w["source"])
            counts[key] = counts.get(key, 0) + 1
    return [{"category": c, "message": m, "source": s, "processes": n} for (c, m, s), n in sorted(counts.items())]


def _line(w: Dict) -> str:
    n = w["processes"]
    return f"[{n} process{'es' if n != 1 else ''}] {w['source']}: {w['category']}: {w['message']}"


def report(directory: str, ns, prog: str, finished: bool) -> None:
    """After the run: mindspeed-tp's own warnings on stderr; every warning in the --json report (when
    ``finished``: the run wrote it) and a log file; with ``ns.verbose`` the library ones listed too."""
    from .report import write_json_atomic

    found = collect(directory)
    for w in found:
        if w["message"].startswith(OWN):
            print(f"{w['category']}: {w['message']}", file=sys.stderr)
    if finished and ns.json and os.path.isfile(ns.json):
        with open(ns.json) as f:
            data = json.load(f)
        data["warnings"] = found
        write_json_atomic(ns.json, data)
    library = [w for w in found if not w["message"].startswith(OWN)]
    if not library:
        return
    fd, log = tempfile.mkstemp(prefix="mindspeed-tp-warnings-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write("".join(_line(w) + "\n" for w in found))
    if ns.verbose:
        print(f"library warnings ({len(library)}, once each):", file=sys.stderr)
        for w in library:
            print("  " + _line(w), file=sys.stderr)
        print(f"{prog}: these warnings are also in {log}", file=sys.stderr)
    else:
        print(f"{prog}: {len(library)} library warning(s) hidden (-v lists them): {log}", file=sys.stderr)
