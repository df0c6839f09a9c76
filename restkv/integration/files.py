"""Files written whole or not at all, with the mode a new file gets."""

from __future__ import annotations

import os
import tempfile


def new_file_mode(folder=False):
    """The mode ``open()`` (``os.makedirs`` for a folder) gives a new file under this process's umask:
    ``0o644`` (``0o755``) with the usual umask ``022``."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask


def atomic_write(path, text):
    """Write ``text`` to ``path`` through a temporary file beside it (fsynced, then renamed), so a
    reader never sees a partial file; the file gets the mode of a new file (:func:`new_file_mode`)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, new_file_mode())  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
