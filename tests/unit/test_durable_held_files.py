"""A durable promotion loads the very files its sidecar check hashed: the check and DCP's load share descriptors, so
a data file swapped between them (``os.replace`` of a same-size copy with other tensor bytes) is not what loads, and
DCP cannot be steered to a file the check did not hold. Real files, a real one-rank DCP promotion (gloo)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from durable_support import promote, sources

from gemscout.errors import IntegrityError
from gemscout.gemini.durable import SIDECAR, held_files


def _state(src: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for t in src.model.state_dict().values()]


@pytest.mark.timeout(60)
def test_a_file_swapped_after_the_check_is_not_what_loads(
    tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, _ = sources({"x": torch.ones(3)})
    saved = _state(src)
    tier = promote(tmp_path / "durable", src, 5, tmp_path)
    folder = tier.path(5)
    (data,) = [p for p in folder.iterdir() if p.suffix == ".distcp"]
    original = data.read_bytes()
    # The forgery: the same size, every byte past DCP's small per-file preamble inverted (the tensors' bytes).
    forged = original[:64] + bytes(b ^ 0xFF for b in original[64:])
    real_reader = held_files.storage_reader
    swapped: list[bool] = []

    def swap_then_read(
        path: Path, held: Any
    ) -> Any:  # runs after every file was hashed, before DCP opens any
        tmp = folder / "swap.tmp"
        tmp.write_bytes(forged)
        os.replace(tmp, data)
        swapped.append(True)
        return real_reader(path, held)

    monkeypatch.setattr(held_files, "storage_reader", swap_then_read)
    with torch.no_grad():
        for p in src.model.parameters():
            p.zero_()
    tier.load(5, src)
    assert swapped and data.read_bytes() == forged  # by name, the folder now serves the forgery
    assert all(torch.equal(a, b) for a, b in zip(_state(src), saved, strict=True))
    with pytest.raises(IntegrityError, match="does not match its SHA-256"):
        tier.verify(5)  # and a fresh check refuses it


@pytest.mark.timeout(60)
def test_dcp_gets_only_the_files_that_were_verified(tmp_path: Path, one_rank: None) -> None:
    src, _ = sources({"x": torch.ones(3)})
    tier = promote(tmp_path / "durable", src, 5, tmp_path)
    folder = tier.path(5)
    reader = held_files.storage_reader(folder, {})
    with pytest.raises(IntegrityError, match="not one of the files verified"):
        with reader.fs.create_stream(folder / ".metadata", "rb"):
            pass
    with pytest.raises(IntegrityError, match="not one of the files verified"):
        with reader.fs.create_stream(folder / SIDECAR, "wb"):
            pass
