"""One check for the directories that only this daemon's user may enter: the SSD tier's and the socket's.

`ensure_private_dir(path, what)` guarantees, when it returns, that `path` is a real directory (not a symlink to
one), owned by this process's uid, with no group or other permission bits: it creates it 0700 (parents as
`os.makedirs` makes them), or checks an existing one and tightens it to 0700. A shared directory (world-writable or
sticky, like /tmp) is refused and never tightened: chmod-ing /tmp would break every other user of the machine, and
a process running as root owns /tmp by uid, so this refusal is what protects it. The checks run on a file
descriptor opened with O_NOFOLLOW, so the directory checked is the one tightened.

A refusal raises `NotPrivateDir` (an OSError, so callers that already report OSErrors report it too) with a
message that names `what`, the path and what to do; it changes nothing on disk. Other errors (a parent that cannot
be created, no permission to look) are the plain OSErrors the system gives.
"""
from __future__ import annotations

import errno
import os
import socket
import stat

__all__ = ["NotPrivateDir", "ensure_private_dir"]


class NotPrivateDir(OSError):
    """The directory cannot be made private to us; the message says why and what to do instead."""


def ensure_private_dir(path: str, what: str, group: int | None = None) -> None:
    """Create `path` 0700, or check that it is a real directory of ours that is not shared and tighten it to
    0700. `what` names it in messages ("ssd directory", "socket directory"). With `group` (a gid), the directory
    is that group's and 0710: its members may reach a socket inside by name, not list or write it. Raises
    NotPrivateDir."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass                        # a file or a (dangling) symlink in its place: refused below
    fd = _open_dir(path, what)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise NotPrivateDir(f"{what} {path} belongs to uid {st.st_uid}, not to us ({os.getuid()}); "
                                f"choose a directory of our own")
        if st.st_mode & (stat.S_ISVTX | stat.S_IWOTH):
            raise NotPrivateDir(f"{what} {path} is shared (world-writable or sticky, like /tmp); use a private "
                                f"directory inside it, e.g. {os.path.join(path, 'kvstore')}")
        mode = stat.S_IMODE(st.st_mode)
        if group is not None:
            if st.st_gid != group:
                os.fchown(fd, -1, group)
            if mode != 0o710:
                os.fchmod(fd, 0o710)
        elif mode & 0o077 and mode != 0o710:     # 0710 is server.socket_group's layout: left alone
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _open_dir(path: str, what: str) -> int:
    """A descriptor of the directory itself: never of a symlink's target, never of a file."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    raise NotPrivateDir(f"{what} {path} is a symlink or not a directory; refusing to follow it: give the path of "
                        f"a real directory")


class SocketServed(OSError):
    """Another process answers at the socket's path."""


class NotASocket(OSError):
    """Something other than a socket is at the path."""


def listen_private(path: str, backlog: int, mode: int = 0o600, group: int | None = None) -> socket.socket:
    """Listen on a Unix socket at `path`, mode 0600 from its creation (its directory checked by the caller): a stale
    socket (nobody answers) is replaced; a live one (SocketServed) or any other file (NotASocket) is not."""
    if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise NotASocket(errno.EEXIST, f"{path} exists and is not a socket")
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise SocketServed(errno.EADDRINUSE, f"another process serves at {path}")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)                     # a stale socket from a process that died
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    if group is not None:
        os.chown(path, -1, group)
    os.chmod(path, mode)
    sock.listen(backlog)
    return sock
