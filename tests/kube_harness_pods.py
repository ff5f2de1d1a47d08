"""The pods of the stand-in cluster (``kube_harness.py``): a real ``ktlite_server`` process
behind each pod the fake API server creates, its environment, Secret files and volumes, its
readiness as the kubelet would probe it, and the pod proxy's table that forwards to it."""

from __future__ import annotations

import base64
import itertools
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import image_python  # noqa: E402
import kube_fake as kf  # noqa: E402
from kube_harness_sandbox import (  # noqa: E402
    _as,
    _black_hole,
    _hide_callers_files,
    _pod_user,
    _stop,
    _under,
)
from mount_points import MountPoints  # noqa: E402

from ktlite.backends.kube_pod_template import STATE_DIR  # noqa: E402

NAMESPACE = "default"
TOKEN = "harness-api-token"
SERVER_PORT = 32300
IMAGE_PYTHON = "/opt/ktlite-harness-image"  # where a pod finds its image's Python


class Pods:
    """Real server processes for the fake's pods."""

    def __init__(self, root: Path) -> None:
        self.root = root
        bind_s = float(os.environ.get("KTLITE_HARNESS_PVC_BIND_S", "1.5"))
        self.fake = kf.FakeKube(
            token=TOKEN,
            pod_behavior=self.behavior,
            pod_termination_seconds=0.2,  # a real pod: seconds; waits still see Terminating
            follow_idle_timeout=5.0,
            pvc_bind_seconds=bind_s,
            knative=os.environ.get("KTLITE_HARNESS_KNATIVE") == "1",
            custom_metrics=os.environ.get("KTLITE_HARNESS_CUSTOM_METRICS") == "1",
        )
        self.holes: list[
            tuple[socket.socket, socket.socket]
        ] = []  # addresses of pods that are gone
        self.fake.proxy_handlers = _Handlers(self)
        self.procs: dict[
            str, tuple[subprocess.Popen[bytes], str, str]
        ] = {}  # uid -> (process, pod, ip)
        self.mount_points = MountPoints()  # made on this machine, shared with other stand-ins
        self.lock = threading.Lock()
        self.ips = itertools.count(10)
        # where pods reach the API server: this stand-in's (serve() sets it), or, with
        # KTLITE_HARNESS_POD_API=unreachable, an address that swallows connections, as the
        # `kubernetes` Service's address does on a cluster without kube-proxy
        self.api_url = ""
        # each stand-in its own 127.X.0.0/16: two stand-ins (xdist workers, other test runs on
        # this machine) would otherwise both find an address free and then race for it
        self.net, self.net_claim = _claim_net()
        nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # as Go's net/http has it
        # the pod proxy's; like the API server's, it does not verify a TLS pod's certificate
        self.http = httpx.Client(
            timeout=httpx.Timeout(600.0, connect=5.0),
            transport=httpx.HTTPTransport(socket_options=nodelay, verify=False),
        )
        self.image_python = image_python.make(root / "image", seen_at=IMAGE_PYTHON)
        self.bare_python = image_python.make(root / "bare-image", server_packages=False)
        threading.Thread(target=self._reap, daemon=True).start()

    def behavior(self, pod: dict[str, Any]) -> kf.PodScript:
        container = pod["spec"]["containers"][0]
        if "does-not-exist" in container.get("image", ""):
            return [(0, kf.pending()), (1, kf.err_image_pull()), (3, kf.image_pull_backoff())]
        install = next(
            (e.get("value", "") for e in container.get("env", []) if e["name"] == "KTLITE_INSTALL"),
            "",
        )
        if (
            "does-not-exist" in install
        ):  # as the bootstrap in an image without ktlite that cannot install it
            log = (
                f"ktlite: the image has no ktlite; installing {install}\nERROR: Could not find a version that "
                f"satisfies the requirement {install}\nktlite: could not install {install}\n"
            )
            return [
                (0, kf.pending()),
                (1, kf.terminated_error(exit_code=78, logs=log)),
                (3, kf.crash_loop(exit_code=78, logs=log)),
            ]
        cpu = ((container.get("resources") or {}).get("requests") or {}).get("cpu", "0")
        if not cpu.endswith("m") and float(cpu) > 64:
            return kf.unschedulable(
                "0/3 nodes are available: 3 Insufficient cpu. preemption: 0/3 "
                "nodes are available: 3 No preemption victims found for "
                "incoming pod."
            )
        ip = self._free_ip()
        proc = self._start(pod, ip)
        with self.lock:
            self.procs[pod["metadata"]["uid"]] = (proc, pod["metadata"]["name"], ip)
        probe = (container.get("readinessProbe") or {}).get("httpGet") or {}
        up: Any = (
            _Probe(ip)
            if probe.get("path", "/health") == "/health"
            else _HttpProbe(ip, probe["path"], proc)
        )

        def status(ctx: kf.PodCtx) -> kf.Obj:
            code = proc.poll()  # the container ended (a failed setup step: exit code 78)
            if code is not None:
                return kf.terminated_error(exit_code=code).status(ctx)
            return (kf.ready(ip) if up() else kf.running_not_ready(ip)).status(ctx)

        return kf.PodState(status, ip=ip)

    def _secret(self, name: str) -> dict[str, Any]:
        # the store itself: fake.get() would run the controllers again, re-entrantly, from
        # inside the pod creation that called behavior()
        return self.fake._store.get(("secrets", NAMESPACE, name)) or {}

    def _free_ip(self) -> str:
        """The next loopback address whose pod port no one holds: other stand-in clusters (other
        test runs on this machine) hand out the same addresses."""
        for n in self.ips:
            if n % 256 in (0, 255):
                continue
            ip = f"{self.net}.{n // 256}.{n % 256}"
            with socket.socket() as probe:
                try:
                    probe.bind((ip, SERVER_PORT))
                except OSError:
                    continue
            return ip
        raise AssertionError("unreachable: the counter is endless")

    def _env(self, pod: dict[str, Any], ip: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in pod["spec"]["containers"][0].get("envFrom", []):
            if "secretRef" in source:
                data = self._secret(source["secretRef"]["name"]).get("data") or {}
                env.update({k: base64.b64decode(v).decode() for k, v in data.items()})
        for item in pod["spec"]["containers"][0].get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
                continue
            source = item.get("valueFrom", {})
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self._secret(ref["name"])
                env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                if path == "metadata.name":
                    env[item["name"]] = pod["metadata"]["name"]
                elif path == "metadata.namespace":
                    env[item["name"]] = NAMESPACE
                elif path == "status.podIP":
                    env[item["name"]] = ip
                elif path.startswith("metadata.labels['"):
                    env[item["name"]] = pod["metadata"]["labels"].get(path[17:-2], "")
        return env

    def _start(self, pod: dict[str, Any], ip: str) -> subprocess.Popen[bytes]:
        name = pod["metadata"]["name"]
        pod_env = self._env(pod, ip)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}
        env.update(pod_env)
        env["KTLITE_KUBE_API"] = self.api_url  # the API server as pods reach it (or do not)
        # as in the real cluster's image (Debian's Python 3.11.2): a tarfile without extraction
        # filters, in the server and every process it starts (they inherit PYTHONPATH)
        old_tarfile = str(Path(__file__).resolve().parent / "old_tarfile")
        env["PYTHONPATH"] = os.pathsep.join([old_tarfile, *filter(None, [env.get("PYTHONPATH")])])
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod["spec"].get("volumes", [])
            if "persistentVolumeClaim" in v
        }
        user = _pod_user(pod)
        mounts = []
        for m in pod["spec"]["containers"][0].get("volumeMounts", []):
            if m["name"] in claims:
                src = self.root / "pvc" / claims[m["name"]]
                src.mkdir(parents=True, exist_ok=True)
                if user is not None:  # as the kubelet does for a volume that applies fsGroup
                    os.chown(src, -1, user[2])
                    src.chmod(0o2775)
                self._mount_point(Path(m["mountPath"]))
                mounts.append(f"mount --bind {src} {m['mountPath']}")
        # the pod's home (an emptyDir at the HOME its spec names): a fresh tmpfs there, under
        # which its file secrets go
        home = pod_env.get("HOME") or ("/root" if self._secret_mounts(pod) else "")
        if home:
            env["HOME"] = home
            mounts += self._secret_mounts(pod, home, user)
        if user is not None:
            mounts += self._open_root(pod)
        # the kubelet's hosts file: the pod's own name resolves to its IP, nothing else does
        hosts = self.root / "etc-hosts" / name
        hosts.parent.mkdir(exist_ok=True)
        hosts.write_text(
            "# Kubernetes-managed hosts file (the stand-in's).\n127.0.0.1\tlocalhost\n"
            f"::1\tlocalhost ip6-localhost ip6-loopback\n{ip}\t{name}\n"
        )
        mounts.append(f"mount --bind {shlex.quote(str(hosts))} /etc/hosts")
        # the image: a Python with the server's packages and no ktlite, first on PATH
        self._mount_point(Path(IMAGE_PYTHON))
        image = self.image_python
        if "no-server-packages" in pod["spec"]["containers"][0].get("image", ""):
            image = self.bare_python  # an image with a Python and nothing else
        mounts.append(f"mount --bind {shlex.quote(str(image))} {IMAGE_PYTHON}")
        env["PATH"] = f"{IMAGE_PYTHON}/bin:{env.get('PATH', os.defpath)}"
        # the state emptyDir, and the pod's own address for the server to bind
        self._mount_point(Path(STATE_DIR))
        mounts.append(f"mount -t tmpfs -o mode=0777 tmpfs {STATE_DIR}")
        env["KTLITE_HOST"] = ip
        command = pod["spec"]["containers"][0]["command"]
        script = " && ".join(
            [
                f"hostname {name}",
                *mounts,
                *_hide_callers_files(),
                # the container's own command: the real bootstrap, as the pod's user
                f"exec {_as(user)}{shlex.join(command)}",
            ]
        )
        proc = subprocess.Popen(
            ["unshare", "-m", "-u", "--propagation", "private", "sh", "-c", script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd="/tmp",
            start_new_session=True,
        )
        threading.Thread(target=self._pump, args=(proc, name), daemon=True).start()
        return proc

    def _open_root(self, pod: dict[str, Any]) -> list[str]:
        """For a pod of a non-root user: a fresh /root it may pass through (0711), with what
        this machine runs from under /root (a pyenv Python) bound back onto it; the machine's
        own /root (0700) would stop that user from reaching its Python."""
        keep = _under(Path("/root"))
        stage = self.root / "secret-volumes" / pod["metadata"]["uid"] / "root-keep"
        commands = []
        for i, path in enumerate(keep):
            commands += [
                f"mkdir -p {stage}/{i}",
                f"mount --bind {shlex.quote(str(path))} {stage}/{i}",
            ]
        commands.append("mount -t tmpfs -o mode=0711 tmpfs /root")
        for i, path in enumerate(keep):
            q = shlex.quote(str(path))
            commands += [f"mkdir -p {q}", f"mount --bind {stage}/{i} {q}"]
        return commands

    def _secret_mounts(
        self, pod: dict[str, Any], home: str = "", user: tuple[int, int, int] | None = None
    ) -> list[str]:
        """Shell commands that mount the pod's secret volumes: each item written (with its
        mode) under DIR/secret-volumes/<pod uid>/, then bind-mounted read-only, one file per
        ``subPath`` mount. ``home`` (the pod's HOME) gets a fresh tmpfs first (a container's
        own home), so nothing is written into this machine's."""
        volumes = self._volume_files(pod)
        wanted = [
            m for m in pod["spec"]["containers"][0].get("volumeMounts", []) if m["name"] in volumes
        ]
        if not wanted and not home:
            return []
        base = self.root / "secret-volumes" / pod["metadata"]["uid"]
        for name, files in volumes.items():
            (base / name).mkdir(parents=True, exist_ok=True)
            for rel, (content, mode) in files.items():
                target = base / name / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
                if user is not None:  # the kubelet's fsGroup: the group's, and group-readable
                    os.chown(target, -1, user[2])
                    mode |= 0o440
                target.chmod(mode)
        commands = []
        if home:
            # what this machine runs from stays (a pyenv Python under /root): bound aside first,
            # then back onto the fresh home
            keep = _under(Path(home))
            stage = base / "keep"
            for i, path in enumerate(keep):
                commands += [
                    f"mkdir -p {stage}/{i}",
                    f"mount --bind {shlex.quote(str(path))} {stage}/{i}",
                ]
            self._mount_point(Path(home))
            commands.append(f"mount -t tmpfs -o mode=0777 tmpfs {shlex.quote(home)}")
            for i, path in enumerate(keep):
                commands += [
                    f"mkdir -p {shlex.quote(str(path))}",
                    f"mount --bind {stage}/{i} {shlex.quote(str(path))}",
                ]
        for m in wanted:
            src, path = base / m["name"] / m.get("subPath", ""), shlex.quote(m["mountPath"])
            if not m.get(
                "subPath"
            ):  # a directory mount (the launch Secret): made here (mount_points)
                self._mount_point(Path(m["mountPath"]))
            make = (
                f"mkdir -p {shlex.quote(str(Path(m['mountPath']).parent))} && touch {path}"
                if m.get("subPath")
                else f"mkdir -p {path}"
            )
            commands += [
                make,
                f"mount --bind {shlex.quote(str(src))} {path}",
                f"mount -o remount,bind,ro {path}",
            ]
        return commands

    def _volume_files(self, pod: dict[str, Any]) -> dict[str, dict[str, tuple[bytes, int]]]:
        """Each secret or projected volume's files: path -> (content, mode). A projected
        Secret's (optional: an absent one gives none), a projected ServiceAccount token is one the fake issued for the pod's account (none if that
        account does not exist); the cluster's CA a placeholder (the API here is plain HTTP)."""
        out: dict[str, dict[str, tuple[bytes, int]]] = {}
        for v in pod["spec"].get("volumes", []):
            if "secret" in v:
                vol = v["secret"]
                data = self._secret(vol["secretName"]).get("data") or {}  # may be absent
                items = vol.get("items") or [{"key": k, "path": k} for k in data]
                out[v["name"]] = {
                    item["path"]: (
                        base64.b64decode(data[item["key"]]),
                        item.get("mode", vol.get("defaultMode", 0o644)),
                    )
                    for item in items
                }
            elif "projected" in v:
                vol, files = v["projected"], {}
                mode = vol.get("defaultMode", 0o644)
                for source in vol.get("sources", []):
                    if "serviceAccountToken" in source:
                        account = pod["spec"].get("serviceAccountName", "default")
                        found = self.fake._store.get(("serviceaccounts", NAMESPACE, account))
                        if found is not None:  # the store itself, as _secret reads it
                            token = self.fake.accounts.issue(
                                NAMESPACE, account, found["metadata"]["uid"]
                            )
                            files[source["serviceAccountToken"]["path"]] = (token.encode(), mode)
                    for item in (source.get("configMap") or {}).get("items", []):
                        files[item["path"]] = (b"# the stand-in's API is plain HTTP\n", mode)
                    ref = source.get("secret")
                    if ref is not None:  # an optional one that is not there gives no files
                        data = self._secret(ref["name"]).get("data") or {}
                        for item in ref.get("items") or [{"key": k, "path": k} for k in data]:
                            if item["key"] in data:
                                content = base64.b64decode(data[item["key"]])
                                files[item["path"]] = (content, item.get("mode", mode))
                out[v["name"]] = files
        return out

    def _pump(self, proc: subprocess.Popen[bytes], name: str) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            self.fake.append_logs(name, raw.decode(errors="replace"))

    def _reap(self) -> None:
        """Stop the process of every pod that is gone or being deleted."""
        while True:
            time.sleep(0.3)
            with (
                self.lock
            ):  # never held while taking the fake's lock (behavior() nests the other way)
                running = list(self.procs.items())
            for uid, (proc, name, ip) in running:
                pod = self.fake.get("pods", NAMESPACE, name)
                if (
                    pod is None
                    or pod["metadata"]["uid"] != uid
                    or pod["metadata"].get("deletionTimestamp")
                ):
                    _stop(proc)
                    try:
                        hole = _black_hole(ip, SERVER_PORT)
                    except OSError:  # the address is not free yet: the next round tries again
                        continue
                    with self.lock:
                        self.procs.pop(uid, None)
                        self.holes.append(hole)

    def _mount_point(self, path: Path) -> None:
        """A mount point a bind mount needs on this machine's filesystem (a private mount
        namespace does not make one): removed by the last stand-in cluster to stop, so no /data
        or /store is left in this machine's root (``mount_points``)."""
        self.mount_points.make(path)

    def stop_all(self) -> None:
        with self.lock:
            for proc, _, _ in self.procs.values():
                _stop(proc)
            self.procs.clear()
            for hole in self.holes:
                for sock in hole:
                    sock.close()
            self.mount_points.release()
            self.net_claim.close()


def _claim_net() -> tuple[str, socket.socket]:
    """A 127.X.0.0/16 of this stand-in's own, and the socket that claims it: bound to the pod
    port on 127.X.0.1 (never a pod's address) for as long as the stand-in runs, so that no
    other stand-in on this machine takes the same X (the kernel refuses the second bind). X is
    tried from the stand-in's pid on: two pids with the same remainder once shared a /16, and a
    pod of one answered the other's proxy (401: another deployment's token)."""
    first = os.getpid() % 253
    for step in range(253):
        net = f"127.{(first + step) % 253 + 1}"
        claim = socket.socket()
        try:
            claim.bind((f"{net}.0.1", SERVER_PORT))
        except OSError:
            claim.close()
            continue
        return net, claim
    raise AssertionError("every 127.X.0.0/16 (X in 1..253) is claimed by another stand-in")


class _Probe:
    """True once the address accepts connections on the pod port (then stays True)."""

    def __init__(self, ip: str) -> None:
        self.ip, self.up = ip, False

    def __call__(self) -> bool:
        if not self.up:
            try:
                socket.create_connection((self.ip, SERVER_PORT), timeout=0.2).close()
                self.up = True
            except OSError:
                pass
        return self.up


class _HttpProbe:
    """A readiness probe on a path (``/health?ready=1``), as the kubelet runs it: asked every
    half second by a thread of its own (never under the fake's lock); True while it answers 200."""

    def __init__(self, ip: str, path: str, proc: subprocess.Popen[bytes]) -> None:
        self.url, self.proc, self.ok = f"http://{ip}:{SERVER_PORT}{path}", proc, False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while self.proc.poll() is None:
                try:
                    self.ok = client.get(self.url).status_code == 200
                except httpx.HTTPError:
                    self.ok = False
                time.sleep(0.5)
        self.ok = False

    def __call__(self) -> bool:
        return self.ok


class _Handlers(dict):  # type: ignore[type-arg]
    """The fake's proxy table: every pod's server port forwards to its process."""

    def __init__(self, pods: Pods) -> None:
        super().__init__()
        self.pods = pods

    def get(self, key: Any, default: Any = None) -> Any:
        if key[1] != SERVER_PORT:
            return default
        return lambda request: self.pods.http.send(request, stream=True)
