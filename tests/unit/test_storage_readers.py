"""Readers of a checkpoint folder open only regular files, never read past the declared size, and check a header's
structure before its layout is used: special files are refused quickly with an IntegrityError, a header forged with
recomputed digests but an impossible layout is refused (not decoded), junk names cannot make a real generation be
pruned, and deep JSON never ends in RecursionError. Real files written with gemscout's writer."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from frames_support import frame_of

from gemscout.errors import IntegrityError
from gemscout.files import load_json, parse_json
from gemscout.gemini import store
from gemscout.gemini.lifecycle import TrustLedger
from gemscout.state.layout import frame_prefix, parse_prefix

STATE = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.ones(5, dtype=torch.int64),
    "e": torch.empty(0, 2),
    "n": 3,
}


def good_file(folder: Path, step: int = 1) -> Path:
    prefix, data = frame_of(STATE, step)
    path = store.step_file(folder, step)
    store.write_checkpoint(path, prefix, data, fsync=False)
    return path


def forge(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite ``path``'s header with ``edit`` applied and its header digest recomputed (the data unchanged)."""
    prefix, data = store.read_frame(path)
    parsed = parse_prefix(prefix)
    end = 16 + int.from_bytes(prefix[8:16], "little")
    doc = json.loads(prefix[16:end])
    edit(doc)
    assert parsed is not None
    store.write_checkpoint(path, frame_prefix(json.dumps(doc).encode()), data, fsync=False)


@pytest.mark.timeout(30)
def test_a_fifo_a_link_to_dev_zero_and_an_8_gib_sparse_file_are_refused_quickly(
    tmp_path: Path,
) -> None:
    os.mkfifo(store.step_file(tmp_path, 1))
    os.symlink("/dev/zero", store.step_file(tmp_path, 2))
    sparse = good_file(tmp_path, 3)
    os.truncate(sparse, 8 << 30)
    os.symlink(
        good_file(tmp_path / "elsewhere", 4), store.step_file(tmp_path, 4)
    )  # a link out of the folder
    assert store.list_steps(tmp_path) == [4, 3, 2, 1]
    for step, why in (
        (1, "not a regular file"),
        (2, "symbolic link"),
        (3, "trailing bytes"),
        (4, "symbolic link"),
    ):
        for reader in (store.read_header, store.read_frame, store.read_verified):
            t0 = time.monotonic()
            with pytest.raises(IntegrityError, match=why):
                reader(store.step_file(tmp_path, step))
            assert time.monotonic() - t0 < 2.0


@pytest.mark.timeout(30)
def test_non_ascii_digits_and_a_trailing_newline_are_not_step_names(tmp_path: Path) -> None:
    good_file(tmp_path, 1)
    good_file(tmp_path, 2)
    (tmp_path / "step-\u0969\u0969\u0969\u0969\u0969\u0969\u0969\u0969\u0969.gsc").write_bytes(
        b"x"
    )  # Devanagari 9s
    (tmp_path / "step-000000009.gsc\n").write_bytes(b"x")
    assert store.list_steps(tmp_path) == [2, 1]
    store.prune_safe(tmp_path, frontier=2, keep=2)
    assert store.list_steps(tmp_path) == [2, 1]  # the junk did not push a real generation out
    (tmp_path / "replicas").mkdir()
    for name in ("owner-x", "owner-\u0661", "owner-1", "owner-02"):
        (tmp_path / "replicas" / name).mkdir()
    assert store.RankPaths(tmp_path).held_owners() == [1, 2]


