"""Trust gating and the recipe rotation, without a process group.

* :class:`RotationTracker` against a brute-force oracle of its definition ("the newest step s such that every recipe
  passed clean at some step >= s, with no SDC since") over random verdict sequences, and case by case;
* the catalog: recipe boundaries found in the workload model (through a DDP-style wrapper), bounded optimizer slices,
  a due schedule that visits every recipe, and ConfigErrors that name the field to set;
* :class:`ScoutConfig` validation, the pickle-free capture wire format, and the harness's numerical injectors.
"""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
import torch
from torch import nn

from gemscout.errors import ConfigError
from gemscout.scout import C3Result, RotationTracker, ScoutConfig, Verdict
from gemscout.scout.capture import Captured
from gemscout.scout.capture_wire import pack, unpack
from gemscout.scout.digests import tensor_digest
from gemscout.scout.recipes import RecipeKind, build_catalog
from gemscout.scout.rotation import is_clean, is_sdc
from qualification.faults import FAULT_KINDS, corrupt
from qualification.workloads import build_model

A, B = "blake3:" + "a" * 64, "blake3:" + "b" * 64


def agree(name: str, step: int) -> C3Result:
    return C3Result(
        verdict=Verdict.AGREE,
        recipe=name,
        step=step,
        majority_digest=A,
        digests_by_rank={0: A, 1: A, 2: A},
    )


def attributed(name: str, step: int) -> C3Result:
    return C3Result(
        verdict=Verdict.ATTRIBUTED,
        recipe=name,
        step=step,
        ranks=(2,),
        majority_digest=A,
        digests_by_rank={0: A, 1: A, 2: B},
    )


def split(name: str, step: int) -> C3Result:  # two peers disagree: SDC without a culprit
    return C3Result(
        verdict=Verdict.INCONCLUSIVE, recipe=name, step=step, digests_by_rank={0: A, 1: B}
    )


def unchecked(name: str, step: int) -> C3Result:  # a precondition failed: not a pass, not a fault
    return C3Result(
        verdict=Verdict.INCONCLUSIVE,
        recipe=name,
        step=step,
        digests_by_rank={0: A, 1: B},
        preconditions_ok=False,
        reason="precondition 'param_digest' disagrees",
    )


CATALOG = ("embedding", "hidden.0", "hidden.1", "hidden.2", "output", "optimizer.0", "optimizer.1")


def test_result_classification() -> None:
    assert is_clean(agree("x", 1)) and not is_sdc(agree("x", 1))
    assert is_sdc(attributed("x", 1)) and is_sdc(split("x", 1))
    assert not is_sdc(unchecked("x", 1)) and not is_clean(unchecked("x", 1))


def test_whole_catalog_at_every_due_step_certifies_at_once() -> None:
    tracker = RotationTracker(CATALOG)
    for step in (5, 10, 15):
        assert tracker.record(step, {name: agree(name, step) for name in CATALOG}) == step


def test_rotation_waits_for_every_recipe_and_certifies_the_oldest_needed_step() -> None:
    tracker = RotationTracker(["embedding", "hidden.0", "hidden.1", "hidden.2"])
    assert (
        tracker.record(1, {"embedding": agree("embedding", 1), "hidden.0": agree("hidden.0", 1)})
        is None
    )
    assert (
        tracker.record(2, {"embedding": agree("embedding", 2), "hidden.1": agree("hidden.1", 2)})
        is None
    )
    assert tracker.pending == ("hidden.2",)
    assert (
        tracker.record(3, {"embedding": agree("embedding", 3), "hidden.2": agree("hidden.2", 3)})
        == 1
    )
    assert (
        tracker.record(4, {"embedding": agree("embedding", 4), "hidden.0": agree("hidden.0", 4)})
        == 2
    )
    assert tracker.certified_step == 2 and tracker.last_clean("hidden.0") == 4


def test_sdc_forgets_every_earlier_pass_including_its_own_step() -> None:
    tracker = RotationTracker(["a", "b"])
    assert tracker.record(1, {"a": agree("a", 1), "b": agree("b", 1)}) == 1
    assert tracker.record(2, {"a": agree("a", 2), "b": attributed("b", 2)}) is None
    assert tracker.last_sdc_step == 2 and tracker.pending == ("a", "b")
    assert tracker.record(3, {"a": agree("a", 3)}) is None
    assert tracker.record(4, {"b": agree("b", 4)}) == 3
    assert (
        tracker.record(5, {"a": split("a", 5), "b": agree("b", 5)}) is None
    )  # two-peer mismatch is SDC too


