"""The ssh backend's copies in a host's cache (``~/.cache/ktlite``) are reused only while they
hold what was shipped (issue 25, item 8): each is named for the digest of its files and checked
against it, so a copy that was changed, lost a file or gained one is shipped again, and the
cache is the user's alone (0700). Real sshd hosts with homes of their own; marked ``ssh``."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from ssh_hosts import SshHosts, ssh_marks

import ktlite as kt

pytestmark = ssh_marks(timeout=240)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    with SshHosts(tmp_path_factory.mktemp("ssh-cache"), count=3, own_home=True) as h:
        yield h


on = SshHosts.compute_on  # on(hosts, i): a Compute on host i alone


def which_server() -> str:
    import ktlite_server
    import ktlite_wire.frames

    return f"{ktlite_server.__file__} {ktlite_wire.frames.__file__}"


def _source_copy(home: Path) -> Path:
    (copy,) = (home / ".cache" / "ktlite").glob("src-*")
    return copy


def _deploy(hosts: SshHosts, index: int, name: str) -> str:
    remote = kt.fn(which_server, name=name).to(on(hosts, index))
    try:
        (seen,) = remote()
    finally:
        remote.teardown()
    return seen


@pytest.mark.parametrize(
    ("index", "spoil"),
    [(0, "changed"), (1, "cut short"), (2, "grown")],
)
def test_a_spoilt_copy_of_ktlite_on_a_host_is_shipped_again(
    hosts: SshHosts, index: int, spoil: str
) -> None:
    home = hosts.hosts[index].home
    assert home is not None
    first = _deploy(hosts, index, f"cache-{index}-a")
    copy = _source_copy(home)
    assert str(copy) in first
    cache = home / ".cache" / "ktlite"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    marker = home / "tampered"
    server_init = copy / "ktlite_server" / "__init__.py"
    original = server_init.read_bytes()
    if spoil == "changed":  # code that runs in every pod server started from this copy
        server_init.write_text(f"open({str(marker)!r}, 'w').close()\n" + original.decode())
    elif spoil == "cut short":  # a module gone (a copy cut off, a disk that filled up)
        (copy / "ktlite_wire" / "frames.py").unlink()
    else:  # a file that was never shipped, on the copy's import path
        (copy / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    second = _deploy(hosts, index, f"cache-{index}-b")
    assert not marker.exists(), "a pod server ran the spoilt copy"
    assert str(copy) in second  # the same copy, shipped again
    assert server_init.read_bytes() == original
    assert (copy / "ktlite_wire" / "frames.py").is_file()
    assert not (copy / "sitecustomize.py").exists()
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith("src-")) == [copy.name]
