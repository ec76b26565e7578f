"""Order-sensitive tensor digests: equal exactly when dtype, shape and row-major bytes are equal."""

from __future__ import annotations

import re

import pytest
import torch

from gemscout.scout.digests import digest_many, tensor_digest

DIGEST_FORMAT = re.compile(r"^blake3:[0-9a-f]{64}$")


def _flip_low_bit(t: torch.Tensor, index: int) -> torch.Tensor:
    """Copy of ``t`` with the least significant bit of element ``index`` flipped (lowest mantissa bit for floats)."""
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    flipped = t.clone()
    bits = flipped.view(int_dtype).reshape(-1)
    bits[index] ^= 1
    return flipped


def test_digest_format_and_determinism() -> None:
    t = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    assert DIGEST_FORMAT.match(tensor_digest(t))
    assert tensor_digest(t) == tensor_digest(t.clone())


def test_known_answer_pins_the_format() -> None:
    # Peers running different gemscout versions must not disagree silently: changing the digest layout must change
    # the domain tag, and this test then fails on purpose.
    assert (
        tensor_digest(torch.arange(4, dtype=torch.int32))
        == "blake3:765254f5f3b7d31519086a4ee33b245b858c31f2f032756333cf40b282ab7f9b"
    )


@pytest.mark.parametrize(
    "permute",
    [
        lambda t: t.flip(0),
        lambda t: t.roll(1),
        lambda t: t[torch.tensor([1, 0, *range(2, t.numel())])],  # swap the first two values only
        lambda t: t[torch.randperm(t.numel(), generator=torch.Generator().manual_seed(3))],
    ],
    ids=["reverse", "roll", "swap-two", "random"],
)
def test_a_permutation_of_values_changes_the_digest(permute) -> None:  # type: ignore[no-untyped-def]
    t = torch.arange(16, dtype=torch.float32) * 0.5 + 1.0
    permuted = permute(t)
    assert sorted(permuted.tolist()) == sorted(t.tolist())  # same multiset of values...
    assert tensor_digest(permuted) != tensor_digest(t)  # ...different order, different digest