FORGERIES: dict[str, Callable[[dict[str, Any]], None]] = {
    "negative offset": lambda d: d["tensors"][1].update(offset=-64),
    "overlapping offset": lambda d: d["tensors"][1].update(offset=0),
    "unaligned offset": lambda d: d["tensors"][1].update(offset=50),
    "offset past the end": lambda d: d["tensors"][1].update(offset=1 << 40),
    "another dtype": lambda d: d["tensors"][0].update(dtype="float64"),
    "a dtype that is a list": lambda d: d["tensors"][0].update(dtype=["float32"]),
    "an unknown dtype": lambda d: d["tensors"][0].update(dtype="float128"),
    "another shape": lambda d: d["tensors"][0].update(shape=[4, 4]),
    "a negative dimension": lambda d: d["tensors"][0].update(shape=[-3, -4]),
    "a bool dimension": lambda d: d["tensors"][1].update(shape=[True] * 5),
    "nbytes not numel x itemsize": lambda d: d["tensors"][0].update(nbytes=40),
    "data_nbytes too small": lambda d: d.update(data_nbytes=64),
    "identity a list": lambda d: d.update(identity=["run", 1]),
    "a string step": lambda d: d["identity"].update(step="1"),
    "a skeleton index out of range": lambda d: d["skeleton"].update(w={"__t__": 9}),
    "a skeleton index twice": lambda d: d["skeleton"].update(b={"__t__": 0}),
    "a skeleton index that is a string": lambda d: d["skeleton"].update(w={"__t__": "0"}),
    "a malformed dict marker": lambda d: d["skeleton"].update(n={"__dict__": [["k"]]}),
    "a deep skeleton": lambda d: d.update(skeleton=json.loads("[" * 500 + "]" * 500)),
    "no tensors list": lambda d: d.update(tensors={"0": {}}),
    "a short digest": lambda d: d["tensors"][0].update(digest="ab"),
    "format 2": lambda d: d.update(format=2),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_forged_header_with_recomputed_digests_is_refused_not_decoded(
    tmp_path: Path, name: str
) -> None:
    path = good_file(tmp_path)
    forge(path, FORGERIES[name])
    for reader in (store.read_header, store.read_verified):
        with pytest.raises(IntegrityError, match="malformed|truncated|trailing|nested"):
            reader(path)


@pytest.mark.timeout(30)
def test_deep_or_huge_json_is_refused_without_recursion_error(tmp_path: Path) -> None:
    deep = "[" * 200_000 + "]" * 200_000
    with pytest.raises(IntegrityError, match="nested"):
        parse_json(deep, "x")
    with pytest.raises(IntegrityError, match="nested"):
        parse_json("[" * 100 + "]" * 100, "x")
    (tmp_path / "status.json").write_text('{"states": ' + deep + "}")
    ledger = TrustLedger.load(tmp_path / "status.json")
    assert ledger.states == {} and "nested" in (ledger.load_problem or "")
    (tmp_path / "big.json").write_bytes(b" " * (2 << 20))
    with pytest.raises(IntegrityError, match="cap"):
        load_json(tmp_path / "big.json", max_bytes=1 << 20)
    for doc in (
        {"states": {"1": "trusted"}},
        {"states": {"01": "candidate"}},
        {"attempts": {"1": -1}},
        {"states": ["candidate"]},
        {"run_id": 5},
        [1],
    ):
        (tmp_path / "status.json").write_text(json.dumps(doc))
        assert TrustLedger.load(tmp_path / "status.json").load_problem is not None, doc


@pytest.mark.timeout(30)
def test_an_unsendable_gather_part_is_an_error_on_every_rank_not_a_dead_rank(
    one_rank: None,
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from gemscout import _dist as comm

    assert comm.gather_json({"a": [1]}, group=dist.group.WORLD, timeout=timedelta(seconds=10)) == [
        {"a": [1]}
    ]
    with pytest.raises(IntegrityError, match="rank 0 could not send its part"):
        comm.gather_json({"a": {1, 2}}, group=dist.group.WORLD, timeout=timedelta(seconds=10))


@pytest.mark.timeout(30)
def test_a_bad_run_json_reads_as_no_recorded_run_never_a_hang(tmp_path: Path) -> None:
    from gemscout.files import recorded_run_id

    marker = tmp_path / "run.json"
    marker.write_text('{"run_id": "job-1"}')
    assert recorded_run_id(tmp_path) == "job-1"
    for text in ("[1]", '{"run_id": 5}', "[" * 100_000 + "]" * 100_000, "{"):
        marker.write_text(text)
        assert recorded_run_id(tmp_path) == ""
    marker.unlink()
    os.mkfifo(marker)  # read_text() would block here until a writer came
    assert recorded_run_id(tmp_path) == ""
