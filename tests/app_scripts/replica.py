"""A plain command for kt.app tests, driven by MODE:

ok    print the PET_* / rank env this replica got, exit 0
wait  print "waiting", wait for the file $GO, print "done"
fail  replica 0 writes its pid to $PIDS/0 and sleeps; replica 1 waits for that file,
      prints a marker and exits 3
"""

import json
import os
import sys
import time
from pathlib import Path

mode = os.environ.get("MODE", "ok")
node = int(os.environ["PET_NODE_RANK"])

if mode == "ok":
    keys = sorted(k for k in os.environ if k.startswith("PET_")) + [
        "NODE_RANK",
        "GROUP_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "APP_GREETING",
    ]
    print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
elif mode == "wait":
    print(f"waiting {node}", flush=True)
    deadline = time.monotonic() + 60
    while not Path(os.environ["GO"]).exists():
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.05)
    print(f"done {node}", flush=True)
elif mode == "fail":
    pids = Path(os.environ["PIDS"])
    if node == 0:
        (pids / "0").write_text(str(os.getpid()))
        print("replica 0 sleeping", flush=True)
        time.sleep(120)
        print("replica 0 woke up: it was never stopped", flush=True)
    else:
        while not (pids / "0").exists():
            time.sleep(0.05)
        print("replica 1 is about to fail: marker-3f9a", flush=True)
        sys.exit(3)
