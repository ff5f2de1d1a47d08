"""Hosts of the ``ssh`` backend: bare machines reached over SSH, one pod per host.

    kt.Compute(backend="ssh", hosts=["gpu1", "alice@10.0.0.2:2222"])
    kt.Compute(backend="ssh", hosts=[kt.Host("node1", num_proc=4), kt.Host("node2", num_proc=2)])
    kt.Compute(backend="ssh", hosts=kt.Hosts(["gpu1", "gpu2"], accept_new_host_keys=True))

A host string is what ``ssh`` takes: an alias of ``~/.ssh/config`` (its HostName, User,
Port, IdentityFile, ProxyJump apply), ``host``, ``user@host`` or ``user@host:port``
(``[v6addr]:port`` for IPv6).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ktlite.errors import ConfigError

_TARGET = re.compile(
    r"^(?:(?P<user>[^@\s/]+)@)?(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^@:\s/\[\]]+))"
    r"(?::(?P<port>\d{1,5}))?$"
)


@dataclass(frozen=True)
class Host:
    """One machine: ``address`` as ``ssh`` takes it, and its rank processes (``num_proc``,
    default: the deployment's)."""

    address: str
    num_proc: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or _TARGET.match(self.address) is None:
            raise ConfigError(
                f"host {self.address!r} is not an SSH destination; give an alias of "
                "~/.ssh/config or host, user@host, user@host:port"
            )
        if self.num_proc is not None and (
            isinstance(self.num_proc, bool)
            or not isinstance(self.num_proc, int)
            or self.num_proc < 1
        ):
            raise ConfigError(
                f"Host({self.address!r}, num_proc={self.num_proc!r}): num_proc is the rank "
                "processes on that host, a whole number >= 1"
            )

    @property
    def target(self) -> tuple[str | None, str, int | None]:
        """(user, host, port) as written; the SSH config fills what is None."""
        m = _TARGET.match(self.address)
        assert m is not None
        port = int(m["port"]) if m["port"] else None
        if port is not None and not 1 <= port <= 65535:
            raise ConfigError(f"host {self.address!r}: port {port} is out of range")
        return m["user"], m["v6"] or m["host"], port


@dataclass(frozen=True)
class Hosts:
    """The machines of an ``ssh`` deployment and how to reach them.

    Args:
        hosts: :class:`Host` objects or SSH destinations, one pod each, in rank order.
        accept_new_host_keys: trust (and add to known_hosts) the key of a host not yet in it,
            as ``StrictHostKeyChecking=accept-new``; a host whose key changed is refused
            either way. Default False: an unknown host is refused.
        python: the Python to run on the hosts (default: the first of python3.X, python3
            at least this client's minor version).
        forward: reach the pod servers through SSH port forwards (True), straight over TCP
            (False), or straight where the host's port answers and forwarded where not (None).
        master_addr: the address the hosts reach host 0 by (default: the address SSH
            reached it at); for machines with several networks.
        ssh_config: the OpenSSH client config to read (default ``~/.ssh/config``).
        known_hosts: the known_hosts file (default ``~/.ssh/known_hosts``).
    """

    hosts: tuple[Host, ...] = ()
    accept_new_host_keys: bool = False
    python: str | None = None
    forward: bool | None = None
    master_addr: str | None = None
    ssh_config: str | None = None
    known_hosts: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.hosts, (str, Host)):
            raise ConfigError(
                f"hosts={self.hosts!r} must be a list of hosts, e.g. ['gpu1', 'gpu2']"
            )
        items = tuple(
            h if isinstance(h, Host) else Host(h) if isinstance(h, str) else _bad(h)
            for h in self.hosts
        )
        if not items:
            raise ConfigError("hosts=[] names no machine; give at least one SSH destination")
        seen: dict[str, int] = {}
        for i, h in enumerate(items):
            if h.address in seen:
                raise ConfigError(
                    f"host {h.address!r} is listed twice (entries {seen[h.address]} and {i}); "
                    "one pod per host: give it num_proc=... instead"
                )
            seen[h.address] = i
        object.__setattr__(self, "hosts", items)
        for name in ("accept_new_host_keys",):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.forward not in (None, True, False):
            raise ConfigError(f"forward={self.forward!r} must be True, False or None (automatic)")

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def sizes(self) -> list[int | None]:
        """Each host's ``num_proc`` (None: the deployment's)."""
        return [h.num_proc for h in self.hosts]


def _bad(entry: object) -> Host:
    raise ConfigError(f"hosts entry {entry!r} must be an SSH destination string or a kt.Host")


def as_hosts(value: object) -> Hosts | None:
    """``Compute(hosts=...)``: None, a list of destinations/``Host`` s, or a ``Hosts``."""
    if value is None or isinstance(value, Hosts):
        return value
    if isinstance(value, (list, tuple)):
        return Hosts(tuple(value))
    raise ConfigError(
        f"hosts={value!r} must be a list of SSH destinations (or kt.Host objects), or kt.Hosts(...)"
    )
