"""Loaded by every Python process started with this folder on PYTHONPATH (the pod servers of
tests/test_wire_server.py, and their rank processes). With KTLITE_PICKLE_AUDIT set, each
unpickling a process does is recorded in ``<KTLITE_PICKLE_AUDIT>/<pid>.log``: the test then
reads the pod servers' logs (by their pids) and ignores the rank processes'.

With KTLITE_WIRE_VERSION set, the process speaks that protocol version (an older or newer
ktlite, for the version-mismatch tests).
"""

import os
import sys

_AUDIT = os.environ.get("KTLITE_PICKLE_AUDIT")
if _AUDIT:
    import pickle
    import traceback

    def _record(what: str) -> None:
        with open(os.path.join(_AUDIT, f"{os.getpid()}.log"), "a") as f:
            f.write(f"{what}\n{''.join(traceback.format_stack(limit=12))}\n")

    _loads, _load, _Unpickler = pickle.loads, pickle.load, pickle.Unpickler

    def loads(*args, **kwargs):
        _record("pickle.loads")
        return _loads(*args, **kwargs)

    def load(*args, **kwargs):
        _record("pickle.load")
        return _load(*args, **kwargs)

    class Unpickler(_Unpickler):
        def __init__(self, *args, **kwargs):
            _record("pickle.Unpickler")
            super().__init__(*args, **kwargs)

    pickle.loads, pickle.load, pickle.Unpickler = loads, load, Unpickler
    # what a C extension's unpickling (or a reference kept from before this ran) still shows
    sys.addaudithook(
        lambda event, args: _record(f"{event} {args[:2]}") if event == "pickle.find_class" else None
    )

_VERSION = os.environ.get("KTLITE_WIRE_VERSION")
if _VERSION:
    import ktlite_wire.version

    ktlite_wire.version.PROTOCOL_VERSION = int(_VERSION)
