"""A module that stands for a C extension such as torch's: importing it registers it with the
process (``sys``, which outlives a failed import), and a second registration is refused, as
pybind11 refuses to define a type twice ("an object with that name is already defined").
``SLOW_IMPORT_HOLD`` seconds of its import are spent after registering (torch's import takes
seconds on a busy machine); ``SLOW_IMPORT_MARKER`` names a file touched when the import began."""

import os
import sys
import time
from pathlib import Path

if getattr(sys, "_slow_import_registered", False):
    raise RuntimeError(
        "generic_type: cannot initialize type 'SlowImport': an object with that name "
        "is already defined"
    )
sys._slow_import_registered = True  # type: ignore[attr-defined]
if os.environ.get("SLOW_IMPORT_MARKER"):
    Path(os.environ["SLOW_IMPORT_MARKER"]).touch()
_end = time.monotonic() + float(os.environ.get("SLOW_IMPORT_HOLD") or 0)
while time.monotonic() < _end:
    time.sleep(0.02)
VALUE = "imported"
