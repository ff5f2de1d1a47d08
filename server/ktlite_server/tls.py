"""The pod server's TLS: its deployment's certificate and key, served on its port, and the
context its requests to the other pods pin that same certificate with.

The client makes both (``ktlite.net.tls``) and ships them with the launch, as it ships the
token: on stdin's second line, after the token (``--tls-stdin``: the local and SSH backends;
JSON ``{"cert": PEM, "key": PEM}``), or as files (``--tls-cert-file`` and ``--tls-key-file``,
default ``KTLITE_TLS_CERT_FILE`` / ``KTLITE_TLS_KEY_FILE``: on Kubernetes, the token Secret's
volume). Python's ``ssl`` loads a key only from a file: one from stdin is written to a private
directory (0700, an unpredictable name), loaded, and removed at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ktlite_wire import pinning, privatefiles


@dataclass(frozen=True)
class ServerTls:
    """What a pod serves with (``server``) and calls its peers with (``peers``)."""

    server: ssl.SSLContext = field(repr=False)
    peers: ssl.SSLContext = field(repr=False)
    fingerprint: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls-stdin",
        action="store_true",
        help='serve TLS with the certificate and key of stdin\'s second line ({"cert", "key"})',
    )
    p.add_argument(
        "--tls-cert-file",
        default=os.environ.get("KTLITE_TLS_CERT_FILE") or None,
        help="serve TLS with this certificate (default: $KTLITE_TLS_CERT_FILE)",
    )
    p.add_argument(
        "--tls-key-file",
        default=os.environ.get("KTLITE_TLS_KEY_FILE") or None,
        help="... and this key (default: $KTLITE_TLS_KEY_FILE)",
    )


def load(args: argparse.Namespace) -> ServerTls | None:
    """The server's TLS as ``args`` ask (None: plain HTTP). Call after the token was read
    from stdin. The variables naming the files are not left for the rank processes."""
    os.environ.pop("KTLITE_TLS_CERT_FILE", None)
    os.environ.pop("KTLITE_TLS_KEY_FILE", None)
    if args.tls_stdin:
        try:
            shipped = json.loads(sys.stdin.readline())
            cert, key = shipped["cert"], shipped["key"]
        except (ValueError, KeyError, TypeError):
            raise SystemExit(
                "ktlite_server: --tls-stdin, but stdin's second line is not the JSON "
                '{"cert", "key"} the client sends; start the server through ktlite'
            ) from None
        return _contexts(cert.encode(), key.encode())
    if args.tls_cert_file or args.tls_key_file:
        if not (args.tls_cert_file and args.tls_key_file):
            raise SystemExit(
                "ktlite_server: TLS needs both --tls-cert-file and --tls-key-file "
                "(KTLITE_TLS_CERT_FILE, KTLITE_TLS_KEY_FILE); one was given"
            )
        try:
            cert = Path(args.tls_cert_file).read_bytes()
            key = Path(args.tls_key_file).read_bytes()
        except OSError as e:
            raise SystemExit(
                f"ktlite_server: cannot read the TLS certificate or key ({e.filename}: "
                f"{e.strerror}; uid {os.getuid()}, groups {os.getgroups()}); on Kubernetes the "
                "pod's fsGroup must give its user read access to the token Secret's files"
            ) from None
        return _contexts(cert, key)
    return None


def _contexts(cert: bytes, key: bytes) -> ServerTls:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_2
    scratch = privatefiles.scratch_dir("ktlite-tls-")
    try:
        privatefiles.write_file(Path(scratch) / "cert.pem", cert)
        privatefiles.write_file(Path(scratch) / "key.pem", key)
        server.load_cert_chain(Path(scratch) / "cert.pem", Path(scratch) / "key.pem")
    except ssl.SSLError as e:
        raise SystemExit(
            f"ktlite_server: the TLS certificate and key do not load ({e.reason or e}); "
            "the client ships them with the launch: deploy again"
        ) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ServerTls(server, pinning.client_context(cert), pinning.pem_fingerprint(cert))
