"""One rank of a deterministic Megatron Core GPTModel run on CPU (gloo), with or without gemscout, with optional faults.

The model is Megatron Core's own ``GPTModel`` (local layer spec: ColumnParallel / RowParallel linears, vocab-parallel
embedding and cross entropy) on ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=--tp)``; the
loop is hand-written (Megatron's own DDP, optimizers and schedules run in
:mod:`qualification.programs.megatron_loop_rank`): gradients are averaged over the data-parallel group with one
all-reduce per parameter, and a torch AdamW updates. Dropout is on (hidden and attention),
so Megatron's RNG tracker is exercised (attention dropout forks it). CUDA calls Megatron makes on its CPU path are
redirected by :mod:`qualification.programs._megatron_cpu_shims` (test-only).

``--experts N`` (N > 0) makes every layer's MLP a Megatron ``MoELayer`` (local spec: SequentialMLP experts, top-2
router with the auxiliary load-balancing loss, the ``alltoall`` token dispatcher) over ``--ep`` expert-parallel ranks;
expert gradients are averaged over Megatron's expert-data-parallel group, the rest over the data-parallel group.
With SCOUT the session also checks the dispatch's AllToAlls (``session.check_alltoall`` on every MoE layer): ``a2a``
holds each step's results.

Writes ``<out>/rank<r>.json``: losses per step, resume step, recovery decision, ``state_digest`` (SHA-256 over the
model state, the AdamW state and Megatron's RNG tracker streams), SCOUT's peers / topology, its reports and the trust
states, the replay faults that fired, and whether ``destroy_model_parallel()`` closed the session (``closed_by_destroy``:
Megatron destroys its gloo groups through ``torch.distributed.destroy_process_group``, which gemscout wraps).

Takes the lifecycle driver's arguments (``--topology megatron-tp1|megatron-tp2|megatron-ep2`` — the last: 4 experts
over ep=2, tp=1 —, ``--interval``, ``--persist-every``,
``--ranks-per-node``, ``--sigterm-step``) and writes the keys it reads (``replicas_equal``: ranks with the same TP
and EP coordinates hold equal modules; ``times``; ``stats``), so campaign cells can run it.

Faults: ``--kill-rank R --kill-step S`` SIGKILLs rank R after step S (its checkpoint drained first);
``--fault-rank R --fault-step S --fault-recipe NAME`` corrupts what rank R computes when *replaying* NAME at step S
(``qualification.faults``: SCOUT must name R; training itself is untouched); ``--drop-capture-rank R
--drop-capture-step S`` throws away what rank R captured in the forward/backward of step S, right before its update
(``Scout.set_next_step(S)`` re-arms capture for S: the public seam), so R, the source of its peer group at S, has no
inputs for the forward recipes while the other peer groups do. ``--a2a-corrupt-rank R --a2a-corrupt-step S`` (MoE
with SCOUT) flips one byte of rank R's send buffer in the AllToAll check's ``balanced`` replay at S, after R digested
it (the bytes change on the way to R's first EP group rank, as in ``moe_rank.py``). ``cycles`` records each step's SCOUT verdicts and
the seconds each rank spent in its replays' collectives.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from qualification.programs._failstop import FailStop
from qualification.programs._rank import finish, run, trust_states
from qualification.programs._tensor_bytes import tensor_bytes
from qualification.programs.specs import parse
from qualification.programs.specs.megatron import GPT_TOPOLOGIES as TOPOLOGIES
from qualification.programs.specs.megatron import MegatronSpec

VOCAB, SEQ, BATCH = 128, 32, 4
CAUSAL = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)


def state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 over the model state, the optimizer state and Megatron's RNG tracker streams."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):
            h.update(name.encode())
            h.update(tensor_bytes(t))
    for i, state in sorted(opt.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{i}.{key}".encode())
            h.update(tensor_bytes(value) if torch.is_tensor(value) else repr(value).encode())
    for name, state in sorted(get_cuda_rng_tracker().get_states().items()):
        h.update(name.encode())
        h.update(tensor_bytes(state))
    return h.hexdigest()


def module_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        if isinstance(t, torch.Tensor):
            h.update(tensor_bytes(t))
    return h.hexdigest()


def build(
    tp: int, seed: int, ep: int = 1, experts: int = 0, etp: int | None = None
) -> tuple[Any, torch.nn.Module]:
    """Model parallel state, the RNG tracker and a small GPTModel (seeded: every run builds the same weights), with
    ``experts`` MoE experts per layer (0: dense MLPs); ``etp``: expert_tensor_parallel_size (None: the TP size)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    moe: dict[str, Any] = {}
    if experts:
        moe = {
            "num_moe_experts": experts,
            "moe_token_dispatcher_type": "alltoall",
            "moe_router_topk": 2,
            "moe_grouped_gemm": False,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": 1e-2,
            "expert_model_parallel_size": ep,
        }
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        tensor_model_parallel_size=tp,
        **moe,
    )
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False)
    model = GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False,
    )
    return ps, model


