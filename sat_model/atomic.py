"""Atomic, durable writes: readers see the old file or folder or the new one, never half of either,
and what was renamed into place survives a power cut.

A file goes to a temporary file in the destination's own folder (same filesystem, so the rename is
atomic), is fsynced, ``os.replace`` puts it in place, and the folder is fsynced so that the
rename itself is on disk. A folder (a model, a gallery) is filled under a hidden temporary name
that carries the writer's PID (``.<name>.<pid>.<random>``), fsynced file by file, then swapped
with the old one by :func:`replace_dir` in a single ``renameat2(RENAME_EXCHANGE)``: the
destination never stops existing. Temporary files and folders of writers that died (SIGKILL, OOM,
power cut) are removed by the next writer; those of a live writer are left alone.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "ForeignFolderError",
    "check_replaceable",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "pid_alive",
    "remove_dead_temps",
    "replace_dir",
    "temp_dir",
    "write_bytes_atomic",
    "write_text_atomic",
]


class ForeignFolderError(RuntimeError):
    """The folder to replace was not written by this project: it is never deleted."""


def fsync_dir(path: str | Path) -> None:
    """Flush a folder's entries (names created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Flush a file written by another handle (a library's writer) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file under ``root`` and every folder, ``root`` included (children first)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                fsync_file(path)
        fsync_dir(folder)


def write_bytes_atomic(path: str | Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically, creating the parent folder if needed.

    ``durable=False`` skips the fsyncs: still all-or-nothing for readers, but a power cut may
    lose the file; fine for many small files that are cheap to regenerate.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the umask decides the mode, as for any file the user writes (mkstemp would make it 0600)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    tmp = _new_name(path.parent, f".{path.name}.", ".tmp")
    fd = os.open(tmp, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)  # the rename is an entry of the folder: without this it may vanish


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (signal 0: existence check only)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True


def temp_dir(parent: str | Path, name: str) -> Path:
    """A new hidden folder ``parent/.<name>.<pid>.<random>`` for this process to fill; it
    becomes an output folder, so the umask decides its mode (mkdtemp would make it 0700)."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    path = _new_name(Path(parent), f".{name}.{os.getpid()}.", "")
    path.mkdir(0o777)  # exclusive: an existing name raises FileExistsError
    return path


def _new_name(parent: Path, prefix: str, suffix: str) -> Path:
    """``parent/<prefix><8 random hex digits><suffix>``, created exclusively by the caller."""
    return parent / f"{prefix}{secrets.token_hex(4)}{suffix}"


def remove_dead_temps(parent: str | Path, name: str) -> list[Path]:
    """Delete ``parent/.<name>.<pid>.*`` (folders or files) whose writer no longer runs.

    A PID reused by an unrelated live process keeps its temp until that process ends: the safe
    side. Returns what was removed.
    """
    removed = []
    prefix = f".{name}."
    for tmp in Path(parent).glob(f"{glob.escape(prefix)}*"):
        pid = tmp.name[len(prefix) :].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def check_replaceable(destination: Path, owned: Callable[[Path], bool]) -> None:
    """Raise :class:`ForeignFolderError` unless ``destination`` is absent, an empty folder, or a
    folder ``owned`` recognises as this project's (checked before hours of work, and again at
    the swap)."""
    destination = Path(destination)
    if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
        raise ForeignFolderError(f"refusing to replace {destination}: not a folder")
    if destination.is_dir() and any(destination.iterdir()) and not owned(destination):
        raise ForeignFolderError(
            f"refusing to replace {destination}: it exists and was not written by sat "
            f"(point the param at a new or sat-owned folder, or remove it yourself)"
        )


def replace_dir(staging: Path, destination: Path, owned: Callable[[Path], bool]) -> None:
    """Put the folder ``staging`` at ``destination`` durably; the old folder is deleted after.

    ``destination`` is replaced only when it is absent, an empty folder, or ``owned(destination)``
    says this project wrote it (a folder of the user's, ``~`` say, is never deleted).

    Raises:
        ForeignFolderError: ``destination`` exists and is not ours; ``staging`` is left in place.
    """
    staging, destination = Path(staging), Path(destination)
    check_replaceable(destination, owned)
    fsync_tree(staging)
    parent = destination.parent
    if not destination.exists():
        os.rename(staging, destination)
    elif _exchange(staging, destination):
        shutil.rmtree(staging)  # the old folder, now under the temporary name
    else:  # no RENAME_EXCHANGE here: two renames, a short window without the folder
        old = staging.with_name(staging.name + ".old")
        os.rename(destination, old)
        os.rename(staging, destination)
        shutil.rmtree(old)
    fsync_dir(parent)


# Linux renameat2(2) flag; the standard library has no exchange (os.replace cannot put a folder
# over a non-empty one), hence the direct libc call.
_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the OS or file system cannot (then nothing moved)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not glibc >= 2.28 (macOS, musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # e.g. NFS, old kernels
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))
