"""Test-only CPU layer for Megatron Core 0.16.1's own training machinery (its ``DistributedDataParallel``, its
optimizers through ``get_megatron_optimizer`` and the ``get_forward_backward_func()`` schedules) on torch 2.13.0+cpu.

Megatron Core hard-codes CUDA in ~234 places (``device="cuda"``, ``torch.cuda.current_device()``, ``.cuda()``,
``param.type() == "torch.cuda.FloatTensor"``, CUDA streams). :func:`install` adds, on top of
:mod:`qualification.programs._megatron_cpu_shims` (``torch.cuda.current_device()`` → the CPU, the RNG tracker on the
CPU generator), the two redirections that DDP, ``get_megatron_optimizer`` and the schedules reach on this path,
measured by counting which ones fire (DDP with and without ``overlap_grad_reduce``, ``DistributedOptimizer`` and
``FP32Optimizer``, 1F1B over two stages, with gemscout attached):

1. ``device="cuda"`` (or ``"cuda:N"``, a CUDA ``torch.device``) given to any torch function → ``"cpu"``: Megatron's
   found-inf flags, grad-norm scratch tensors and the schedules' token counters are created on "cuda" by name
   (``torch.zeros`` / ``torch.tensor``, every step);
2. ``Tensor.type()`` with no argument reports a CPU float / half / bf16 tensor as ``"torch.cuda.FloatTensor"`` (...):
   the optimizers and ``clip_grads`` dispatch on that string and refuse anything else ("Wrapped parameters must be
   one of torch.cuda.FloatTensor ...").

Both are done by one ``TorchFunctionMode`` entered on the calling (training) thread; torch keeps function modes per
thread, so gemscout's background copy / io threads never run under it. Not needed on this path, so not shimmed:
``Tensor.cuda()`` / ``.to("cuda")`` (the CPU-offload helpers), CUDA streams and events (only with several
distributed-optimizer instances), int device ordinals (``current_device()`` already answers the CPU).

``torch.cuda.is_available()`` is NOT faked: it stays False, so gemscout sees a CPU machine (no CUDA RNG capture, no
side-stream copies) and Megatron takes its non-GPU branches where it has them. Nothing here changes the numerics of
a Megatron op: every redirected tensor is one Megatron would have made on the GPU with the same values.

Tied to megatron-core 0.16.1 on torch 2.13.0: :func:`install` refuses any other pair, and refuses a CUDA machine
(run Megatron as shipped there). The runtime (``src/gemscout``) never imports this module.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["MEGATRON_VERSION", "install"]

MEGATRON_VERSION = "0.16.1"
TORCH_VERSION = "2.13.0"
_MODE: TorchFunctionMode | None = None
_CUDA_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaAsCpu(TorchFunctionMode):
    """Shims 1 and 2 of the module docstring, for every torch call made on the thread that entered it."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPES.get(name, name)
        return func(*args, **kwargs)


def install() -> None:
    """Install the shims (idempotent) on the calling thread; call before building the Megatron model.

    Raises RuntimeError on a CUDA machine or with another megatron-core / torch pair than the one verified."""
    global _MODE
    if _MODE is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "the Megatron CPU layer is for machines without CUDA; run Megatron as shipped on a GPU"
        )
    megatron = importlib.metadata.version("megatron-core")
    if megatron != MEGATRON_VERSION or torch.__version__.split("+")[0] != TORCH_VERSION:
        raise RuntimeError(
            f"qualification.frameworks.megatron_cpu is verified for megatron-core {MEGATRON_VERSION} "
            f"on torch {TORCH_VERSION}, found {megatron} on {torch.__version__}"
        )
    from qualification.programs import _megatron_cpu_shims

    _megatron_cpu_shims.install()
    _MODE = _CudaAsCpu()
    _MODE.__enter__()  # for the life of the process, on this (the training) thread
