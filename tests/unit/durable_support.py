"""A real one-rank durable promotion built with gemscout's own writer (checkpoint file → DCP directory), for the
storage tests: the caller state is the test's, the model and optimizer a small seeded pair."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemscout.gemini import store
from gemscout.gemini.durable import DurableTier
from gemscout.gemini.durable import promote as collective
from gemscout.gemini.promotion import REPLICATED
from gemscout.state import training_state
from gemscout.state.codec import encode
from gemscout.state.layout import Layout, build_header, frame_prefix, tensor_digests

RUN = "storage-test"
IDENTITY = {"run_id": RUN, "topology": "t", "owner": 0}


def sources(extra: Any, seed: int = 0) -> tuple[training_state.StateSources, dict[str, Any]]:
    """A seeded Linear + SGD (momentum, one step taken) whose caller state is ``extra``, and the box whose
    ``"extra"`` a restore replaces."""
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).square().mean().backward()
    opt.step()
    box = {"extra": extra}

    def load_extra(value: Any) -> None:
        box["extra"] = value

    src = training_state.StateSources(
        model, opt, extra_state_fn=lambda: box["extra"], load_extra_state_fn=load_extra
    )
    return src, box


def write_file(path: Path, state: Any, step: int) -> None:
    """Write ``state`` as a checkpoint file of ``step`` with gemscout's writer."""
    skeleton, tensors = encode(state)
    layout = Layout.of(tensors)
    data = torch.empty(layout.data_nbytes, dtype=torch.uint8)
    for view, t in zip(layout.views(data), tensors, strict=True):
        view.copy_(t)
    header = build_header(
        layout, tensor_digests(layout, data), skeleton, {**IDENTITY, "step": step}
    )
    store.write_checkpoint(path, frame_prefix(header), data, fsync=False)


def promote(
    durable_dir: Path, src: training_state.StateSources, step: int, work: Path
) -> DurableTier:
    """Promote ``src``'s state of ``step`` (one rank, the default group) like a DDP job would."""
    path = work / f"step-{step:09d}.gsc"
    write_file(path, training_state.collect(src, step), step)
    tier = DurableTier(durable_dir, run_id=RUN, fsync=False, group=dist.group.WORLD, rank=0)
    collective.promote_own_file(
        tier,
        step,
        path,
        {},
        check=lambda ident, where: None,
        group=dist.group.WORLD,
        rank=0,
        timeout=timedelta(seconds=30),
        replicated=REPLICATED,
    )
    return tier
