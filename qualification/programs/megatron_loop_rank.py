"""One rank of Megatron Core's own training loop on CPU (gloo), with or without gemscout, with optional faults.

Megatron's machinery, unchanged: ``DistributedDataParallel`` (its grad buffers, bucketed reduce-scatter / all-reduce,
``overlap_grad_reduce`` hooks), the optimizer ``get_megatron_optimizer`` builds (``--distopt``: the
``DistributedOptimizer``, fp32 main-parameter shards; otherwise ``FP32Optimizer``), grad clipping, and the
``get_forward_backward_func()`` schedule with ``finalize_model_grads`` (Megatron-LM's wiring of ``config``), on a small
``GPTModel`` with dropout on. Megatron's hard-coded CUDA is redirected to the CPU by the test-only
:mod:`qualification.frameworks.megatron_cpu`. ``--pp 2`` runs two pipeline stages with the 1F1B schedule; ``--vpp 2``
adds virtual pipeline stages (each rank builds one ``GPTModel`` chunk per virtual stage, as Megatron-LM's
``get_model`` does, each in its own DDP) and Megatron's interleaved 1F1B schedule. The model has ``--layers``
transformer layers (default ``max(2, pp * vpp)``: every (virtual) stage holds at least one).

Writes ``<out>/rank<r>.json``: losses per step, resume step, recovery decision, ``state_digest`` (SHA-256 over the
model, this rank's optimizer shard — fp32 main parameters and Adam state — and the RNG tracker streams),
``replicas_equal`` (data-parallel peers hold the same model: Megatron's gradient sync ran), SCOUT's peers, topology,
catalog, recipes due per cycle, verdicts and reports, the replay faults that fired.

Faults: ``--kill-rank R --kill-step S`` SIGKILLs rank R after step S (its checkpoint drained first);
``--fault-rank R --fault-step S --fault-recipe NAME`` corrupts what rank R computes when replaying NAME at step S.
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
from qualification.programs.megatron_gpu_rank import state_digest
from qualification.programs.specs import parse
from qualification.programs.specs.megatron import LOOP_TOPOLOGIES as TOPOLOGIES
from qualification.programs.specs.megatron import MegatronLoopSpec

VOCAB, SEQ, BATCH, MICRO = 128, 32, 4, 2
CAUSAL = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True = masked


def _model_hash(h: Any, model: torch.nn.Module) -> None:
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):
            h.update(name.encode())
            h.update(tensor_bytes(t))


def build(args: MegatronLoopSpec) -> tuple[Any, list[Any], list[Any], Any]:
    """Parallel state, a seeded GPTModel (this rank's stage chunks of it), Megatron's DDP around each chunk and the
    optimizer over all of them."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    vpp = args.vpp if args.vpp > 1 else None
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=vpp
    )
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.layers or max(2, args.pp * args.vpp),
        hidden_size=64,
        num_attention_heads=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_cpu_initialization=True,
        deterministic_mode=True,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
    )
    chunks, ddps = [], []
    for i in range(
        args.vpp
    ):  # Megatron-LM's get_model: one chunk per virtual stage, each in its own DDP
        stage = {"ignore_virtual": False, "vp_stage": i} if vpp else {}
        chunk = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            share_embeddings_and_output_weights=False,
            pre_process=ps.is_pipeline_first_stage(**stage),
            post_process=ps.is_pipeline_last_stage(**stage),
            vp_stage=i if vpp else None,
        )
        chunks.append(chunk)
        ddps.append(
            DistributedDataParallel(
                config,
                DistributedDataParallelConfig(
                    use_distributed_optimizer=args.distopt, overlap_grad_reduce=args.overlap
                ),
                chunk,
                disable_bucketing=i > 0,
            )
        )
    # Megatron-LM's wiring (training.py): without finalize_model_grads the schedule never syncs the DDP grad
    # buffers, and every rank would step on its own gradients.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [d.no_sync for d in ddps] if vpp else ddps[0].no_sync
    if args.overlap:
        config.grad_sync_func = (
            [d.start_grad_sync for d in ddps] if vpp else ddps[0].start_grad_sync
        )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=3e-3, weight_decay=0.01, use_distributed_optimizer=args.distopt
        ),
        ddps,
    )
    return ps, chunks, ddps, optimizer


