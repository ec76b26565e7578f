"""The ZeRO-1/2 optimizer recipe's slice plan: which slices of the partitioned fp32 masters SCOUT replays.

Under ZeRO-1/2 the fp32 master partition and its optimizer state live on one rank only, so the source of a slice is
its **partition owner**. The catalog lists, for every rank of the data-parallel group, slices of that rank's flat fp32
partition (at most ``optimizer_slice_numel`` elements, starts aligned to :data:`ALIGN` elements so the replay runs the
same vector / scalar split of the elementwise kernels as the live update — a slice replayed from another offset can
differ in the last bit where a compiler contracts the scalar tail into an FMA). The plan is pure: every rank computes
the same one from the partition sizes. :class:`~gemscout.adapters.deepspeed.scout.ZeroScout` walks it (over owners,
then over their slices) and replays the slices. Nothing here imports deepspeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from gemscout.scout.recipes import Recipe, RecipeKind

__all__ = ["ALIGN", "ZeroSlice", "plan_slices"]

ALIGN = 64
"""Slice starts are multiples of this many elements (twice the widest float32 SIMD vector, AVX-512)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroSlice:
    """Elements ``[start, stop)`` of param group ``group``'s fp32 partition held by global rank ``owner``."""

    name: str
    owner: int
    group: int
    start: int
    stop: int

    @property
    def key(self) -> str:
        """The parameter name used on the wire and in digests (same on every rank)."""
        return f"group{self.group}[{self.start}:{self.stop}]"

    @property
    def recipe(self) -> Recipe:
        return Recipe(
            name=self.name, kind=RecipeKind.OPTIMIZER, params=(self.key,), group_index=self.group
        )


def plan_slices(
    peers: tuple[int, ...], partition_numel: list[int], bound: int
) -> dict[int, list[ZeroSlice]]:
    """Every owner's slices, by global rank. Pure: equal on every rank given the same partition sizes."""
    step = max(ALIGN, bound // ALIGN * ALIGN)
    plan: dict[int, list[ZeroSlice]] = {}
    for owner in peers:
        slices: list[ZeroSlice] = []
        for group, numel in enumerate(partition_numel):
            for start in range(0, numel, step):
                slices.append(
                    ZeroSlice(
                        name=f"optimizer.rank{owner}.{len(slices)}",
                        owner=owner,
                        group=group,
                        start=start,
                        stop=min(numel, start + step),
                    )
                )
        plan[owner] = slices
    return plan
