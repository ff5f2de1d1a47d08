"""Run the unmodified torchrun script train_ddp.py on 2 replicas x 2 processes with kt.app.

Run from the repository root (needs torch, and `torchrun` on PATH: an activated venv):

    python examples/torchrun_app.py
    ktlite run examples/torchrun_app.py       # the same, from the shell

Each replica is a pod running the command; ktlite gives torchrun its node count, node rank
and master address (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, ...), so the command names
none of them. Output streams as "[replica r] ...".
"""

from __future__ import annotations

from pathlib import Path

import ktlite as kt

app = kt.app(
    cli_command="torchrun --nproc_per_node=2 train_ddp.py --steps 5",
    replicas=2,
    name="torchrun-ddp",
    workdir=Path(__file__).parent,  # the files the replicas get (this folder)
    cpus=2,
    rendezvous_timeout=120,  # fail instead of hanging if the replicas never meet
)

if __name__ == "__main__":
    try:
        print("exit codes", app.run())  # [0, 0]
    finally:
        app.teardown()
