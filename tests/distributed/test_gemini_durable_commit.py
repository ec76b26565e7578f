"""The collective promotion of sharded state commits only when every rank succeeded: real FSDP2 on 2 gloo ranks,
calling gemscout.gemini.durable.promote directly. First rank 1 has no checkpoint of the step: every rank raises, no
directory gets the step's name and no temporary one is left. Then both ranks promote; the promotion verifies, and a
collective load into a zeroed model and optimizer gives back the captured state bit for bit."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from qualification.launch import launch

REPO = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import torch
    import torch.distributed as dist
    from gemscout.errors import IntegrityError
    from gemscout.gemini.durable import keys, promote
    from gemscout.gemini.durable import DurableTier
    from gemscout.state import training_state
    from gemscout.state.codec import encode
    from gemscout.state.layout import Layout, build_header, frame_prefix, parse_prefix, tensor_digests
    from qualification.programs.train_rank import state_digest, wrap
    from qualification.workloads import build_model, lm_loss, synthetic_batch

    out = Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    model = wrap(build_model("three-block", seed=0), "fsdp2", 2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in (1, 2):
        x, y = synthetic_batch(seed=0, step=step, rank=rank)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sources = training_state.StateSources(model, opt)
    skeleton, tensors = encode(training_state.collect(sources, 2))
    layout = Layout.of(tensors)
    data = torch.empty(layout.data_nbytes, dtype=torch.uint8)
    for view, t in zip(layout.views(data), tensors):
        view.copy_(t)
    ident = {"run_id": "r", "topology": "t", "owner": rank, "step": 2}
    parsed = parse_prefix(frame_prefix(build_header(layout, tensor_digests(layout, data), skeleton, ident)))
    tier = DurableTier(out / "durable", run_id="r", fsync=False, group=group, rank=rank)
    likes = keys.live_shards(sources)
    result = {"captured": state_digest(model, opt)}
    try:
        promote.promote(tier, 2, None if rank == 1 else (parsed, data), likes, group=group, rank=rank,
                                timeout=timedelta(seconds=60))
        result["half"] = "committed"
    except IntegrityError as exc:
        result["half"] = f"refused: {exc}"
    dist.barrier()
    result["after_half"] = sorted(p.name for p in (out / "durable").iterdir()) if (out / "durable").exists() else []
    promote.promote(tier, 2, (parsed, data), likes, group=group, rank=rank, timeout=timedelta(seconds=60))
    result["newest"] = tier.newest_step()
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
        for st in opt.state.values():
            for v in st.values():
                (v.to_local() if hasattr(v, "to_local") else v).zero_()
    result["zeroed"] = state_digest(model, opt)
    tier.load(2, sources)
    result["restored"] = state_digest(model, opt)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    import os
    os._exit(0)
""")


@pytest.mark.timeout(240)
def test_sharded_promotion_commits_only_when_every_rank_succeeded(tmp_path: Path) -> None:
    script = tmp_path / "promote_rank.py"
    script.write_text(PROGRAM)
    res = launch(
        [str(script), str(REPO), str(tmp_path)],
        world_size=2,
        timeout_s=180,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, (res, (tmp_path / "logs" / "rank0.attempt0.log").read_text()[-3000:])
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in out:
        assert r["half"].startswith("refused") and "could not prepare" in r["half"], r["half"]
        assert r["after_half"] == [], "a failed promotion left a directory behind"
        assert r["newest"] == 2
        assert r["zeroed"] != r["captured"]
        assert r["restored"] == r["captured"], "durable load is not bitwise"
