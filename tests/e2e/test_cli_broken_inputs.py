"""`qualify` and `validation-evidence` over a corpus of broken inputs: each one a one-line error with its documented
exit code (docs/qualification.md, docs/evidence.md), never a traceback.

The commands run in-process (each CLI's ``main``) so the corpus stays cheap; one case of each
also runs as a real subprocess, the way a user meets it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from qualification.cli import main as qualify_main
from qualification.evidence.cli import main as evidence_main

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
DEEP = 5000


def deep_json() -> str:
    return "[" * DEEP + "]" * DEEP


def deep_toml() -> str:
    return (
        'name = "deep"\ntier = "cpu"\ndescription = "d"\n'
        "boundaries = { validated = [], not_validated = [] }\nmatrix = "
        + "[" * DEEP
        + "]" * DEEP
        + "\n"
    )


def _bundle_with(tmp: Path, files: dict[str, str | bytes]) -> Path:
    bundle = tmp / "bundle"
    bundle.mkdir()
    for name, data in files.items():
        target = bundle / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data if isinstance(data, bytes) else data.encode())
    return bundle


# (name, build the argv in tmp_path, expected exit code)
QUALIFY: dict[str, tuple[Callable[[Path], list[str]], int]] = {
    "run a deeply nested TOML": (
        lambda t: ["run", str(_write(t / "deep.toml", deep_toml())), "--out", str(t / "o")],
        2,
    ),
    "run a file that is not UTF-8": (
        lambda t: ["run", str(_write(t / "bin.toml", b"\xff\xfe")), "--out", str(t / "o")],
        2,
    ),
    "run invalid TOML": (
        lambda t: ["run", str(_write(t / "bad.toml", "name = [")), "--out", str(t / "o")],
        2,
    ),
    "run an unknown campaign": (lambda t: ["run", "no-such-campaign", "--out", str(t / "o")], 2),
    "seal a non-JSON summary.json": (
        lambda t: ["seal", str(_dir(t / "run", {"summary.json": "not json"}))],
        2,
    ),
    "seal a deeply nested summary.json": (
        lambda t: ["seal", str(_dir(t / "run", {"summary.json": deep_json()}))],
        2,
    ),
    "seal a summary.json of the wrong shape": (
        lambda t: ["seal", str(_dir(t / "run", {"summary.json": "[1]"}))],
        2,
    ),
    "seal an empty summary object": (
        lambda t: ["seal", str(_dir(t / "run", {"summary.json": "{}"}))],
        2,
    ),
    "seal a directory without a summary": (lambda t: ["seal", str(_dir(t / "run", {}))], 2),
    "report a non-JSON summary.json": (
        lambda t: [
            "report",
            str(_dir(t / "run", {"summary.json": "{"})),
            "--out",
            str(t / "r.html"),
        ],
        2,
    ),
    "report a deeply nested summary.json": (
        lambda t: [
            "report",
            str(_dir(t / "run", {"summary.json": deep_json()})),
            "--out",
            str(t / "r.html"),
        ],
        2,
    ),
    "verify a bundle that does not exist": (
        lambda t: ["verify", str(t / "absent"), "--expected-commit", "a" * 40],
        2,
    ),
    "verify with a short SHA": (
        lambda t: [
            "verify",
            str(_dir(t / "b", {"manifest.json": "{}"})),
            "--expected-commit",
            "abc",
        ],
        2,
    ),
    "verify a deeply nested manifest": (
        lambda t: [
            "verify",
            str(_dir(t / "b", {"manifest.json": deep_json()})),
            "--expected-commit",
            "a" * 40,
        ],
        1,
    ),
}

EVIDENCE: dict[str, tuple[Callable[[Path], list[str]], int]] = {
    "verify a deeply nested manifest.json": (
        lambda t: [
            "verify",
            str(_dir(t / "b", {"manifest.json": deep_json()})),
            "--expected-commit",
            "a" * 40,
        ],
        1,
    ),
    "verify a non-JSON manifest.json": (
        lambda t: [
            "verify",
            str(_dir(t / "b", {"manifest.json": "nope"})),
            "--expected-commit",
            "a" * 40,
        ],
        1,
    ),
    "verify a deeply nested manifest.dsse.json": (lambda t: _dsse_case(t), 5),
    "verify a file that is no archive": (
        lambda t: ["verify", str(_write(t / "x.txt", "x")), "--expected-commit", "a" * 40],
        2,
    ),
    "verify a broken .tar.gz": (
        lambda t: [
            "verify",
            str(_write(t / "x.tar.gz", b"\x1f\x8b garbage")),
            "--expected-commit",
            "a" * 40,
        ],
        1,
    ),
    "seal with non-JSON facts": (
        lambda t: [
            "seal",
            str(_dir(t / "p", {"a.log": "x"})),
            "--facts",
            str(_write(t / "f.json", "{")),
        ],
        2,
    ),
    "seal with deeply nested facts": (
        lambda t: [
            "seal",
            str(_dir(t / "p", {"a.log": "x"})),
            "--facts",
            str(_write(t / "f.json", deep_json())),
        ],
        2,
    ),
    "seal with facts of the wrong shape": (
        lambda t: [
            "seal",
            str(_dir(t / "p", {"a.log": "x"})),
            "--facts",
            str(_write(t / "f.json", "[]")),
        ],
        2,
    ),
    "an unknown subcommand": (lambda t: ["frobnicate"], 2),
}


def _write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _dir(path: Path, files: dict[str, str]) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _dsse_case(tmp: Path) -> list[str]:
    from qualification.evidence.sign import generate_key

    _, public = generate_key(tmp / "k.pem")
    bundle = _dir(
        tmp / "b",
        {"manifest.json": json.dumps({"predicate": {}}), "manifest.dsse.json": deep_json()},
    )
    return ["verify", str(bundle), "--expected-commit", "a" * 40, "--public-key", str(public)]


def _no_traceback(output: str) -> None:
    assert "Traceback" not in output, output
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert len(lines) <= 2, output  # the error line (and, for --json, its JSON object)


@pytest.mark.parametrize("case", sorted(QUALIFY))
def test_qualify_says_one_line_with_its_exit_code(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build, code = QUALIFY[case]
    try:
        exit_code = qualify_main(build(tmp_path))
    except Exception as exc:  # the CLI's handler let it through: a traceback for the user
        pytest.fail("".join(traceback.format_exception(exc)))
    captured = capsys.readouterr()
    output = captured.out + captured.err
    _no_traceback(output)
    assert exit_code == code, output
    assert not (tmp_path / "o").exists(), "nothing runs on bad input"


@pytest.mark.parametrize("case", sorted(EVIDENCE))
def test_validation_evidence_says_one_line_with_its_exit_code(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build, code = EVIDENCE[case]
    assert evidence_main(build(tmp_path)) == code
    captured = capsys.readouterr()
    _no_traceback(captured.err)
    assert captured.err.startswith("validation-evidence: error: "), captured.err


@pytest.mark.skipif(
    importlib.util.find_spec("sigstore") is not None, reason="the sigstore extra is installed here"
)
def test_sign_sigstore_without_the_extra_fails_before_any_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "never"
    code = qualify_main(["run", "selftest", "--sign", "sigstore", "--out", str(out)])
    output = "".join(capsys.readouterr())
    assert code == 2 and "pip install 'gemscout[sigstore]'" in output, output
    _no_traceback(output)
    assert not out.exists(), "no cell may run before the signer is known to work"


def test_the_real_entry_points_agree(tmp_path: Path) -> None:
    deep = _write(tmp_path / "deep.toml", deep_toml())
    proc = subprocess.run(
        [sys.executable, "-m", "qualification", "run", str(deep), "--out", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        proc.returncode == 2
        and "nested too deeply" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    bundle = _dir(tmp_path / "b", {"manifest.json": deep_json()})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qualification.evidence.cli",
            "verify",
            str(bundle),
            "--expected-commit",
            "a" * 40,
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        proc.returncode == 1
        and json.loads(proc.stdout)["status"] == "INVALID"
        and "Traceback" not in proc.stderr
    )
