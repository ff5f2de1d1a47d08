"""Real OpenSSH servers on loopback, one per simulated host, for tests of the SSH backend.

    with SshHosts(tmp_path, count=2) as hosts:
        subprocess.run(["ssh", "-F", hosts.ssh_config, "host0", "hostname"])

Each host is a real ``sshd`` (its own config, host key and loopback address; never the system
config) that the real client, or any library speaking SSH, reaches through the generated
``ssh_config`` aliases with strict host key checking. ``Host.stop()`` kills the daemon and every
session on it at once, as when a machine dies; ``Host.start()`` brings it back with the same
key and port. ``SshHosts(..., sftp=False)`` leaves out the SFTP subsystem (as some hosts do);
``own_home=True`` gives each host's sessions a ``HOME`` of its own (sshd's ``SetEnv``), so
its ``~/.cache/ktlite`` starts empty. Everything lives under the caller's directory; nothing
is ever deleted.

Needs root (sshd's privilege separation; tests log in as root) and ``/usr/sbin/sshd``
(``apt-get install openssh-server``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = "/run/sshd"
START_TIMEOUT_S = 10.0
HOSTS_PER_WORKER = 20
# 127.0.0.1 and 127.0.0.10-99 belong to other harnesses; each xdist worker gets its own block
ADDRESS_PREFIX = "127.0.1."
FIRST_ADDRESS = 10


class SshdError(RuntimeError):
    """An sshd did not come up; the message carries what it wrote to stderr."""


def sshd_available() -> bool:
    """Whether this machine can run the fixture (for ``pytest.mark.skipif``)."""
    return os.path.exists(SSHD)


def ssh_marks(timeout: float) -> list[pytest.MarkDecorator]:
    """A module's ``pytestmark`` for tests against real sshd: marked ``ssh`` (run by
    ``.ci/test``'s engines half), ``timeout`` seconds each, skipped without sshd."""
    return [
        pytest.mark.ssh,
        pytest.mark.timeout(timeout),
        pytest.mark.skipif(
            not sshd_available(), reason="needs /usr/sbin/sshd (apt-get install openssh-server)"
        ),
    ]


def _keygen(path: Path, comment: str) -> str:
    """Write a passphrase-less ed25519 key pair; return the public key as "type base64"."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=True,
    )
    return " ".join(Path(f"{path}.pub").read_text().split()[:2])


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _worker_index() -> int:
    """Which xdist worker this is ("gw3" -> 3), so that concurrent workers use other addresses."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker[2:]) if worker[2:].isdigit() else 0


def _ensure_privsep_dir() -> None:
    """sshd refuses to start without it; systemd normally creates it, here nobody does."""
    try:
        os.mkdir(PRIVSEP_DIR, 0o755)
    except FileExistsError:
        return
    os.chmod(PRIVSEP_DIR, 0o755)  # mkdir's mode is masked by the umask


def _quote(path: Path) -> str:
    return f'"{path}"'


