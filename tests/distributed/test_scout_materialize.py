"""SCOUT's parameter gathers on real gloo meshes, against DTensor's own answer: what SCOUT replays on must be the
parameter itself, bit for bit, or every peer would agree on the wrong numbers and nothing would notice.

One launch of 4 ranks builds three meshes — FSDP2 (4), HSDP (2x2), FSDP2 x TP (2x2) — over a model with uneven
shapes (a 3-row weight on 4 shards leaves one shard empty), trains one step so gradients and AdamW moments exist,
then gathers parameters, gradients and moments with :class:`~gemscout.scout.materialize.Materializer` (the batched
path for FSDP's dim-0 shards, DTensor's redistribute for strided FSDP x TP shards) and compares each with
``full_tensor()`` (or its TP chunk). It also checks what each rank derives as its peers.

Run as a script (``python test_scout_materialize.py``) under the launcher, this file is the rank program.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def rank_main(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from gemscout.scout.materialize import Materializer
    from gemscout.topology_discovery import discover

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(6, 10)
            self.fc2 = nn.Linear(10, 6)
            self.odd = nn.Linear(5, 3)  # 3 rows on 4 shards: one empty shard

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x))) + self.odd(x[..., :5]).sum(-1, keepdim=True)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    def build(kind: str) -> Model:
        torch.manual_seed(0)
        model = Model()
        if kind == "fsdp2":
            mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
        elif kind == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            for block in model.blocks:
                parallelize_module(
                    block, mesh2d["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
                )
            mesh = mesh2d["dp"]
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    report: dict[str, Any] = {"rank": rank}
    for kind in ("fsdp2", "hsdp", "fsdp2-tp"):
        model = build(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(rank if kind != "fsdp2-tp" else rank // 2)
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        model(
            torch.randn(4, 6)
        ).sum().backward()  # gradients of a second step, moments of the first
        topology = discover(model)
        assert topology is not None
        materializer = Materializer(topology, timedelta(seconds=60))
        tensors: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            tensors[f"param.{name}"] = param
            tensors[f"grad.{name}"] = param.grad
            for key, value in opt.state[param].items():
                if isinstance(value, DTensor):
                    tensors[f"state.{name}#{key}"] = value
        gathered, seconds = materializer.gather_named(tensors)
        mismatched = []
        for key, tensor in tensors.items():
            expected = tensor.full_tensor()
            got = gathered[key]
            if isinstance(
                got, DTensor
            ):  # TP placement kept: this rank's TP chunk of the whole tensor
                placement = got.placements[0]
                if not placement.is_replicate():
                    tp = got.device_mesh.get_local_rank()
                    expected = expected.chunk(got.device_mesh.size(), dim=placement.dim)[tp]  # type: ignore[attr-defined]
                got = got.to_local()
            if got.shape != expected.shape or not torch.equal(
                got.view(-1).view(torch.int32), expected.reshape(-1).view(torch.int32)
            ):
                mismatched.append(key)
        report[kind] = {
            "peers": list(topology.peers),
            "kind": topology.kind,
            "checked": len(tensors),
            "mismatched": mismatched,
            "seconds": seconds,
            "private": all(
                gathered[k].data_ptr() != getattr(t, "_local_tensor", t).data_ptr()
                for k, t in tensors.items()
                if gathered[k].numel()
            ),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # leave without gloo teardown (it can deadlock; every rank has written its result)


@pytest.mark.timeout(120)
def test_gathers_equal_full_tensor_on_every_mesh(tmp_path: Path) -> None:
    from qualification.launch import launch

    res = launch(
        [__file__, str(tmp_path)],
        world_size=4,
        timeout_s=100,
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    assert res.ok, res
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    peers = {
        "fsdp2": [[0, 1, 2, 3]] * 4,
        "hsdp": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "fsdp2-tp": [[0, 2], [1, 3], [0, 2], [1, 3]],
    }
    for r in ranks:
        for kind in ("fsdp2", "hsdp", "fsdp2-tp"):
            seen = r[kind]
            assert seen["checked"] >= 24 and seen["mismatched"] == [], (kind, seen)
            assert seen["private"], kind
            assert seen["peers"] == peers[kind][r["rank"]], (kind, seen)
    assert [ranks[0][k]["kind"] for k in ("fsdp2", "hsdp", "fsdp2-tp")] == [
        "fsdp",
        "hsdp",
        "fsdp+tp",
    ]


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
