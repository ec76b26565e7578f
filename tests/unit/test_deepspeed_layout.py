"""The per-parameter store of DeepSpeed ZeRO state (adapters/deepspeed/layout.py), without deepspeed or a process group.

A parameter fragment is a DCP chunk of the parameter's full flattened tensor: written by the rank that owns it, read
back into any other cut of the same tensor (DCP reads the overlapping part of each saved chunk). Here one process
writes real DCP files (``no_dist``) and reads them back; the multi-rank promotion and resharded resume with a real
engine are in tests/distributed/test_deepspeed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gemscout.adapters.deepspeed.layout import FORMAT, ZeroPerParameter, _Chunk

pytestmark = pytest.mark.timeout(60)


def test_a_fragment_is_stored_as_a_chunk_of_the_full_parameter_and_read_back_in_any_cut(
    tmp_path: Path,
) -> None:
    full = torch.randn(10, generator=torch.Generator().manual_seed(0))
    dcp.save({"z/master/w": _Chunk(full.clone(), 0, 10)}, checkpoint_id=str(tmp_path), no_dist=True)
    meta = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata["z/master/w"]
    assert tuple(meta.size) == (10,) and meta.properties.dtype == torch.float32  # type: ignore[union-attr]

    # A new partition holding elements 3..8 of the parameter, at offset 2 of its flat buffer.
    flat = torch.zeros(9)
    dcp.load(
        {"z/master/w": _Chunk(flat.narrow(0, 2, 5), 3, 10)},
        checkpoint_id=str(tmp_path),
        no_dist=True,
    )
    assert torch.equal(flat[2:7], full[3:8]) and not flat[:2].any() and not flat[7:].any()
    # Any DCP user reads the whole parameter as a plain tensor.
    plain = {"z/master/w": torch.empty(10)}
    dcp.load(plain, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(plain["z/master/w"], full)


def test_a_chunk_outside_its_parameter_is_refused_at_save(tmp_path: Path) -> None:
    # (That the chunks of all ranks tile each parameter exactly, DCP checks when more than one rank saves.)
    # DCP wraps the ValueError in its CheckpointException, a BaseException.
    with pytest.raises(BaseException, match=r"key:z/master/w has out of bounds chunk"):
        dcp.save(
            {"z/master/w": _Chunk(torch.ones(4), 8, 10)}, checkpoint_id=str(tmp_path), no_dist=True
        )


def test_a_chunk_is_only_a_save_and_load_target() -> None:
    chunk = _Chunk(torch.ones(4), 2, 10)
    assert chunk.shape == (10,) and "start=2" in repr(chunk)
    with pytest.raises(TypeError, match=r"only a DCP save/load target"):
        chunk.sum()


def test_the_codec_takes_zero_partitions_with_a_fragment_table_only() -> None:
    codec = ZeroPerParameter()
    assert codec.accepts({"optimizer": {"format": FORMAT, "fragments": []}})
    assert not codec.accepts(
        {"optimizer": {"format": FORMAT}}
    )  # taken before the table existed: per rank
    assert not codec.accepts({"optimizer": {"state": {}, "param_groups": []}})
    assert not codec.accepts([])
