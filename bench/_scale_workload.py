"""The class ``bench_scale.py`` deploys on its simulated ranks (importable by reference in
the simulated pods' host processes, whose ``sys.path`` holds ``bench/``)."""

from __future__ import annotations

import asyncio


class Workload:
    """One instance per rank: the calls the scale harness times."""

    def __init__(self, tag: str = "first") -> None:
        self._tag = tag

    def tag(self) -> str:
        return self._tag

    def noop(self) -> None:
        return None

    def kilobyte(self) -> bytes:
        return b"x" * 1024

    def echo(self, item: object) -> object:
        return item

    def say(self) -> None:
        print("this rank says hello")

    async def hold(self, seconds: float) -> None:
        """A long call (a cancel or a pod's death ends it): says when it started."""
        print("this rank holds")
        await asyncio.sleep(seconds)
