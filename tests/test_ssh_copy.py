"""The ssh backend on hosts whose sshd has no SFTP subsystem (no ``Subsystem sftp`` line),
each with a home directory of its own (so its ``~/.cache/ktlite`` starts empty): ktlite's
source reaches the host over the SSH connection itself, a failed copy names the host and
leaves no staging directory, and a ``ktlite`` folder in the login's home shadows nothing
(user code runs in that home). Marked ``ssh`` like ``test_ssh.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from ssh_hosts import SshHosts, ssh_marks

import ktlite as kt

pytestmark = ssh_marks(timeout=180)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    with SshHosts(tmp_path_factory.mktemp("ssh-nosftp"), count=3, sftp=False, own_home=True) as h:
        yield h


on = SshHosts.compute_on  # on(hosts, i): a Compute on host i alone


def cache(home: Path) -> list[str]:
    root = home / ".cache" / "ktlite"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def tree_digest(root: Path) -> str:
    """ssh_copy.DIGEST, run here as the host runs it."""
    from ktlite.backends.ssh_copy import DIGEST

    space: dict = {}
    exec(DIGEST, space)
    return space["tree_digest"](str(root))


def double(x: int) -> int:
    return 2 * x


def where() -> dict:
    import os

    import ktlite
    import ktlite_server

    with open("data.txt") as f:  # relative: the login's home
        data = f.read()
    return {
        "cwd": os.getcwd(),
        "data": data,
        "ktlite": ktlite.__file__,
        "ktlite_server": ktlite_server.__file__,
    }


def test_a_host_without_sftp_gets_ktlite_over_the_ssh_connection(hosts: SshHosts) -> None:
    # it once failed with "DeployError: Session request failed" (the SFTP subsystem refused)
    home = hosts.hosts[0].home
    assert home is not None and cache(home) == []
    remote = kt.fn(double, name="nosftp-copy").to(on(hosts, 0))
    try:
        assert remote(21) == [42]
    finally:
        remote.teardown()
    entries = cache(home)
    sources = [e for e in entries if e.startswith("src-")]
    assert len(sources) == 1, entries
    # named for its digest, which the host's copy has (the host computed it as this client does)
    assert tree_digest(home / ".cache" / "ktlite" / sources[0]) == sources[0][len("src-") :]
    assert (home / ".cache" / "ktlite" / sources[0] / "ktlite" / "api" / "remote.py").exists()
    assert not [e for e in entries if ".tmp-" in e], entries


def test_a_failed_copy_names_the_host_and_leaves_no_staging_directory(
    hosts: SshHosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ktlite.backends.ssh import SshBackend

    home = hosts.hosts[1].home
    assert home is not None
    # what the host receives is not a tar.gz: its unpacking fails half way
    monkeypatch.setattr(
        SshBackend.shared(), "_bundle", ("0badc0ffee000000", b"not a tar.gz" * 1000)
    )
    with pytest.raises(kt.DeployError) as info:
        kt.fn(double, name="nosftp-broken").to(on(hosts, 1))
    message = str(info.value)
    assert message.startswith(f"host 0 ({hosts.hosts[1].name}): copying "), message
    assert "src-0badc0ffee000000" in message and "ReadError" in message, message
    assert not [e for e in cache(home) if e.startswith("src-")], cache(
        home
    )  # no staging, no half copy


def test_a_ktlite_folder_in_the_login_home_shadows_nothing(hosts: SshHosts) -> None:
    # the pod's launcher once started with `cd ~ && python -m ktlite_server.sshlaunch`, which
    # imported the home's ktlite_server folder
    home = hosts.hosts[2].home
    assert home is not None
    for package in ("ktlite", "ktlite_server"):
        (home / package).mkdir()
        (home / package / "__init__.py").write_text(
            f"raise ImportError('the home\\'s {package} folder')\n"
        )
    (home / "data.txt").write_text("read from the home directory")
    remote = kt.fn(where, name="nosftp-home").to(on(hosts, 2))
    try:
        (seen,) = remote()
    finally:
        remote.teardown()
    assert seen["cwd"] == str(home) and seen["data"] == "read from the home directory", seen
    shipped = str(home / ".cache" / "ktlite")
    assert seen["ktlite"].startswith(shipped) and seen["ktlite_server"].startswith(shipped), seen
