"""The benchmark rank programs' specs (:mod:`qualification.programs.specs.bench`): each round-trips through a spec
file, and the flags the launchers used to pass parse to the same spec as the file the launchers now write."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from qualification.programs.specs import parse, schema, spec_argv
from qualification.programs.specs.bench import (
    GEMINI_ROLES,
    GOODPUT_ARMS,
    GeminiBenchSpec,
    GoodputSpec,
    GoodputTorchftSpec,
)

pytestmark = pytest.mark.timeout(30)


def _roundtrip(spec: object, path: Path) -> object:
    return parse(type(spec), spec_argv(spec, path))


@pytest.mark.parametrize(
    "spec",
    [
        GoodputSpec(arm="none", work=Path("/w"), events=Path("/w/events.jsonl"), steps=4),
        GoodputTorchftSpec(work=Path("/w"), events=Path("/w/events-0.jsonl"), steps=4),
        GeminiBenchSpec(role="off", out=Path("/o"), state_mib=4.0, ckpt=Path("/c")),
        GeminiBenchSpec(
            role="on", out=Path("/o"), state_mib=4.0, ckpt=Path("/c"), dcp=Path("/d"), no_fsync=True
        ),
    ],
    ids=["goodput", "goodput-torchft", "gemini-off", "gemini-on"],
)
def test_a_spec_round_trips_through_its_file(spec: object, tmp_path: Path) -> None:
    assert _roundtrip(spec, tmp_path / "spec.json") == spec


def test_each_schema_requires_what_argparse_required() -> None:
    assert sorted(schema(GoodputSpec)["required"]) == ["arm", "events", "steps", "work"]
    assert sorted(schema(GoodputTorchftSpec)["required"]) == ["events", "steps", "work"]
    assert sorted(schema(GeminiBenchSpec)["required"]) == ["ckpt", "out", "role", "state_mib"]


def test_the_constants_are_the_programs() -> None:
    assert GOODPUT_ARMS == ("none", "gemscout", "gemscout-skip", "dcp", "calibrate")
    assert GEMINI_ROLES == ("off", "on")
    assert schema(GoodputSpec)["properties"]["arm"]["enum"] == list(GOODPUT_ARMS)


def test_goodput_old_flags_parse_to_the_launchers_spec(tmp_path: Path) -> None:
    from qualification.bench import goodput

    work = tmp_path / "dcp"
    # The pre-change launcher's argv (qualification/bench/goodput.py, torchrun()), after "-m goodput_rank".
    old = ["--arm", "dcp", "--work", str(work), "--events", str(work / "events.jsonl")]
    old += ["--steps", "60", "--fail-steps", "15,30,45", "--dcp-every", "3"]
    old += ["--state-mib", "32.0", "--batch", "64"]
    args = goodput.parse(["--steps", "60", "--fail-every", "15"])
    written = GoodputSpec(
        arm="dcp",
        work=work,
        events=work / "events.jsonl",
        steps=args.steps,
        fail_steps=",".join(map(str, args.fail_steps)),
        dcp_every=3,
        state_mib=args.state_mib,
        batch=args.batch,
    )
    argv = spec_argv(written, work / "spec-dcp.json")
    assert parse(GoodputSpec, old) == parse(GoodputSpec, argv) == written


def test_goodput_torchft_old_flags_parse_to_the_launchers_spec(tmp_path: Path) -> None:
    work = tmp_path / "torchft"
    old = ["--work", str(work), "--events", str(work / "events-1.jsonl"), "--steps", "60"]
    old += ["--fail-steps", "15,30,45", "--state-mib", "32.0", "--batch", "64"]
    written = GoodputTorchftSpec(
        work=work,
        events=work / "events-1.jsonl",
        steps=60,
        fail_steps="15,30,45",
        state_mib=32.0,
        batch=64,
    )
    argv = spec_argv(written, work / "spec-replica1.json")
    assert parse(GoodputTorchftSpec, old) == parse(GoodputTorchftSpec, argv) == written
    assert written.timeout_s == 30.0  # the launcher never passed --timeout-s


def _gemini_args() -> argparse.Namespace:
    from qualification.bench import gemini

    return gemini.parse(["--quick"])


def test_gemini_old_flags_parse_to_the_launchers_specs(tmp_path: Path, monkeypatch) -> None:
    """Both roles of :func:`qualification.bench.gemini.run_size`, with the launch itself stubbed out."""
    from qualification.bench import gemini

    args = _gemini_args()
    raw, scratch = tmp_path / "raw", tmp_path / "scratch"
    out = raw / "4mib"
    timeout_s = 240 + 1.5 * 4.0 * max(1.0, args.steps / 8)
    # The pre-change launcher's argv (qualification/bench/gemini.py, run_size()), after "-m gemini_rank".
    common = [
        "--out",
        str(out),
        "--state-mib",
        "4.0",
        "--steps",
        "2",
        "--batch",
        "16",
        "--reps",
        "1",
    ]
    common += ["--chunk-bytes", str(16 * 1024 * 1024), "--ckpt", str(scratch / "4mib" / "gemini")]
    common += ["--overlap-factor", "2.5", "--persist-every", "2"]
    old = {
        "on": [*common, "--role", "on", "--dcp", str(scratch / "4mib" / "dcp")]
        + ["--quiet-captures", "2", "--timeout-s", str(timeout_s)],
        "off": [*common, "--role", "off", "--overlap-micro", "3"],
    }
    launched: dict[str, list[str]] = {}

    class Done:
        ok = True

    def fake_launch(argv: list[str], **_kw: object) -> Done:
        role = "on" if not launched else "off"
        launched[role] = list(argv)
        out.mkdir(parents=True, exist_ok=True)
        if role == "on":
            for r in range(gemini.WORLD):
                doc = {"loops": {"overlap_on": {"micro_batches": 3}}}
                (out / f"on.rank{r}.json").write_text(json.dumps(doc))
        else:
            for r in range(gemini.WORLD):
                (out / f"off.rank{r}.json").write_text("{}")
        return Done()

    monkeypatch.setattr(gemini, "launch", fake_launch)
    monkeypatch.setattr(gemini._report, "summarize", lambda *a, **k: {})
    gemini.run_size(args, 4.0, raw, scratch)
    for role in ("on", "off"):
        argv = launched[role]
        assert argv[:2] == ["-m", "qualification.bench.gemini_rank"]
        assert argv[2:] == ["--spec", str(out / f"spec-{role}.json")]
        assert parse(GeminiBenchSpec, argv[2:]) == parse(GeminiBenchSpec, old[role])
