"""Where a command writes: checked before the work, and a result that cannot be written where asked is
still saved somewhere named.

A command that measures or trains for minutes and only then finds its destination unwritable loses
the work. So every command's output options (:data:`OUTPUT_OPTIONS`) are checked before anything
runs (:func:`check_outputs`, called by the command line for every command), by creating and removing
a probe file where the output will go: it is the one test that holds for read-only file systems,
root (whom permission bits do not stop), a file standing where a folder must be, and a full disk's
quota alike. Nothing is created. A write that still fails after the work (the disk filled up meanwhile)
goes to the temporary folder instead, and the command says where (:func:`save_or_fallback`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable

__all__ = ["OUTPUT_OPTIONS", "check_writable", "check_outputs", "save_or_fallback"]

#: option destinations that name a file or folder a command writes, and how the user spells them
OUTPUT_OPTIONS = {"out": "--out", "runs_dir": "--runs-dir", "checkpoint_dir": "--checkpoint-dir",
                  "profile_dir": "--profile-dir", "copy_to": "--copy-to"}


def _probe(folder: str) -> None:
    fd, probe = tempfile.mkstemp(prefix=".sparsecomm-probe.", dir=folder)
    os.close(fd)
    os.unlink(probe)


def check_writable(path: str, option: str) -> None:
    """Raise ``ValueError`` naming ``option`` and ``path`` unless ``path`` (a file or a folder, existing
    or not) can be written: an existing folder takes a new file, an existing file can be replaced
    (its folder takes a new file), a missing path can be made under its nearest existing folder.
    Creates nothing."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        where = full
    else:
        where = os.path.dirname(full)
        while not os.path.exists(where):
            where = os.path.dirname(where)
        if not os.path.isdir(where):
            raise ValueError(f"{option} {path!r} cannot be written: {where!r} is a file, not a folder")
        if os.path.exists(full) and not os.access(full, os.W_OK):
            raise ValueError(f"{option} {path!r} cannot be written: the file is read-only")
    try:
        _probe(where)
    except OSError as exc:
        raise ValueError(f"{option} {path!r} cannot be written: {exc.strerror or exc} in {where!r}") from None


def check_outputs(args: argparse.Namespace) -> None:
    """:func:`check_writable` for every output option of :data:`OUTPUT_OPTIONS` that ``args`` sets."""
    for dest, option in OUTPUT_OPTIONS.items():
        value = getattr(args, dest, None)
        if isinstance(value, str) and value:
            check_writable(value, option)


def save_or_fallback(write: Callable[[str], None], path: str, what: str) -> str:
    """``write(path)``; when that fails with ``OSError``, ``write`` to a file of the same name in the
    temporary folder instead and say so on stderr. Returns where the result is.

    Raises:
        OSError: the fallback failed too (both errors in the message).
    """
    try:
        write(path)
        return path
    except OSError as first:
        name = os.path.basename(os.path.normpath(path)) or "result"
        fallback = os.path.join(tempfile.mkdtemp(prefix="sparsecomm-"), name)
        try:
            write(fallback)
        except OSError as second:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(fallback))
            raise OSError(f"could not write the {what} to {path!r} ({first}) nor to {fallback!r} ({second})") from None
        print(f"warning: could not write the {what} to {path!r} ({first.strerror or first}); saved it to "
              f"{fallback!r} instead", file=sys.stderr, flush=True)
        return fallback
