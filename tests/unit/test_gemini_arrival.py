"""Verification on arrival (chunk by chunk, as recovery and replication receive) and the header-only inventory of
checkpoint files: the same verdicts as the whole-buffer check, never an exception mid-transfer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from frames_support import frame_of

from gemscout.errors import IntegrityError
from gemscout.gemini import store
from gemscout.gemini.arrival import ArrivalCheck, VerifyOnArrival
from gemscout.state.codec import encode
from gemscout.state.layout import Layout

STATE = {
    "big": torch.randn(5000),
    "empty": torch.empty(0),
    "small": torch.arange(7),
    "mid": torch.randn(300, 3),
}


def feed(prefix: bytes, data: torch.Tensor, chunk: int) -> ArrivalCheck:
    check = ArrivalCheck(prefix, data)
    for end in range(chunk, data.numel() + chunk, chunk):
        check.received(min(end, data.numel()))
    return check


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [1, 63, 64, 1000, 4096, 1 << 20])
def test_chunked_verification_accepts_an_intact_frame(chunk: int) -> None:
    prefix, data = frame_of(STATE)
    parsed = feed(prefix, data, chunk).result()
    assert parsed.identity == {"step": 3}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [64, 1000, 1 << 20])
def test_a_flipped_byte_is_named_after_the_whole_transfer(chunk: int) -> None:
    prefix, data = frame_of(STATE)
    layout = Layout.of(encode(STATE)[1])
    victim = layout.entries[2]  # "small", after a tensor that spans many chunks and an empty one
    data[victim.offset + 3] ^= 0xFF
    check = feed(prefix, data, chunk)  # must not raise while "receiving"
    with pytest.raises(IntegrityError, match="tensor 2 digest mismatch"):
        check.result()


@pytest.mark.timeout(60)
def test_a_bad_header_or_short_data_fails_closed() -> None:
    prefix, data = frame_of(STATE)
    bad = bytearray(prefix)
    bad[20] ^= 0x01
    with pytest.raises(IntegrityError, match="header digest"):
        feed(bytes(bad), data, 4096).result()
    with pytest.raises(IntegrityError, match="truncated"):
        feed(prefix, data[:100].clone(), 64).result()
    with pytest.raises(IntegrityError, match="truncated"):
        feed(b"", torch.empty(0, dtype=torch.uint8), 64).result()
    with pytest.raises(IntegrityError, match="no checkpoint arrived"):
        VerifyOnArrival().result()


@pytest.mark.timeout(60)
def test_header_inventory_reads_no_payload_and_read_frame_is_byte_exact(tmp_path: Path) -> None:
    prefix, data = frame_of(STATE)
    path = store.step_file(tmp_path, 5)
    store.write_checkpoint(path, prefix, data, fsync=False)
    assert store.read_header(path).identity == {"step": 3}
    got_prefix, got = store.read_frame(path)
    assert got_prefix == prefix and torch.equal(got, data)
    raw = bytearray(path.read_bytes())
    raw[len(prefix) + 5] ^= (
        0xFF  # payload damage: invisible to the header inventory, caught when the frame is verified
    )
    path.write_bytes(bytes(raw))
    store.read_header(path)
    check = VerifyOnArrival()
    frame = store.read_frame(path)
    check(*frame).received(frame[1].numel())
    with pytest.raises(IntegrityError, match="digest mismatch"):
        check.result()
    path.write_bytes(bytes(raw[:-5]))
    with pytest.raises(IntegrityError, match="truncated"):
        store.read_header(path)
    path.write_bytes(bytes(raw) + b"x")
    with pytest.raises(IntegrityError, match="trailing"):
        store.read_header(path)
    path.write_bytes(bytes(raw[:10]))
    with pytest.raises(IntegrityError, match="truncated"):
        store.read_header(path)
