"""``ktlite dashboard`` (issue 27, item 1) on a real deployment: two local pods of two ranks
each, a call that prints a line on every rank and one that raises on rank 3, real pod
servers, the dashboard's real server on 127.0.0.1 and, last, the page in a real headless
Chromium (Debian's ``chromium`` and ``chromium-driver``, which ``.ci/run`` installs).

One deployment and one dashboard serve every test of the module; the browser test tears the
deployment down through the page, so it runs last.
"""

from __future__ import annotations

import base64
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import ktlite as kt
from ktlite.backends.local import LocalBackend
from ktlite.dashboard import timeline
from ktlite.dashboard.access import HEADER
from ktlite.dashboard.logs import Follower, Followers
from ktlite.dashboard.serve import Dashboard
from ktlite.dashboard.views import scrub
from ktlite_server.callhistory import CallHistory
from ktlite_server.localcall import CallHandle
from ktlite_server.ranks import Outcome
from ktlite_wire import codec
from ktlite_wire.errors import RemoteExceptionInfo
from ktlite_wire.status import Status

NAME = "dash-job"
SERVED = "dash-served"  # an autoscaled deployment: replicas and the autoscaler's decision
WAIT_S = 60.0  # the page's refreshes run every 1-3 s; a busy 2-core machine is slower
ARTIFACTS = Path(os.environ.get("KTLITE_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))


def work(fail: bool = False, wait_for: str | None = None, say: str = "dashboard-line") -> int:
    rank = int(os.environ["RANK"])
    print(f"{say} from rank {rank}", flush=True)
    deadline = time.monotonic() + 120
    while wait_for and not Path(wait_for).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{wait_for} did not appear within 120 s")
        time.sleep(0.05)  # until the test lets the call end
    if fail and rank == 3:
        raise ValueError("dashboard-boom on rank 3")
    return rank


def _until(what: str, ask: Any, done: Any) -> Any:
    """``ask()`` again until ``done`` says its answer is the one awaited (the dashboard follows
    logs in a thread of its own), for up to ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    answer = ask()
    while not done(answer):
        assert time.monotonic() < deadline, f"waited {WAIT_S:g}s for {what}; last: {answer}"
        time.sleep(0.2)  # between two requests, bounded by the deadline
        answer = ask()
    return answer


@dataclass
class Board:
    dashboard: Dashboard
    remote: Any
    token: str  # the deployment's, which no answer may hold

    def get(self, path: str, secret: str | None = "own", **headers: str) -> httpx.Response:
        if secret is not None:
            headers[HEADER] = self.dashboard.token if secret == "own" else secret
        return httpx.get(self.dashboard.base_url + path, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Board]:
    # a Kubernetes backend that cannot be reached: its kubeconfig does not exist
    missing = tmp_path_factory.mktemp("kube") / "no-such-kubeconfig"
    before = os.environ.get("KTLITE_KUBECONFIG")
    os.environ["KTLITE_KUBECONFIG"] = str(missing)
    remote = kt.fn(work).to(kt.Compute().distribute("pytorch", workers=2, num_proc=2), name=NAME)
    served = None
    dashboard = None
    try:
        served = kt.fn(work).to(kt.Compute().autoscale(min_scale=1, max_scale=2), name=SERVED)
        assert served() == 0
        assert remote() == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="dashboard-boom"):
            remote(fail=True)
        dashboard = Dashboard(backends=["local", "kubernetes"]).start()
        yield Board(dashboard, remote, remote.deployment.applied.token)
    finally:
        if dashboard is not None:
            dashboard.stop()
        if LocalBackend.shared().lookup(NAME) is not None:
            remote.teardown()
        if served is not None:
            served.teardown()
        if before is None:
            os.environ.pop("KTLITE_KUBECONFIG", None)
        else:
            os.environ["KTLITE_KUBECONFIG"] = before


def test_the_api_needs_the_runs_secret_and_the_page_does_not(board: Board) -> None:
    assert board.get("/api/deployments", secret=None).status_code == 401
    assert board.get("/api/deployments", secret="not-the-secret").status_code == 403
    assert board.get(f"/api/deployments/local/{NAME}/logs", secret=None).status_code == 401
    # a page of another site whose name points at 127.0.0.1 (DNS rebinding) names its own host
    rebound = board.get("/api/deployments", Host=f"evil.example:{board.dashboard.port}")
    assert rebound.status_code == 403, rebound.text
    assert board.get("/api/deployments").status_code == 200
    page = board.get("/", secret=None)
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert board.get("/static/dashboard.js", secret=None).status_code == 200
    assert board.get("/static/../app.py", secret=None).status_code == 404


def test_a_teardown_from_another_origin_is_refused(board: Board) -> None:
    url = f"{board.dashboard.base_url}/api/deployments/local/{NAME}/teardown"
    secret = {HEADER: board.dashboard.token}
    for headers in ({"origin": "http://evil.example"}, {}, {"origin": "null"}):
        if not headers:  # without the secret, even from the page's own origin
            headers, secret = {"origin": board.dashboard.base_url}, {}
        resp = httpx.post(url, headers={**secret, **headers}, timeout=30)
        assert resp.status_code in (401, 403), (headers, resp.status_code, resp.text)
    assert LocalBackend.shared().lookup(NAME) is not None, "a refused teardown tore it down"


def test_the_deployment_its_ranks_calls_and_logs_without_its_token(board: Board) -> None:
    listing = board.get("/api/deployments")
    rows = {b["backend"]: b for b in listing.json()["backends"]}
    assert sorted(d["name"] for d in rows["local"]["deployments"]) == [NAME, SERVED]
    assert "could not load a Kubernetes configuration" in rows["kubernetes"]["error"]
    assert rows["kubernetes"]["set_up"] is False  # a row saying why, not an error page

    detail = board.get(f"/api/deployments/local/{NAME}")
    assert detail.status_code == 200, detail.text
    body = detail.json()
    ranks = [r for pod in body["pods"] for r in pod["ranks"]]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    assert all(r["state"] == "idle" and r["rss_bytes"] > 0 for r in ranks), ranks
    failed, ok = body["calls"][:2]  # newest first
    assert ok["status"] == "ok" and [r["status"] for r in ok["ranks"]] == ["ok"] * 4
    assert {r["pod"] for r in ok["ranks"]} == {f"{NAME}-0", f"{NAME}-1"}
    for r in ok["ranks"]:
        assert r["run_s"] > 0 and r["reach_s"] >= 0 and r["wait_s"] >= 0
        assert abs(r["reach_s"] + r["run_s"] + r["wait_s"] - ok["duration_s"]) < 1e-3
    assert failed["status"] == "failed" and failed["failed_ranks"] == [3]
    error = failed["ranks"][3]["error"]
    assert error["type"] == "ValueError" and "dashboard-boom on rank 3" in error["message"]
    assert "in work" in error["traceback"] and "raise ValueError" in error["traceback"]

    lines = _until(
        "rank 1's and rank 3's lines in the dashboard's logs",
        lambda: board.get(f"/api/deployments/local/{NAME}/logs").json()["lines"],
        lambda lines: {1, 3} <= {x["rank"] for x in lines if "dashboard-line" in x["text"]},
    )
    line = next(x for x in lines if x["text"] == "dashboard-line from rank 1")
    assert line["pod"] == f"{NAME}-0" and line["rank"] == 1

    for text in (listing.text, detail.text, str(lines)):
        assert board.token not in text

    replicas = board.get(f"/api/deployments/local/{SERVED}").json()
    assert f"{SERVED}: autoscaled, 1 replica(s) running (1..2)" in replicas["serving"]
    assert "autoscaler:" in replicas["serving"], replicas["serving"]
    assert [c["status"] for c in replicas["calls"]] == ["ok"]
    assert board.get("/api/deployments/local/no-such-job").status_code == 404
    gone = _until(
        "the logs of a deployment that does not run to say so",
        lambda: board.get("/api/deployments/local/no-such-job/logs").json(),
        lambda answer: answer["error"] is not None,
    )
    assert "no-such-job" in gone["error"] and gone["ended"] and not gone["lines"]


def test_a_running_call_and_a_stuck_rank(board: Board, tmp_path: Path) -> None:
    """A rank busy with a call shows it (the call's id, for how long) and, busy for longer than
    the page's ``stuck_after``, as stuck; once the call ends it is in the recent calls."""
    served = kt.fn(name=SERVED)
    release = tmp_path / "release"
    done: queue.Queue[Any] = queue.Queue()
    caller = threading.Thread(target=lambda: done.put(served(wait_for=str(release))), daemon=True)
    caller.start()
    path = f"/api/deployments/local/{SERVED}?stuck_after=0.5"
    try:
        seen = _until(
            "the served call's rank to be stuck",
            lambda: board.get(path).json(),
            lambda a: any(r["stuck"] for p in a["pods"] for r in p["ranks"]),
        )
        (rank,) = [r for p in seen["pods"] for r in p["ranks"]]
        assert rank["state"] == "busy" and len(rank["calls"]) == 1, rank
        assert board.get(f"/api/deployments/local/{SERVED}?stuck_after=0").status_code == 400
    finally:
        release.touch()
    assert done.get(timeout=WAIT_S) == 0
    calls = board.get(path).json()["calls"]
    assert calls[0]["id"] == rank["calls"][0]["id"] and calls[0]["status"] == "ok"
    assert calls[0]["duration_s"] >= 0.5  # it was stuck for at least that long


def _dashboard_until_ctrl_c(env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    """Run ``ktlite dashboard --no-browser ARGS``, read its deployments once through the API,
    then Ctrl-C it: it must exit 0. Returns the backends' rows."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ktlite.commands.cli", "dashboard", "--no-browser", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # an xdist worker may ignore SIGINT, and an ignored signal stays ignored across exec:
        # the command is given Ctrl-C's default, as a terminal would
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()], daemon=True)
    reader.start()
    try:
        seen = []
        while not (seen and seen[-1].startswith("ktlite dashboard: ")):
            try:
                seen.append(lines.get(timeout=WAIT_S))
            except queue.Empty:
                raise AssertionError(f"no address within {WAIT_S:g}s; it printed {seen}") from None
        url = seen[-1].split(": ", 1)[1].strip()
        base, _, secret = url.partition("/#token=")
        assert base.startswith("http://127.0.0.1:") and secret, url
        answer = httpx.get(f"{base}/api/deployments", headers={HEADER: secret}, timeout=30)
        assert answer.status_code == 200, answer.text
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            proc.wait(timeout=WAIT_S)
            reader.join(WAIT_S)
            printed = "".join(lines.queue)
            raise AssertionError(f"still running {WAIT_S:g}s after Ctrl-C:\n{printed}") from None
        assert code == 0, code
        rows: list[dict[str, Any]] = answer.json()["backends"]
        return rows
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)
        reader.join(WAIT_S)  # it ends at the output's end, the process's exit
        if proc.stdout is not None:
            proc.stdout.close()


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}
    env["KTLITE_HOME"] = str(home)
    env["PYTHONFAULTHANDLER"] = "1"  # a hang is reported with its threads' stacks
    return env


def test_the_command_prints_its_address_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    rows = _dashboard_until_ctrl_c(_env(tmp_path))
    # every backend, each listed or why not
    assert [b["backend"] for b in rows] == ["local", "kubernetes", "ssh"]


def test_ctrl_c_stops_the_command_while_a_clusters_list_hangs(tmp_path: Path) -> None:
    """A cluster whose API server accepts connections and never answers (a black hole): its
    list shows as not answering, and Ctrl-C still stops the dashboard at once (the list's
    thread was joined at exit, so it waited on the hung request)."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)  # connections complete in the kernel's backlog; nothing is ever read
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: hole\n"
        f"clusters:\n- name: hole\n  cluster: {{server: 'http://127.0.0.1:{hole.getsockname()[1]}'}}\n"
        "contexts:\n- name: hole\n  context: {cluster: hole, user: hole, namespace: default}\n"
        "users:\n- name: hole\n  user: {token: not-a-token}\n"
    )
    env = _env(tmp_path)
    env["KUBECONFIG"] = str(kubeconfig)
    try:
        rows = _dashboard_until_ctrl_c(env, "--backend", "kubernetes")
    finally:
        hole.close()
    assert len(rows) == 1 and "did not answer within" in rows[0]["error"], rows


def test_the_pod_keeps_a_bounded_ring_of_calls() -> None:
    history = CallHistory(max_calls=3, errors_max=300)
    info = codec.dumps_parts(RemoteExceptionInfo("KeyError", "'x'", "Traceback ...\nKeyError"))
    encoded = b"".join(bytes(memoryview(p).cast("B")) for p in info)
    for i in range(5):
        handle = CallHandle(f"call-{i}")
        handle.outcomes = [
            Outcome(0, Status.OK, b"a value the ring must not keep"),
            Outcome(1, Status.ERROR, encoded) if i % 2 else Outcome(1, Status.DIED, message="x"),
        ]
        history.record(handle)
    kept = history.snapshot()
    assert [c["id"] for c in kept] == ["call-2", "call-3", "call-4"]
    assert all(c["start"] <= c["end"] for c in kept)
    assert kept[1]["ranks"][1]["error"] == base64.b64encode(encoded).decode()
    assert "value" not in str(kept)
    assert timeline.error_of(kept[1]["ranks"][1]["error"]) == {
        "type": "KeyError",
        "message": "'x'",
        "traceback": "Traceback ...\nKeyError",
    }
    # errors over the ring's byte budget push out the oldest calls, never the newest
    small = CallHistory(max_calls=10, errors_max=len(encoded) + 10)
    for i in range(3):
        handle = CallHandle(f"fail-{i}")
        handle.outcomes = [Outcome(0, Status.ERROR, encoded)]
        small.record(handle)
    assert [c["id"] for c in small.snapshot()] == ["fail-2"]


def _browser() -> Any:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the dev extra)")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (.ci/run installs them: "
            "apt-get install chromium chromium-driver)"
        )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1800")
    return webdriver.Chrome(service=Service(driver), options=options)


def test_the_page_in_a_real_browser(board: Board) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    browser = _browser()
    shots = (ARTIFACTS / "dashboard-failed-call.png", ARTIFACTS / "dashboard-ok-call.png")
    try:
        wait = WebDriverWait(browser, WAIT_S, ignored_exceptions=[StaleElementReferenceException])

        def until(what: str, check: Any) -> Any:
            try:
                return wait.until(check)
            except Exception as e:
                page = browser.find_element(By.TAG_NAME, "body").text[-3000:]
                raise AssertionError(
                    f"waited {WAIT_S:g}s for {what}; the page shows:\n{page}"
                ) from e

        browser.get(board.dashboard.url)
        assert "#token" not in browser.current_url  # the page takes the secret out of the address
        until(
            "the deployment in the list",
            lambda b: b.find_element(By.CSS_SELECTOR, f'button[data-deployment="local/{NAME}"]'),
        ).click()
        until(
            "4 ranks", lambda b: len(b.find_elements(By.CSS_SELECTOR, "#ranks tr[data-rank]")) == 4
        )
        until(
            "rank 2's log line",
            lambda b: any(
                "dashboard-line from rank 2" in e.text
                for e in b.find_elements(By.CSS_SELECTOR, "#logs .line")
            ),
        )
        browser.find_element(By.ID, "log-rank").send_keys("rank 1")
        until(
            "only rank 1's lines",
            lambda b: (
                {
                    e.get_attribute("data-rank")
                    for e in b.find_elements(By.CSS_SELECTOR, "#logs .line")
                }
                == {"1"}
            ),
        )
        # the newest call is shown first: the one that failed on rank 3, with its traceback
        until(
            "the failed call's traceback",
            lambda b: (
                "raise ValueError"
                in b.find_element(By.CSS_SELECTOR, '#errors .error[data-rank="3"] .traceback').text
            ),
        )
        assert "dashboard-boom on rank 3" in browser.find_element(By.ID, "errors").text
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(shots[0])), f"no screenshot at {shots[0]}"

        def chose_ok_call(b: Any) -> bool:
            b.find_element(By.CSS_SELECTOR, '#calls tr[data-status="ok"]').click()
            rows = b.find_elements(By.CSS_SELECTOR, "#timeline-rows .trow")
            return [r.get_attribute("data-status") for r in rows] == ["ok"] * 4

        until("the successful call's timeline of 4 ranks", chose_ok_call)
        bars = browser.find_elements(By.CSS_SELECTOR, "#timeline-rows .seg.run")
        assert len(bars) == 4 and all(b.size["width"] >= 1 for b in bars)
        assert browser.save_screenshot(str(shots[1])), f"no screenshot at {shots[1]}"
        print(f"dashboard screenshots: {shots[0]} {shots[1]}")

        # live: a call made while the page is open shows up, with its lines, without a reload
        assert board.remote(say="live-call") == [0, 1, 2, 3]
        until(
            "the new call's row",
            lambda b: len(b.find_elements(By.CSS_SELECTOR, "#calls tr[data-call]")) == 3,
        )
        until(
            "the new call's line of rank 1",
            lambda b: any(
                e.text.endswith("live-call from rank 1")
                for e in b.find_elements(By.CSS_SELECTOR, "#logs .line")
            ),
        )

        # an engine pod's line (a Ray head that lost a node), as the page writes it
        line = browser.execute_script(
            "return engineLine('job-0', arguments[0]);",
            {
                "kind": "ray",
                "head": True,
                "alive": True,
                "pid": 7,
                "started_at": time.time() - 60,
                "nodes": [{}, {}],
                "lost": ["job-2"],
            },
        )
        assert line.startswith("job-0: ray head · alive · pid 7 · up "), line
        assert line.endswith("· 2 Ray node(s) in the cluster · LOST: job-2"), line

        browser.find_element(By.ID, "teardown").click()  # asks first
        until("the confirmation", expected_conditions.alert_is_present())
        browser.switch_to.alert.accept()
        until(
            "the deployment gone from the page",
            lambda b: (
                not b.find_elements(By.CSS_SELECTOR, f'button[data-deployment="local/{NAME}"]')
            ),
        )
        assert LocalBackend.shared().lookup(NAME) is None
    finally:
        browser.quit()