def _proc_tree() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process now alive."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # exited while we looked
        ppid = int(stat.rpartition(")")[2].split()[1])  # the command name may hold spaces or ")"
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _proc_tree(), set[int](), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def pid_gone(pid: int) -> bool:
    """Whether a process has exited (a zombie counts: whoever inherited it may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


class Host:
    """One sshd on its own loopback address and port."""

    def __init__(
        self,
        name: str,
        address: str,
        root: Path,
        authorized_keys: Path,
        extra_config: list[str],
        sftp: bool = True,
        own_home: bool = False,
    ) -> None:
        self.name = name
        self.address = address
        self.port = _free_port(address)
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sftp = sftp  # False: no `Subsystem sftp` line, as on hosts whose sshd offers none
        # its sessions' HOME (sshd's SetEnv), so that its ~/.cache/ktlite is its own
        self.home = self.dir / "home" if own_home else None
        if self.home is not None:
            self.home.mkdir(exist_ok=True)
        self.host_key = self.dir / "ssh_host_ed25519_key"
        self.host_key_pub = _keygen(self.host_key, name)
        self.config = self.dir / "sshd_config"
        self.log = self.dir / "sshd.log"
        self._authorized_keys = authorized_keys
        self._extra_config = extra_config
        self._proc: subprocess.Popen[bytes] | None = None

    def known_hosts_line(self, key: str | None = None) -> str:
        return f"[{self.address}]:{self.port} {key or self.host_key_pub}\n"

    def _write_config(self) -> None:
        lines = [
            f"ListenAddress {self.address}:{self.port}",
            f"HostKey {_quote(self.host_key)}",
            f"PidFile {_quote(self.dir / 'sshd.pid')}",
            f"AuthorizedKeysFile {_quote(self._authorized_keys)}",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",  # pytest's tmp dirs are not as private as sshd wants
            "AllowTcpForwarding yes",
            *(["Subsystem sftp internal-sftp"] if self.sftp else []),
            *([f"SetEnv HOME={self.home}"] if self.home is not None else []),
            "MaxSessions 50",
            "MaxStartups 100",
            "LogLevel ERROR",
            *self._extra_config,
        ]
        self.config.write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        """Start sshd and return once its port accepts connections."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name} is already running")
        _ensure_privsep_dir()
        self._write_config()
        log_from = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            code = self._proc.poll()
            if code is not None:
                self._proc = None
                raise SshdError(
                    f"sshd for {self.name} ({self.address}:{self.port}) exited with "
                    f"{code}: {self._log_since(log_from)}"
                )
            if self._answers():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise SshdError(
                    f"sshd for {self.name} ({self.address}:{self.port}) did not accept "
                    f"connections within {START_TIMEOUT_S} s: {self._log_since(log_from)}"
                )
            time.sleep(0.02)

    def _answers(self) -> bool:
        """Whether sshd greets a connection; the probe then says hello back, which keeps sshd
        from logging an error for a client that never identified itself."""
        try:
            with socket.create_connection((self.address, self.port), 0.5) as sock:
                greeting = sock.recv(256)
                sock.sendall(b"SSH-2.0-ssh_hosts_probe\r\n")
        except OSError:
            return False
        return greeting.startswith(b"SSH-")

    def _log_since(self, offset: int) -> str:
        with self.log.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace").strip() or "(no output)"

    def stop(self) -> None:
        """Kill sshd and everything it spawned at once, and wait until they are gone.

        The sessions call setsid(), so they are not in sshd's session or process group: they are
        found as its descendants, each frozen (SIGSTOP) before its children are looked for so
        that none can fork past us, then all killed together.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        frozen: set[int] = set()
        pending = {proc.pid}
        while pending:
            for pid in pending:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            frozen |= pending
            pending = _descendants(proc.pid) - frozen
        for pid in frozen:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while not all(pid_gone(pid) for pid in frozen - {proc.pid}):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of {self.name}'s sshd outlived SIGKILL")
            time.sleep(0.01)


class SshHosts:
    """``count`` sshd hosts under ``root``, a user key authorized on all of them, and the
    client files (``ssh_config`` aliases ``host0``.., ``known_hosts``) to reach them."""

    def __init__(
        self, root: Path, count: int, user: str = "root", sftp: bool = True, own_home: bool = False
    ) -> None:
        if not 0 < count <= HOSTS_PER_WORKER:
            raise ValueError(f"count must be 1..{HOSTS_PER_WORKER}, not {count}")
        self.root = root
        self.user = user
        root.mkdir(parents=True, exist_ok=True)
        self.user_key = root / "id_ed25519"
        authorized_keys = root / "authorized_keys"
        authorized_keys.write_text(_keygen(self.user_key, "ktlite-test") + "\n")
        self.known_hosts = root / "known_hosts"
        self.ssh_config = root / "ssh_config"
        first = FIRST_ADDRESS + HOSTS_PER_WORKER * (_worker_index() % 12)  # stays below .255
        extra = self._supported_extras()
        self.hosts = [
            Host(
                f"host{i}",
                f"{ADDRESS_PREFIX}{first + i}",
                root,
                authorized_keys,
                extra,
                sftp,
                own_home,
            )
            for i in range(count)
        ]

    def _supported_extras(self) -> list[str]:
        """``PerSourcePenalties no`` where this sshd knows it (OpenSSH >= 9.8): otherwise a test
        that fails to authenticate on purpose gets 127.0.0.1 refused by the next test's host."""
        _ensure_privsep_dir()
        check = subprocess.run(
            [
                SSHD,
                "-t",
                "-f",
                "/dev/null",
                "-o",
                f"HostKey={self.user_key}",
                "-o",
                "PerSourcePenalties=no",
            ],
            capture_output=True,
        )
        return ["PerSourcePenalties no"] if check.returncode == 0 else []

    def __enter__(self) -> SshHosts:
        try:
            for host in self.hosts:
                self._start_new(host)
        except BaseException:
            self.stop()
            raise
        self.known_hosts.write_text("".join(host.known_hosts_line() for host in self.hosts))
        self.ssh_config.write_text("".join(self._alias(host) for host in self.hosts))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @staticmethod
    def _start_new(host: Host) -> None:
        """Start a host, on another free port if something took its port since it was picked."""
        for attempt in range(3):
            try:
                host.start()
                return
            except SshdError as error:
                if "Cannot bind any address" not in str(error) or attempt == 2:
                    raise
                host.port = _free_port(host.address)

    def stop(self) -> None:
        for host in self.hosts:
            host.stop()

    def _alias(self, host: Host) -> str:
        return (
            f"Host {host.name}\n"
            f"  HostName {host.address}\n"
            f"  Port {host.port}\n"
            f"  User {self.user}\n"
            f"  IdentityFile {_quote(self.user_key)}\n"
            f"  UserKnownHostsFile {_quote(self.known_hosts)}\n"
            "  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n"
            "  IdentitiesOnly yes\n"
        )

    def compute_on(self, index: int) -> Any:
        """A ``kt.Compute`` on host ``index`` alone, through these hosts' client files and with
        this interpreter on the host."""
        import ktlite as kt

        return kt.Compute(
            hosts=kt.Hosts(
                [self.hosts[index].name],
                ssh_config=str(self.ssh_config),
                known_hosts=str(self.known_hosts),
                python=sys.executable,
            )
        )

    def wrong_host_key_known_hosts(self) -> Path:
        """A known_hosts in which host0 has another key, as if another machine had taken its
        address (for tests that the backend refuses it). Call it once the hosts are started."""
        path = self.root / "known_hosts.wrong"
        if not path.exists():
            impostor = _keygen(self.root / "impostor_ed25519_key", "impostor")
            lines = [self.hosts[0].known_hosts_line(impostor)]
            path.write_text("".join(lines + [host.known_hosts_line() for host in self.hosts[1:]]))
        return path
