"""Resource quantities as users write them: memory sizes, CPU counts and durations.

Memory takes Kubernetes' spellings (``"512Mi"``, ``"4Gi"``, ``"2G"``) and the ones NeMo RL,
Ray and most people write (``"8GB"``, ``"512MiB"``, ``"16gb"``, a number of bytes). A decimal
unit means powers of ten (GB = 10^9 bytes), a binary one powers of two (GiB = 2^30), as in
Kubernetes; :func:`memory_quantity` gives the Kubernetes spelling that manifests carry.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ktlite.errors import ConfigError

# a number, optional blanks, then a unit: k/K/M/G/T/P/E with an optional "i" and an optional
# "B" (any case); a bare number is bytes
_MEMORY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*(?:([kKmMgGtTpPeE])(i?)[bB]?|[bB])?$")
_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50, "E": 2**60}
_CPU = re.compile(r"^([0-9]+(\.[0-9]+)?)(m)?$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _memory_parts(value: Any, field_name: str) -> tuple[str, str, bool]:
    """(number, unit letter upper-cased or "", binary?) of a memory size, or a ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{field_name}={value!r} must be a memory size such as '4Gi' or '8GB'")
    text = str(value).strip()
    if isinstance(value, float) and value.is_integer():
        text = str(int(value))
    m = _MEMORY.match(text)
    if not m:
        raise ConfigError(
            f"{field_name}={value!r} is not a valid memory size (allowed: a number of "
            "bytes, or a number with a unit: '512Mi', '4Gi' and '4GiB' are powers of "
            "two, '512M', '4G' and '4GB' powers of ten)"
        )
    number, letter, binary = m.group(1), (m.group(2) or "").upper(), bool(m.group(3))
    if text[len(number) :].strip() == "m":
        # Kubernetes reads a lower-case "m" as milli: "512m" of memory is half a byte
        raise ConfigError(
            f"{field_name}={value!r} would mean 0.512 bytes to Kubernetes (m is milli); "
            f"write {number}Mi or {number}M (megabytes)"
        )
    return number, letter, binary


def parse_memory(value: Any, field_name: str = "memory") -> int:
    """Bytes in a memory size: ``"512Mi"``, ``"4Gi"``, ``"2G"``, ``"8GB"``, ``"1.5GiB"``, 1024."""
    number, letter, binary = _memory_parts(value, field_name)
    scale = 1 if not letter else (_BINARY if binary else _DECIMAL)[letter]
    return int(float(number) * scale)


def memory_quantity(value: Any, field_name: str = "memory") -> str:
    """The Kubernetes spelling of a memory size: ``"8GB"`` gives ``"8G"``, ``"512MiB"`` gives
    ``"512Mi"``, ``"4gb"`` gives ``"4G"``; a Kubernetes quantity is returned as it is."""
    number, letter, binary = _memory_parts(value, field_name)
    if not letter:
        return number
    return f"{number}{'k' if letter == 'K' and not binary else letter}{'i' if binary else ''}"


def parse_cpus(value: Any, field_name: str = "cpus") -> float:
    """Parse cpus given as a number (2, 0.5) or a Kubernetes quantity ("500m", "2")."""
    if isinstance(value, bool):
        raise ConfigError(
            f"{field_name}={value!r} must be a number such as 2 or 0.5, or a string like '500m'"
        )
    if isinstance(value, (int, float)):
        cpus = float(value)
    else:
        m = _CPU.match(str(value).strip())
        if not m:
            raise ConfigError(
                f"{field_name}={value!r} is not a valid CPU quantity "
                "(allowed: a number such as 2 or 0.5, or millicores such as '500m')"
            )
        cpus = float(m.group(1)) / (1000 if m.group(3) else 1)
    if not math.isfinite(cpus) or cpus <= 0:
        raise ConfigError(f"{field_name}={value!r} must be a finite number greater than 0")
    return cpus


def parse_duration(value: Any, name: str) -> float | None:
    """A duration in seconds: a number, or "90", "30m", "1h", "2d"; None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip().lower() if isinstance(value, str) else ""
        unit = _DURATION_UNITS.get(text[-1:], 0) if text[-1:].isalpha() else 1
        try:
            seconds = float(text[:-1] if text[-1:].isalpha() else text) * unit
        except ValueError:
            seconds = 0.0
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{name}={value!r} must be a duration such as 600, '30m', '1h' or '2d'")
    return seconds