def test_precondition_failures_neither_pass_nor_reset() -> None:
    tracker = RotationTracker(["a", "b"])
    tracker.record(1, {"a": agree("a", 1), "b": agree("b", 1)})
    assert tracker.record(2, {"a": unchecked("a", 2), "b": agree("b", 2)}) == 1
    assert tracker.last_clean("a") == 1 and tracker.last_sdc_step is None


def test_bad_input_is_refused_and_records_nothing() -> None:
    tracker = RotationTracker(["a", "b"])
    tracker.record(3, {"a": agree("a", 3)})
    with pytest.raises(ValueError, match="steps must increase"):
        tracker.record(3, {"b": agree("b", 3)})
    with pytest.raises(ValueError, match="not in the rotation catalog"):
        tracker.record(4, {"a": agree("a", 4), "zzz": agree("zzz", 4)})
    with pytest.raises(TypeError, match="C3Result"):
        tracker.record(4, {"b": "agree"})  # type: ignore[dict-item]
    assert tracker.pending == ("b",) and tracker.last_clean("a") == 3
    tracker.reset()
    assert (
        tracker.record(1, {"a": agree("a", 1), "b": agree("b", 1)}) == 1
    )  # a rewind after reset is accepted
    for bad in ([], ["a", "a"], [""]):
        with pytest.raises(ValueError):
            RotationTracker(bad)


def oracle(history: list[tuple[int, dict[str, str]]], catalog: tuple[str, ...]) -> int | None:
    """The definition, brute force: the largest s with no SDC at any step >= s and, for every recipe, a clean pass
    at some step >= s."""
    steps = [step for step, _ in history]
    for s in range(max(steps), -1, -1):
        if any(step >= s and "sdc" in outcomes.values() for step, outcomes in history):
            return None  # every smaller s has the same SDC after it
        if all(
            any(step >= s and outcomes.get(name) == "clean" for step, outcomes in history)
            for name in catalog
        ):
            return s
    return None


@pytest.mark.parametrize("seed", range(40))
def test_tracker_matches_the_definition_on_random_histories(seed: int) -> None:
    rng = random.Random(seed)
    catalog = CATALOG[: rng.randint(1, len(CATALOG))]
    makers = {"clean": agree, "sdc": rng.choice([attributed, split]), "unchecked": unchecked}
    tracker, history, step = RotationTracker(catalog), [], 0
    for _ in range(rng.randint(1, 30)):
        step += rng.randint(1, 3)
        chosen = rng.sample(catalog, rng.randint(1, len(catalog)))
        outcomes = {
            n: rng.choices(["clean", "sdc", "unchecked"], weights=[20, 1, 2])[0] for n in chosen
        }
        history.append((step, outcomes))
        got = tracker.record(step, {n: makers[o](n, step) for n, o in outcomes.items()})
        assert got == oracle(history, catalog), history


