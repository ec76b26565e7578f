"""Campaign files: every shipped campaign validates; each kind of malformed file is refused naming its key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qualification import campaign
from qualification.errors import EXIT_USAGE, CampaignError, UsageError

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]

VALID = """\
name = "t"
tier = "cpu"
description = "a small campaign"

[boundaries]
validated = ["the engine"]
not_validated = ["the runtime"]

[defaults]
program = "selftest"
workload = "none"
topology = "local"
fault = { kind = "none" }
seed = 0
timeout_s = 5
params = { mode = "pass", steps = 6 }
expect = { answer = 42 }

[[matrix]]
world_size = 1

[[matrix]]
label = "grid"
world_size = [2, 4]
seed = [0, 1]
fault = [{ kind = "none" }, { kind = "sigkill", rank = 1, step = 4 }]
params = { mode = "dist-pass" }
expect = { bitwise_equal = true }
"""


def write(tmp_path: Path, text: str, name: str = "t.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_a_claim_is_backed_by_the_cells_it_names_or_by_every_cell(tmp_path: Path) -> None:
    text = VALID.replace(
        'validated = ["the engine"]',
        'validated = ["the engine", { claim = "grids", cells = ["t/selftest-grid-*"] }]',
    )
    loaded = campaign.load(write(tmp_path, text))
    ids = [c.id for c in loaded.cells]
    plain, grids = loaded.claims
    assert loaded.validated == ("the engine", "grids")
    assert plain.backing(ids) == ids
    assert grids.backing(ids) == [i for i in ids if "-grid-" in i] and len(grids.backing(ids)) == 8


@pytest.mark.parametrize("path", sorted((REPO / "campaigns").glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_campaign_validates(path: Path) -> None:
    loaded = campaign.load(path)
    assert loaded.name == path.stem, (
        "campaigns are looked up by name, so the file must be called NAME.toml"
    )
    assert loaded.cells, "a campaign without cells qualifies nothing"
    assert len({c.id for c in loaded.cells}) == len(loaded.cells)
    assert len({c.safe_id for c in loaded.cells}) == len(loaded.cells)
    assert loaded.validated and loaded.not_validated, (
        "boundaries must say what is and is not validated"
    )
    for cell in loaded.cells:
        assert cell.id.startswith(f"{loaded.name}/")
        assert "/" not in cell.safe_id


# A claim backed by a framework's cells must name that framework: a loose glob (once "*pp3*", which also matched a
# TorchTitan and a Megatron cell through a recipe name "pp3.hidden.0") would otherwise let a skipped TorchTitan cell
# invalidate the torch pipelining claim, or a Megatron cell back it.
FRAMEWORK_MARKERS = {"/titan_cell-": "TorchTitan", "megatron": "Megatron", "deepspeed": "DeepSpeed"}
"""A substring of a cell id (its program, label or topology) -> the framework that cell runs."""


@pytest.mark.parametrize("path", sorted((REPO / "campaigns").glob("*.toml")), ids=lambda p: p.stem)
def test_a_framework_cell_backs_only_claims_that_name_its_framework(path: Path) -> None:
    loaded = campaign.load(path)
    ids = [c.id for c in loaded.cells]
    for claim in loaded.claims:
        if not claim.cells:
            continue  # backed by every cell of the campaign
        for cell_id in claim.backing(ids):
            for marker, framework in FRAMEWORK_MARKERS.items():
                if marker in cell_id:
                    assert framework in claim.text, (
                        f"{cell_id} backs a claim that does not name {framework}: {claim.text[:80]}"
                    )


def test_shipped_campaigns_exist() -> None:
    assert {"quickstart", "selftest", "cpu-matrix"} <= {
        p.stem for p in (REPO / "campaigns").glob("*.toml")
    }


def test_quickstart_cell_is_the_documented_one() -> None:
    (cell,) = campaign.load("quickstart").cells
    assert (
        cell.id
        == "quickstart/lifecycle-ddp-w3-sigkill-node_losstrue-phaseafter_step-rank1-step4-s0"
    )
    assert (cell.program, cell.workload, cell.topology, cell.world_size) == (
        "lifecycle",
        "tiny-causal-lm",
        "ddp",
        3,
    )
    assert cell.fault == {
        "kind": "sigkill",
        "rank": 1,
        "step": 4,
        "phase": "after-step",
        "node_loss": True,
    }
    assert cell.params == {"steps": 6, "interval": 1}
    # Recovery, not a fresh start: the decision, its step, every rank's source and the resume step are checked too.
    assert cell.expect == {
        "recovered_step": 4,
        "source": "peer",
        "recovery_mode": "restore",
        "rank_sources": ["memory", "peer:2", "memory"],
        "resume_step": {"eq": "observed.recovered_step"},
        "bitwise_equal": True,
        "losses_equal": True,
        "final_step": 6,
    }
    assert cell.timeout_s == 120


@pytest.mark.parametrize("name", ["campaign.schema.json", "cell-result.schema.json"])
def test_schemas_have_one_copy_the_package_data(name: str) -> None:
    assert not (REPO / "schemas").exists()
    assert campaign.load_schema(name) == json.loads(
        (REPO / "qualification" / "schemas" / name).read_text()
    )


def test_matrix_expands_to_the_cartesian_product_in_order(tmp_path: Path) -> None:
    loaded = campaign.load(write(tmp_path, VALID))
    ids = [c.id for c in loaded.cells]
    assert ids[0] == "t/selftest-local-w1-none-s0"
    grid = ids[1:]
    assert len(grid) == 2 * 2 * 2  # world_size x fault x seed
    assert grid[:4] == [
        "t/selftest-grid-local-w2-none-s0",
        "t/selftest-grid-local-w2-none-s1",
        "t/selftest-grid-local-w2-sigkill-rank1-step4-s0",
        "t/selftest-grid-local-w2-sigkill-rank1-step4-s1",
    ]


def test_ids_are_deterministic(tmp_path: Path) -> None:
    first = [c.id for c in campaign.load(write(tmp_path, VALID, "a.toml")).cells]
    second = [c.id for c in campaign.load(write(tmp_path, VALID, "b.toml")).cells]
    assert first == second


def test_defaults_merge_tables_key_by_key_and_fault_is_replaced(tmp_path: Path) -> None:
    cells = campaign.load(write(tmp_path, VALID)).cells
    plain, grid_kill = cells[0], cells[3]
    assert plain.params == {"mode": "pass", "steps": 6}
    assert plain.expect == {"answer": 42}
    assert grid_kill.params == {"mode": "dist-pass", "steps": 6}
    assert grid_kill.expect == {"answer": 42, "bitwise_equal": True}
    assert grid_kill.fault == {"kind": "sigkill", "rank": 1, "step": 4}
    assert grid_kill.world_size == 2 and grid_kill.seed == 0 and grid_kill.timeout_s == 5.0


def test_cell_json_carries_the_contract_fields(tmp_path: Path) -> None:
    record = campaign.load(write(tmp_path, VALID)).cells[0].to_json()
    assert set(record) == {
        "id",
        "program",
        "workload",
        "topology",
        "world_size",
        "fault",
        "seed",
        "timeout_s",
        "params",
        "expect",
        "requires",
    }
    assert record["requires"] == []


def test_fault_slug_distinguishes_faults_of_one_kind() -> None:
    assert campaign.fault_slug({"kind": "sigkill", "step": 4, "rank": 1}) == "sigkill-rank1-step4"
    assert campaign.fault_slug({"kind": "bitflip", "rank": 2, "bit": 30}) == "bitflip-bit30-rank2"
    table = campaign.fault_slug({"kind": "delay", "where": {"phase": "fwd"}})
    assert re.fullmatch(r"delay-where[0-9a-f]{6}", table)


# Each malformed campaign: (what to change, the key the message must name).
MALFORMED = {
    "unknown top-level key": (lambda t: "extra = 1\n" + t, "'extra': unknown key"),
    "unknown matrix key": (
        lambda t: t.replace('label = "grid"', 'label = "grid"\nwrld_size = 2'),
        "'matrix[1].wrld_size': unknown key (did you mean 'world_size'?)",
    ),
    "unknown boundaries key": (
        lambda t: t.replace('not_validated = ["the runtime"]', "not_validated = []\nvalidatd = []"),
        "'boundaries.validatd'",
    ),
    "unknown defaults key": (
        lambda t: t.replace("seed = 0\n", "seed = 0\nsed = 1\n", 1),
        "'defaults.sed'",
    ),
    "wrong type": (
        lambda t: t.replace("world_size = 1\n", 'world_size = "one"\n'),
        "'matrix[0].world_size': must be integer or a list of them",
    ),
    "wrong type in axis": (
        lambda t: t.replace("world_size = [2, 4]", 'world_size = [2, "4"]'),
        "'matrix[1].world_size[1]': must be integer",
    ),
    "missing required key": (
        lambda t: t.replace('tier = "cpu"\n', ""),
        "'tier': missing required key",
    ),
    "bad enum": (
        lambda t: t.replace('tier = "cpu"', 'tier = "tpu"'),
        "'tier': must be one of 'cpu', 'gpu'",
    ),
    "missing cell field": (lambda t: t.replace("seed = 0\n", "", 1), "matrix[0] has no 'seed'"),
    "fault without kind": (
        lambda t: t.replace('fault = { kind = "none" }\n', "fault = { rank = 1 }\n", 1),
        "'defaults.fault.kind': missing required key",
    ),
    "bad expectation operator": (
        lambda t: t.replace("expect = { answer = 42 }", "expect = { answer = { lt = 3 } }"),
        "'defaults.expect.answer.lt': unknown key",
    ),
    "zero world size": (
        lambda t: t.replace("world_size = 1\n", "world_size = 0\n"),
        "'matrix[0].world_size'",
    ),
    "non-positive timeout": (
        lambda t: t.replace("timeout_s = 5", "timeout_s = 0"),
        "'defaults.timeout_s'",
    ),
    "requires not a list": (
        lambda t: t.replace("world_size = 1\n", 'world_size = 1\nrequires = "gpu"\n'),
        "'matrix[0].requires': must be array",
    ),
    "empty matrix": (lambda t: "matrix = []\n" + t.split("[defaults]")[0], "'matrix'"),
    "duplicate cell id": (
        lambda t: t + "\n[[matrix]]\nworld_size = 1\n",
        "give the entries distinct 'label's",
    ),
    "claim backed by no cell": (
        lambda t: t.replace(
            'validated = ["the engine"]', 'validated = [{ claim = "x", cells = ["no-such-*"] }]'
        ),
        "boundaries.validated[0] names cells 'no-such-*', which match none of the 9 cells",
    ),
    "claim without cells": (
        lambda t: t.replace('validated = ["the engine"]', 'validated = [{ claim = "x" }]'),
        "'boundaries.validated[0].cells': missing required key",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_campaign_names_the_file_and_key(tmp_path: Path, case: str) -> None:
    change, expected = MALFORMED[case]
    path = write(tmp_path, change(VALID))
    with pytest.raises(CampaignError) as caught:
        campaign.load(path)
    message = str(caught.value)
    assert caught.value.exit_code == EXIT_USAGE
    assert message.startswith(str(campaign.resolve(str(path)))), message
    assert expected in message, message
    assert "\n" not in message


def test_bad_toml_reports_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace('tier = "cpu"', "tier = cpu"))
    with pytest.raises(CampaignError, match=r"invalid TOML: .*line 2"):
        campaign.load(path)


def test_schema_errors_point_at_the_line_of_the_key(tmp_path: Path) -> None:
    text = VALID.replace('label = "grid"', 'label = "grid"\nwrld_size = 2')
    line = text.splitlines().index("wrld_size = 2") + 1
    with pytest.raises(CampaignError, match=rf"t\.toml:{line}: 'matrix\[1\]\.wrld_size'"):
        campaign.load(write(tmp_path, text))


def test_campaign_by_name_and_unknown_names(tmp_path: Path) -> None:
    assert campaign.load("quickstart").path.name == "quickstart.toml"
    with pytest.raises(UsageError, match="no campaign named 'nope'"):
        campaign.load("nope")
    with pytest.raises(UsageError, match="does not exist"):
        campaign.load(str(tmp_path / "missing.toml"))


def test_filter_by_substring_glob_and_alternatives(tmp_path: Path) -> None:
    cells = campaign.load(write(tmp_path, VALID)).cells
    assert len(campaign.select(cells, "sigkill")) == 4
    assert len(campaign.select(cells, "t/selftest-grid-*-s1")) == 4
    assert (
        len(campaign.select(cells, "selftest-grid-*-s1")) == 4
    )  # the campaign prefix may be left out
    assert len(campaign.select(cells, "w1,w4-none")) == 3
    assert campaign.select(cells, None) == list(cells)
    with pytest.raises(UsageError, match="matches none"):
        campaign.select(cells, "nothing-like-this")


def test_seed_override_replaces_seeds_and_merges_duplicates(tmp_path: Path) -> None:
    cells = campaign.load(write(tmp_path, VALID)).cells
    overridden = campaign.override_seed(cells, 7)
    assert len(overridden) == 1 + 2 * 2  # the seed axis collapses
    assert all(c.seed == 7 and c.id.endswith("-s7") for c in overridden)
    with pytest.raises(UsageError):
        campaign.override_seed(cells, -1)
