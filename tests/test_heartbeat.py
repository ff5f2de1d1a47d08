"""The silence timeout (``KTLITE_SILENCE_TIMEOUT``, :mod:`ktlite_wire.heartbeat`): parsed and
checked once, with an error that names the variable, the value and what is allowed."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ktlite as kt
import ktlite.net.client
from ktlite_wire.heartbeat import DEFAULT_SILENCE_S, HEARTBEAT_S, SILENCE_ENV, silence_timeout


def test_unset_or_blank_is_the_default() -> None:
    assert silence_timeout({}) == DEFAULT_SILENCE_S == 10.0
    assert silence_timeout({SILENCE_ENV: "  "}) == DEFAULT_SILENCE_S


@pytest.mark.parametrize("raw, value", [("3", 3.0), ("2.5", 2.5), (" 30 ", 30.0)])
def test_a_number_above_the_heartbeat_interval_is_taken(raw: str, value: float) -> None:
    assert silence_timeout({SILENCE_ENV: raw}) == value


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "2", "1.5", "nan", "inf", "10s"])
def test_anything_else_names_the_variable_the_value_and_the_fix(raw: str) -> None:
    with pytest.raises(ValueError) as info:
        silence_timeout({SILENCE_ENV: raw})
    text = str(info.value)
    assert f"{SILENCE_ENV}={raw!r}" in text, text
    assert f"above {HEARTBEAT_S:g}" in text and "unset it" in text, text


def test_the_caller_reads_it_once_and_a_bad_value_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setattr(ktlite.net.client, "SILENCE_TIMEOUT", None)
    monkeypatch.setenv(SILENCE_ENV, "1")
    with pytest.raises(kt.ConfigError, match=SILENCE_ENV):
        ktlite.net.client.silence_timeout()
    monkeypatch.setenv(SILENCE_ENV, "4")
    assert ktlite.net.client.silence_timeout() == 4.0
    monkeypatch.setenv(SILENCE_ENV, "7")
    assert ktlite.net.client.silence_timeout() == 4.0  # read once


def test_a_pod_server_with_a_bad_value_stops_at_once_naming_it() -> None:
    """The pod server reads its own environment's value when its coordinator loads."""
    proc = subprocess.run(
        [sys.executable, "-c", "import ktlite_server.coordinator"],
        env={"PATH": "/usr/bin:/bin", SILENCE_ENV: "soon"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert f"{SILENCE_ENV}='soon' is not allowed" in proc.stderr, proc.stderr
