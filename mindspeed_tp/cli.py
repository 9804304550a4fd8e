"""``mindspeed-tp`` console script.

``mindspeed-tp check [flags]`` validates the flags, then launches torchrun on this node with as
many processes as the layouts need (``--nproc`` overrides) running ``python -m mindspeed_tp.check``.
For several nodes, run ``torchrun --nnodes ... -m mindspeed_tp.check`` yourself on each node.

Exit codes: 0 bitwise equal, 1 not bitwise equal, 2 bad input or usage, 3 the run crashed.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import List, Optional

from .errors import ConfigError


def _check(argv: List[str]) -> int:
    from .check.main import plan, required_world_size, resolve_args

    nproc = None
    rest = []
    it = iter(argv)
    for a in it:
        if a == "--nproc":
            nproc = next(it, None)
        elif a.startswith("--nproc="):
            nproc = a.split("=", 1)[1]
        else:
            rest.append(a)
    if "-h" in rest or "--help" in rest:
        from .check.main import build_parser

        build_parser().print_help()
        print("\n  --nproc N             processes to launch (default: the least common multiple of tp*pp)")
        return 0
    try:
        ns = resolve_args(rest)
        layouts = plan(ns).layouts
        world = required_world_size(layouts)
        if nproc is not None:
            if not str(nproc).isdigit() or int(nproc) < 1 or int(nproc) % world:
                raise ConfigError(f"--nproc={nproc} must be a positive multiple of {world} (tp*pp of the layouts)")
            world = int(nproc)
    except ConfigError as exc:
        print(f"mindspeed-tp check: error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mindspeed-tp-") as tmp:
        status = os.path.join(tmp, "status")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "mindspeed_tp.check", *rest, "--status-file", status]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.run(cmd, env=env)
        codes = []
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name)) as f:
                codes.append(json.load(f)["exit_code"])
        if not codes:
            print(f"mindspeed-tp check: the run crashed (torchrun exit code {proc.returncode})", file=sys.stderr)
            return 3
        return 2 if 2 in codes else max(codes)


def _patches(argv: List[str]) -> int:
    from .backends.cpu_shims import shim_registry
    from .patches import registry

    for title, reg in (("numerics patches", registry()), ("CPU shims (no accelerator only)", shim_registry())):
        print(f"# {title}")
        for p in reg.patches:
            print(f"- {p.target}\n    {p.reason}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"check": _check, "patches": _patches}
    if not argv or argv[0] not in commands:
        print("usage: mindspeed-tp {check,patches} [flags]   (mindspeed-tp check --help)", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
