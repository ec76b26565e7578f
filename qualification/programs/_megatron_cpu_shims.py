"""Test-only shims that let Megatron Core's GPTModel run forward and backward on a CPU (gloo) machine.

Megatron Core 0.16.1 reaches for CUDA even in code that has a CPU path: its global memory buffer allocates on
``torch.cuda.current_device()``, and its RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork``)
reads and writes the CUDA generator. :func:`install` points exactly those calls at the CPU:

- ``torch.cuda.current_device`` → ``torch.device("cpu")`` (so buffers land on the CPU);
- ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` / ``synchronize`` → the CPU generator's;
- ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` → the CPU generator's.

MoE layers (``num_moe_experts``, the ``alltoall`` token dispatcher, SequentialMLP experts) need three more:

- ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` → a CPU stand-in with no-op ``wait_stream``,
  ``record_event`` and ``synchronize``: the dispatcher copies its split sizes to the host on a side stream, and on a
  CPU every tensor already is on the host, in order;
- the dispatcher's ``maybe_move_tensor_to_cpu`` → returns the split sizes as numpy arrays for CPU tensors too, which
  is what its GPU path hands ``all_to_all_single`` (on a CPU tensor it would leave a tensor, which gloo refuses);
- ``moe_utils.te_general_gemm`` → None: Megatron Core 0.16.1 references that name without Transformer Engine (a
  NameError in the router's gating linear) although its fallback (``torch.mm``) is right below.

Consequence to keep in mind: Megatron's "CUDA" RNG tracker states are CPU generator states here, and forking the
tracker swaps the CPU generator — what a GPU run does with the CUDA generator. These shims are for the CPU test tier
only (qualification rank programs and tests/distributed); the runtime never imports this module, and a machine with a
GPU must not install them (:func:`install` refuses). Megatron's DDP, schedules and optimizers need more:
:mod:`qualification.frameworks.megatron_cpu` (which installs these too).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["install"]

_INSTALLED = False


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


class _HostStream:
    """A CUDA stream / event stand-in: on a CPU every op already ran, in order, when the next one starts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _HostStream:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


_HOST_STREAM = _HostStream()


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _install_moe() -> None:
    torch.cuda.Stream = _HostStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM  # type: ignore[assignment,return-value]
    torch.cuda.stream = lambda stream=None: _HOST_STREAM  # type: ignore[assignment,return-value]
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host  # type: ignore[assignment]


def install() -> None:
    """Install the shims (idempotent). Call before building a Megatron model. Raises RuntimeError on a CUDA machine,
    where Megatron must run as shipped."""
    global _INSTALLED
    if _INSTALLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "the Megatron CPU shims are for machines without CUDA; run Megatron as shipped on a GPU"
        )
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.get_rng_state = _cpu_get_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = _cpu_set_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = _cpu_manual_seed  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = _cpu_get_rng_state  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_get_rng_state  # type: ignore[assignment]
    mrandom._set_cuda_rng_state = _cpu_set_rng_state  # type: ignore[assignment]
    # The tracker warns when the CPU stream moved inside a fork; with these shims the fork *is* the CPU stream.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)
    _install_moe()
    _INSTALLED = True
