"""Damage GEMINI checkpoint files on disk the way a failing disk, a torn write or a faulty writer would.

Every injector edits one file in place and nothing else: it never goes through gemscout, so the runtime meets the
damage exactly as it would in production, when it reads the file back at recovery. The cases:

* :func:`flip_byte`: one bit flipped in the data region (a bad sector, silent media corruption);
* :func:`truncate`: the second half of the file gone (a torn write, a full disk);
* :func:`drop_digest`: one tensor digest missing from an otherwise well-formed header whose own digest is valid
  (a writer that skipped it), so only the header's content, not its checksum, reveals the fault.

Paths follow the checkpoint layout of :mod:`gemscout.gemini.store`, the replica placement of
:mod:`gemscout.gemini.replication` and the durable tier's layout (:mod:`gemscout.gemini.durable`), so a campaign names
"rank 1's replica of step 6" or "the durable promotion of step 6" and never spells a path.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from gemscout.gemini.durable import SIDECAR, DurableTier
from gemscout.gemini.replication import Placement
from gemscout.gemini.store import RankPaths, step_file
from gemscout.state.digest import DIGEST_SIZE
from gemscout.state.layout import MAGIC, align, frame_prefix

_PREFIX = struct.Struct("<8sQ")  # magic, header length: the fixed start of every checkpoint file


def own_slot(ckpt: Path, rank: int, step: int, *, ranks_per_node: int = 1) -> Path:
    """The file holding ``rank``'s own checkpoint of ``step`` under the checkpoint directory ``ckpt``."""
    paths = RankPaths.of(ckpt, node=rank // ranks_per_node, rank=rank)
    return step_file(paths.own, step)


def replica_slot(
    ckpt: Path, owner: int, step: int, *, world_size: int, ranks_per_node: int = 1
) -> Path:
    """The file in which the replica holder of ``owner`` (by GEMINI's ring placement) keeps its copy of ``step``."""
    placement = Placement(world_size=world_size, ranks_per_node=ranks_per_node)
    holder = placement.target(owner)
    paths = RankPaths.of(ckpt, node=placement.node_of(holder), rank=holder)
    return step_file(paths.replicas(owner), step)


def durable_slot(durable: Path, step: int, *, sidecar: bool = False) -> Path:
    """A file of the durable promotion of ``step``: its largest data file (a DCP ``.distcp``), or its SHA-256
    sidecar when ``sidecar``."""
    folder = DurableTier(durable, run_id="").path(step)
    if sidecar:
        return folder / SIDECAR
    data = [f for f in folder.glob("*.distcp") if f.is_file()]
    if not data:
        raise FileNotFoundError(f"{folder} holds no DCP data file; was step {step} promoted?")
    return max(data, key=lambda f: (f.stat().st_size, f.name))


def lose_every_node(ckpt: Path) -> list[int]:
    """Delete every node's folder (all local storage gone); return the nodes lost."""
    nodes = sorted(int(p.name.split("-", 1)[1]) for p in ckpt.glob("node-*") if p.is_dir())
    for node in nodes:
        lose_node(ckpt, node)
    return nodes


def node_dir(ckpt: Path, node: int) -> Path:
    """The folder holding every file of ``node``; deleting it is how a campaign loses a node."""
    return ckpt / f"node-{node}"


def lose_node(ckpt: Path, node: int) -> None:
    """Delete everything ``node`` had written, as if its local disk went away with it. Raises if it had nothing."""
    folder = node_dir(ckpt, node)
    if not folder.is_dir():
        raise FileNotFoundError(f"node folder {folder} does not exist; nothing to lose")
    shutil.rmtree(folder)


def flip_byte(path: Path, offset_from_end: int = 100) -> None:
    """Flip the lowest bit of the byte ``offset_from_end`` bytes before the end of ``path`` (in the data region for
    any real checkpoint: the last tensor's bytes end there)."""
    raw = bytearray(path.read_bytes())
    if not 0 < offset_from_end <= len(raw):
        raise ValueError(
            f"{path} is {len(raw)} bytes; cannot flip the byte {offset_from_end} from its end"
        )
    raw[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(raw))


def truncate(path: Path) -> None:
    """Keep only the first half of ``path``, as a write cut short would."""
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def drop_digest(path: Path, tensor: int = 0) -> None:
    """Rewrite the header of ``path`` without the digest of tensor ``tensor``, with a freshly computed, valid header
    digest, and keep the data region byte for byte: the file a writer that forgot one digest would leave."""
    raw = path.read_bytes()
    magic, header_len = _PREFIX.unpack_from(raw, 0)
    if magic != MAGIC:
        raise ValueError(f"{path} is not a gemscout checkpoint (magic {magic!r})")
    header = json.loads(raw[_PREFIX.size : _PREFIX.size + header_len])
    del header["tensors"][tensor]["digest"]
    data_start = align(_PREFIX.size + header_len + DIGEST_SIZE)
    new_prefix = frame_prefix(json.dumps(header, separators=(",", ":")).encode())
    path.write_bytes(new_prefix + raw[data_start:])


INJECTORS: dict[str, Callable[[Path], None]] = {
    "byte-flip": flip_byte,
    "truncate": truncate,
    "drop-digest": drop_digest,
}
"""Damage by name, as campaign files spell it in ``fault.kind``."""
