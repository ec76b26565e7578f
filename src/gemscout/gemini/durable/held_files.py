"""A durable promotion's files opened once: hashed and then loaded through the same descriptors.

Verifying a promotion's SHA-256 digests by name and then letting DCP open the same names again leaves a window: a
file swapped (renamed over, or rewritten in place through another link) between the two is loaded unverified. Here
each file is opened once (regular files only, no symbolic link), hashed through its descriptor, and held open
(:meth:`gemscout.gemini.durable.DurableTier.load`);
DCP then reads through :func:`storage_reader`, whose file system hands out fresh read-only opens of the *held* inodes
(``/proc/self/fd/<n>``: an open file description of its own, so DCP's seeks never move another reader's offset), and
refuses any name the verification did not hold. What is loaded is what was hashed, whatever the folder says meanwhile.
Left open: a writer with the file already open can still change its bytes in place after the hash (only an immutable
file system or a copy taken at verification closes that; a copy doubles the I/O of every restore).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any

from gemscout.errors import IntegrityError

__all__ = ["storage_reader"]


def storage_reader(folder: Path, held: Mapping[str, int]) -> Any:
    """A ``torch.distributed.checkpoint.FileSystemReader`` of ``folder`` that reads only the ``held`` descriptors."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HeldFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(
            self, path: str | os.PathLike[str], mode: str
        ) -> Generator[Any, None, None]:
            name = Path(path).name
            if mode != "rb" or Path(path).parent != folder or name not in held:
                raise IntegrityError(
                    f"durable promotion {folder.name}: DCP asked for {name!r} ({mode}), which is not one of "
                    "the files verified against the sidecar"
                )
            fd = os.open(f"/proc/self/fd/{held[name]}", os.O_RDONLY | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as stream:
                yield stream

    reader = FileSystemReader(str(folder))
    reader.fs = HeldFileSystem()
    reader.path = reader.fs.init_path(folder)
    return reader
