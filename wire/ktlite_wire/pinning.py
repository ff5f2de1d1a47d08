"""Pinned TLS: a connection to a pod trusts exactly its deployment's certificate.

Each deployment has its own key and self-signed certificate (made by the client:
``ktlite.net.tls``). Whoever calls a pod (the client, or a pod calling another) trusts that one
certificate and nothing else: no system CA, no other deployment's. Pods are reached by IP,
so the name checked is :data:`SERVER_NAME`, the one name every certificate carries in its
subjectAltName, sent as the TLS server name whatever the address. Standard library only: the
pod server and its peers use this too.
"""

from __future__ import annotations

import hashlib
import socket
import ssl

SERVER_NAME = "ktlite-pod"  # every deployment certificate's one subjectAltName (a DNS name)


class PinnedContext(ssl.SSLContext):
    """A client context that trusts one certificate; ``pinned`` is its fingerprint (for
    errors: the context lists no CA to read it back from)."""

    pinned: str = ""


def client_context(cert_pem: bytes | str) -> PinnedContext:
    """A client context that accepts only the certificate ``cert_pem`` (checked against
    :data:`SERVER_NAME`), TLS 1.2 or newer."""
    ctx = PinnedContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the peer and its name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    pem = cert_pem.decode() if isinstance(cert_pem, bytes) else cert_pem
    ctx.load_verify_locations(cadata=pem)
    ctx.pinned = pem_fingerprint(pem)
    return ctx


def fingerprint(der: bytes) -> str:
    """A certificate's SHA-256 fingerprint (hex, colon-separated pairs; what
    ``openssl x509 -fingerprint -sha256`` prints)."""
    digest = hashlib.sha256(der).hexdigest().upper()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


def pem_fingerprint(cert_pem: bytes | str) -> str:
    """:func:`fingerprint` of a PEM certificate."""
    pem = cert_pem.decode() if isinstance(cert_pem, bytes) else cert_pem
    return fingerprint(ssl.PEM_cert_to_DER_cert(pem))


def presented(host: str, port: int, timeout: float = 5.0) -> str:
    """What the server at ``host:port`` presents, for an error after a failed verification:
    its certificate's fingerprint, or why none could be read (it may not speak TLS at all).
    Nothing is sent but a handshake."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE  # only to read what is presented; the call was refused
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            probe.wrap_socket(raw, server_hostname=SERVER_NAME) as s,
        ):
            der = s.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError) as e:
        return f"no certificate could be read ({e.__class__.__name__}: {e})"
    return f"a certificate with SHA-256 {fingerprint(der)}" if der else "no certificate"


def refusal(host: str, port: int, context: ssl.SSLContext, error: BaseException) -> str:
    """The message of a connection refused because the pod's certificate is not the one
    ``context`` pins: what was expected, what arrived, what to do."""
    expected = getattr(context, "pinned", "") or "unknown"
    return (
        f"the server at {host}:{port} is not this deployment's pod: TLS verification failed "
        f"({error}); expected the deployment's certificate (SHA-256 "
        f"{expected}), it presented {presented(host, port)}. Another "
        "process may hold that address, or the pods were started for another token: tear "
        "the deployment down and deploy again"
    )
