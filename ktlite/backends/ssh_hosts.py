"""The ssh backend's connections: one per host, on an asyncio loop of its own thread, and
how a host's pod server is reached (straight over TCP, or from the host itself)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shlex
import socket
import threading
from pathlib import Path
from typing import Any

import asyncssh

from ktlite.errors import DeployError
from ktlite.specs.hosts import Host, Hosts

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 15.0
COMMAND_TIMEOUT_S = 120.0


class Loop:
    """An asyncio loop on a thread of its own: the SSH connections live there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="ktlite-ssh", daemon=True).start()

    def run(self, coro: Any, timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before 3.11
            future.cancel()
            raise TimeoutError(f"over {timeout:.0f}s") from None


class HostConnection:
    """One host's connection and what the client learned about it."""

    def __init__(self, index: int, host: Host, options: Hosts) -> None:
        self.index = index
        self.host = host
        self.options = options
        self.conn: Any = None
        self.address = ""  # the IP address SSH reached: where the other hosts reach this one
        self.tether: Any = None  # a non-detached server's launcher channel
        self.forward: Any = None  # a local port forward to its server, when used
        self.python = "python3"  # the host's Python, once found

    @property
    def label(self) -> str:
        return f"host {self.index} ({self.host.address})"

    async def connect(self) -> None:
        user, hostname, port = self.host.target
        known = self.options.known_hosts
        kwargs: dict[str, Any] = {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "keepalive_interval": 5,
            "keepalive_count_max": 3,
        }
        if self.options.ssh_config:
            kwargs["config"] = [os.path.expanduser(self.options.ssh_config)]
        if known:
            kwargs["known_hosts"] = os.path.expanduser(known)
        if user:
            kwargs["username"] = user
        if port:
            kwargs["port"] = port
        try:
            self.conn = await asyncssh.connect(hostname, **kwargs)
        except asyncssh.HostKeyNotVerifiable as e:
            if not self.options.accept_new_host_keys:
                raise DeployError(
                    f"{self.label}: its host key is not trusted ({e}); a host not yet in "
                    "known_hosts is accepted only with kt.Hosts(..., accept_new_host_keys=True), "
                    "a changed key never (check with the host's owner, then fix known_hosts)"
                ) from None
            self.conn = await self._accept_new(hostname, kwargs)
        except asyncssh.PermissionDenied as e:
            raise DeployError(
                f"{self.label}: authentication refused ({e.reason}); check the user, the "
                "key (IdentityFile, ssh-agent) and the host's authorized_keys"
            ) from None
        except (OSError, asyncio.TimeoutError, asyncssh.Error) as e:
            raise DeployError(
                f"{self.label}: cannot connect over SSH: {type(e).__name__}: {e}"
            ) from None
        peer = self.conn.get_extra_info("peername")
        self.address = (
            self.options.master_addr if self.index == 0 and self.options.master_addr else peer[0]
        )

    async def _accept_new(self, hostname: str, kwargs: dict[str, Any]) -> Any:
        """``accept_new_host_keys``: connect without checking the key, refuse if known_hosts
        lists the host with another key (a changed key, never accepted), else record it."""
        conn = await asyncssh.connect(hostname, **{**kwargs, "known_hosts": None})
        key = conn.get_server_host_key()
        if key is None:
            conn.close()
            raise DeployError(f"{self.label}: the SSH server sent no host key; not connecting")
        path = Path(os.path.expanduser(self.options.known_hosts or "~/.ssh/known_hosts"))
        addr, port = conn.get_extra_info("peername")[:2]
        listed = []
        if path.exists():
            known = asyncssh.read_known_hosts(str(path))
            for name_ in {hostname, addr}:
                keys, ca_keys, revoked = known.match(name_, addr, port)[:3]
                listed += [*keys, *ca_keys, *revoked]
        if listed:
            conn.close()
            raise DeployError(
                f"{self.label}: its host key CHANGED: {path} lists another key for it. It is "
                "refused even with accept_new_host_keys (someone may be in the middle); check "
                "with the host's owner, then remove the old line from known_hosts"
            )
        name = addr if port == 22 else f"[{addr}]:{port}"
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"{name} {key.export_public_key().decode().strip()}\n")
        logger.warning("added %s's host key to %s (accept_new_host_keys)", self.label, path)
        return conn

    async def run(
        self, command: str, input: str | None = None, timeout: float = COMMAND_TIMEOUT_S
    ) -> str:
        try:
            result = await asyncio.wait_for(
                self.conn.run(command, input=input, check=False), timeout
            )
        except asyncio.TimeoutError:
            raise DeployError(
                f"{self.label}: `{command[:200]}` did not end within {timeout:.0f}s"
            ) from None
        except (asyncssh.Error, OSError) as e:  # e.g. the host refuses another session
            raise DeployError(
                f"{self.label}: `{command[:200]}` could not run: {type(e).__name__}: {e}"
            ) from None
        if result.exit_status != 0:
            raise DeployError(
                f"{self.label}: `{command[:200]}` failed (exit {result.exit_status}): "
                f"{(result.stderr or result.stdout or '').strip()[-1500:]}"
            )
        return str(result.stdout)

    def close(self) -> None:
        if self.forward is not None:
            self.forward.close()
        if self.tether is not None:
            self.tether.close()
        if self.conn is not None:
            self.conn.close()


def remote_path(path: str) -> str:
    """``path`` for the host's shell, quoted, with a leading ``~`` still its home."""
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def tcp_ok_now(address: str, port: int, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((address, port), timeout).close()
    except OSError:
        return False
    return True


async def tcp_ok(address: str, port: int, timeout: float = 1.0) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(address, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def answers(address: str, port: int, c: HostConnection) -> bool:
    """Whether a kept pod's server still listens (from here, or from its host)."""
    if await tcp_ok(address, port):
        return True
    probe = f"import socket; socket.create_connection(({address!r}, {int(port)}), 2).close()"
    try:
        await c.run(f"{shlex.quote(c.python)} -c {shlex.quote(probe)}", timeout=10)
    except DeployError:
        return False
    return True
