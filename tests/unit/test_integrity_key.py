"""The authenticated integrity option: with a job key, every frame's header digest is a keyed BLAKE3 MAC and a
durable sidecar carries an HMAC, so a file, replica or promotion forged without the key is refused; a process
without the key refuses keyed frames naming the setting; the key never shows in a repr. Real files and a real DCP
promotion (one-rank gloo group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from durable_support import promote, sources
from frames_support import frame_of

from gemscout import CheckpointConfig
from gemscout.errors import ConfigError, IntegrityError
from gemscout.gemini import store
from gemscout.gemini.arrival import VerifyOnArrival
from gemscout.gemini.durable import SIDECAR
from gemscout.state import integrity
from gemscout.state.digest import digest_bytes

KEY = bytes(range(32))  # the key the conftest's ``keyed`` fixture sets


def _forge_unkeyed(prefix: bytes, edit: dict[str, object]) -> bytes:
    """What a forger without the key can write: the header edited, its digest recomputed, either unkeyed (the
    old magic) or keyed under a key of their own."""
    n = int.from_bytes(prefix[8:16], "little")
    doc = json.loads(prefix[16 : 16 + n])
    doc["identity"].update(edit)
    header = json.dumps(doc).encode()
    head = (
        b"GEMSCK01"
        + len(header).to_bytes(8, "little")
        + header
        + bytes.fromhex(digest_bytes(header))
    )
    return head + b"\0" * (-len(head) % 64)


@pytest.mark.timeout(30)
def test_a_frame_forged_without_the_key_is_refused_on_disk_and_on_arrival(
    tmp_path: Path, keyed: None
) -> None:
    prefix, data = frame_of({"w": torch.arange(6.0)}, step=2)
    assert prefix[:8] == b"GEMSCKK1"
    path = store.step_file(tmp_path, 2)
    store.write_checkpoint(path, prefix, data, fsync=False)
    assert store.read_verified(path)[0].identity == {"step": 2}
    forged = _forge_unkeyed(prefix, {"step": 2, "owner": 0})
    store.write_checkpoint(path, forged, data, fsync=False)
    with pytest.raises(IntegrityError, match="not authenticated"):
        store.read_header(path)
    integrity.use_key(b"another job's secret key")  # a forger with a key of their own
    other, _ = frame_of({"w": torch.arange(6.0)}, step=2)
    integrity.use_key(KEY)
    store.write_checkpoint(path, other, data, fsync=False)
    with pytest.raises(IntegrityError, match="MAC mismatch"):
        store.read_verified(path)
    check = VerifyOnArrival()  # a replica on the wire: the same prefix, the same check
    check(other, data)
    with pytest.raises(IntegrityError, match="MAC mismatch"):
        check.result()


@pytest.mark.timeout(30)
def test_a_process_without_the_key_names_the_setting(
    tmp_path: Path, keyed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, data = frame_of({"w": torch.ones(2)})
    path = store.step_file(tmp_path, 3)
    store.write_checkpoint(path, prefix, data, fsync=False)
    integrity.use_key(None)
    with pytest.raises(IntegrityError, match="GEMSCOUT_INTEGRITY_KEY"):
        store.read_header(path)
    monkeypatch.setenv(integrity.ENV_KEY, KEY.hex())  # inspect's way: the environment
    assert store.read_header(path).identity == {"step": 3}
    (tmp_path / "key").write_bytes(KEY)
    monkeypatch.delenv(integrity.ENV_KEY)
    monkeypatch.setenv(integrity.ENV_KEY_FILE, str(tmp_path / "key"))
    assert store.read_header(path).identity == {"step": 3}


@pytest.mark.timeout(60)
def test_a_promotion_forged_without_the_key_is_refused(
    tmp_path: Path, keyed: None, one_rank: None
) -> None:
    src, _ = sources({"x": torch.ones(3)})
    tier = promote(tmp_path / "durable", src, 5, tmp_path)
    assert tier.newest_step() == 5
    path = tier.path(5) / SIDECAR
    doc = json.loads(path.read_text())
    assert isinstance(doc.get("mac"), str)
    path.write_text(json.dumps({**doc, "run_id": "someone-else"}))
    with pytest.raises(IntegrityError, match="MAC"):
        tier.verify(5)
    path.write_text(json.dumps({k: v for k, v in doc.items() if k != "mac"}))
    with pytest.raises(IntegrityError, match="MAC"):
        tier.verify(5)
    path.write_text(json.dumps(doc))
    tier.verify(5)
    integrity.use_key(None)
    with pytest.raises(IntegrityError, match="GEMSCOUT_INTEGRITY_KEY"):
        tier.verify(5)


@pytest.mark.timeout(30)
def test_the_key_is_validated_and_never_printed(tmp_path: Path) -> None:
    config = CheckpointConfig(directory=tmp_path, integrity_key=KEY.hex())
    assert KEY.hex() not in repr(config) and "integrity_key" not in repr(config)
    with pytest.raises(ConfigError, match="16 bytes"):
        integrity.derive(b"short")
    with pytest.raises(ConfigError, match="integrity_key"):
        CheckpointConfig(directory=tmp_path, integrity_key=5)  # type: ignore[arg-type]