def test_permuting_rows_of_a_matrix_changes_the_digest() -> None:
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_digest(m[[1, 0, 2]]) != tensor_digest(m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index", [0, 7, 63])
def test_a_single_low_mantissa_bit_flip_changes_the_digest(dtype: torch.dtype, index: int) -> None:
    t = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(dtype)
    flipped = _flip_low_bit(t, index)
    assert not torch.equal(flipped, t)
    assert (flipped.float() - t.float()).abs().max() < 1e-1  # a tiny numerical change...
    assert tensor_digest(flipped) != tensor_digest(t)  # ...that C3 must still see


def test_negative_zero_differs_from_zero() -> None:
    assert tensor_digest(torch.tensor([0.0])) != tensor_digest(torch.tensor([-0.0]))


def test_same_bytes_different_dtype_differ() -> None:
    t = torch.randn(16, generator=torch.Generator().manual_seed(2))
    as_int = t.view(torch.int32)  # bitwise identical memory
    assert tensor_digest(t) != tensor_digest(as_int)
    assert tensor_digest(t.view(torch.uint8)) != tensor_digest(t)


def test_same_values_different_dtype_differ() -> None:
    values = torch.arange(8)
    digests = {
        tensor_digest(values.to(dtype))
        for dtype in (torch.int64, torch.int32, torch.float32, torch.float64)
    }
    assert len(digests) == 4


def test_same_values_different_shape_differ() -> None:
    t = torch.arange(16, dtype=torch.float32)
    shapes = [(16,), (2, 8), (8, 2), (4, 4), (1, 16), (16, 1), (2, 2, 4)]
    digests = {tensor_digest(t.view(shape)) for shape in shapes}
    assert len(digests) == len(shapes)
    assert tensor_digest(torch.tensor(5.0)) != tensor_digest(torch.tensor([5.0]))


def test_layout_does_not_matter_when_values_and_shape_are_equal() -> None:
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = a.t().contiguous().t()  # same shape and values, column-major memory
    assert not b.is_contiguous()
    assert tensor_digest(b) == tensor_digest(a)
    assert tensor_digest(a.t()) == tensor_digest(a.t().contiguous())


def test_views_with_offsets_and_strides_digest_their_values() -> None:
    base = torch.arange(100, dtype=torch.float32)
    view = base[10:50:2]  # storage offset and stride 2
    assert tensor_digest(view) == tensor_digest(view.clone())
    assert tensor_digest(view) != tensor_digest(base[12:52:2])
    expanded = torch.tensor([1.0, 2.0]).expand(3, 2)  # stride 0
    assert tensor_digest(expanded) == tensor_digest(torch.tensor([[1.0, 2.0]] * 3))


def test_conjugate_and_negative_views_digest_their_values() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    assert z.conj().is_conj()
    assert tensor_digest(z.conj()) == tensor_digest(z.conj().resolve_conj())
    assert tensor_digest(z.conj()) != tensor_digest(z)
    negated = torch._neg_view(torch.tensor([1.0, 2.0]))
    assert tensor_digest(negated) == tensor_digest(torch.tensor([-1.0, -2.0]))


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
    ids=str,
)
def test_every_dense_dtype_is_supported(dtype: torch.dtype) -> None:
    def make(values: torch.Tensor) -> torch.Tensor:
        # Permute before converting: some dtypes (float8) have no CPU flip kernel.
        return values % 2 == 1 if dtype is torch.bool else values.to(dtype)

    values = torch.tensor([[1, 0, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]).expand(2, 3, 4)
    t = make(values)
    digest = tensor_digest(t)
    assert DIGEST_FORMAT.match(digest)
    assert digest == tensor_digest(t.clone())
    assert digest != tensor_digest(make(values.roll(1, dims=-1)))
    assert tensor_digest(t.transpose(0, 2)) == tensor_digest(t.transpose(0, 2).contiguous())


def test_bfloat16_bits_are_hashed_not_rounded_values() -> None:
    t = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    assert tensor_digest(t) != tensor_digest(t.float())
    assert tensor_digest(t) != tensor_digest(_flip_low_bit(t, 1))


def test_empty_zero_dim_and_grad_tensors() -> None:
    assert tensor_digest(torch.empty(0)) != tensor_digest(torch.empty(0, 3))
    assert tensor_digest(torch.empty(0)) != tensor_digest(torch.empty(0, dtype=torch.int64))
    w = torch.ones(3, requires_grad=True)
    assert tensor_digest(w) == tensor_digest(torch.ones(3))
    assert tensor_digest(w * 2) == tensor_digest(torch.full((3,), 2.0))


def test_unsupported_tensors_raise_type_error() -> None:
    with pytest.raises(TypeError, match="strided"):
        tensor_digest(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match="meta"):
        tensor_digest(torch.empty(3, device="meta"))
    with pytest.raises(TypeError, match="torch.Tensor"):
        tensor_digest([1.0, 2.0])  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_digest_like_their_cpu_copy() -> None:
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert tensor_digest(t.cuda()) == tensor_digest(t)
    assert tensor_digest(t.cuda().t()) == tensor_digest(t.t())


def test_digest_many_is_independent_of_insertion_order() -> None:
    a, b = torch.arange(3), torch.ones(2, 2)
    assert digest_many({"a": a, "b": b}) == digest_many({"b": b, "a": a})
    assert DIGEST_FORMAT.match(digest_many({"a": a}))


def test_digest_many_covers_names_values_and_pairing() -> None:
    a, b = torch.arange(3.0), torch.arange(3.0) + 1
    reference = digest_many({"a": a, "b": b})
    assert digest_many({"a": b, "b": a}) != reference  # values swapped between names
    assert digest_many({"a": a, "c": b}) != reference  # a renamed tensor
    assert digest_many({"a": a}) != reference  # a missing tensor
    assert digest_many({"a": a, "b": _flip_low_bit(b, 2)}) != reference  # one bit in one tensor
    assert digest_many({"a": a}) != tensor_digest(a)  # a collection is never mistaken for a tensor
    # Name boundaries are unambiguous: ("ab", "c") cannot collide with ("a", "bc") through concatenation.
    t = torch.zeros(1)
    assert digest_many({"ab": t, "c": t}) != digest_many({"a": t, "bc": t})


def test_digest_many_of_nothing_is_stable() -> None:
    assert digest_many({}) == digest_many({})
    assert digest_many({}) != digest_many({"": torch.empty(0)})


def test_digest_many_rejects_bad_names_and_values() -> None:
    with pytest.raises(TypeError, match="str names"):
        digest_many({1: torch.zeros(1)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="tensors"):
        digest_many({"a": 1.0})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="mapping"):
        digest_many([("a", torch.zeros(1))])  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_fast_path_digests_the_same_bytes_as_the_general_path() -> None:
    """Dense CPU tensors are hashed straight from numpy's buffer; everything numpy or a byte cast refuses (bfloat16,
    float8, complex, a pending conjugate or negation, strided and expanded views, tensors that require grad) takes the
    general path. Both must digest the same dtype, shape and row-major bytes."""
    import blake3

    from gemscout.scout import digests

    def general(t: torch.Tensor) -> str:
        hasher = blake3.blake3()
        hasher.update(digests._prefix(t))
        hasher.update(digests._cpu_bytes(t).numpy().data)
        return f"blake3:{hasher.hexdigest()}"

    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, generator=g)
    cases = [
        torch.tensor(2.5),
        base,
        base.t(),
        base[1:4, ::2],
        torch.randn(5, generator=g).expand(3, 5),
        torch.randn(1, 5, generator=g)[:, 1:3],
        base.to(torch.bfloat16),
        base.to(torch.float16),
        base.to(torch.float8_e4m3fn),
        torch.randn(3, dtype=torch.complex64, generator=g).conj(),
        base._neg_view(),
        base.clone().requires_grad_(),
        torch.nn.Parameter(base.clone()),
        torch.empty(0),
        torch.empty(0, 3),
        torch.arange(7, dtype=torch.int8),
        base > 0,
        base.to(torch.float64),
    ]
    for t in cases:
        assert tensor_digest(t) == general(t), (t.dtype, tuple(t.shape), t.stride())
