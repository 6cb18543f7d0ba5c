"""Files in a shared folder, never through a symlink or anything but regular files and real folders.

Whoever can write to the shared folder (``exchange_dir``) could plant a symlink where a party is about to write
(its reserved failure notice, a message, its egress log, its heartbeat) and make it overwrite a file elsewhere that
the party can write, or where it reads, and make it read (and quote) a file of its own. So every function here
takes the shared folder's root ``base`` (the party's own setting, trusted: it may itself be a symlink) and a path
below it, and walks from ``base`` one folder at a time, opening each with ``O_NOFOLLOW | O_DIRECTORY`` and
working relative to the open folder (``dir_fd``): no folder on the way is a symlink, nor can one be swapped for a
symlink between the check and the use. Files are opened with ``O_NOFOLLOW`` and checked to be regular before a
byte is read or written; a removal or rename first checks that the name is a regular file. Anything else raises
:class:`PlantedFile`, naming the path.

Where the platform has no ``dir_fd`` or ``O_NOFOLLOW`` (Windows), each path is checked with ``os.lstat`` before
it is used instead.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from dpneuro.protocol.exchange.base import ExchangeError

__all__ = ["PlantedFile", "append", "create_once", "is_file", "make_folder", "names", "open_read", "read",
           "replace", "status", "touch", "unlink", "write_over"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
# a planted FIFO must not block open(), nor a planted terminal become this process's
_EXTRA = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
_AT = bool(_NOFOLLOW and _DIRECTORY) and {os.open, os.stat, os.mkdir, os.unlink, os.rename, os.link} \
    <= os.supports_dir_fd
#: what open() raises for a symlink under O_NOFOLLOW (ELOOP; EMLINK on FreeBSD), a folder, a FIFO without reader
_REFUSED = {errno.ELOOP, errno.EMLINK, errno.ENOTDIR, errno.EISDIR, errno.ENXIO}


class PlantedFile(ExchangeError):
    """Something other than a regular file or a real folder lies in the shared folder where a party reads or writes."""

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        super().__init__(f"{path} is {what}, planted in the shared folder: dpneuro never reads, writes or removes "
                         "anything through a symlink or a non-regular file there. Remove it (and find out who put it "
                         "there), then start the party again")
        self.path, self.what = Path(path), what

    def __reduce__(self):  # pickled as it was made (the message alone would not make one again)
        return type(self), (self.path, self.what)


def _kind(mode: int, *, folder: bool = False) -> str:
    """What lies there, for the message: ``folder`` when a folder was expected."""
    if stat.S_ISLNK(mode):
        return "a symlink"
    kind = ("a folder" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a special file")
    return f"{kind}, not a {'real folder' if folder else 'regular file'}"


@dataclass
class _Folder:
    """A real folder below ``base``: open (``fd``), or, without ``dir_fd`` support, checked by path (``fd`` None)."""

    path: Path
    fd: int | None

    def at(self, name: str) -> str:
        """``name`` as the os functions take it along with ``dir_fd=self.fd``."""
        return name if self.fd is not None else str(self.path / name)

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(self.at(name), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def regular(self, name: str) -> os.stat_result | None:
        """``name``'s status if it is a regular file, None if there is nothing; else PlantedFile."""
        st = self.lstat(name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise PlantedFile(self.path / name, _kind(st.st_mode))
        return st


def _parts(base: Path, path: Path) -> list[str]:
    try:
        rel = path.relative_to(base)
    except ValueError:
        raise ValueError(f"{path} is not inside the shared folder {base}") from None
    if any(p in ("", ".", "..") for p in rel.parts):
        raise ValueError(f"{path}: no '.' or '..' inside the shared folder {base}")
    return list(rel.parts)


def _subfolder(fd: int, name: str, path: Path, create: bool) -> int | None:
    """Open folder ``name`` in the open folder ``fd`` without following a symlink (made if ``create``)."""
    flags = os.O_RDONLY | _DIRECTORY | _NOFOLLOW
    for attempt in range(2):
        try:
            return os.open(name, flags, dir_fd=fd)
        except FileNotFoundError:
            if not create or attempt:
                return None
        except OSError as exc:
            if exc.errno in _REFUSED:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                raise PlantedFile(path, _kind(st.st_mode, folder=True)) from None
            raise
        with contextlib.suppress(FileExistsError):  # another party made it meanwhile
            os.mkdir(name, dir_fd=fd)
    return None


def _open_folder(base: Path, folder: Path, create: bool) -> _Folder | None:
    """``folder`` (``base`` or below it), checked real all the way down from ``base``; None if it does not exist."""
    parts = _parts(base, folder)
    if create:
        base.mkdir(parents=True, exist_ok=True)
    if not _AT:
        here = base
        for name in parts:
            here = here / name
            try:
                mode = os.lstat(here).st_mode
            except FileNotFoundError:
                if not create:
                    return None
                with contextlib.suppress(FileExistsError):
                    here.mkdir()
                mode = os.lstat(here).st_mode
            if not stat.S_ISDIR(mode):
                raise PlantedFile(here, _kind(mode, folder=True))
        return _Folder(folder, None)
    try:
        fd = os.open(base, os.O_RDONLY | _DIRECTORY)  # the root itself may be a symlink: the party's own setting
    except FileNotFoundError:
        return None
    here = base
    try:
        for name in parts:
            here = here / name
            sub = _subfolder(fd, name, here, create)
            os.close(fd)
            fd = -1
            if sub is None:
                return None
            fd = sub
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return _Folder(folder, fd)


@contextlib.contextmanager
def _folder(base, folder, *, create: bool) -> Iterator[_Folder | None]:
    f = _open_folder(Path(base), Path(folder), create)
    try:
        yield f
    finally:
        if f is not None and f.fd is not None:
            os.close(f.fd)


def _open(f: _Folder, name: str, flags: int, mode: int = 0o600) -> int | None:
    """A regular file ``name`` of ``f`` opened with ``flags``; None if absent (only without ``O_CREAT``)."""
    path = f.path / name
    if f.fd is None:
        f.regular(name)  # no O_NOFOLLOW here: look first
    try:
        fd = os.open(f.at(name), flags | _NOFOLLOW | _EXTRA, mode, dir_fd=f.fd)
    except FileNotFoundError:
        if flags & os.O_CREAT:
            raise  # the folder itself went away
        return None
    except OSError as exc:
        if exc.errno in _REFUSED:
            f.regular(name)
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PlantedFile(path, _kind(st.st_mode))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fsync_folder(f: _Folder) -> None:
    """So that a name just linked or renamed in ``f`` survives a crash (best effort)."""
    if f.fd is None:
        return
    with contextlib.suppress(OSError):  # not every file system lets a folder be fsynced
        os.fsync(f.fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# -- the operations ------------------------------------------------------------------------------------------

def make_folder(base, folder) -> None:
    """Make ``folder`` (below ``base``) and the folders on the way, refusing any that is not a real folder."""
    with _folder(base, folder, create=True):
        pass


def status(base, path) -> os.stat_result | None:
    """The status of the regular file ``path``; None if there is nothing there."""
    path = Path(path)
    with _folder(base, path.parent, create=False) as f:
        return None if f is None else f.regular(path.name)


def is_file(base, path) -> bool:
    """Whether the regular file ``path`` exists (anything else there: PlantedFile)."""
    return status(base, path) is not None


def open_read(base, path) -> BinaryIO | None:
    """The regular file ``path`` open for reading; None if there is nothing there."""
    path = Path(path)
    with _folder(base, path.parent, create=False) as f:
        fd = None if f is None else _open(f, path.name, os.O_RDONLY)
    return None if fd is None else os.fdopen(fd, "rb")


def read(base, path) -> bytes | None:
    """The bytes of the regular file ``path``; None if there is nothing there."""
    fh = open_read(base, path)
    if fh is None:
        return None
    with fh:
        return fh.read()


def names(base, folder) -> list[str]:
    """The names in ``folder``, sorted (none if it does not exist)."""
    with _folder(base, folder, create=False) as f:
        if f is None:
            return []
        return sorted(os.listdir(f.fd if f.fd is not None else f.path))


def create_once(base, path, blob: bytes, mode: int = 0o600) -> bool:
    """Atomically create the file ``path`` holding ``blob``; False if it already existed (left untouched).

    Written to a temporary name in the same folder, fsynced and hard-linked to ``path``: readers see only
    complete files, and the first writer wins.
    """
    path = Path(path)
    with _folder(base, path.parent, create=True) as f:
        assert f is not None
        while True:
            tmp = f".{path.name}.{secrets.token_hex(6)}.tmp"
            try:
                fd = _open(f, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
                break
            except FileExistsError:
                continue
        assert fd is not None  # O_CREAT
        try:
            try:
                _write_all(fd, blob)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                # atomic create-if-absent: never overwrites (nor follows) whatever is at path
                os.link(f.at(tmp), f.at(path.name), src_dir_fd=f.fd, dst_dir_fd=f.fd)
                created = True
            except FileExistsError:
                created = False
            except OSError:
                # a file system without hard links: a rename is still atomic, but two concurrent first writers
                # could race (one party per address makes that a protocol error anyway)
                created = f.regular(path.name) is None
                if created:
                    os.replace(f.at(tmp), f.at(path.name), src_dir_fd=f.fd, dst_dir_fd=f.fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f.at(tmp), dir_fd=f.fd)
        if created:
            _fsync_folder(f)
        else:
            f.regular(path.name)  # what is there must be a file to compare with
        return created


def _created(base, path: Path, flags: int) -> int:
    """A descriptor of the regular file ``path``, made if absent, opened for writing with ``flags``."""
    with _folder(base, path.parent, create=True) as f:
        assert f is not None
        fd = _open(f, path.name, os.O_WRONLY | os.O_CREAT | flags, 0o666)
    assert fd is not None  # O_CREAT
    return fd


def _write(base, path: Path, data: bytes, flags: int) -> None:
    fd = _created(base, path, flags)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def append(base, path, data: bytes) -> None:
    """Append ``data`` to the regular file ``path`` (made if absent) and fsync it."""
    _write(base, Path(path), data, os.O_APPEND)


def write_over(base, path, blob: bytes) -> None:
    """Write ``blob`` at the start of the regular file ``path`` (made if absent), over the bytes it already has.

    Not truncated first: a file holding at least ``len(blob)`` bytes takes them without a new block on disk.
    """
    _write(base, Path(path), blob, 0)


def touch(base, path) -> None:
    """Set the modification time of the regular file ``path`` (made if absent) to now."""
    path = Path(path)
    fd = _created(base, path, 0)
    try:
        if os.utime in os.supports_fd:
            os.utime(fd)
        else:
            os.utime(path)
    finally:
        os.close(fd)


def replace(base, src, dst) -> None:
    """Rename the regular file ``src`` to ``dst`` in the same folder, over the regular file there if any."""
    src, dst = Path(src), Path(dst)
    if src.parent != dst.parent:
        raise ValueError(f"{src} and {dst} must be in the same folder")
    with _folder(base, src.parent, create=False) as f:
        if f is None or f.regular(src.name) is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(src))
        f.regular(dst.name)
        os.replace(f.at(src.name), f.at(dst.name), src_dir_fd=f.fd, dst_dir_fd=f.fd)
        _fsync_folder(f)


def unlink(base, path) -> None:
    """Remove the regular file ``path`` if it exists."""
    path = Path(path)
    with _folder(base, path.parent, create=False) as f:
        if f is not None and f.regular(path.name) is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f.at(path.name), dir_fd=f.fd)
