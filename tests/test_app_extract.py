"""Unpacking ``kt.app``'s working directory on a pod (``ktlite/net/archive.py``), on every Python
ktlite supports: here with ``tarfile``'s ``data`` filter, and in a subprocess whose ``tarfile``
``tests/old_tarfile`` makes old (no filters, no ``filter=``), as Debian 12's Python 3.11.2 has
it. A tree made by ``pack()`` arrives whole on both paths; hostile archives are refused on both,
naming the member, and nothing is written anywhere.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

import ktlite as kt
from ktlite.api.apps import pack, run_replica
from ktlite.net.archive import extract

OLD_TARFILE = Path(__file__).parent / "old_tarfile"
MTIME = 1_600_000_000
RANK_ENV = {
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "GROUP_WORLD_SIZE": "1",
    "NODE_RANK": "0",
}

# run in the unpacked folder: what is there, as JSON (a link's target is not followed)
LIST_TREE = """
import json, os
tree = {}
for dirpath, dirs, files in os.walk("."):
    for f in dirs + files:
        path = os.path.join(dirpath, f)[2:]
        st = os.lstat(path)
        if os.path.islink(path):
            tree[path] = ["link", os.readlink(path)]
        elif os.path.isfile(path):
            tree[path] = ["file", oct(st.st_mode & 0o7777), int(st.st_mtime), open(path).read()]
print("TREE " + json.dumps(tree, sort_keys=True))
"""


def _old_python(
    code: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a Python whose tarfile predates extraction filters."""
    path = [str(OLD_TARFILE), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    full = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=full, capture_output=True, text=True, timeout=120
    )


def _tree_line(out: str) -> dict[str, list]:
    return json.loads(next(line for line in out.splitlines() if line.startswith("TREE "))[5:])


def test_the_old_tarfile_subprocess_has_no_extraction_filter() -> None:
    # the fallback below is only exercised if this holds
    run = _old_python(
        "import io, tarfile\n"
        "assert not hasattr(tarfile, 'data_filter') and not hasattr(tarfile, 'FilterError')\n"
        "tar = tarfile.open(fileobj=io.BytesIO(), mode='w')\n"
        "try:\n"
        "    tar.extractall('.', filter='data')\n"
        "except TypeError as e:\n"
        "    print(e)\n"
    )
    assert run.returncode == 0, run.stderr
    assert "TarFile.extractall() got an unexpected keyword argument 'filter'" in run.stdout
    assert hasattr(tarfile, "data_filter")  # ... and this process takes the other path


# ---- a tree made by pack() -------------------------------------------------------------------


def _packed_tree(root: Path) -> tuple[bytes, dict[str, list]]:
    """pack() of a folder with a link, a hard link and modes the data filter changes; the
    tree that must come out."""
    (root / "conf").mkdir(parents=True)
    files = {
        "train.py": ("print('hi')\n", 0o644),
        "conf/run.yaml": ("epochs: 3\n", 0o664),
        "run.sh": ("echo run\n", 0o4777),
        "private.txt": ("secret\n", 0o600),
        "notes.txt": ("x\n", 0o666 | 0o2000),
    }
    for rel, (text, mode) in files.items():
        (root / rel).write_text(text)
        os.chmod(root / rel, mode)
        os.utime(root / rel, (MTIME, MTIME))
    (root / "conf/latest.yaml").symlink_to("run.yaml")
    os.link(root / "conf/run.yaml", root / "copy.yaml")
    blob = pack(root)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        kinds = sorted(m.type for m in tar.getmembers())
    assert kinds.count(tarfile.SYMTYPE) == 1 and kinds.count(tarfile.LNKTYPE) == 1, kinds
    expected = {
        "train.py": ["file", "0o644", MTIME, "print('hi')\n"],
        "conf/run.yaml": ["file", "0o644", MTIME, "epochs: 3\n"],  # no group write
        "copy.yaml": ["file", "0o644", MTIME, "epochs: 3\n"],
        "conf/latest.yaml": ["link", "run.yaml"],
        "run.sh": ["file", "0o755", MTIME, "echo run\n"],  # no set-uid, no other write
        "private.txt": ["file", "0o600", MTIME, "secret\n"],
        "notes.txt": ["file", "0o644", MTIME, "x\n"],
    }  # no set-gid
    return blob, expected


