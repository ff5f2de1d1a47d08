"""The ssh backend without SSH: host strings, how hosts make the deployment's layout, the
inactivity TTL, the plan (no secrets in it), and bad input refused before anything connects.
Real sshd is in test_ssh.py."""

from __future__ import annotations

import pytest

import ktlite as kt
from ktlite.api.compute import parse_duration
from ktlite.backends.registry import get_backend
from ktlite.backends.ssh import SshBackend
from ktlite.specs.deployment_spec import DeploymentSpec


@pytest.mark.parametrize(
    "address, target",
    [
        ("gpu1", (None, "gpu1", None)),
        ("alice@10.0.0.2", ("alice", "10.0.0.2", None)),
        ("alice@10.0.0.2:2222", ("alice", "10.0.0.2", 2222)),
        ("[fe80::1]:2200", (None, "fe80::1", 2200)),
        ("bob@node-3.cluster.example", ("bob", "node-3.cluster.example", None)),
    ],
)
def test_host_strings_are_ssh_destinations(address: str, target: tuple) -> None:
    assert kt.Host(address).target == target


@pytest.mark.parametrize(
    "hosts, match",
    [
        (["a b"], "not an SSH destination"),
        (["user@"], "not an SSH destination"),
        ([], "names no machine"),
        ("gpu1", "must be a list of SSH destinations"),
        (["gpu1", "gpu1"], "listed twice"),
        ([3], "must be an SSH destination string or a kt.Host"),
    ],
)
def test_bad_hosts_are_config_errors(hosts: object, match: str) -> None:
    with pytest.raises(kt.ConfigError, match=match):
        kt.Compute(hosts=hosts)
    with pytest.raises(kt.ConfigError, match="num_proc=0.*whole number >= 1"):
        kt.Host("gpu1", num_proc=0)


def test_hosts_make_the_layout_one_pod_per_host() -> None:
    c = kt.Compute(hosts=[kt.Host("node1", num_proc=4), kt.Host("node2", num_proc=2)])
    assert c.backend == "ssh" and c.distributed.workers == 2 and c.distributed.sizes == (4, 2)
    assert kt.Compute(hosts=["a", "b"]).distributed.sizes == (1, 1)
    assert kt.Compute(gpus=2, hosts=["a", "b"]).distributed.sizes == (2, 2)  # one rank per GPU
    d = kt.Compute(hosts=["a", "b", "c"]).distribute("pytorch", num_proc=2).distributed
    assert (d.framework, d.workers, d.sizes) == ("pytorch", 3, (2, 2, 2))
    d = kt.Compute(hosts=[kt.Host("a", num_proc=3), "b"]).distribute("pytorch").distributed
    assert d.sizes == (3, 1)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: kt.Compute(hosts=["a", "b"]).distribute("pytorch", workers=3),
            "workers=3.*2 host",
        ),
        (
            lambda: kt.Compute(hosts=[kt.Host("a", num_proc=2), "b"]).distribute(
                "pytorch", num_proc=4
            ),
            "Host\\('a', num_proc=2\\) but distribute\\(\\) gives it 4",
        ),
        (lambda: kt.Compute(backend="kubernetes", hosts=["a"]), "machines of backend='ssh'"),
        (lambda: kt.Hosts(["a"], forward="yes"), "forward='yes'"),
        (lambda: kt.Hosts(["a"], accept_new_host_keys="yes"), "accept_new_host_keys='yes'"),
    ],
)
def test_hosts_that_disagree_with_the_layout_are_config_errors(make, match: str) -> None:
    with pytest.raises(kt.ConfigError, match=match):
        make()


@pytest.mark.parametrize(
    "value, seconds",
    [
        (None, None),
        (600, 600.0),
        ("90", 90.0),
        ("30m", 1800.0),
        ("1h", 3600.0),
        ("2d", 172800.0),
        ("1.5h", 5400.0),
    ],
)
def test_inactivity_ttl_durations(value: object, seconds: float | None) -> None:
    assert parse_duration(value, "inactivity_ttl") == seconds
    assert kt.Compute(inactivity_ttl=value).inactivity_seconds == seconds


@pytest.mark.parametrize("value", ["soon", "0", "-5m", "5x", True])
def test_bad_inactivity_ttl(value: object) -> None:
    with pytest.raises(kt.ConfigError, match="inactivity_ttl"):
        kt.Compute(inactivity_ttl=value)  # before anything is deployed


def test_backend_ssh_without_hosts_says_what_it_needs() -> None:
    spec = DeploymentSpec("nohosts", kt.Compute(backend="ssh").pod_spec())
    with pytest.raises(kt.ConfigError, match="needs the machines: Compute\\(hosts=.*ssh.hosts"):
        SshBackend.shared().plan(spec)


def test_hosts_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KTLITE_SSH_HOSTS", "gpu1, alice@10.0.0.2:2222")
    c = kt.Compute(backend="ssh").distribute("pytorch", num_proc=2)
    assert [h.address for h in c.hosts.hosts] == ["gpu1", "alice@10.0.0.2:2222"]
    assert c.distributed.workers == 2 and c.distributed.sizes == (2, 2)
    assert kt.Compute().hosts is None  # only for the ssh backend


def test_the_plan_names_every_host_and_no_secret() -> None:
    compute = kt.Compute(
        hosts=["gpu1", "alice@10.0.0.2:2222"],
        env={"WANDB_API_KEY": "sk-secret-value"},
        inactivity_ttl="1h",
    ).distribute("pytorch", num_proc=2)
    plan = get_backend("ssh").plan(DeploymentSpec("planned", compute.pod_spec()))
    text = str(plan)
    assert "ssh gpu1:" in text and "ssh alice@10.0.0.2:2222:" in text
    assert "--inactivity-ttl 3600" in text and "--procs 2" in text
    assert "WANDB_API_KEY=..." in text and "sk-secret-value" not in text