def test_scrub_and_the_log_follower_blank_a_token() -> None:
    secret = "tok-" + "x" * 20
    answer = {"name": "a", "token": secret, "pods": [{"error": f"Bearer {secret} refused"}]}
    assert scrub(answer, (secret,)) == {
        "name": "a",
        "pods": [{"error": "Bearer [redacted] refused"}],
    }
    follower = Follower(
        lambda: iter([f"[job-0] [rank 1] printed {secret}", "[job-1] server line", "bare"]),
        lambda: (secret,),
    )
    got = _until(
        "the follower to read its three lines", lambda: follower.since(0), lambda a: a["ended"]
    )
    assert [(x["pod"], x["rank"], x["text"]) for x in got["lines"]] == [
        ("job-0", 1, "printed [redacted]"),
        ("job-1", None, "server line"),
        (None, None, "bare"),
    ]
    assert got["error"] is None and follower.since(2)["lines"][0]["text"] == "bare"
    # a follower that ended is kept for a while: the page is told why, not handed a new one
    followers = Followers()
    gone = followers.get(("local", "gone"), lambda: iter(()), lambda: ())
    _until("the follower of an empty log to end", lambda: gone.since(0), lambda a: a["ended"])
    assert followers.get(("local", "gone"), lambda: iter(()), lambda: ()) is gone
