"""``python -m ktlite_server``: run one pod's server (:mod:`ktlite_server.podprocess`).

The cyclic garbage collector is off while the server's modules load: FastAPI, pydantic and
uvicorn build some hundred thousand objects, and the collections their creation sets off
scanned them again and again, about a quarter of the process's start CPU (0.52 -> 0.38 s on
this project's 2-core machine). They are then frozen (``gc.freeze``): long-lived, never
garbage, so later collections, on the call path, skip them.
"""

from __future__ import annotations

import gc

gc.disable()
from ktlite_server.podprocess import main  # noqa: E402  (after gc.disable, on purpose)

gc.freeze()
gc.enable()

if __name__ == "__main__":
    main()
