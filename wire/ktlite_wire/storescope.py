"""What a data store token may reach: the store's full token, or one scoped to key prefixes.

The store holds one secret, its master key (the ``ktlite-store-token`` Secret on Kubernetes).
Presented as a token it grants everything; only the user's own client, which can read the
Secret, holds it. A deployment's pods get a *scoped* token instead, minted by that client::

    kts1.<base64url(JSON {"n": holder, "g": [[prefix, "rw" | "r"], ...]})>.<base64url(MAC)>

where MAC is HMAC-SHA256 under the master key of everything before the last dot. The store
checks it by recomputing the MAC (no table of tokens to keep or revoke: a new master key, as
``ktlite store teardown`` + create makes, invalidates them all). A grant names a key prefix
and whether it may be written; a scoped token never covers the root (``""``), and only the
full token may list the root or wipe the store. Standard library only: the store server
imports it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass

from ktlite_wire.storedir import KeyRefused, check_key

TOKEN_PREFIX = "kts1."
_MAC_CONTEXT = b"ktlite-store-token\0"
MAX_TOKEN = 16 << 10  # a scoped token is a header value: bounded before it is decoded


@dataclass(frozen=True)
class Grant:
    """Access to ``prefix`` and every key under it: read, and write too with ``write``."""

    prefix: str
    write: bool = False

    def covers(self, key: str) -> bool:
        return under(key, self.prefix)

    def __str__(self) -> str:
        return f"{'read/write' if self.write else 'read'} {self.prefix!r}"


def under(key: str, prefix: str) -> bool:
    """Whether ``key`` is ``prefix`` or below it (every key is under the root ``""``)."""
    return not prefix or key == prefix or key.startswith(prefix + "/")


@dataclass(frozen=True)
class Scope:
    """What one token may reach: everything (``full``), or its grants."""

    grants: tuple[Grant, ...] = ()
    full: bool = False
    holder: str = ""  # whom the token was minted for (a deployment's name), for messages

    def may_read(self, key: str) -> bool:
        return self.full or (bool(key) and any(g.covers(key) for g in self.grants))

    def may_write(self, key: str) -> bool:
        return self.full or (bool(key) and any(g.write and g.covers(key) for g in self.grants))

    def describe(self) -> str:
        if self.full:
            return "the store's full token"
        grants = ", ".join(str(g) for g in self.grants) or "nothing"
        return f"the token of {self.holder or 'a deployment'} ({grants})"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(master: str, payload: str) -> bytes:
    return hmac.new(master.encode(), _MAC_CONTEXT + payload.encode(), hashlib.sha256).digest()


def check_grants(grants: tuple[Grant, ...]) -> tuple[Grant, ...]:
    """``grants`` with checked prefixes, or a :class:`KeyRefused` naming the bad one (the
    root is never granted)."""
    out = []
    for grant in grants:
        if grant.prefix in ("", "/"):
            raise KeyRefused(
                "a scoped store token never covers the store's root; grant a prefix such as "
                "'datasets'"
            )
        out.append(Grant(check_key(grant.prefix, what="prefix"), bool(grant.write)))
    return tuple(out)


def mint(master: str, holder: str, grants: tuple[Grant, ...]) -> str:
    """A token for ``holder`` that reaches ``grants`` only (the client mints it)."""
    body = {"n": holder, "g": [[g.prefix, "rw" if g.write else "r"] for g in check_grants(grants)]}
    payload = _b64(json.dumps(body, separators=(",", ":"), sort_keys=True).encode())
    return f"{TOKEN_PREFIX}{payload}.{_b64(_mac(master, payload))}"


def scope_of(master: str, token: str) -> Scope | None:
    """What ``token`` reaches in the store of ``master``; None when it is neither the master
    key nor a token minted with it (compared in constant time)."""
    if hmac.compare_digest(token.encode(), master.encode()):
        return Scope(full=True)
    if not token.startswith(TOKEN_PREFIX) or len(token) > MAX_TOKEN:
        return None
    payload, _, mac = token[len(TOKEN_PREFIX) :].rpartition(".")
    try:
        if not hmac.compare_digest(_unb64(mac), _mac(master, payload)):
            return None
        body = json.loads(_unb64(payload))
        grants = check_grants(tuple(Grant(str(p), mode == "rw") for p, mode in body["g"]))
        return Scope(grants=grants, holder=str(body.get("n", "")))
    except (ValueError, TypeError, KeyError):  # a MAC that matched over a malformed body
        return None
