"""The package root's private helpers: ``_tensors.is_dtensor`` and ``_modules.unwrap``.

Each replaced differently written copies (``state/codec``, ``scout/materialize``, ``scout/topology``;
``scout/recipes``, ``state/training_state``, ``adapters/megatron``); every case a caller relied on is here.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from gemscout._modules import unwrap
from gemscout._tensors import is_dtensor

pytestmark = pytest.mark.timeout(60)


def test_a_dtensor_and_a_dtensor_subclass_are_dtensors_and_their_local_part_is_not(
    one_rank: None,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    dtensor = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    assert is_dtensor(dtensor)
    assert is_dtensor(
        nn.Parameter(dtensor)
    )  # FSDP2's parameters: a Parameter whose data is a DTensor
    assert not is_dtensor(dtensor.to_local())

    class Derived(DTensor):  # the materializer's isinstance semantics: a subclass counts
        pass

    assert is_dtensor(Derived.from_local(torch.ones(2), mesh, [Shard(0)]))


def test_plain_values_and_lookalikes_are_not_dtensors() -> None:
    class DTensor:  # same class name, not torch's: the codec's old name check said no, and so does this
        device_mesh = None

        def to_local(self) -> None:
            return None

    for value in (torch.ones(2), nn.Parameter(torch.ones(2)), DTensor(), 3, None, "DTensor"):
        assert not is_dtensor(value)


def test_is_dtensor_never_imports_dtensor(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes `import torch.distributed.tensor` raise: the helper must answer without importing it.
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", None)
    assert not is_dtensor(torch.ones(2))
    assert sys.modules["torch.distributed.tensor"] is None


class _Wrapper(nn.Module):
    """DDP / DeepSpeed engine / Megatron Float16Module style: the model held as ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_unwrap_follows_module_through_every_wrapper() -> None:
    inner = nn.Linear(2, 2)
    assert unwrap(inner) is inner
    assert unwrap(_Wrapper(inner)) is inner
    assert (
        unwrap(_Wrapper(_Wrapper(inner))) is inner
    )  # Megatron: DistributedDataParallel(Float16Module(model))


def test_unwrap_stops_at_a_module_attribute_that_is_not_a_module() -> None:
    holder = nn.Linear(2, 2)
    holder.module = "not a module"  # type: ignore[assignment]
    assert unwrap(holder) is holder
    outer = _Wrapper(holder)
    assert unwrap(outer) is holder
    plain = nn.Sequential(nn.Linear(2, 2))  # children are not `.module`: nothing to unwrap
    assert unwrap(plain) is plain


def test_unwrap_of_real_ddp_is_the_model(one_rank: None) -> None:
    model = nn.Linear(2, 2)
    assert unwrap(nn.parallel.DistributedDataParallel(model)) is model
