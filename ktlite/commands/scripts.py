"""A user's script, imported as a module by the ``ktlite`` command (``deploy``, ``run``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from ktlite.errors import ConfigError


def load_script(path: str, argv: Sequence[str] | None = None) -> ModuleType:
    """Import ``path`` as a module named after its file (so ``__main__`` blocks do not run),
    with its directory importable, as ``python script.py`` would have it. With ``argv``, the
    script sees ``sys.argv == [path, *argv]`` while it runs (a script may build its commands
    from its arguments)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"{path}: no such file; give a Python script, e.g. `ktlite deploy train.py`"
        )
    sys.path.insert(0, str(file.resolve().parent))
    name = file.stem
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path} is not a Python script")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    saved = sys.argv
    if argv is not None:
        sys.argv = [path, *argv]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = saved
    return module
