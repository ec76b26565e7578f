"""One rank of Megatron Core's own GPU training path under gemscout: ``DistributedDataParallel``, the
``DistributedOptimizer`` (``get_megatron_optimizer``) and the ``get_forward_backward_func()`` schedule (GPU tier).

Same ``<out>/rank<r>.json`` as :mod:`qualification.programs.megatron_rank` (losses, resume step, decision,
``state_digest`` over the model, this rank's distributed-optimizer shard and state, and the RNG tracker).
``--kill-rank R --kill-step S`` SIGKILLs rank R after step S (its checkpoint drained first). One rank per GPU (NCCL).
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from qualification.programs._failstop import FailStop
from qualification.programs._rank import finish, run
from qualification.programs._tensor_bytes import tensor_bytes
from qualification.programs.specs import parse
from qualification.programs.specs.megatron import MegatronGpuSpec

VOCAB, SEQ, BATCH = 128, 32, 4


def state_digest(model: torch.nn.Module, optimizer: Any) -> str:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):
            h.update(name.encode())
            h.update(tensor_bytes(t))
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = part.optimizer
        for g in inner.param_groups:
            for p in g["params"]:
                h.update(tensor_bytes(p))
                for key, value in sorted(inner.state.get(p, {}).items()):
                    h.update(key.encode())
                    h.update(
                        tensor_bytes(value) if torch.is_tensor(value) else repr(value).encode()
                    )
    for name, state in sorted(get_cuda_rng_tracker().get_states().items()):
        h.update(name.encode())
        h.update(tensor_bytes(state))
    return h.hexdigest()


def main() -> None:
    args = parse(MegatronGpuSpec)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", timeout=timedelta(seconds=120))
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
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel()
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        deterministic_mode=True,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False,
    ).cuda()
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False),
        model,
    )
    # Megatron-LM's wiring: without finalize_model_grads the schedule never syncs DDP's grad buffers (found on CPU,
    # qualification/programs/megatron_loop_rank.py: every rank stepped on its own gradients).
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=3e-3, weight_decay=0.01, use_distributed_optimizer=True
        ),
        [ddp],
    )
    rank, dp_rank = dist.get_rank(), ps.get_data_parallel_rank()
    losses: dict[int, float] = {}
    session = None
    if args.ckpt is not None:
        import gemscout

        session = gemscout.enable_resiliency(
            [ddp],
            optimizer,
            checkpoint=gemscout.CheckpointConfig(directory=args.ckpt, run_id="mc-gpu", fsync=False),
            extra_state_fn=lambda: {"losses": {str(k): v for k, v in losses.items()}},
            load_extra_state_fn=lambda s: losses.update(
                {int(k): float(v) for k, v in s["losses"].items()}
            ),
        )
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device="cuda"), diagonal=1)

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        tokens, labels = next(data)
        positions = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, SEQ)
        return chunk(tokens, positions, causal, labels=labels), partial(loss_func)

    forward_backward = get_forward_backward_func()
    for step in range((session.resume_step if session else 0) + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 101 + dp_rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).cuda()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter([(tokens[:, :-1], tokens[:, 1:].contiguous())]),
            model=[ddp],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=False,
        )
        losses[step] = float(out[0]["lm loss"])
        optimizer.step()  # the session's hooks run around this call
        FailStop.of(args, rank).after_step(session, step)
    if session is not None and session.checkpointer is not None:
        session.checkpointer.drain()
    result = {
        "rank": rank,
        "resume_step": session.resume_step if session else 0,
        "decision": session.last_decision.to_dict() if session and session.last_decision else None,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "state_digest": state_digest(model, optimizer),
    }
    if session is not None:
        session.close()
    finish(args.out, rank, result)


if __name__ == "__main__":
    run(main)