def main() -> None:
    args = parse(MegatronLoopSpec)
    if args.topology is not None:  # the lifecycle driver's names for the layouts (campaign cells)
        args = dataclasses.replace(args, **TOPOLOGIES[args.topology])
    torch.set_num_threads(1)
    from qualification.frameworks import megatron_cpu

    megatron_cpu.install()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    ps, chunks, ddps, optimizer = build(args)
    model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)  # what the digests read
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    dp_rank = ps.get_data_parallel_rank()
    losses: dict[int, float] = {}
    verdicts: dict[str, dict[str, str]] = {}
    reports: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    session, injector = None, None
    times: dict[str, float] = {}
    if args.ckpt is not None:
        import gemscout

        t_attach = time.time()
        scout = (
            gemscout.ScoutConfig(
                interval=args.interval,
                recipes=("embedding", "hidden", "output"),
                stragglers=None,
                timeout=timedelta(seconds=60),
            )
            if args.scout
            else None
        )
        session = gemscout.enable_resiliency(
            ddps,
            optimizer,
            scout=scout,
            interval=args.interval,
            checkpoint=gemscout.CheckpointConfig(
                directory=args.ckpt,
                run_id="mc-loop",
                fsync=False,
                ranks_per_node=args.ranks_per_node,
                persist_every=args.persist_every,
                keep_generations=args.keep_generations,
                timeout=timedelta(seconds=60),
            ),
            extra_state_fn=lambda: {"losses": {str(k): v for k, v in losses.items()}},
            load_extra_state_fn=lambda s: losses.update(
                {int(k): float(v) for k, v in s["losses"].items()}
            ),
            on_fault_report=lambda r: reports.append(r.to_dict()),
            on_recovery_decision=lambda d: decisions.append(d.to_dict()),
        )
        times = {"attach_wall": t_attach, "restored_wall": time.time()}
        if session.scout is not None:
            from qualification.faults import Injector, fail_at

            injector = Injector(session.scout)
            if rank == args.fault_rank:
                injector.set(
                    fail_at("bitflip", rank=rank, step=args.fault_step, recipe=args.fault_recipe)
                )

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        return loss, {
            "lm loss": loss.detach().clone()
        }  # the schedule divides ``loss`` in place by the micro-batches

    def forward_step(data: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        tokens, labels = next(data)
        positions = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], SEQ)
        return chunk(tokens, positions, CAUSAL, labels=labels), loss_func

    # Count DDP's gradient syncs: a distributed optimizer keeps its replicas equal even when none ran (every rank
    # all-gathers the shards its peers updated from their own gradients), so equal replicas alone would not show it.
    grad_syncs = [0]
    finish_grad_sync = ddps[0].finish_grad_sync

    def counted_finish_grad_sync(*a: Any, **k: Any) -> Any:
        grad_syncs[0] += 1
        return finish_grad_sync(*a, **k)

    ddps[0].finish_grad_sync = counted_finish_grad_sync
    forward_backward = get_forward_backward_func()
    due: dict[str, list[str]] = {}
    for step in range((session.resume_step if session else 0) + 1, args.steps + 1):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 101 + dp_rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        micro = [
            (tokens[i : i + BATCH // MICRO, :-1], tokens[i : i + BATCH // MICRO, 1:].contiguous())
            for i in range(0, BATCH, BATCH // MICRO)
        ]
        for d in ddps:
            d.zero_grad_buffer()
        optimizer.zero_grad()
        # Interleaved: one iterator per chunk (each chunk's forward reads every micro-batch once).
        data: Any = [iter(micro) for _ in ddps] if len(ddps) > 1 else iter(micro)
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=ddps,
            num_microbatches=MICRO,
            seq_length=SEQ,
            micro_batch_size=BATCH // MICRO,
            forward_only=False,
        )
        # The last pipeline stage holds the loss of each micro-batch; every stage records it (the lifecycle reads rank 0).
        loss = torch.tensor(
            [sum(float(o["lm loss"]) for o in out) / len(out) if out else 0.0], dtype=torch.float64
        )
        if args.pp > 1:
            dist.broadcast(
                loss,
                ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
        losses[step] = float(loss)
        optimizer.step()  # the session's hooks run around this call
        cycle = (
            session.scout.last_result if session is not None and session.scout is not None else None
        )
        if cycle is not None and cycle.step == step:
            verdicts[str(step)] = {name: r.verdict.value for name, r in cycle.results.items()}
            due[str(step)] = [r.name for r in session.scout.catalog.due(step)]
        if session is not None:  # the first step trained after the restore (recovery wall time)
            times.setdefault("first_step_wall", time.time())
        FailStop.of(args, rank).after_step(session, step)
    trust = trust_states(session)
    h = hashlib.sha256()
    _model_hash(h, model)
    replicas: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(replicas, (ps.get_pipeline_model_parallel_rank(), h.hexdigest()))
    stage = ps.get_pipeline_model_parallel_rank()
    result = {
        "rank": rank,
        "dp_rank": dp_rank,
        "pp_rank": stage,
        "optimizer": [
            type(p).__name__ for p in getattr(optimizer, "chained_optimizers", None) or [optimizer]
        ],
        "resume_step": session.resume_step if session else 0,
        "decision": session.last_decision.to_dict() if session and session.last_decision else None,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "state_digest": state_digest(model, optimizer),
        "replicas_equal": len({d for s, d in replicas if s == stage}) == 1,
        "grad_syncs": grad_syncs[0],
        "peers": list(session.scout.peers) if session and session.scout else None,
        "topology": session.scout.topology.to_dict()
        if session and session.scout and session.scout.topology
        else None,
        "catalog": list(session.scout.catalog.names) if session and session.scout else [],
        "due": due,
        "schedule": forward_backward.__name__,
        "errors": session.checkpointer.errors if session and session.checkpointer else [],
        "verdicts": verdicts,
        "trust": trust,
        "reports": reports,
        "decisions": decisions,
        "fired": injector.fired if injector is not None else [],
        "times": times,
        "final_step": args.steps,
        "stats": session.checkpointer.stats if session and session.checkpointer else {},
    }
    if session is not None:
        session.close()
    finish(args.out, rank, result)


if __name__ == "__main__":
    run(main)
