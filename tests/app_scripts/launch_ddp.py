"""Seed 004's `kt run` form: a script that declares a torchrun job with its command, for
`ktlite run python launch_ddp.py ARGS...` (its arguments go on to the training script)."""

import shlex
import sys
from pathlib import Path

import ktlite as kt

HERE = Path(__file__).parent
ddp = kt.app(
    name="launch-ddp",
    cli_command="torchrun --nproc_per_node=1 allreduce.py " + shlex.join(sys.argv[1:]),
    replicas=2,
    workdir=HERE,
    rendezvous_timeout=60,
)

if __name__ == "__main__":
    print("MAIN BLOCK RAN")
