"""A small but real GEMINI checkpoint directory built with gemscout's own writers (checkpoint files of two ranks
with held replicas, trust ledgers, fault logs, run.json, a durable promotion), and structural mutations of the JSON
documents in it: the fuzz test and the ``gemscout inspect`` corpus test share them."""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from gemscout.config import TrustState
from gemscout.faultlog import FILE_NAME, FaultLog
from gemscout.gemini import store
from gemscout.gemini.lifecycle import TrustLedger
from gemscout.reports import FaultReport
from gemscout.state.codec import encode
from gemscout.state.layout import Layout, build_header, frame_prefix, tensor_digests

RUN = "corpus"
DATA = Path(__file__).parent / "data"


def state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {
        "step": step,
        "model": {"w": torch.randn(3, 4, generator=g), "b": torch.zeros(4, dtype=torch.float16)},
        "optimizer": {
            "state": {0: {"m": torch.randn(3, 4, generator=g)}},
            "param_groups": [{"lr": 0.1}],
        },
        "extra": {"tokens": torch.arange(5), "note": "x", "t": (1, 2.5, None)},
        "empty": torch.empty(0),
    }


def write_frame(path: Path, obj: Any, identity: dict[str, Any]) -> None:
    skeleton, tensors = encode(obj)
    layout = Layout.of(tensors)
    data = torch.empty(layout.data_nbytes, dtype=torch.uint8)
    for view, t in zip(layout.views(data), tensors, strict=True):
        view.copy_(t)
    store.write_checkpoint(
        path,
        frame_prefix(build_header(layout, tensor_digests(layout, data), skeleton, identity)),
        data,
        fsync=False,
    )


def build(root: Path) -> Path:
    """``root/ckpt`` (2 ranks, steps 1 and 2, each holding the other's replicas) and ``root/durable``."""
    ckpt = root / "ckpt"
    store.write_json_atomic(ckpt / "run.json", {"run_id": RUN}, fsync=False)
    for rank in range(2):
        paths = store.RankPaths.of(ckpt, node=rank, rank=rank)
        other = 1 - rank
        for step in (1, 2):
            write_frame(
                store.step_file(paths.own, step),
                state(step, rank),
                {"run_id": RUN, "topology": "t", "owner": rank, "step": step},
            )
            write_frame(
                store.step_file(paths.replicas(other), step),
                state(step, other),
                {"run_id": RUN, "topology": "t", "owner": other, "step": step},
            )
        ledger = TrustLedger(path=paths.status, run_id=RUN, fsync=False)
        ledger.states = {1: TrustState.RECOVERY_VERIFIED, 2: TrustState.CANDIDATE}
        ledger.attempts = {1: 1}
        ledger.save()
        assert paths.status.exists()
        log = FaultLog(paths.root / FILE_NAME, fsync=False)
        log.append(
            {
                **FaultReport(
                    kind="sdc",
                    scope="rank",
                    ranks=(other,),
                    step=2,
                    reason="peers disagree",
                    recipe="fwd",
                    evidence={"digests": ["a", "b"]},
                ).to_dict(),
                "reported_by": rank,
            }
        )
    shutil.copytree(DATA / "durable-format2", root / "durable")
    return ckpt


def header_doc(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[8:16], "little")
    return json.loads(raw[16 : 16 + n])  # type: ignore[no-any-return]


def rewrite_header(path: Path, doc: Any) -> None:
    """The file with its header replaced by ``doc`` and the header digest recomputed (the data kept)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[8:16], "little")
    old_prefix_end = -(-(16 + n + 32) // 64) * 64
    data = (
        torch.frombuffer(bytearray(raw[old_prefix_end:]), dtype=torch.uint8)
        if len(raw) > old_prefix_end
        else torch.empty(0, dtype=torch.uint8)
    )
    store.write_checkpoint(
        path, frame_prefix(json.dumps(doc, allow_nan=True).encode()), data, fsync=False
    )


WEIRD: list[Any] = [
    None,
    True,
    False,
    -1,
    0,
    2**70,
    1.5,
    float("nan"),
    "",
    "x",
    "1",
    [],
    {},
    [1, "a"],
    {"a": 1},
    ["float32"],
    {"__t__": 0},
    {"__dt__": [0, [1], [1]]},
    {"__dict__": [[1]]},
    "../../etc/passwd",
]


def _paths(doc: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) in ``doc``."""
    out: list[tuple[Any, Any]] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        items = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for k, v in items:
            out.append((node, k))
            stack.append(v)
    return out


def mutate(doc: Any, rng: random.Random) -> Any:
    """One structural mutation of a copy of ``doc``: delete, retype, nest deeply, duplicate, add a key, or swap."""
    doc = copy.deepcopy(doc)
    spots = _paths(doc)
    if not spots:
        return rng.choice(WEIRD)
    node, key = rng.choice(spots)
    op = rng.randrange(6)
    if op == 0:
        del node[key]
    elif op == 1:
        node[key] = copy.deepcopy(rng.choice(WEIRD))
    elif op == 2:
        deep: Any = node[key]
        for _ in range(rng.choice((70, 400))):  # deeper: see dumps()
            deep = [deep]
        node[key] = deep
    elif op == 3 and isinstance(node, list):
        node.insert(key, copy.deepcopy(node[key]))
    elif op == 3:
        node[f"{key}_"] = copy.deepcopy(node[key])
    elif op == 4 and isinstance(node[key], int | float) and not isinstance(node[key], bool):
        node[key] = rng.choice((-node[key] - 1, node[key] + 1, node[key] * 64, str(node[key])))
    else:
        other_node, other_key = rng.choice(spots)
        try:
            mine, theirs = (
                copy.deepcopy(node[key]),
                copy.deepcopy(other_node[other_key]),
            )  # copies: never a cycle
            node[key], other_node[other_key] = theirs, mine
        except (KeyError, IndexError):
            node[key] = None
    return doc


def dumps(doc: Any, rng: random.Random) -> str:
    """``doc`` as JSON text; one time in ten nested 100,000 levels deep instead (Python's own encoder cannot write
    that, a hostile writer can)."""
    if rng.randrange(10) == 0:
        return '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    return json.dumps(doc, allow_nan=True)
