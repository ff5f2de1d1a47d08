"""The data store's storage: keys, and a directory that holds their values.

Keys are '/'-separated relative paths (``"datasets/mnist"``). A key holds a file, a directory
tree, or a Python object (a file that starts with :data:`OBJECT_MAGIC`); the prefixes of
keys are directories, so ``ls`` works like ``ls``. Layout under the store's root::

    root/data/<key>     the values
    root/tmp/           uploads being written, and values being replaced or removed

Every write lands in ``tmp/`` first and is renamed into place, so a reader sees either the
old value or the new one, never half of one. The local backend uses this directly; on
Kubernetes the store pod's server (``ktlite_server.store``) serves the same directory over
HTTP. Standard library only: the server imports it.

Errors are :class:`StoreFault` with an :class:`~ktlite_wire.errors.ErrorCode` (``NOT_FOUND``,
``CONFLICT``, ``BAD_REQUEST``): the store pod answers by code, and the client's
``ktlite.datastore.storedir`` raises its own errors by overriding :meth:`StoreDir.fault`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tarfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from ktlite_wire import privatefiles
from ktlite_wire.errors import ErrorCode

OBJECT_MAGIC = b"KTLITE-OBJECT-1\n"  # 16 bytes at the start of a stored Python object
MAX_KEY = 1024
MAX_SEGMENT = 255  # bytes of one segment in UTF-8: a file name's limit on every common filesystem
CHUNK = 1 << 20
_BAD_CHARS = ("\0", "\\")
KINDS = ("file", "dir", "object")
ROOT_REFUSED = (
    "the data store's root is not removed by rm (recursive or not): `ktlite store wipe` "
    "deletes every key, after asking"
)


class StoreFault(Exception):
    """A data store operation failed; ``code`` classifies it, ``key`` names the key."""

    def __init__(
        self, message: str, key: str | None = None, code: ErrorCode = ErrorCode.CONFLICT
    ) -> None:
        super().__init__(message)
        self.key = key
        self.code = code


class KeyRefused(StoreFault, ValueError):
    """Not a valid key (the caller's mistake)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=ErrorCode.BAD_REQUEST)


def check_key(key: Any, *, what: str = "key", allow_root: bool = False) -> str:
    """``key`` normalised (one trailing '/' dropped), or a KeyRefused naming what is wrong."""
    if not isinstance(key, str):
        raise KeyRefused(f"{what}={key!r}: a data store key is a string such as 'datasets/mnist'")
    norm = key[:-1] if key.endswith("/") and key != "/" else key
    if norm == "" and allow_root:
        return ""
    problem = None
    if norm == "":
        problem = "it is empty"
    elif norm.startswith("/"):
        problem = "it is absolute (starts with '/')"
    elif len(norm) > MAX_KEY:
        problem = f"it is longer than {MAX_KEY} characters"
    elif any(c in norm for c in _BAD_CHARS):
        problem = "it holds a NUL or a backslash"
    else:
        parts = norm.split("/")
        if any(p == "" for p in parts):
            problem = "it has an empty segment ('//')"
        elif any(p in (".", "..") for p in parts):
            problem = "it has a '.' or '..' segment"
        elif any(_unencodable(p) for p in parts):
            problem = "it is not valid Unicode text (a lone surrogate)"
        elif long := next((p for p in parts if len(p.encode()) > MAX_SEGMENT), None):
            problem = (
                f"its segment {long[:40]!r}... is {len(long.encode())} bytes long, over the "
                f"{MAX_SEGMENT} bytes a segment may have (it is a file name in the store)"
            )
    if problem:
        raise KeyRefused(
            f"{what}={key!r} is not a valid data store key: {problem}; keys are "
            "relative '/'-separated paths without '.', '..' or empty segments, "
            "e.g. 'datasets/mnist'"
        )
    return norm


def _unencodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def missing_text(key: str, where: str) -> str:
    return f"no key {key!r} in the data store {where}; `ktlite ls` lists what it holds"


class StoreDir:
    """A data store kept in directory ``root`` (``where`` describes it in errors)."""

    def __init__(self, root: str | os.PathLike[str], where: str = "") -> None:
        self.root = Path(root)
        self.data = self.root / "data"
        self.tmp = self.root / "tmp"
        self.where = where or f"at {self.root}"
        for d in (self.root, self.data, self.tmp):  # 0700: one user's (or one pod's) data
            privatefiles.make_dir(d)

    def __repr__(self) -> str:
        return f"StoreDir({str(self.root)!r})"

    def fault(
        self, message: str, key: str | None = None, code: ErrorCode = ErrorCode.CONFLICT
    ) -> Exception:
        """The exception this store raises (a subclass raises its own kind)."""
        return StoreFault(message, key, code)

    def missing(self, key: str) -> Exception:
        return self.fault(missing_text(key, self.where), key, ErrorCode.NOT_FOUND)

    def path(self, key: str) -> Path:
        return self.data / key if key else self.data

    # ---- reading ------------------------------------------------------------------------

    def entry(self, key: str) -> dict[str, Any] | None:
        """``{"key", "name", "type", "size"}`` of ``key``, or None if it holds nothing."""
        path = self.path(key)
        try:
            st = path.lstat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        name = key.rsplit("/", 1)[-1]
        if stat.S_ISDIR(st.st_mode):
            return {"key": key, "name": name + "/", "type": "dir", "size": _tree_size(path)}
        kind, size = _file_kind(path, st.st_size)
        return {"key": key, "name": name, "type": kind, "size": size}

    def ls(self, prefix: str, recursive: bool = False) -> list[dict[str, Any]]:
        """The entries directly under ``prefix`` (every file and object below it with
        ``recursive``); a key that holds a file or an object lists itself."""
        top = self.entry(prefix) if prefix else {"type": "dir"}
        if top is None:
            raise self.missing(prefix)
        if top["type"] != "dir":
            return [top]
        base = self.path(prefix)
        out = []
        if recursive:
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames.sort()
                rel = Path(dirpath).relative_to(self.data).as_posix()
                for name in sorted(filenames):
                    entry = self.entry(name if rel == "." else f"{rel}/{name}")
                    if entry is not None:
                        out.append(
                            {**entry, "name": entry["key"][len(prefix) + 1 if prefix else 0 :]}
                        )
            return sorted(out, key=lambda e: e["key"])
        with contextlib.suppress(FileNotFoundError):
            for name in sorted(os.listdir(base)):
                entry = self.entry(f"{prefix}/{name}" if prefix else name)
                if entry is not None:
                    out.append(entry)
        return out

    def open(self, key: str) -> tuple[IO[bytes], dict[str, Any]]:
        """An open file of a file or object key (positioned after an object's header), and
        its entry. The open file stays valid if the key is replaced meanwhile."""
        entry = self.entry(key)
        if entry is None:
            raise self.missing(key)
        if entry["type"] == "dir":
            raise self.fault(f"key {key!r} holds a directory, not a file", key)
        try:
            f = open(self.path(key), "rb")  # noqa: SIM115 - the caller closes it
        except FileNotFoundError:
            raise self.missing(key) from None
        if f.read(len(OBJECT_MAGIC)) != OBJECT_MAGIC:
            f.seek(0)
            entry = {**entry, "type": "file", "size": os.fstat(f.fileno()).st_size}
        else:
            entry = {
                **entry,
                "type": "object",
                "size": os.fstat(f.fileno()).st_size - len(OBJECT_MAGIC),
            }
        return f, entry

    def tar(self, key: str) -> tuple[int, Iterator[bytes]]:
        """A directory key as an uncompressed tar stream: (its size in bytes, its chunks).
        Paths in it are relative to the key; only directories and regular files go in."""
        base = self.path(key)
        if not base.is_dir():
            if self.entry(key) is None:
                raise self.missing(key)
            raise self.fault(f"key {key!r} holds a file, not a directory", key)
        return tar_stream(base)

    def used_by_values(self) -> int:
        """Bytes of the values the store holds (a walk of its tree)."""
        return _tree_size(self.data)

    # ---- writing ------------------------------------------------------------------------

    def staging(self) -> Path:
        return self.tmp / uuid.uuid4().hex

    def write(self, key: str, chunks: Iterable[bytes], kind: str = "file") -> dict[str, Any]:
        """Store a file (or an object, ``kind="object"``) from ``chunks``."""
        staged = self.staging()
        try:
            with privatefiles.create_new(staged) as f:
                if kind == "object":
                    f.write(OBJECT_MAGIC)
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            self.install(staged, key)
        except BaseException:
            with contextlib.suppress(OSError):
                staged.unlink()
            raise
        entry = self.entry(key)
        assert entry is not None
        return entry

    def write_tar(self, key: str, stream: IO[bytes]) -> dict[str, Any]:
        """Store a directory from a tar stream (see :func:`extract`)."""
        staged = self.staging()
        try:
            try:
                extract(stream, staged)
            except StoreFault as e:
                raise self.fault(str(e), key, e.code) from e
            self.install(staged, key)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        entry = self.entry(key)
        assert entry is not None
        return entry

    def install(self, staged: Path, key: str) -> None:
        """Rename ``staged`` (a file or directory in tmp/) to ``key``, replacing its value."""
        target = self.path(key)
        self._parents(key)
        if staged.is_dir() or target.is_dir():
            # a directory cannot be replaced by one rename: move the old value aside first
            old = self.staging()
            with contextlib.suppress(FileNotFoundError):
                os.rename(target, old)
            os.rename(staged, target)
            _remove(old)
        else:
            os.replace(staged, target)

    def _parents(self, key: str) -> None:
        parts = key.split("/")[:-1]
        here = self.data
        for i, part in enumerate(parts):
            here = here / part
            if here.exists() and not here.is_dir():
                held = "/".join(parts[: i + 1])
                raise self.fault(
                    f"cannot store {key!r}: key {held!r} holds a file, not a directory; "
                    f"remove it first (kt.rm({held!r}))",
                    key,
                )
            with contextlib.suppress(FileExistsError):
                here.mkdir(mode=privatefiles.DIR_MODE)

    def remove(self, key: str, recursive: bool = False) -> dict[str, Any]:
        """Delete ``key`` (a directory only with ``recursive``). Never the root: emptying the
        whole store is :meth:`wipe`, a separate call."""
        if not key:
            raise self.fault(ROOT_REFUSED, None, ErrorCode.BAD_REQUEST)
        entry = self.entry(key)
        if entry is None:
            raise self.missing(key)
        if entry["type"] == "dir" and not recursive:
            raise self.fault(
                f"key {key!r} is a directory; pass recursive=True (`ktlite rm -r`) to "
                "remove it and everything under it",
                key,
            )
        aside = self.staging()
        try:
            os.rename(self.path(key), aside)
        except FileNotFoundError:
            raise self.missing(key) from None
        _remove(aside)
        return entry

    def wipe(self) -> int:
        """Delete every key (``ktlite store wipe``); the number of top-level keys removed."""
        removed = 0
        for child in list(self.data.iterdir()):
            aside = self.staging()
            with contextlib.suppress(FileNotFoundError):
                os.rename(child, aside)
                _remove(aside)
                removed += 1
        return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _file_kind(path: Path, size: int) -> tuple[str, int]:
    if size < len(OBJECT_MAGIC):
        return "file", size
    try:
        with open(path, "rb") as f:
            head = f.read(len(OBJECT_MAGIC))
    except OSError:
        return "file", size
    if head == OBJECT_MAGIC:
        return "object", size - len(OBJECT_MAGIC)
    return "file", size


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


# ---- tar streams (directories on the wire) --------------------------------------------------


def tar_stream(base: Path) -> tuple[int, Iterator[bytes]]:
    """Directory ``base`` as a tar stream, without reading any file into memory whole: (the
    stream's exact size, known up front so that it can go with a Content-Length; its chunks).
    Symlinks and special files are left out (a store holds data, not links)."""
    members: list[tuple[bytes, Path | None, int]] = []  # (header, file or None, size)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(base)
        if rel_dir != Path("."):
            info = tarfile.TarInfo(rel_dir.as_posix())
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            members.append((info.tobuf(tarfile.PAX_FORMAT), None, 0))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            info = tarfile.TarInfo((rel_dir / name).as_posix())
            info.size, info.mode, info.mtime = (
                st.st_size,
                stat.S_IMODE(st.st_mode),
                int(st.st_mtime),
            )
            members.append((info.tobuf(tarfile.PAX_FORMAT), path, st.st_size))
    total = sum(len(h) + _padded(size) for h, _, size in members) + 2 * tarfile.BLOCKSIZE

    def chunks() -> Iterator[bytes]:
        for header, path, size in members:
            yield header
            if path is None:
                continue
            sent = 0
            with open(path, "rb") as f:
                while sent < size:
                    chunk = f.read(min(CHUNK, size - sent))
                    if not chunk:
                        raise StoreFault(f"{path} shrank while it was being sent; send it again")
                    sent += len(chunk)
                    yield chunk
            if _padded(size) != size:
                yield b"\0" * (_padded(size) - size)
        yield b"\0" * (2 * tarfile.BLOCKSIZE)

    return total, chunks()


def _padded(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def extract(stream: IO[bytes], dest: Path) -> int:
    """Unpack a tar stream (read sequentially) into new directory ``dest``; only directories
    and regular files, each under ``dest`` (no absolute paths, no '..', no links). Returns the
    number of files."""
    dest.mkdir(parents=True)
    files = 0
    with tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK) as tar:
        for member in tar:
            name = member.name.rstrip("/")
            parts = name.split("/")
            if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
                if name in ("", "."):
                    continue
                raise StoreFault(
                    f"refused a directory upload: member {member.name!r} is not a "
                    "plain relative path"
                )
            target = dest.joinpath(*parts)
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif member.isfile():
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                with open(target, "wb") as out:
                    shutil.copyfileobj(source, out, CHUNK)
                os.chmod(target, (member.mode & 0o777) | 0o600)
                files += 1
            # links and special files are skipped: a store holds data only
    return files


def address_file(pod_ips_file: str) -> str:
    """Where a pod server keeps the store address handed to it at deploy time: next to its
    peer list (``KTLITE_POD_IPS_FILE``, which every rank process knows)."""
    directory, name = os.path.split(pod_ips_file)
    return os.path.join(
        directory, name.replace("pod-ips", "store", 1) if "pod-ips" in name else f"store-{name}"
    )


class ChunkReader:
    """A read-only file over an iterator of byte chunks (for ``tarfile``'s stream mode)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""
        self._pos = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            rest = self._buf[self._pos :] + b"".join(self._chunks)
            self._buf, self._pos = b"", 0
            return rest
        while len(self._buf) - self._pos < n:
            try:
                chunk = next(self._chunks)
            except StopIteration:
                break
            self._buf = self._buf[self._pos :] + chunk
            self._pos = 0
        out = self._buf[self._pos : self._pos + n]
        self._pos += len(out)
        return out


def open_reader(chunks: Iterator[bytes]) -> IO[bytes]:
    return ChunkReader(chunks)  # type: ignore[return-value]