# -- the catalog and its schedule ---------------------------------------------------------------------------------
class Wrapper(nn.Module):
    """Stands in for DDP: the real model sits at ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def three_block() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build_model("three-block", seed=0)
    return Wrapper(model), torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_catalog_finds_the_boundaries_through_a_wrapper() -> None:
    model, opt = three_block()
    catalog = build_catalog(model, opt, ScoutConfig())
    assert catalog.names == (
        "embedding",
        "hidden.0",
        "hidden.1",
        "hidden.2",
        "output",
        "optimizer.0",
        "optimizer.1",
        "optimizer.2",
    )
    assert catalog["embedding"].modules == ("embed",)
    assert catalog["hidden.2"].modules == ("blocks.2",)
    assert catalog["output"].modules == ("norm", "head")
    slices = [r for r in catalog.recipes if r.kind is RecipeKind.OPTIMIZER]
    params = dict(model.module.named_parameters())
    assert [n for r in slices for n in r.params] == list(
        params
    )  # every parameter exactly once, in order
    for r in slices:
        size = sum(params[n].numel() for n in r.params)
        assert size <= 1 << 16 or len(r.params) == 1


def test_due_schedule_visits_every_recipe_within_one_rotation() -> None:
    model, opt = three_block()
    catalog = build_catalog(model, opt, ScoutConfig(interval=2, recipe_intervals={"optimizer": 4}))
    assert catalog.due(3) == ()
    assert [r.name for r in catalog.due(2)] == ["embedding", "hidden.1", "output"]
    assert [r.name for r in catalog.due(4)] == ["embedding", "hidden.2", "output", "optimizer.1"]
    seen = {r.name for step in range(2, 2 + 2 * 3, 2) for r in catalog.due(step)}
    assert {n for n in catalog.names if n.startswith("hidden")} <= seen
    seen_slices = {
        r.name
        for step in range(4, 4 + 4 * 3, 4)
        for r in catalog.due(step)
        if r.name.startswith("opt")
    }
    assert seen_slices == {"optimizer.0", "optimizer.1", "optimizer.2"}
    whole = build_catalog(
        model, opt, ScoutConfig(hidden_per_cycle=None, optimizer_slices_per_cycle=None)
    )
    assert [r.name for r in whole.due(7)] == list(whole.names)
    two = build_catalog(model, opt, ScoutConfig(hidden_per_cycle=2))
    for step in range(1, 10):
        assert len({r.name for r in two.due(step) if r.kind is RecipeKind.HIDDEN}) == 2
    assert catalog.fingerprint() == build_catalog(*three_block(), ScoutConfig()).fingerprint()
    assert (
        catalog.fingerprint()
        != build_catalog(model, opt, ScoutConfig(optimizer_slice_numel=1000)).fingerprint()
    )


def test_rotating_kinds_replays_one_kind_per_due_step_and_still_visits_every_recipe() -> None:
    """``rotate_kinds``: the n-th due step replays one kind (embedding, hidden, output, optimizer in turn); each kind's
    own rotation advances once per turn, so within kinds x members due steps every recipe is replayed — and the
    tracker certifies only once every recipe passed clean."""
    model, opt = three_block()
    catalog = build_catalog(model, opt, ScoutConfig(interval=2, rotate_kinds=True))
    assert catalog.due(3) == ()
    kinds = [{r.kind.value for r in catalog.due(step)} for step in range(2, 2 + 2 * 8, 2)]
    assert (
        kinds == [{"hidden"}, {"output"}, {"optimizer"}, {"embedding"}] * 2
    )  # the n-th due step: kinds[n % 4]
    assert all(
        len(catalog.due(step)) == 1 for step in range(2, 40, 2)
    )  # one block / one slice per turn
    rounds = 4 * 3  # 4 kinds, 3 blocks and 3 optimizer slices
    seen = [r.name for step in range(2, 2 + 2 * rounds, 2) for r in catalog.due(step)]
    assert set(seen) == set(catalog.names)
    tracker = RotationTracker(catalog.names)
    certified = [
        tracker.record(step, {r.name: agree(r.name, step) for r in catalog.due(step)})
        for step in range(2, 2 + 2 * rounds, 2)
    ]
    # optimizer.2, the last recipe to come up, passes at step 22 (n = 11); hidden.0's pass at step 2 is the oldest
    assert certified[:10] == [None] * 10 and certified[10:] == [2, 2]
    with pytest.raises(ConfigError, match="rotate_kinds"):
        ScoutConfig(rotate_kinds=True, recipe_intervals={"optimizer": 4})
    with pytest.raises(ConfigError, match="rotate_kinds"):
        ScoutConfig(rotate_kinds=1)  # type: ignore[arg-type]


def test_catalog_errors_name_the_field_to_set() -> None:
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"ScoutConfig\.embedding: no nn\.Embedding"):
        build_catalog(mlp, opt, ScoutConfig())
    with pytest.raises(ConfigError, match=r"ScoutConfig\.blocks: no nn\.ModuleList"):
        build_catalog(mlp, opt, ScoutConfig(recipes=("hidden",)))
    with pytest.raises(
        ConfigError, match=r"ScoutConfig\.head: the model has no submodule 'lm_head'"
    ):
        build_catalog(mlp, opt, ScoutConfig(recipes=("output",), head="lm_head"))
    catalog = build_catalog(mlp, opt, ScoutConfig(recipes=("output", "optimizer")))
    assert catalog["output"].modules == ("2",)  # no norm outside blocks: the head alone
    with pytest.raises(ConfigError, match="needs the optimizer"):
        build_catalog(mlp, None, ScoutConfig(recipes=("optimizer",)))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"interval": 0}, "interval"),
        ({"recipe_intervals": {"decoder": 2}}, "recipe_intervals"),
        ({"recipe_intervals": {"hidden": 0}}, "recipe_intervals"),
        ({"recipes": ()}, "recipes"),
        ({"recipes": ("hidden", "hidden")}, "recipes"),
        ({"hidden_per_cycle": 0}, "hidden_per_cycle"),
        ({"optimizer_slice_numel": 0}, "optimizer_slice_numel"),
        ({"head": ""}, "head"),
        ({"timeout": timedelta(0)}, "timeout"),
        ({"stragglers": {}}, "stragglers"),
        ({"intervall": 2}, "intervall"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ScoutConfig(**kwargs)  # type: ignore[arg-type]


def test_config_canonical_order_and_overrides() -> None:
    config = ScoutConfig(
        recipes=("optimizer", "embedding"), interval=3, recipe_intervals={"optimizer": 6}
    )
    assert config.recipes == ("embedding", "optimizer")
    assert config.interval_of("embedding") == 3 and config.interval_of("optimizer") == 6


# -- wire format and injectors ------------------------------------------------------------------------------------
def test_wire_round_trip_keeps_every_dtype_shape_and_byte() -> None:
    tensors = {
        "f32": torch.randn(3, 5),
        "scalar": torch.tensor(7.5),
        "ids": torch.randint(0, 100, (2, 9)),
        "bf16": torch.randn(4).to(torch.bfloat16),
        "mask": torch.rand(6) > 0.5,
        "empty": torch.empty(0, 3),
        "noncontig": torch.randn(4, 6).t(),
        "f64": torch.randn(3, dtype=torch.float64),
    }
    meta = {"args": [{"value": {"tuple": [1, 2]}}], "training": True, "k": None}
    captures = {
        "x": Captured(step=9, tensors=tensors, meta=meta),
        "y": Captured(step=9, error="no capture"),
    }
    header, payload = pack(9, captures)
    back = unpack(header, payload, 9)
    assert back["y"].error == "no capture" and back["y"].tensors == {}
    assert back["x"].meta == meta
    for key, tensor in tensors.items():
        assert tensor_digest(back["x"].tensors[key]) == tensor_digest(tensor), key
    # The digest of what was received covers every input byte and the layout, but not the RNG state.
    digest = back["x"].received_digest
    assert digest is not None and digest.startswith("blake3:")
    flipped = payload.clone()
    flipped[0] ^= 1
    assert unpack(header, flipped, 9)["x"].received_digest != digest
    reshaped = header.replace(b'"f32", "torch.float32", [3, 5]', b'"f32", "torch.float32", [5, 3]')
    assert reshaped != header and unpack(reshaped, payload, 9)["x"].received_digest != digest
    with_rng = pack(
        9, {"x": Captured(step=9, tensors={**tensors, "rng.cpu": torch.get_rng_state()}, meta=meta)}
    )
    other_rng = pack(
        9,
        {
            "x": Captured(
                step=9,
                tensors={**tensors, "rng.cpu": torch.zeros(5056, dtype=torch.uint8)},
                meta=meta,
            )
        },
    )
    assert unpack(*with_rng, 9)["x"].received_digest == unpack(*other_rng, 9)["x"].received_digest
    with pytest.raises(ValueError, match="for step 9, expected version 1 for step 10"):
        unpack(header, payload, 10)
    with pytest.raises(ValueError, match="malformed"):
        unpack(header, payload[:8], 9)


@pytest.mark.parametrize("kind", [k for k in FAULT_KINDS if k != "stale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_numerical_fault_changes_the_digest_and_nothing_else(
    kind: str, dtype: torch.dtype
) -> None:
    if kind == "scale" and dtype == torch.bfloat16:
        pytest.skip(
            "1 + 1e-3 is below bfloat16's resolution (ulp 2**-8): the scaled values round back unchanged"
        )
    original = torch.randn(4, 8).to(dtype)
    kept = original.clone()
    corrupted = corrupt(original, kind)
    assert torch.equal(original, kept)  # the input is never modified
    assert corrupted.shape == original.shape and corrupted.dtype == original.dtype
    assert tensor_digest(corrupted) != tensor_digest(original)
    if kind == "permute":
        assert torch.equal(corrupted.reshape(-1).sort().values, original.reshape(-1).sort().values)
    if kind in ("bitflip", "signflip", "zero"):
        assert int((corrupted != original).sum()) == 1  # exactly one element touched
    with pytest.raises(ValueError, match="stale"):
        corrupt(original, "stale")


def test_scout_cadence_defaults_to_a_multiple_of_the_capture_interval_of_at_least_ten_steps() -> (
    None
):
    from gemscout.api import _scout_cadence

    assert [_scout_cadence(None, k) for k in (1, 3, 10, 25)] == [10, 12, 10, 25]
    assert _scout_cadence(20, 10) == 20 and _scout_cadence(1, 1) == 1
    with pytest.raises(
        ConfigError, match=r"ScoutConfig.interval=7 is not a multiple of .*interval=2.* such as 6"
    ):
        _scout_cadence(7, 2)
    with pytest.raises(ConfigError, match="ScoutConfig.interval"):
        ScoutConfig(interval=0)
    assert (
        ScoutConfig().interval is None and ScoutConfig().cadence == 1
    )  # a Scout without a session: every step
