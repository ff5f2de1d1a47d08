"""``ktlite.compute``: the module of :class:`Compute` and :class:`Volume` that also is, when
called, the ``@kt.compute`` decorator.

``kt.compute(cpus=2)`` is Kubetorch's decorator and ``kt.Compute`` its class; a module that
held the class under the decorator's name used to be hidden by the decorator
(``import ktlite.compute`` gave a function). This module is both, so ``import ktlite.compute``,
``from ktlite.compute import Compute`` and ``@kt.compute(cpus=1)`` all work.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

from ktlite.api.compute import Compute
from ktlite.api.decorators import compute as _decorator
from ktlite.specs.volume import Volume

__all__ = ["Compute", "Volume"]


class _DecoratorModule(types.ModuleType):
    """A module that calls ``@kt.compute`` when called."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _decorator(*args, **kwargs)


__signature__ = inspect.signature(_decorator)
__wrapped__ = _decorator
sys.modules[__name__].__class__ = _DecoratorModule
