"""Test-only CPU layer for TorchTitan 0.3.0 on torch 2.13.0+cpu: the shims, the run's config, and its assets.

A real ``torchtitan.trainer.Trainer`` does not run on a CPU-only gloo machine as shipped
(../shared/notes/cpu-feasibility.md §7). :func:`apply` installs, before anything else imports torchtitan, the
smallest changes that let it run; each changes torchtitan's (never gemscout's) CPU behaviour:

1. device type "cpu": torchtitan picks ``torch._utils._get_available_device_type() or "cuda"`` once, at import of
   ``torchtitan.tools.utils``; on a machine without an accelerator that is "cuda" and ``Trainer.__init__`` fails in
   ``torch.cuda.set_device``. The answer is "cpu" while that module is imported, and torch's function is put back;
2. memory monitor: ``torch.cpu`` has no ``memory_stats`` / ``get_device_properties`` / ``get_device_name`` /
   ``reset_peak_memory_stats`` / ``empty_cache``; torchtitan's metrics module gets a CPU stand-in (zero stats);
3. SUM reduction: torchtitan sets FSDP2's gradient divide factor to 1.0, which makes FSDP2 reduce-scatter with
   ``ReduceOp.PREMUL_SUM`` and gloo has none; FSDP2 is also told to reduce with SUM and divide locally (by 1.0: the
   same gradients);
4. process-group timeouts: after the first step torchtitan calls ``barrier(device_ids=[device.current_device()])``
   (``torch.cpu.current_device()`` is the string "cpu") and ``torch.distributed.set_timeout`` (newer than torch
   2.13); here it only synchronises, and the groups keep the timeout they were created with;
5. attention (CHANGES THE MODEL): FlexAttention has no backward on CPU. The llama3 model registry builds plain causal
   ``ScaledDotProductAttention`` instead, so attention crosses document boundaries inside a packed sequence (the
   per-document block-causal mask is gone; RoPE positions still restart per document);
6. pipeline schedules: torchtitan 0.3.0 calls ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)`` with
   microbatches it split itself, a keyword form newer than torch 2.13 (whose ``step`` splits a whole batch and would
   take those keywords for model inputs); the schedules accept that call and run their own ``_step_microbatches`` on
   the given microbatches after torch's per-step set-up (same numerics, no model change).

:func:`trainer_config` adds what is configuration rather than code: ``spmd_backend="partial_dtensor"`` (the default
``spmd_types`` rejects FSDP2 parameters that are not DTensors on the full mesh), fp32 parameters (bf16 matmuls are
~8x slower on this CPU), CUDA graphs off. :func:`make_assets` builds the tokenizer and the ``c4_test`` dataset the
debug config reads (they are not in the wheel): a byte-level BPE trained on synthetic text, and synthetic text.

This is a CPU smoke of gemscout's TorchTitan integration, not a qualification of TorchTitan's numerics. The layer is
tied to one torch + torchtitan pair; :func:`apply` refuses any other, and refuses a machine with CUDA (run
TorchTitan as shipped there). The runtime (``src/gemscout``) never imports this module.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["TORCHTITAN_VERSION", "apply", "make_assets", "trainer_config"]

TORCHTITAN_VERSION = "0.3.0"
TORCH_VERSION = "2.13.0"
VOCAB = 2000  # below the debug model's 2048 embedding rows
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
_APPLIED = False


class _CpuMemory:
    """What torchtitan's DeviceMemoryMonitor asks of a device module, for the CPU (no allocator statistics)."""

    class _Props:
        total_memory = 1 << 34  # nominal 16 GiB; only used for percentages in log lines

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)  # set_device, current_device, device_count, synchronize ...

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> _CpuMemory._Props:
        return self._Props()

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None


def _check_versions() -> None:
    titan = importlib.metadata.version("torchtitan")
    if titan != TORCHTITAN_VERSION or not torch.__version__.startswith(TORCH_VERSION):
        raise RuntimeError(
            f"the TorchTitan CPU shims are written for torchtitan {TORCHTITAN_VERSION} on torch "
            f"{TORCH_VERSION}; found torchtitan {titan}, torch {torch.__version__}"
        )
    if torch.cuda.is_available():
        raise RuntimeError(
            "the TorchTitan CPU shims are for machines without CUDA; run TorchTitan as shipped"
        )


