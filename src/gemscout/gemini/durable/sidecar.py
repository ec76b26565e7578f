"""A durable promotion's sidecar, ``gemscout-sidecar.json``: what it must contain, its digests and its MAC.

The sidecar names every file of the promotion with its size and SHA-256, and the JSON skeleton (per rank, for a
collective promotion) that turns the stored tensors back into training state. Everything in it is checked here
before any of it is used; with the job's integrity key it also carries a MAC over its canonical bytes, so a forged
or foreign promotion is refused (:mod:`gemscout.state.integrity`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

from gemscout import record_mac
from gemscout.errors import IntegrityError
from gemscout.files import is_int, open_regular
from gemscout.state import integrity
from gemscout.state.layout import check_skeleton

SIDECAR = "gemscout-sidecar.json"
MAX_SIDECAR_BYTES = 256 << 20
_HEX = frozenset("0123456789abcdef")


def sha256_file(path: Path, size: int | None = None) -> str:
    """Streamed SHA-256 of a regular file; with ``size``, refused (IntegrityError) unless the file has exactly that
    many bytes, checked before reading and never read past."""
    with open_regular(path) as (fd, st):
        return sha256_fd(path.name, fd, st, size)


def sha256_fd(name: str, fd: int, st: os.stat_result, size: int | None) -> str:
    h = hashlib.sha256()
    if size is not None and st.st_size != size:
        raise IntegrityError(f"{name} is {st.st_size} bytes, not the {size} its sidecar records")
    done, end = 0, st.st_size if size is None else size
    while done < end:
        block = os.pread(fd, min(1 << 20, end - done), done)
        if not block:
            raise IntegrityError(f"{name} shrank while being hashed")
        h.update(block)
        done += len(block)
    return h.hexdigest()


def check_sidecar(doc: Any, step: int) -> dict[str, Any]:
    """The sidecar's structure, checked before anything in it is used: ``files`` maps plain file names to
    ``{"sha256": 64 hex digits, "size": int >= 0}``; a sharded one lists per rank an object with its skeleton,
    identity and ``entries`` of ``[key, shape | null, stride | null]``; format 1 gives a tensor count. Raises
    IntegrityError naming what is wrong."""

    def refuse(why: str) -> IntegrityError:
        return IntegrityError(f"durable step {step}: sidecar is malformed: {why}")

    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise refuse("no files object")
    for name, meta in doc["files"].items():
        if not name or "/" in name or name in (".", "..", SIDECAR) or "\0" in name:
            raise refuse(f"file name {name!r} is not a plain name")
        if (
            not isinstance(meta, dict)
            or not is_int(meta.get("size"))
            or not isinstance(meta.get("sha256"), str)
            or len(meta["sha256"]) != 64
            or not set(meta["sha256"]) <= _HEX
        ):
            raise refuse(f"file {name!r} has no valid size and sha256")
    if not isinstance(doc.get("run_id", ""), str):
        raise refuse("run_id is not a string")
    if doc.get("sharded"):
        ranks = doc.get("ranks")
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
            raise refuse("ranks is not a non-empty list of objects")
        for i, r in enumerate(ranks):
            if r.get("codec") is not None:
                if not isinstance(r["codec"], str):
                    raise refuse(f"rank {i} codec is not a string")
                continue
            entries = r.get("entries")
            if not isinstance(entries, list) or not all(
                isinstance(e, list)
                and len(e) == 3
                and isinstance(e[0], str)
                and all(
                    v is None or (isinstance(v, list) and all(is_int(d) for d in v)) for v in e[1:]
                )
                for e in entries
            ):
                raise refuse(f"rank {i} entries are not [key, shape, stride] lists")
            if not isinstance(r.get("identity"), dict) or not is_int(r.get("rank_specific", 0)):
                raise refuse(f"rank {i} has no identity object")
            try:
                check_skeleton(r.get("skeleton"), len(entries))
            except IntegrityError as exc:
                raise refuse(f"rank {i}: {exc}") from None
    else:
        if not is_int(doc.get("tensors")):
            raise refuse("tensors is not a non-negative integer")
        try:
            check_skeleton(doc.get("skeleton"), doc["tensors"])
        except IntegrityError as exc:
            raise refuse(str(exc)) from None
    return doc


def canonical(doc: dict[str, Any]) -> bytes:
    """The bytes a sidecar's MAC covers: every field but ``mac``, as sorted, compact JSON."""
    return record_mac.canonical(doc)


def check_mac(sidecar: dict[str, Any], step: int) -> None:
    """With the job's integrity key, the sidecar must carry a valid MAC (see :mod:`gemscout.state.integrity`)."""
    key = integrity.current_key()
    mac = sidecar.get("mac")
    if key is None:
        if mac is not None:
            raise IntegrityError(
                f"durable step {step}: the promotion is authenticated with an integrity key this "
                f"process does not have; set {integrity.ENV_KEY_FILE} or {integrity.ENV_KEY}"
            )
        return
    if not isinstance(mac, str) or not hmac.compare_digest(
        mac, integrity.sidecar_mac(canonical(sidecar), key)
    ):
        raise IntegrityError(
            f"durable step {step}: sidecar MAC missing or wrong: not written with this job's "
            "integrity key (forged or another job)"
        )