@pytest.mark.timeout(120)
def test_run_replica_unpacks_a_packed_tree_on_a_python_without_the_data_filter(
    tmp_path: Path,
) -> None:
    blob, expected = _packed_tree(tmp_path / "src")
    (tmp_path / "files.tgz").write_bytes(blob)
    run = _old_python(
        "import sys\n"
        "from pathlib import Path\n"
        "from ktlite.api.apps import run_replica\n"
        "blob = Path(sys.argv[1]).read_bytes()\n"
        "run_replica([sys.executable, '-c', sys.argv[2]], blob, None, 30, {})\n",
        str(tmp_path / "files.tgz"),
        LIST_TREE,
        env=RANK_ENV,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert _tree_line(run.stdout) == expected


def test_extract_with_the_data_filter_gives_the_same_tree(tmp_path: Path) -> None:
    blob, expected = _packed_tree(tmp_path / "src")
    extract(blob, tmp_path / "dest")
    listed = subprocess.run(
        [sys.executable, "-c", LIST_TREE],
        cwd=tmp_path / "dest",
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert _tree_line(listed.stdout) == expected


# ---- hostile archives ------------------------------------------------------------------------


def _reg(name: str, data: bytes = b"gotcha\n") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    if kind == tarfile.CHRTYPE:
        info.devmajor, info.devminor = 1, 3  # /dev/null's numbers
    return info, b""


def _sym(name: str, target: str) -> tuple[tarfile.TarInfo, bytes]:
    return _special(name, tarfile.SYMTYPE, target)


# case -> (members given the box folder that holds dest/, the member the error must name).
# Extracted naively each would write, or leave a link, outside dest/.
HOSTILE: dict[str, tuple[Callable[[Path], list[tuple[tarfile.TarInfo, bytes]]], str]] = {
    "dotdot": (lambda box: [_reg("ok.txt"), _reg("../escape.txt")], "../escape.txt"),
    "dotdot-nested": (lambda box: [_reg("sub/../../escape.txt")], "sub/../../escape.txt"),
    "absolute": (lambda box: [_reg(f"{box}/escape.txt")], "/escape.txt"),
    "symlink-absolute": (lambda box: [_sym("passwd", "/etc/passwd")], "passwd"),
    "symlink-up": (lambda box: [_sym("up", "../../x")], "up"),
    "symlink-through-symlink": (lambda box: [_sym("a", "b/.."), _sym("b", ".")], "'a'"),
    "below-a-symlink": (lambda box: [_sym("here", "."), _sym("here/up", "..")], "here/up"),
    "hardlink-out": (lambda box: [_special("h", tarfile.LNKTYPE, "../sentinel.txt")], "'h'"),
    "hardlink-absolute": (
        lambda box: [_special("h", tarfile.LNKTYPE, f"{box}/sentinel.txt")],
        "'h'",
    ),
    "device": (lambda box: [_special("null", tarfile.CHRTYPE)], "null"),
    "fifo": (lambda box: [_special("pipe", tarfile.FIFOTYPE)], "pipe"),
    "twice": (lambda box: [_reg("a.txt"), _sym("a.txt", "../sentinel.txt")], "a.txt"),
}


def _hostile_case(parent: Path, case: str) -> tuple[Path, Path]:
    """``parent/case/box/{dest/, sentinel.txt}`` and the case's archive in ``parent/case``."""
    box = parent / case / "box"
    (box / "dest").mkdir(parents=True)
    (box / "sentinel.txt").write_text("untouched\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in HOSTILE[case][0](box):
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    (parent / case / "files.tgz").write_bytes(buf.getvalue())
    return box, parent / case / "files.tgz"


def _nothing_written(box: Path) -> None:
    assert sorted(os.listdir(box.parent)) == ["box", "files.tgz"]
    assert sorted(os.listdir(box)) == ["dest", "sentinel.txt"]
    assert os.listdir(box / "dest") == []
    assert (box / "sentinel.txt").read_text() == "untouched\n"
    assert os.stat(box / "sentinel.txt").st_nlink == 1


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archive_is_refused_with_the_data_filter(tmp_path: Path, case: str) -> None:
    box, archive = _hostile_case(tmp_path, case)
    with pytest.raises(kt.ConfigError, match="refusing to unpack") as info:
        extract(archive.read_bytes(), box / "dest")
    assert HOSTILE[case][1] in str(info.value)
    _nothing_written(box)


@pytest.mark.timeout(120)
def test_hostile_archives_are_refused_without_the_data_filter(tmp_path: Path) -> None:
    boxes = {case: _hostile_case(tmp_path, case) for case in HOSTILE}
    jobs = {case: [str(archive), str(box / "dest")] for case, (box, archive) in boxes.items()}
    run = _old_python(
        "import json, sys\n"
        "from pathlib import Path\n"
        "import ktlite\n"
        "from ktlite.net.archive import extract\n"
        "out = {}\n"
        "for case, (archive, dest) in json.loads(sys.argv[1]).items():\n"
        "    try:\n"
        "        extract(Path(archive).read_bytes(), dest)\n"
        "        out[case] = None\n"
        "    except ktlite.ConfigError as e:\n"
        "        out[case] = str(e)\n"
        "print('RESULT ' + json.dumps(out))\n",
        json.dumps(jobs),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    errors = json.loads(next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    for case, (box, _) in boxes.items():
        assert errors[case] is not None, f"{case}: extracted"
        assert HOSTILE[case][1] in errors[case], (case, errors[case])
        _nothing_written(box)


def test_a_refused_archive_leaves_no_folder_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    box, archive = _hostile_case(tmp_path, "dotdot")
    sandbox = box / "dest"  # run_replica's own folder is made (and must be removed) in here
    monkeypatch.setattr(tempfile, "tempdir", str(sandbox))
    for key, value in RANK_ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(kt.ConfigError, match=r"'\.\./escape\.txt'"):
        run_replica(
            [sys.executable, "-c", "print('never runs')"], archive.read_bytes(), None, 30, {}
        )
    _nothing_written(box)


def test_pack_refuses_a_link_out_of_the_folder_before_anything_is_deployed(tmp_path: Path) -> None:
    from ktlite.api.apps import pack

    (tmp_path / "outside.csv").write_text("x")
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print(1)\n")
    (work / "data.csv").symlink_to(tmp_path / "outside.csv")
    with pytest.raises(kt.ConfigError, match="data.csv") as info:
        pack(work)
    assert "inside" in str(info.value)
    (work / "data.csv").unlink()
    (work / "data.csv").symlink_to("train.py")  # a link that stays inside is shipped
    assert pack(work)
