"""A deployment's TLS identity: the private key and self-signed certificate its pods serve
with, and the client context that pins that certificate.

The key is derived from the deployment token (HKDF-SHA256 with a label of its own, as the Ray
cluster's token is: :func:`ktlite.modes.engines.ray_token`), so wherever the client keeps the
token (``state.json``, the token Secret) it can make the same identity again, and nothing
more is stored on the client. Whoever holds the token can already run code on every pod, so
the key gives no one more than they had. The key goes only to the deployment's own pods (the
SSH channel, the local server's stdin, the token Secret); it never appears in a repr, a log
or a plan (:data:`KEY_PLACEHOLDER`).

The certificate names :data:`ktlite_wire.pinning.SERVER_NAME` (pods are reached by IP), is
signed deterministically (RFC 6979: the same token gives the same bytes in every process, so
a client that did not start the pods pins exactly what they serve, and an unchanged token
Secret is not rewritten) and is valid for ten years: it is trusted by pinning, not by its
dates, and a deployment's token changes it.
"""

from __future__ import annotations

import datetime
import functools
import json
import ssl
from dataclasses import dataclass, field

from ktlite_wire import pinning

KEY_PLACEHOLDER = "<TLS key of the deployment, made from its token at deploy>"
CERT_PLACEHOLDER = "<TLS certificate of the deployment, made from its token at deploy>"
_LABEL = b"ktlite-pod-tls-key-v1"
_NOT_BEFORE = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)
_VALID = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class TlsIdentity:
    """A deployment's certificate and private key (PEM). The key never shows in a repr."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    def __repr__(self) -> str:
        return f"TlsIdentity(sha256={self.fingerprint}, key=<hidden>)"

    @property
    def fingerprint(self) -> str:
        return pinning.pem_fingerprint(self.cert_pem)

    def shipped(self) -> dict[str, str]:
        """Certificate and key as a server reads them (``--tls-stdin``: this, as one JSON
        line after the token)."""
        return {"cert": self.cert_pem.decode(), "key": self.key_pem.decode()}

    def stdin_line(self) -> bytes:
        """:meth:`shipped` as the line a server started with ``--tls-stdin`` reads."""
        return json.dumps(self.shipped()).encode() + b"\n"


# a plan's stand-in for the line above (plans are printed; keys never are)
SHIPPED_PLACEHOLDER = json.dumps({"cert": CERT_PLACEHOLDER, "key": KEY_PLACEHOLDER})


@functools.lru_cache(maxsize=64)
def identity(token: str) -> TlsIdentity:
    """The TLS identity of the deployment whose token is ``token``: the same bytes for the
    same token, in any process."""
    # imported here: only deployments that use TLS pay for loading it
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from cryptography.x509.oid import NameOID

    curve = ec.SECP256R1()
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # P-256's n
    # 48 bytes reduced mod n: the bias of the reduction is below 2^-128
    seed = HKDF(algorithm=hashes.SHA256(), length=48, salt=None, info=_LABEL).derive(token.encode())
    key = ec.derive_private_key(int.from_bytes(seed, "big") % (order - 1) + 1, curve)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, pinning.SERVER_NAME)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(int.from_bytes(seed[:16], "big") >> 1 or 1)
        .not_valid_before(_NOT_BEFORE)
        .not_valid_after(_NOT_BEFORE + _VALID)
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(pinning.SERVER_NAME)]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256(), ecdsa_deterministic=True)  # the same bytes every time
    )
    return TlsIdentity(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


@functools.lru_cache(maxsize=64)
def pinned_context(token: str) -> ssl.SSLContext:
    """The client context for the pods of the deployment whose token is ``token``: it
    trusts exactly their certificate (one context per deployment, shared by its connections)."""
    return pinning.client_context(identity(token).cert_pem)
