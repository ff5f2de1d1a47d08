"""Make this interpreter's ``tarfile`` look like one from before PEP 706 (extraction filters),
as in Debian 12's Python 3.11.2 or any 3.10 < 3.10.12 / 3.11 < 3.11.4, which ktlite supports.

Put this folder first on ``PYTHONPATH`` and Python imports it at startup (``site`` runs
``sitecustomize``); child processes inherit the variable, so a whole process tree gets the old
``tarfile``. Used by the stand-in cluster's pods (``kube_harness.py``), imitating a real
cluster's image, and by ``test_app_extract.py``.

What an old ``tarfile`` lacks, and so what goes: the filter functions and their errors,
``TarFile.extraction_filter``, ``TarInfo.replace``, and the ``filter=`` argument of
``extractall``/``extract`` (passing it raises ``TypeError``, as there). Extraction without it
keeps the old behaviour: every member as the archive says (the ``fully_trusted`` filter).
"""

from __future__ import annotations

import tarfile
from typing import Any

_GONE = (
    "data_filter",
    "tar_filter",
    "fully_trusted_filter",
    "FilterError",
    "AbsolutePathError",
    "OutsideDestinationError",
    "SpecialFileError",
    "AbsoluteLinkError",
    "LinkOutsideDestinationError",
)


def _make_old() -> None:
    trusted = getattr(tarfile, "fully_trusted_filter", None)
    if trusted is None:
        return  # already an old tarfile
    new_extractall, new_extract = tarfile.TarFile.extractall, tarfile.TarFile.extract

    # the old signatures; the filter is passed as a function because the module-level
    # names the new code looks a filter up by are deleted below
    def extractall(
        self: tarfile.TarFile, path: Any = ".", members: Any = None, *, numeric_owner: bool = False
    ) -> None:
        new_extractall(self, path, members, numeric_owner=numeric_owner, filter=trusted)

    def extract(
        self: tarfile.TarFile,
        member: Any,
        path: Any = "",
        set_attrs: bool = True,
        *,
        numeric_owner: bool = False,
    ) -> None:
        new_extract(self, member, path, set_attrs, numeric_owner=numeric_owner, filter=trusted)

    extractall.__qualname__, extract.__qualname__ = "TarFile.extractall", "TarFile.extract"
    tarfile.TarFile.extractall = extractall  # type: ignore[method-assign]
    tarfile.TarFile.extract = extract  # type: ignore[method-assign]
    for name in _GONE:
        delattr(tarfile, name)
    del tarfile.TarFile.extraction_filter
    del tarfile.TarInfo.replace


_make_old()
