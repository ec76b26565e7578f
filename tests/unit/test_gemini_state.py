"""Pure logic of the checkpoint format: codec round trips, layout, digests, fail-closed parsing, atomic store."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from frames_support import frame_of

from gemscout.errors import ConfigError, IntegrityError
from gemscout.gemini import store
from gemscout.state.codec import decode, encode
from gemscout.state.layout import parse_prefix, verify_data
from gemscout.state.training_state import capture_rng, restore_rng


def restore(prefix: bytes, data: torch.Tensor) -> object:
    parsed = parse_prefix(prefix)
    verify_data(parsed, data)
    return decode(parsed.skeleton, parsed.layout.views(data))


def test_round_trip_keeps_every_value_type_and_bit() -> None:
    obj = {
        "w": torch.randn(5, 3),
        "bf": torch.randn(7).to(torch.bfloat16),
        "i": torch.arange(4),
        "b": torch.tensor([True, False]),
        "empty": torch.empty(0, 2),
        "scalar": torch.tensor(2.5),
        "nested": {1: [1.5, float("inf"), None, "x"], "t": (1, 2)},
        "np": np.arange(6, dtype=np.uint32),
        "nan": float("nan"),
    }
    back = restore(*frame_of(obj))
    for k in ("w", "bf", "i", "b", "scalar"):
        assert back[k].dtype == obj[k].dtype and back[k].shape == obj[k].shape
        assert (
            back[k].contiguous().numpy().tobytes() == obj[k].contiguous().numpy().tobytes()
            if obj[k].dtype != torch.bfloat16
            else torch.equal(back[k].view(torch.int16), obj[k].view(torch.int16))
        )
    assert back["empty"].shape == (0, 2)
    assert back["nested"] == {1: [1.5, float("inf"), None, "x"], "t": (1, 2)}
    assert isinstance(back["nested"]["t"], tuple)
    assert np.array_equal(back["np"], obj["np"]) and back["np"].dtype == np.uint32
    assert back["nan"] != back["nan"]


def test_unstorable_value_is_refused_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"state\.extra\.fn is a function"):
        encode({"extra": {"fn": lambda: 0}})


def test_rng_capture_restore_replays_every_stream() -> None:
    state = capture_rng()
    a = (torch.rand(3), random.random(), np.random.rand())
    back = restore(*frame_of(state))
    restore_rng(back)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]


@pytest.mark.parametrize("where", ["header", "data", "digest"])
def test_any_flipped_bit_is_detected(where: str) -> None:
    prefix, data = frame_of({"w": torch.randn(64)})
    if where == "data":
        data[10] ^= 1
    elif where == "header":
        p = bytearray(prefix)
        p[20] ^= 1
        prefix = bytes(p)
    else:
        p = bytearray(prefix)
        hlen = int.from_bytes(p[8:16], "little")
        p[16 + hlen] ^= 1
        prefix = bytes(p)
    with pytest.raises(IntegrityError):
        restore(prefix, data)


def test_truncated_data_is_refused() -> None:
    prefix, data = frame_of({"w": torch.randn(64)})
    with pytest.raises(IntegrityError, match="truncated"):
        restore(prefix, data[:100])


def test_atomic_store_reads_back_and_fails_closed(tmp_path: Path) -> None:
    prefix, data = frame_of({"w": torch.randn(32)})
    path = store.step_file(tmp_path / "own", 7)
    store.write_checkpoint(path, prefix, data)
    parsed, back = store.read_verified(path)
    assert parsed.identity["step"] == 3 and torch.equal(back, data)
    raw = bytearray(path.read_bytes())
    path.write_bytes(bytes(raw) + b"x")
    with pytest.raises(IntegrityError, match="trailing"):
        store.read_verified(path)
    path.write_bytes(bytes(raw[:-5]))
    with pytest.raises(IntegrityError, match="truncated"):
        store.read_verified(path)
    assert [p.name for p in (tmp_path / "own").iterdir()] == [path.name]  # no temp file left behind


def test_failed_write_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with store.atomic_writer(tmp_path / "x.gsc") as fh:
            fh.write(b"partial")
            raise RuntimeError("writer died")
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_of_dead_writer_is_cleaned(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    dead = tmp_path / f".tmp-{pid}-deadbeef-step-000000001.gsc"
    mine = tmp_path / f".tmp-{os.getpid()}-cafebabe-step-000000002.gsc"
    dead.write_bytes(b"x")
    mine.write_bytes(b"y")
    assert store.clean_stale_temps(tmp_path) == 1
    assert not dead.exists() and mine.exists()


def test_prune_keeps_everything_past_the_frontier(tmp_path: Path) -> None:
    folder = tmp_path / "own"
    for s in range(1, 8):
        store.step_file(folder, s).parent.mkdir(parents=True, exist_ok=True)
        store.step_file(folder, s).write_bytes(b"x")
    store.prune_safe(folder, frontier=4, keep=2)
    assert store.list_steps(folder) == [7, 6, 5, 4, 3]


def test_prune_keeps_protected_steps_beyond_the_generations(tmp_path: Path) -> None:
    folder = tmp_path / "own"
    folder.mkdir()
    for s in range(1, 8):
        store.step_file(folder, s).write_bytes(b"x")
    store.prune_safe(
        folder, frontier=6, keep=2, protect={1, 4, 9}
    )  # 9: not on disk, nothing to keep
    assert store.list_steps(folder) == [7, 6, 5, 4, 1]
