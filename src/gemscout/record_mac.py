"""MACs over the JSON records kept beside a rank's checkpoints: the trust ledger and the fault log.

With the job's integrity key (:mod:`gemscout.state.integrity`), each record carries ``mac``: HMAC-SHA256, under
that key, of the record's other fields as sorted, compact JSON, bound to what the record is and whose it is
(``scope``, e.g. ``"status.json node-0/rank-1"``), so a record written by someone without the key is refused, and so
is an authentic record copied to another rank's folder or into another kind of file. Without a key nothing is
authenticated (digests guard frames against damage, not forgers) and a record that carries a MAC is refused, as a
keyed frame is, naming the setting it needs.

Not covered by a MAC: deleting a record, or putting back an older authentic record of the same rank (a rollback);
recovery takes the union of every rank's ledgers, so one rank's rollback cannot drop a rejection its peers recorded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

from gemscout.errors import IntegrityError
from gemscout.state import integrity

__all__ = ["canonical", "check", "rank_scope", "sign"]

FIELD = "mac"
_CONTEXT = b"gemscout record mac v1\0"


def canonical(doc: dict[str, Any]) -> bytes:
    """The bytes a MAC covers: every field of ``doc`` but ``mac``, as sorted, compact JSON."""
    return json.dumps(
        {k: v for k, v in doc.items() if k != FIELD},
        sort_keys=True,
        separators=(",", ":"),
        allow_nan=True,
    ).encode()


def rank_scope(kind: str, folder: Path) -> str:
    """The scope of a record of ``kind`` kept in rank folder ``folder`` (``.../node-<n>/rank-<r>``): its last two
    names, so the whole checkpoint tree may move but a record may not change rank."""
    return f"{kind} {folder.parent.name}/{folder.name}"


def _mac(doc: dict[str, Any], scope: str, key: bytes) -> str:
    message = _CONTEXT + scope.encode() + b"\0" + canonical(doc)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(doc: dict[str, Any], scope: str) -> dict[str, Any]:
    """``doc`` with its ``mac`` under the job key in force, or ``doc`` unchanged when there is none."""
    key = integrity.current_key()
    if key is None:
        return doc
    return {**{k: v for k, v in doc.items() if k != FIELD}, FIELD: _mac(doc, scope, key)}


def check(doc: dict[str, Any], scope: str, what: str) -> None:
    """Refuse ``doc`` (IntegrityError naming ``what``) unless its MAC matches the job key in force; with no key, refuse
    a record that carries one. Raises only IntegrityError (or ConfigError for an unreadable key setting)."""
    key = integrity.current_key()
    mac = doc.get(FIELD)
    if key is None:
        if mac is not None:
            raise IntegrityError(
                f"{what} is authenticated with an integrity key this process does not have; set "
                f"{integrity.ENV_KEY_FILE} or {integrity.ENV_KEY} (or CheckpointConfig.integrity_key)"
            )
        return
    if mac is None:
        raise IntegrityError(
            f"{what} is not authenticated, but this job has an integrity key: refused (written by a job "
            "without the key, or forged)"
        )
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(doc, scope, key)):
        raise IntegrityError(
            f"{what}: MAC does not match this job's integrity key: refused (forged, damaged, or another "
            "rank's or job's record)"
        )