def _corrupt(case: str, step: int, buffer: torch.Tensor, args: MegatronSpec) -> torch.Tensor | None:
    """One byte of the ``balanced`` replay's send buffer flipped at ``--a2a-corrupt-step`` (after it was digested)."""
    if case != "balanced" or step != args.a2a_corrupt_step:
        return None
    bad = buffer.clone()
    bad.view(-1).view(torch.uint8)[0] ^= 0x10
    return bad


def batch(seed: int, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels and positions of one step for one data-parallel rank (TP partners read the same batch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + dp_rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (
        tokens[:, :-1],
        tokens[:, 1:].contiguous(),
        torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ),
    )


def main() -> None:
    args = parse(MegatronSpec)
    if (
        args.topology is not None
    ):  # topology name → (tensor, expert model parallel size, MoE experts)
        tp, ep, experts = TOPOLOGIES[args.topology]
        args = dataclasses.replace(args, tp=tp, ep=ep, experts=experts)
    torch.set_num_threads(1)
    from qualification.programs import _megatron_cpu_shims

    _megatron_cpu_shims.install()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ps, model = build(args.tp, args.seed, args.ep, args.experts, args.etp)
    dp_group, dp_rank, dp_size = (
        ps.get_data_parallel_group(),
        ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(),
    )
    edp_group = ps.get_expert_data_parallel_group() if args.experts else None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses: dict[int, float] = {}
    reports: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    session = None
    decision = None
    injector = None
    topology = None
    times: dict[str, float] = {}
    cycles: dict[str, dict[str, Any]] = {}
    a2a: dict[str, list[dict[str, Any]]] = {}
    check = None
    if args.ckpt is not None:
        import gemscout

        def extra() -> dict[str, Any]:
            return {"losses": {str(k): v for k, v in losses.items()}}

        def load_extra(state: dict[str, Any]) -> None:
            losses.clear()
            losses.update({int(k): float(v) for k, v in state["losses"].items()})

        cfg = gemscout.CheckpointConfig(
            directory=args.ckpt,
            run_id=args.run_id,
            ranks_per_node=args.ranks_per_node,
            persist_every=args.persist_every,
            keep_generations=args.keep_generations,
            timeout=timedelta(seconds=60),
            fsync=False,
            durable_directory=args.durable,
            durable_every=args.durable_every,
        )
        scout = (
            gemscout.ScoutConfig(
                interval=args.interval,
                recipes=("embedding", "hidden", "output", "optimizer"),
                stragglers=None,
                timeout=timedelta(seconds=60),
            )
            if args.scout
            else None
        )
        t_attach = time.time()
        session = gemscout.enable_resiliency(
            [model],
            opt,
            interval=args.interval,
            checkpoint=cfg,
            scout=scout,
            extra_state_fn=extra,
            load_extra_state_fn=load_extra,
            on_fault_report=lambda r: reports.append(r.to_dict()),
            on_recovery_decision=lambda d: decisions.append(d.to_dict()),
        )
        decision = session.last_decision.to_dict() if session.last_decision else None
        times = {"attach_wall": t_attach, "restored_wall": time.time()}
        if session.scout is not None:
            from qualification.faults import Injector, fail_at

            topology = (
                session.scout.topology.to_dict() if session.scout.topology is not None else None
            )
            injector = Injector(session.scout)
            if rank == args.fault_rank:
                injector.set(
                    fail_at(
                        args.fault_kind, rank=rank, step=args.fault_step, recipe=args.fault_recipe
                    )
                )
            if args.experts and args.ep > 1:
                from gemscout.adapters.megatron.topology import moe_layers
                from gemscout.scout.alltoall import AllToAllConfig

                check = session.check_alltoall(*moe_layers(model), config=AllToAllConfig())
                if rank == args.a2a_corrupt_rank:
                    check.register_send_hook(
                        lambda case, step, buffer: _corrupt(case, step, buffer, args)
                    )
    start = session.resume_step + 1 if session else 1
    model.train()
    for step in range(start, args.steps + 1):
        tokens, labels, positions = batch(args.seed, step, dp_rank)
        opt.zero_grad(set_to_none=True)
        # An explicit causal mask (True = masked): Megatron's default one is built on "cuda".
        loss = model(tokens, positions, CAUSAL, labels=labels).mean()
        loss.backward()
        for p in (
            model.parameters()
        ):  # Megatron's DDP is CUDA-only: average over the data-parallel group by hand
            if p.grad is not None and dp_size > 1:
                # Expert weights (flagged allreduce=False) have their replicas on the expert-data-parallel group;
                # the loss is averaged over the whole data-parallel group, as Megatron's DDP scales them.
                expert = getattr(p, "allreduce", True) is False
                dist.all_reduce(p.grad, group=edp_group if expert else dp_group)
                p.grad.div_(dp_size)
        losses[step] = loss.item()
        if (
            session is not None
            and session.scout is not None
            and rank == args.drop_capture_rank
            and step == args.drop_capture_step
        ):
            session.scout.set_next_step(
                step
            )  # this rank's captures of the step are gone; training is untouched
        opt.step()
        if session is not None and args.certify:
            session.certify(session.step)
        if (
            check is not None
        ):  # the session checked this step's recorded AllToAlls before its update
            a2a[str(step)] = [r.to_dict() for r in check.last_results]
        result = (
            session.scout.last_result if session is not None and session.scout is not None else None
        )
        if result is not None and result.step == step:
            cycles[str(step)] = {
                "verdicts": {
                    n: {"verdict": r.verdict.value, "reason": r.reason}
                    for n, r in result.results.items()
                },
                "collective_s": {
                    n: {str(k): v for k, v in t.items()} for n, t in result.collective_s.items()
                },
            }
        if session is not None:  # the first step trained after the restore (recovery wall time)
            times.setdefault("first_step_wall", time.time())
        FailStop.of(args, rank).after_step(session, step)
    trust = trust_states(session)
    # Replicas: ranks with the same TP and EP coordinates hold the same shard (test-side comparison; gemscout never
    # pickles).
    shards: list[Any] = [None] * world
    coord = (ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank())
    dist.all_gather_object(shards, (coord, module_digest(model)))
    result = {
        "rank": rank,
        "world_size": world,
        "tp": args.tp,
        "dp_rank": dp_rank,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "dp_group": dist.get_process_group_ranks(dp_group),
        "resume_step": session.resume_step if session else 0,
        "decision": decision,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "state_digest": state_digest(model, opt),
        "peers": list(session.scout.peers) if session and session.scout else None,
        "topology": topology,
        "errors": session.checkpointer.errors if session and session.checkpointer else [],
        "reports": reports,
        "decisions": decisions,
        "trust": trust,
        "fired": injector.fired if injector is not None else [],
        "replicas_equal": len({d for t, d in shards if tuple(t) == coord}) == 1,
        "ep": args.ep,
        "ep_rank": coord[1],
        "a2a": a2a,
        "edp_group": dist.get_process_group_ranks(edp_group) if edp_group is not None else None,
        "times": times,
        "final_step": args.steps,
        "cycles": cycles,
        # What megatron_scout_cell reads (as megatron_loop_rank writes it): each step's verdict per recipe.
        "verdicts": {
            s: {n: v["verdict"] for n, v in c["verdicts"].items()} for s, c in cycles.items()
        },
        "schedule": "hand-written",
        "stats": session.checkpointer.stats if session and session.checkpointer else {},
    }
    dist.barrier()
    # Megatron's teardown destroys its gloo groups through torch.distributed.destroy_process_group, which gemscout
    # wraps: the session must be closed (threads stopped, hooks removed) before the groups go away.
    ps.destroy_model_parallel()
    result["closed_by_destroy"] = session.closed if session is not None else None
    finish(args.out, rank, result)


if __name__ == "__main__":
    run(main)
