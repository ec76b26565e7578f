"""One rank of SCOUT on Hugging Face ``transformers`` causal LMs under plain DDP or FSDP2, several cases in one process.

A new user's path: a model built from a config (no download), ``DistributedDataParallel``, ``enable_resiliency`` with
GEMINI and SCOUT, the model's own loss. Process start plus ``import torch, transformers`` costs seconds, so one launch
runs every ``--case`` for every ``--family`` in turn, each on a fresh model, optimizer, session and checkpoint folder.

Families (tiny configs): ``llama`` (RMSNorm, rotary ``position_embeddings``, untied head), ``gpt2`` (LayerNorm,
learned positions, dropout, the head tied to the token embedding), ``qwen2`` (Llama-like with q/k/v biases; tied
head here). Every decoder layer is called with keyword arguments — a tuple of tensors, ``position_ids``,
``attention_mask=None``, ``use_cache`` and a ``DynamicCache`` — which is what SCOUT must capture and replay.

Cases: ``healthy`` (every recipe replayed at every cycle: each cycle must certify its own step), ``persistent``
(``--fault-rank``'s decoder layer ``--fault-block`` adds 1e-3 to its output from ``--fault-step`` on, in training and
replay: an ordinary forward hook), ``replay`` (one corrupted replay of ``hidden.0`` on ``--fault-rank`` at
the first step >= ``--fault-step`` where it is due: :class:`qualification.faults.ReplayFault`), and with
``--unreplayable FAMILY`` ``unreplayable`` (training on top of a prefix's ``DynamicCache``, which SCOUT must refuse to
replay, with the reason). ``--fsdp2 FAMILY`` runs the three cases once more with the model under FSDP2 the way its
tutorial wraps it: ``fully_shard`` on every decoder layer, then on the root, with no mesh given (torch builds an unnamed
1-D mesh over the world). Writes ``<out>/rank<r>.json``: ``{key: {case: {cycles, reports, decisions, trust, metrics,
catalog}}}``, the key being the family, or ``<family>+fsdp2``.
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gemscout
from gemscout.scout.recipes import unwrap
from qualification.faults import Injector, ReplayFault
from qualification.programs.specs import parse
from qualification.programs.specs.hf import CASES, FAMILIES, HfSpec

EXTRA_CASES = ("unreplayable",)
VOCAB, SEQ, BATCH = 96, 16, 2


def build_model(family: str, seed: int = 0) -> nn.Module:
    """A tiny causal LM of ``family`` from its config; the same weights for the same seed on every rank."""
    import transformers

    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    if family == "llama":
        config = transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **common,
        )
        return transformers.LlamaForCausalLM(config)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)
        return transformers.GPT2LMHeadModel(config)
    if family == "qwen2":
        config = transformers.Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            **common,
        )
        return transformers.Qwen2ForCausalLM(config)
    raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")


def batch(step: int, rank: int, seed: int = 0) -> torch.Tensor:
    """Token ids of ``rank``'s micro-batch at ``step`` (deterministic, different on every rank)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)


def add_to_output(module: nn.Module, delta: float) -> Any:
    """A persistent fault: every forward of ``module`` (training and replay) returns its output plus ``delta``."""

    def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output + delta
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (output[0] + delta, *output[1:])
        return None

    return module.register_forward_hook(hook)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM of :data:`FAMILIES` (Llama and Qwen2: ``model.layers``; GPT-2: ``h``)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"no decoder layers found on {type(model).__name__}")
    return layers


