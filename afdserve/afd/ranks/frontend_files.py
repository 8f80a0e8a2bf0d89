"""The files a frontend keeps in the temp directory while it runs: the rendezvous store directory
of each world it spawns (mode 0700) and, for ranks started elsewhere when no key is given, the
file holding the fresh key (mode 0600). The world removes them when it stops (world.py); a
frontend that was killed (SIGKILL, the OOM killer) removes nothing, so each name says who owns
it: `afdserve-store-PID-START-NS-XXXXXXXX`, with the owner's pid, its start time (clock ticks
after boot, /proc/PID/stat) and its pid namespace. A frontend that creates one of these files
first removes those of owners that are provably gone: the same user's, in the same pid
namespace, whose pid no longer runs (or runs another process, started at another time). Files
of a live frontend, of another user, of another pid namespace (a container sharing /tmp) or
named the old way (no owner) are left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

STORE_PREFIX = "afdserve-store-"
KEY_PREFIX = "afdserve-authkey-"


def _process_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a process from /proc/PID/stat; None where it has
    no entry there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[19])  # fields 3 (state) and 22 (starttime) of proc(5)


def _pid_namespace() -> int:
    """This process's pid namespace (its inode), 0 where /proc does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag() -> str:
    """PID-START-NS of this process, the owner part of the names it gives its files."""
    pid = os.getpid()
    try:
        start = (_process_start(pid) or ("", 0))[1]
    except OSError:
        start = 0
    return f"{pid}-{start}-{_pid_namespace()}"


def _owner(name: str) -> tuple[int, int, int] | None:
    """(pid, start, namespace) from a file's name; None when it is not one of ours."""
    for prefix in (STORE_PREFIX, KEY_PREFIX):
        if name.startswith(prefix):
            parts = name[len(prefix) :].split("-")
            if len(parts) == 4 and all(p.isdigit() for p in parts[:3]):
                return int(parts[0]), int(parts[1]), int(parts[2])
    return None


def _gone(pid: int, start: int, namespace: int) -> bool:
    """True only when the owner provably no longer runs."""
    if namespace != _pid_namespace():
        return False  # its pids are not ours to look up
    if namespace == 0:  # no /proc: whether the pid runs at all is all there is to know
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # another user's process: it runs
            pass
        return False
    try:
        found = _process_start(pid)
    except OSError:
        return False
    if found is None:
        return True
    state, started = found
    # A pid taken by a later process (another start time) or a zombie: the owner runs no more.
    return started != start or state == "Z"


def make_store_dir() -> str:
    """A fresh directory for a world's rendezvous store, mode 0700, named after this process."""
    remove_stale()
    return tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{owner_tag()}-")


def write_key_file(key: bytes) -> str:
    """A fresh file holding `key` in hex, mode 0600, named after this process."""
    remove_stale()
    fd, path = tempfile.mkstemp(prefix=f"{KEY_PREFIX}{owner_tag()}-")
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return path


def remove(path: str) -> None:
    """A store directory or key file; one already gone is no error."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _ours(directory: str) -> list[tuple[str, tuple[int, int, int]]]:
    """(path, owner) of every store directory and key file of this user in `directory`."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        owner = _owner(entry.name)
        if owner is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        kind = stat.S_ISDIR if entry.name.startswith(STORE_PREFIX) else stat.S_ISREG
        if info.st_uid == os.getuid() and kind(info.st_mode):
            found.append((entry.path, owner))
    return found


def remove_stale(directory: str | None = None) -> list[str]:
    """Remove the store directories and key files of frontends that are gone; the paths removed."""
    removed = []
    for path, owner in _ours(directory or tempfile.gettempdir()):
        if _gone(*owner):
            remove(path)
            removed.append(path)
            log.info("removed %s, left by frontend pid %d, which no longer runs", path, owner[0])
    return removed


def remove_own(directory: str | None = None) -> list[str]:
    """Remove every store directory and key file of this process: the last line of defence at
    its exit (serve.py), when none of its worlds runs any more; the paths removed."""
    me = tuple(int(part) for part in owner_tag().split("-"))
    removed = []
    for path, owner in _ours(directory or tempfile.gettempdir()):
        if owner == me:
            remove(path)
            removed.append(path)
    return removed
