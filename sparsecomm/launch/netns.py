"""Linux network-namespace primitives shared by the emulated network (:mod:`.netemu`) and the data
file server (:mod:`.fileserver`): running iproute2, joining a namespace, finding stale namespaces."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess

__all__ = ["NETNS_DIR", "run_tool", "setns", "pid_alive", "stale_namespaces"]

NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000


def run_tool(*argv: str, stdin: str | None = None) -> None:
    """Run one iproute2 command; raise RuntimeError with its stderr when it fails."""
    done = subprocess.run(argv, input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {done.returncode}): "
                           f"{done.stderr.strip() or done.stdout.strip()}")


def setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd`` (``os.setns`` exists only
    from Python 3.12; older versions call libc)."""
    if hasattr(os, "setns"):
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns(CLONE_NEWNET) failed: {os.strerror(errno)}")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_namespaces(pattern: re.Pattern[str]) -> list[str]:
    """Names in ``NETNS_DIR`` matching ``pattern`` (with a ``pid`` group: the creator's process id)
    whose creating process is dead."""
    try:
        names = sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []
    return [name for name in names
            if (match := pattern.match(name)) and not pid_alive(int(match.group("pid")))]