def apply() -> None:
    """Install every shim (idempotent). Call before anything imports torchtitan.

    Raises RuntimeError on another torchtitan / torch version, on a CUDA machine, or when torchtitan's device module
    was already imported (it would have chosen "cuda")."""
    global _APPLIED
    if _APPLIED:
        return
    _check_versions()
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError(
            "apply() must run before torchtitan is imported (it picks its device type at import)"
        )
    import torch._utils as tutils

    # 1. Device type "cpu", only for the moment torchtitan reads it.
    original = tutils._get_available_device_type
    tutils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]
    try:
        import torchtitan.tools.utils as titan_utils
    finally:
        tutils._get_available_device_type = original  # type: ignore[assignment]
    assert titan_utils.device_type == "cpu"

    # 2. Memory statistics torch.cpu does not have.
    import torchtitan.components.metrics as metrics

    metrics.device_module = _CpuMemory()  # type: ignore[attr-defined]

    # 3. gloo has no PREMUL_SUM: reduce with SUM, divide locally (by the same factor, 1.0).
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule

    def disable_division_with_sum(model: torch.nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = disable_division_with_sum  # type: ignore[assignment]

    # 4. No dist.set_timeout in torch 2.13, and barrier(device_ids=["cpu"]) raises: synchronise only.
    import torchtitan.distributed.utils as titan_dist

    def set_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
        torch.distributed.barrier()

    titan_dist.set_pg_timeouts = set_pg_timeouts  # type: ignore[assignment]

    # 5. FlexAttention has no CPU backward: the llama3 registry builds plain causal SDPA (changes the model).
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()  # type: ignore[attr-defined]

    # 6. Pipeline schedules: torchtitan 0.3.0 hands step() microbatches it split itself (a newer torch's keywords).
    _accept_presplit_microbatches()
    _APPLIED = True


def _accept_presplit_microbatches() -> None:
    """Let torch 2.13's pipeline schedules take ``step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)``, as torchtitan
    0.3.0's ``pp_forward_backward_step`` calls them: the same per-iteration set-up as torch's own ``step`` (backward
    flag on every stage, runtime state cleared), then the schedule's ``_step_microbatches`` on the given microbatches
    instead of torch splitting a whole batch. Any other call goes to torch's ``step`` unchanged."""
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        original = cls.step

        def step(
            self: Any,
            *args: Any,
            arg_mbs: Any = None,
            kwarg_mbs: Any = None,
            target_mbs: Any = None,
            losses: Any = None,
            return_outputs: bool = True,
            loss_kwargs: Any = None,
            _torch: Any = original,
            **kwargs: Any,
        ) -> Any:
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return _torch(
                    self,
                    *args,
                    losses=losses,
                    return_outputs=return_outputs,
                    loss_kwargs=loss_kwargs,
                    **kwargs,
                )
            if args or kwargs or return_outputs:
                raise RuntimeError(
                    "pre-split pipeline step: only torchtitan's call (microbatches, no outputs) is "
                    "supported by the CPU shim"
                )
            if self._has_backward and not torch.is_grad_enabled():
                raise RuntimeError(
                    "step() requires gradients to be enabled for backward computation"
                )
            stages = getattr(self, "_stages", None) or [self._stage]
            for stage in stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(
                arg_mbs, kwarg_mbs, target_mbs, losses, False, loss_kwargs=loss_kwargs
            )
            return None

        cls.step = step  # type: ignore[method-assign]


def trainer_config(
    *,
    assets: Path,
    dump: Path,
    steps: int,
    seq_len: int = 128,
    local_batch: int = 2,
    seed: int = 0,
    dp_shard: int = -1,
    dp_replicate: int = 1,
    pp: int = 1,
    pp_schedule: str = "1F1B",
) -> Any:
    """The llama3 debug model's ``Trainer.Config`` (torchtitan's own ``llama3_debugmodel``) set up for this CPU:
    fp32 parameters, ``partial_dtensor``, no CUDA graphs, no validation, TorchTitan's own checkpointing off, a fixed
    seed, the assets of :func:`make_assets`. ``pp`` > 1: TorchTitan's own pipeline split and ``pp_schedule``
    (``1F1B``, ``Interleaved1F1B``, ...). Call after :func:`apply`."""
    if not _APPLIED:
        raise RuntimeError("call apply() before building a TorchTitan config")
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.hf_assets_path = str(assets / "tokenizer")
    config.dataloader.dataset_path = str(assets / "c4_test")
    config.dump_folder = str(dump)
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = local_batch
    config.training.mixed_precision_param = (
        "float32"  # bf16 matmuls: ~8 s/step on this CPU instead of ~1 s
    )
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = (
        "partial_dtensor"  # spmd_types wants every parameter on the full SPMD mesh
    )
    config.parallelism.data_parallel_shard_degree = dp_shard
    config.parallelism.data_parallel_replicate_degree = dp_replicate
    config.parallelism.pipeline_parallel_degree = (
        pp  # microbatches of 1 sample: local_batch of them per step
    )
    config.parallelism.pipeline_parallel_schedule = pp_schedule
    config.checkpoint.enable = (
        False  # gemscout restores; Trainer.train() would load its own DCP checkpoint
    )
    config.validator.enable = False
    config.debug.seed = seed
    config.debug.enable_structured_logging = False
    config.metrics.log_freq = 1
    return config


def _words(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(600)]


def make_assets(folder: Path, *, documents: int = 1500, seed: int = 0) -> Path:
    """Write ``folder/tokenizer`` (a byte-level BPE, ``VOCAB`` ids with BOS/EOS, trained here on the synthetic text)
    and ``folder/c4_test/data.json`` (``documents`` lines ``{"text": ...}``, the c4_test format). Needs the
    ``tokenizers`` package (a torchtitan dependency). Returns ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    words = _words(rng)
    texts = [
        " ".join(rng.choice(words) for _ in range(rng.randint(20, 160))) + "."
        for _ in range(documents)
    ]
    data = folder / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    (data / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tok = folder / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return folder


if __name__ == "__main__":  # python -m qualification.frameworks.torchtitan_cpu ASSETS_DIR
    print(make_assets(Path(sys.argv[1])))
