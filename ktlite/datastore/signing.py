"""Signed objects: every Python object in the data store carries its writer's signature, and
``kt.get`` checks it before it unpickles anything.

The keys, all derived from the store's master key M (the Secret's token on Kubernetes, the file
``signing.key`` of a local store) by HMAC-SHA256, in a tree that follows the keys' segments::

    K("")      = HMAC(M, "ktlite-store-sign")          the root: your machine only
    K("a")     = HMAC(K(""), "seg\\0a")
    K("a/b")   = HMAC(K("a"), "seg\\0b")                ... one step per segment

Holding K(p) gives the key of every prefix below p and of none above or beside it. Your machine
holds M, hence every key. A deployment's pods are handed K(g) for each prefix g they were
granted (their own, and what ``store_access`` shares), never K("").

An object stored at ``key`` is ``SIG_MAGIC``, one JSON line ``{"writer", "level", "macs"}``,
then the pickle. ``level`` is the prefix whose key the writer signed with (its grant; "" for
your machine) and ``macs`` holds, for that level and each prefix below it down to ``key``,
HMAC(K(level'), "ktlite-store-object-1\\0" key "\\0" writer "\\0" sha256(pickle)). A reader
that holds K(g) for a g above ``key`` checks the MAC at the deeper of g and ``level``, a key it
can derive. So the signature binds the object to its key (copying it elsewhere breaks it) and
to a key that only a holder of that prefix or one above it has: a pod of another deployment,
which holds only its own grants' keys, cannot forge it. A read grant hands over the prefix's
key too (HMAC cannot separate checking from signing): the store itself refuses that pod's
writes there, and anything it signs is bound to a key under that prefix.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from ktlite.errors import DataStoreError
from ktlite_wire.storescope import under

SIG_MAGIC = b"KTLITE-SIG-1\n"
MAX_HEADER = 64 << 10  # the JSON line: bounded before it is parsed
_ROOT_CONTEXT = b"ktlite-store-sign"
_OBJECT_CONTEXT = b"ktlite-store-object-1\0"


def root_key(master: str) -> bytes:
    """K(""), the signing key of the whole store."""
    return hmac.new(master.encode(), _ROOT_CONTEXT, hashlib.sha256).digest()


def _segments(at: str, target: str) -> list[str]:
    rest = target[len(at) :].lstrip("/") if at else target
    return rest.split("/") if rest else []


def _step(key: bytes, segment: str) -> bytes:
    return hmac.new(key, b"seg\0" + segment.encode(), hashlib.sha256).digest()


def derive(key: bytes, at: str, target: str) -> bytes:
    """K(target) from K(at); ``target`` is ``at`` or below it."""
    for segment in _segments(at, target):
        key = _step(key, segment)
    return key


def _mac(level_key: bytes, key: str, writer: str, digest: bytes) -> str:
    message = _OBJECT_CONTEXT + key.encode() + b"\0" + writer.encode() + b"\0" + digest
    return hmac.new(level_key, message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Signer:
    """The signing keys one process holds: K(prefix) for each of its prefixes, and which of
    them it writes under. ``name`` is how its objects name their writer."""

    name: str
    keys: dict[str, bytes] = field(repr=False)
    writes: tuple[str, ...] = ()

    @classmethod
    def full(cls, master: str, name: str = "your machine") -> Signer:
        """The holder of the master key: every prefix."""
        return cls(name, {"": root_key(master)}, ("",))

    def handed(self, prefixes: Iterable[str]) -> dict[str, str]:
        """K(p) for each of ``prefixes`` (base64), for a deployment's pods."""
        return {p: base64.b64encode(derive(*self._key_for(p), p)).decode() for p in prefixes}

    @classmethod
    def from_handoff(cls, name: str, keys: dict[str, str], writes: Iterable[str]) -> Signer:
        return cls(name, {p: base64.b64decode(k) for p, k in keys.items()}, tuple(writes))

    def _key_for(self, key: str) -> tuple[bytes, str]:
        """K(p) of the deepest prefix p this signer holds at or above ``key``, and p."""
        prefix = max((p for p in self.keys if under(key, p)), key=len)
        return self.keys[prefix], prefix

    def sign(self, key: str, payload: bytes) -> bytes:
        """``payload`` (a pickle) as stored at ``key``: the signature block, then the pickle."""
        return self.block(key, payload) + payload

    def block(self, key: str, payload: bytes) -> bytes:
        """The signature block that goes before ``payload`` at ``key`` (sent as its own part,
        so a large pickle is not copied)."""
        levels = [p for p in self.writes if under(key, p)]
        if not levels:
            mine = ", ".join(repr(p) for p in self.writes)
            raise DataStoreError(
                f"{self.name} may not write {key!r}: it signs objects under {mine} only; "
                "grant the prefix with kt.Compute(store_access={prefix: 'write'}) and call "
                ".to() again"
                if mine
                else f"{self.name} holds no key to sign {key!r} with (its store address was "
                "handed over by an older ktlite client): call .to() again",
                key=key,
            )
        level = max(levels, key=len)
        digest = hashlib.sha256(payload).digest()
        level_key, here = derive(*self._key_for(level), level), level
        macs = {here: _mac(level_key, key, self.name, digest)}
        for segment in _segments(level, key):
            level_key, here = _step(level_key, segment), f"{here}/{segment}" if here else segment
            macs[here] = _mac(level_key, key, self.name, digest)
        header = json.dumps({"writer": self.name, "level": level, "macs": macs}).encode()
        return SIG_MAGIC + header + b"\n"

    def verify(self, key: str, stored: bytes | bytearray) -> memoryview:
        """The pickle of an object read from ``key``, once its signature is checked; a
        :class:`DataStoreError` naming the key and the writer when it does not match."""
        view = memoryview(stored)
        if bytes(view[: len(SIG_MAGIC)]) != SIG_MAGIC:
            raise DataStoreError(
                f"refused to unpickle key {key!r}: it carries no signature (written by ktlite "
                "before objects were signed, or not by ktlite); put it again from your machine",
                key=key,
            )
        end = bytes(view[len(SIG_MAGIC) : len(SIG_MAGIC) + MAX_HEADER]).find(b"\n")
        try:
            if end < 0:
                raise ValueError("no end of the signature line")
            header = json.loads(bytes(view[len(SIG_MAGIC) : len(SIG_MAGIC) + end]))
            writer, level, macs = str(header["writer"]), str(header["level"]), header["macs"]
            if not isinstance(macs, dict):
                raise ValueError("macs is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise DataStoreError(
                f"refused to unpickle key {key!r}: its signature block is malformed ({e})",
                key=key,
            ) from None
        payload = view[len(SIG_MAGIC) + end + 1 :]
        if not self._matches(key, writer, level, macs, hashlib.sha256(payload).digest()):
            raise DataStoreError(
                f"refused to unpickle key {key!r}: its signature (writer {writer!r}, signed "
                f"with the key of prefix {level!r}) does not match"
                + self._why(key, level)
                + "; it was not written through this store's keys (planted, altered, or "
                "copied from another key or store); put it again from your machine",
                key=key,
            )
        return payload

    def _matches(
        self, key: str, writer: str, level: str, macs: dict[str, object], digest: bytes
    ) -> bool:
        if not under(key, level):
            return False
        for held, held_key in self.keys.items():
            if not under(key, held):
                continue
            at = held if under(held, level) else level if under(level, held) else None
            if at is None or not isinstance(macs.get(at), str):
                continue
            want = _mac(derive(held_key, held, at), key, writer, digest)
            if hmac.compare_digest(want, str(macs[at])):
                return True
        return False

    def _why(self, key: str, level: str) -> str:
        if any(under(key, p) for p in self.keys):
            return ""
        return f" (this process holds keys for {', '.join(map(repr, self.keys))} only)"
