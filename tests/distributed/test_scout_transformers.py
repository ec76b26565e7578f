"""SCOUT on Hugging Face transformers models, as a user brings them: Llama, GPT-2 (tied head, dropout) and Qwen2
built from tiny configs, plain DDP, enable_resiliency with GEMINI and SCOUT, 4 real gloo ranks; Llama once more under
FSDP2 wrapped as its tutorial does (``fully_shard`` per decoder layer, then the root, no mesh given: an unnamed 1-D
mesh, which SCOUT's topology discovery refused before).

Every decoder layer is called with ``position_embeddings`` (a tuple of tensors), ``position_ids``,
``attention_mask=None``, ``use_cache`` and a live ``DynamicCache``; before the capture handled those, every ``hidden.*``
recipe was INCONCLUSIVE ("did not return") and nothing was ever certified. One launch runs all nine (family, case)
pairs (qualification/programs/hf_rank.py): process start plus importing torch and transformers is most of the cost.
"""

from __future__ import annotations

import json

import pytest

from qualification.launch import launch

pytest.importorskip("transformers")

WORLD, FAULT_RANK, FAULT_STEP, FAULT_BLOCK, INTERVAL, STEPS = 4, 2, 3, 0, 2, 4
FAMILIES = ("llama", "gpt2", "qwen2", "llama+fsdp2")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("hf")
    argv = [
        "-m",
        "qualification.programs.hf_rank",
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--interval",
        str(INTERVAL),
        "--fault-rank",
        str(FAULT_RANK),
        "--fault-step",
        str(FAULT_STEP),
        "--fault-block",
        str(FAULT_BLOCK),
        "--unreplayable",
        "llama",
        *[arg for family in FAMILIES if "+" not in family for arg in ("--family", family)],
        "--fsdp2",
        "llama",
    ]
    res = launch(argv, world_size=WORLD, timeout_s=280, log_dir=out / "logs")
    assert res.ok, res
    docs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, doc in enumerate(docs):
        doc["log"] = "".join(p.read_text() for p in sorted((out / "logs").glob(f"rank{r}.*")))
    return docs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_healthy_runs_certify_every_cycle(ranks: list[dict], family: str) -> None:
    for r, doc in enumerate(ranks):
        case = doc[family]["healthy"]
        assert sorted(int(s) for s in case["cycles"]) == list(range(INTERVAL, STEPS + 1, INTERVAL))
        for step, cycle in case["cycles"].items():
            bad = {n: v["reason"] for n, v in cycle["verdicts"].items() if v["verdict"] != "agree"}
            assert not bad, f"rank {r} step {step}: {bad}"
            assert cycle["certified"] == int(step), (
                r,
                step,
                cycle["certified"],
            )  # advances at every cycle
        assert {n.split(".")[0] for n in cycle["verdicts"]} == {
            "embedding",
            "hidden",
            "output",
            "optimizer",
        }
        assert case["reports"] == []
        assert case["metrics"]["scout.certified_step"] == STEPS
        assert case["metrics"]["scout.unreplayable_recipes"] == 0
        assert all(st == "recovery_verified" for st in case["trust"].values()), case["trust"]
    assert ranks[0][family]["healthy"]["tied"] is (
        family.split("+")[0] != "llama"
    )  # GPT-2, Qwen2 tie the head


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_persistent_decoder_layer_fault_is_attributed_within_one_rotation(
    ranks: list[dict], family: str
) -> None:
    blocks = sum(1 for n in ranks[0][family]["persistent"]["catalog"] if n.startswith("hidden."))
    rotation_end = FAULT_STEP + INTERVAL * blocks  # every block is due once within this many steps
    for doc in ranks:
        case = doc[family]["persistent"]
        sdc = [rep for rep in case["reports"] if rep["kind"] == "sdc"]
        assert sdc, case["cycles"]
        first = sdc[0]
        assert first["ranks"] == [FAULT_RANK] and first["scope"] == "rank", first
        assert (
            first["recipe"] == f"hidden.{FAULT_BLOCK}"
            and FAULT_STEP <= first["step"] <= rotation_end
        ), first
        _rejected_job_wide(case, first["step"])
        for step, cycle in case[
            "cycles"
        ].items():  # nothing false before the fault, no other rank ever named
            for name, v in cycle["verdicts"].items():
                assert v["verdict"] != "inconclusive", (step, name, v["reason"])
                assert v["ranks"] in ([], [FAULT_RANK]), (step, name, v)
    assert len({json.dumps(d[family]["persistent"]["trust"], sort_keys=True) for d in ranks}) == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_replay_only_fault_is_attributed_and_rejected(ranks: list[dict], family: str) -> None:
    for doc in ranks:
        case = doc[family]["replay"]
        step = case["replay_fault_step"]
        sdc = [rep for rep in case["reports"] if rep["kind"] == "sdc"]
        assert [(rep["step"], rep["ranks"], rep["recipe"]) for rep in sdc] == [
            (step, [FAULT_RANK], "hidden.0")
        ], sdc
        _rejected_job_wide(case, step)
    assert ranks[FAULT_RANK][family]["replay"]["fired"], "the replay fault never fired"
    assert len({json.dumps(d[family]["replay"]["trust"], sort_keys=True) for d in ranks}) == 1


def _rejected_job_wide(case: dict, detected: int) -> None:
    trust = {int(s): st for s, st in case["trust"].items()}
    decision = next(d for d in case["decisions"] if d["failure_kind"] == "sdc")
    assert decision["mode"] == "restore" and decision["step"] < detected, decision
    assert trust[decision["step"]] == "recovery_verified"
    uncertified = [s for s in trust if decision["step"] < s < detected]
    assert uncertified and all(trust[s] == "rejected" for s in uncertified), trust
    assert detected not in trust, "the contaminated step was captured"


@pytest.mark.timeout(300)
def test_an_input_scout_cannot_replay_is_reported_once_with_its_reason_and_counted(
    ranks: list[dict],
) -> None:
    """Training on top of a prefix's DynamicCache: every decoder layer's cache already holds past positions. SCOUT
    must name that reason (not "did not return"), keep those recipes INCONCLUSIVE (nothing certified), still check
    the rest, log it once per recipe, and count it in session.metrics()."""
    for r, doc in enumerate(ranks):
        case = doc["llama"]["unreplayable"]
        for step, cycle in case["cycles"].items():
            for name, v in cycle["verdicts"].items():
                if name.startswith("hidden."):
                    assert v["verdict"] == "inconclusive", (r, step, name, v)
                    assert v["reason"].startswith(
                        f"SCOUT cannot replay '{name}': recipe input kwarg.cache is a DynamicCache whose layer"
                    ), v["reason"]
                    assert (
                        "already holds 4 past positions" in v["reason"]
                        and "did not return" not in v["reason"]
                    )
                else:
                    assert v["verdict"] == "agree", (r, step, name, v)
            assert cycle["certified"] is None
        assert case["metrics"]["scout.unreplayable_recipes"] == 2
        assert case["reports"] == []
    log = ranks[0]["log"]
    for name in ("hidden.0", "hidden.1"):  # two cycles ran; the lowest peer says it once
        assert log.count(f"gemscout: SCOUT cannot replay '{name}'") == 1, log[-3000:]
    assert "SCOUT cannot replay" not in ranks[1]["log"]
