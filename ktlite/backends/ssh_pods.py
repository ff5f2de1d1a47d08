"""A pod on an SSH host, as the ssh backend makes it: the host's Python found, ktlite's source
(and, where the host lacks them, the server's packages from this client's installation) copied
into a per-user cache (``~/.cache/ktlite``), the pod server started through
``ktlite_server.sshlaunch`` with the token, environment and secret files on the channel's stdin
(never on a command line), reached straight or through a port forward, and stopped with its
whole session. Mixed into :class:`~ktlite.backends.ssh.SshBackend`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import platform
import shlex
import sys
from typing import Any

from ktlite.backends import ssh_copy
from ktlite.backends import ssh_hosts as sh
from ktlite.backends.server_source import server_packages
from ktlite.errors import DeployError, LaunchTimeout
from ktlite.logconfig import pod_env
from ktlite.net import tls
from ktlite.specs.deployment_spec import DeploymentSpec

CACHE = "~/.cache/ktlite"


def pod_scheme(pod: dict[str, Any]) -> str:
    """How a pod of the state is spoken to: ``https`` where its server serves TLS."""
    return "https" if pod.get("tls") else "http"


class SshPods:
    """Starting, reaching and stopping pod servers on SSH hosts (mixed into the ssh backend)."""

    _bundle: tuple[str, bytes] | None  # ktlite's source: (version, tar.gz), built once
    _deps: tuple[str, bytes | None] | None  # the server's packages: (key, bundle once built)

    def _deps_key(self) -> str:
        if self._deps is None:
            self._deps = (ssh_copy.deps_digest(), None)
        return self._deps[0]

    def _deps_files(self) -> bytes:
        key, bundle = self._deps or (ssh_copy.deps_digest(), None)
        if bundle is None:
            bundle = ssh_copy.deps_bundle()
            self._deps = (key, bundle)
        return bundle

    def _server_args(self, spec: DeploymentSpec, ordinal: int) -> list[str]:
        args = [
            "--pod",
            f"{spec.name}-{ordinal}",
            "--ordinal",
            str(ordinal),
            "--procs",
            str(spec.distributed.procs(ordinal)),
        ]
        ttl = spec.pod.calls.inactivity_seconds
        if ttl is not None:
            args += ["--inactivity-ttl", f"{ttl:g}"]
        return args

    async def _start(
        self,
        spec: DeploymentSpec,
        c: sh.HostConnection,
        token: str,
        version: str,
        bundle: bytes,
        pick: int,
        pod_hash: str,
        secret_env: dict[str, str],
        secret_files: list[dict[str, Any]],
        secure: bool = False,
    ) -> dict[str, Any]:
        # each copy in the host's cache is named for its digest and reused only when it still
        # has it (ssh_copy.DIGEST): one changed, cut short or grown is shipped again
        src = f"{CACHE}/src-{version}"
        python, missing, env_tag, holds = await self._python(c, {"src": (src, version)})
        c.python = python
        if "src" not in holds:
            await ssh_copy.upload(c, src, bundle, version)
        path = src
        if missing and env_tag == f"{sys.implementation.cache_tag} {platform.machine()}":
            # the server's packages from this client's own installation: no index needed there
            key = await asyncio.to_thread(self._deps_key)
            deps = f"{CACHE}/deps-{key}"
            if "deps" not in await self._verified(c, {"deps": (deps, key)}):
                await ssh_copy.upload(c, deps, await asyncio.to_thread(self._deps_files), key)
            path = f"{src}:{deps}"
        image = spec.pod.image
        env = {
            **pod_env(),
            **spec.pod.merged_env,
            **secret_env,
            "KTLITE_POD_ORDINAL": str(c.index),
            "KTLITE_DEPLOYMENT": spec.name,
            "KTLITE_BACKEND": "ssh",
            "PYTHONUNBUFFERED": "1",
            "KTLITE_WORKDIR": "~",  # ranks run in the login's home
        }
        steps = [
            [kind, list(arg) if kind == "pip_install" else arg]
            for kind, arg in (image.steps if image is not None else ())
            if kind in ("pip_install", "run_bash")
        ]
        run_dir = f"{CACHE}/run/{spec.name}-{c.index}"
        msg = {
            "token": token,
            "env": env,
            "args": self._server_args(spec, c.index),
            "run_dir": run_dir,
            "cache_dir": CACHE,
            "steps": steps,
            "detached": spec.detached,
            "bind": c.address,
            "pick_master_port": pick,
            "timeout": spec.pod.calls.launch_timeout,
            "secret_files": secret_files,
            "pins": {"cloudpickle": importlib.metadata.version("cloudpickle")},
        }
        if secure:  # the deployment's certificate and key, on the channel as the token is
            msg["tls"] = tls.identity(token).shipped()
        path = path.replace("~", "$HOME")  # expanded after ':' by every shell, unlike '~'
        # started in ktlite's cache, not the home: a ~/ktlite folder there would shadow ktlite
        command = (
            f"cd {CACHE} && PYTHONPATH={path}${{PYTHONPATH:+:$PYTHONPATH}} exec {shlex.quote(python)} "
            "-m ktlite_server.sshlaunch"
        )
        proc = await c.conn.create_process(command, encoding="utf-8")
        proc.stdin.write(json.dumps(msg) + "\n")
        if spec.detached:
            proc.stdin.write_eof()
        try:
            line = await asyncio.wait_for(
                proc.stdout.readline(), spec.pod.calls.launch_timeout + 10
            )
        except asyncio.TimeoutError:
            proc.close()
            raise LaunchTimeout(
                f"{c.label}: the pod server did not start within "
                f"{spec.pod.calls.launch_timeout:.0f}s"
            ) from None
        if not line:
            err = (await proc.stderr.read()).strip()
            raise DeployError(
                f"{c.label}: starting the pod server failed: {err[-2000:] or 'no output'}"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise DeployError(f"{c.label}: {reply['error']}")
        if spec.detached:
            proc.close()
        else:
            c.tether = proc  # the server lives as long as this channel
        return {
            "ordinal": c.index,
            "name": f"{spec.name}-{c.index}",
            "host": c.host.address,
            "address": c.address,
            "port": reply["port"],
            "pid": reply["pid"],
            "run_dir": run_dir,
            "python": python,
            "hash": pod_hash,
            "master_port": reply.get("master_port"),
            "tls": secure,
        }

    async def _verified(self, c: sh.HostConnection, copies: dict[str, tuple[str, str]]) -> set[str]:
        """Which of ``copies`` (name -> (directory, digest)) the host's cache holds intact."""
        code = ssh_copy.verify_code(copies)
        out = await c.run(f"{shlex.quote(c.python)} -c {shlex.quote(code)}")
        return {w[len("KTLITE_OK_") :] for w in out.split() if w.startswith("KTLITE_OK_")}

    async def _python(
        self, c: sh.HostConnection, copies: dict[str, tuple[str, str]]
    ) -> tuple[str, list[str], str, set[str]]:
        """The host's Python: the one asked for, else the first python3.X at least as new
        as this client's minor, else python3 when new enough. Also, in the same round trip:
        which of the server's packages it lacks (cloudpickle: at this client's version), its
        cache tag and machine, and which of ``copies`` (name -> (directory, digest)) its
        cache holds intact (:meth:`_verified`)."""
        want = sys.version_info[:2]
        if c.options.python:
            candidates = [c.options.python]
        else:
            candidates = [f"python3.{m}" for m in range(want[1], want[1] + 4)] + ["python3"]
        pins = {"cloudpickle": importlib.metadata.version("cloudpickle")}
        code = (
            f"import sys\nprint(sys.executable, *sys.version_info[:2])\n"
            f"sys.version_info[:2] < {tuple(want)} and sys.exit(1)\n"
            "import importlib.metadata as m, importlib.util as u, platform\n"
            f"pins = {pins!r}\n"
            "def bad(p):\n"
            "    if u.find_spec(p) is None: return True\n"
            "    try: return p in pins and m.version(p) != pins[p]\n"
            "    except m.PackageNotFoundError: return True\n"
            "print('KTLITE_ENV', sys.implementation.cache_tag, platform.machine(), "
            f"*[p for p in {server_packages()!r} if bad(p)])\n" + ssh_copy.verify_code(copies)
        )
        probe = " || ".join(
            f"(command -v {shlex.quote(p)} >/dev/null 2>&1 && {shlex.quote(p)} -c "
            f"{shlex.quote(code)})"
            for p in candidates
        )
        out = await c.run(f"{{ {probe}; }}; true")
        found: list[str] = []
        holds = {line[len("KTLITE_OK_") :] for line in out.split() if line.startswith("KTLITE_OK_")}
        lines = [line for line in out.splitlines() if not line.startswith("KTLITE_OK_")]
        for i, line in enumerate(lines):
            if line.startswith("KTLITE_ENV"):
                continue
            path, major, minor = line.rsplit(" ", 2)
            found.append(f"{path} ({major}.{minor})")
            env = (
                lines[i + 1].split()
                if i + 1 < len(lines) and lines[i + 1].startswith("KTLITE_ENV")
                else None
            )
            if env is not None and (int(major), int(minor)) >= want:
                return path, env[3:], f"{env[1]} {env[2]}", holds
        raise DeployError(
            f"{c.label}: no Python {want[0]}.{want[1]} or newer (found: {', '.join(found) or 'none'} "
            f"among {', '.join(candidates)}); install one, or name it with kt.Hosts(..., python=...)"
        )

    async def _reach(self, c: sh.HostConnection, pod: dict[str, Any], forward: bool | None) -> None:
        """How this client reaches the pod: straight, or through a port forward."""
        direct = forward is not True and await sh.tcp_ok(pod["address"], pod["port"])
        scheme = pod_scheme(pod)
        if direct:
            pod["url"] = f"{scheme}://{sh.hostport(pod['address'], pod['port'])}"
            return
        if forward is False:
            raise DeployError(
                f"{c.label}: its pod server at {pod['address']}:{pod['port']} does not answer "
                "from here, and forward=False; allow SSH port forwarding (forward=None)"
            )
        c.forward = await c.conn.forward_local_port("127.0.0.1", 0, pod["address"], pod["port"])
        pod["url"] = f"{scheme}://127.0.0.1:{c.forward.get_port()}"

    async def _stop_pod(
        self, c: sh.HostConnection | None, pod: dict[str, Any], grace: float
    ) -> None:
        """Stop a pod's server and everything of its session; remove its run dir."""
        if c is None or c.conn is None:
            return
        # inline, not ktlite_server.engine.session_pids: teardown must work even where the
        # host's cached ktlite source is gone
        code = (
            "import os, signal, sys, time\n"
            f"sid = {int(pod['pid'])}\n"
            "def members():\n"
            "    out = []\n"
            "    for e in os.listdir('/proc'):\n"
            "        if e.isdigit():\n"
            "            try:\n"
            "                if os.getsid(int(e)) != sid: continue\n"
            "                state = open(f'/proc/{e}/stat').read().rsplit(')', 1)[1].split()[0]\n"
            "            except (OSError, IndexError): continue\n"
            "            if state not in 'ZXx': out.append(int(e))  # a zombie has exited\n"
            "    return out\n"
            "try: cmd = open(f'/proc/{sid}/cmdline', 'rb').read()\n"
            "except OSError: cmd = b''\n"
            "if b'ktlite_server' in cmd:\n"
            "    for sig, wait in ((signal.SIGTERM, " + f"{grace}" + "), (signal.SIGKILL, 5)):\n"
            "        for p in members():\n"
            "            try: os.kill(p, sig)\n"
            "            except OSError: pass\n"
            "        end = time.monotonic() + wait\n"
            "        while members() and time.monotonic() < end: time.sleep(0.05)\n"
        )
        run_dir = pod.get("run_dir")
        rm = f" && rm -rf {sh.remote_path(run_dir)}" if run_dir and "/run/" in run_dir else ""
        python = shlex.quote(pod.get("python") or c.python)
        await c.run(f"{python} -c {shlex.quote(code)}{rm}", timeout=grace + 30)