def wrap(model: nn.Module, how: str) -> nn.Module:
    if how == "ddp":
        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def run_case(family: str, case: str, args: HfSpec, rank: int, how: str = "ddp") -> dict[str, Any]:
    model = build_model(family)
    ddp = wrap(model, how)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    ckpt = args.out / f"ckpt-{family}-{how}-{case}"
    reports: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    healthy = case in ("healthy", "unreplayable")
    session = gemscout.enable_resiliency(
        ddp,
        opt,
        interval=1,
        checkpoint=gemscout.CheckpointConfig(
            directory=ckpt,
            run_id=f"hf-{family}-{how}-{case}",
            fsync=False,
            keep_generations=8,
            handle_signals=False,
        ),
        # healthy: the whole catalog at every cycle, so every clean cycle certifies its own step; fault cases: the
        # default rotation (one block per cycle), so "within one rotation" is what is asserted.
        scout=gemscout.ScoutConfig(
            interval=args.interval,
            hidden_per_cycle=None if healthy else 1,
            optimizer_slices_per_cycle=None if healthy else 1,
            # numeric checks only: replay timing on 4 ranks sharing 2 loaded cores is
            # scheduling noise, and the straggler detectors have their own cells
            stragglers=None,
        ),
        on_fault_report=lambda r: reports.append(r.to_dict()),
        on_recovery_decision=lambda d: decisions.append(d.to_dict()),
    )
    scout = session.scout
    assert scout is not None
    injector = Injector(scout)
    # The replay fault acts at the first step >= --fault-step where hidden.0 is due (the rotation picks the block).
    replay_step = next(
        s
        for s in range(args.fault_step, args.fault_step + 64)
        if "hidden.0" in [r.name for r in scout.catalog.due(s)]
    )
    if case == "replay" and rank == args.fault_rank:
        injector.set(ReplayFault("bitflip", rank, replay_step, "hidden.0"))
    handle = None
    cycles: dict[str, Any] = {}
    for step in range(1, args.steps + 1):
        if case == "persistent" and rank == args.fault_rank and step == args.fault_step:
            path = scout.catalog[f"hidden.{args.fault_block}"].modules[0]
            handle = add_to_output(unwrap(ddp).get_submodule(path), 1e-3)
        ids = batch(step, rank)
        if case == "unreplayable":
            # Training on top of a prefix's cache (prefix caching): each decoder layer gets a cache that already
            # holds past positions, which SCOUT refuses to replay; it must say so, not report "did not return".
            import transformers

            cache = transformers.DynamicCache()
            with torch.no_grad():
                unwrap(ddp)(input_ids=batch(step + 1000, rank)[:, :4], cache=cache, use_cache=True)
            loss = ddp(input_ids=ids, labels=ids, cache=cache, use_cache=True).loss
        else:
            loss = ddp(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result = scout.last_result
        if result is not None and result.step == step:
            cycles[str(step)] = {
                "certified": result.certified_step,
                "verdicts": {
                    n: {"verdict": r.verdict.value, "ranks": list(r.ranks), "reason": r.reason}
                    for n, r in result.results.items()
                },
            }
    if handle is not None:
        handle.remove()
    injector.remove()
    assert session.checkpointer is not None
    session.checkpointer.drain()
    trust = {str(s): st.value for s, st in sorted(session.checkpointer.ledger.states.items())}
    doc = {
        "cycles": cycles,
        "replay_fault_step": replay_step,
        "fired": injector.fired,
        "reports": reports,
        "decisions": decisions,
        "trust": trust,
        "metrics": session.metrics(),
        "catalog": list(scout.catalog.names),
        "modules": {r.name: list(r.modules) for r in scout.catalog.recipes if r.has_module},
        "tied": unwrap(ddp).get_output_embeddings().weight
        is unwrap(ddp).get_input_embeddings().weight,
    }
    session.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
    return doc


def main() -> None:
    args = parse(HfSpec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    out: dict[str, dict[str, Any]] = {}
    # No --family: every family, or none when --fsdp2 names the ones to run.
    families = list(args.family) if args.family else ([] if args.fsdp2 else list(FAMILIES))
    runs = [(family, case, "ddp") for family in families for case in args.case or CASES]
    if args.unreplayable:
        runs.append((args.unreplayable, "unreplayable", "ddp"))
    runs += [(family, case, "fsdp2") for family in args.fsdp2 for case in args.case or CASES]
    for family, case, how in runs:
        key = family if how == "ddp" else f"{family}+{how}"
        out.setdefault(key, {})[case] = run_case(family, case, args, rank, how)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(out, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
