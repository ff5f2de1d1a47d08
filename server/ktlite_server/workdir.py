"""The directory user code runs in, apart from the one ktlite's own processes start in.

``python -m ktlite_server`` (and ``-m ktlite_server.rank``) imports from its working
directory first: started in a folder holding a ``ktlite/`` or ``ktlite_server/`` of the
user's, it would import those instead of the installed packages. So backends start the pod
server in a directory of ktlite's own (local: the deployment's directory; ssh: the pod's run
directory), rank processes inherit it, and each rank then moves to ``KTLITE_WORKDIR`` before
any user code runs (local: the caller's working directory; ssh: the login's home). The import
path keeps the start directory, so relative paths in user code are the workdir's while
imports never see its files (the caller's local modules reach the ranks by source).
"""

from __future__ import annotations

import logging
import os

ENV = "KTLITE_WORKDIR"


def enter() -> None:
    """Move to ``KTLITE_WORKDIR`` (``~`` is the home directory) when it is set; if it cannot
    be entered, log a warning (on the rank's stderr: the pod's log) and stay where the
    process started."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        os.chdir(os.path.expanduser(path))
    except OSError as e:
        logging.getLogger(__name__).warning(
            "ktlite: cannot enter the working directory %s (%s); user code runs in %s",
            path,
            e.strerror,
            os.getcwd(),
        )
