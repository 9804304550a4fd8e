"""Worker: each rank passes a different profile file to the checker; every rank must exit 2."""
import os
import sys

import yaml

from mindspeed_tp.check.main import main

rank = int(os.environ["RANK"])
tmp = sys.argv[1]
path = os.path.join(tmp, f"profile-rank{rank}.yaml")
with open(path, "w") as f:
    yaml.safe_dump({"name": "mismatch", "attention_block_size": 128 if rank == 0 else 64}, f)
code = main(["--tp", "2", "--profile", path, "--dtype", "fp32"])
with open(os.path.join(tmp, f"code{rank}"), "w") as f:
    f.write(str(code))
# The checker destroyed its groups on the error path; leave past the interpreter's teardown, where
# gloo can abort a finished process (tests/workers/worker_exit.py; seen here once in a CI-tier run)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
