#!/usr/bin/env python3
"""Write docs/validation.md from verified qualification evidence bundles, and from nothing else.

Every bundle is verified first (``qualification.evidence.verify_bundle``: intake, signature, schema, digests,
consistency, commit); an invalid one stops the script with one line on stderr and the verifier's exit code, and no
page is written. The page then says exactly what the evidence supports:

* a bundle made from ``--expected-commit`` (default: HEAD of ``--repo``) is *current* only when the verifier finds
  that commit at the head of main and the run PASSED with at least one cell run;
* a bundle from any other commit is listed under "Historical evidence" with its commit named (it is verified against
  its own commit: the bytes are intact, but they describe that commit, not this one);
* a dirty tree, a commit that is not on main, unknown freshness, a FAILED run, or a run whose every cell was skipped
  is said in so many words at the top of the page, never presented as a pass.

Usage::

    python scripts/render_validation_doc.py --update-blocks README.md docs/*.md
    python scripts/render_validation_doc.py BUNDLE [BUNDLE ...] [--expected-commit SHA] [--out docs/validation.md]
        [--repo .] [--main-ref main] [--public-key PEM | --trusted-root JSON --cert-identity SAN]
        [--require-signature] [--require-current]

``--update-blocks FILE...`` rewrites instead every generated figures block in those Markdown files
(:mod:`qualification.report.docblocks`) from the committed bundle it names, verified against its own commit; the
block names that commit and says "historical" when it is not HEAD.

Exit codes: 0 page written; 1 a bundle is invalid; 2 usage; 4 commit mismatch inside a bundle; 5 signature;
with ``--require-current``, 3 (STALE) or 6 (not on main, unknown, dirty, failed or nothing ran) and no page.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from qualification.errors import (  # noqa: E402  (the path above must come first)
    EXIT_NOT_ON_MAIN,
    EXIT_STALE,
    BundleInvalid,
    QualificationError,
    UsageError,
)
from qualification.evidence.freshness import evidence_only  # noqa: E402
from qualification.evidence.manifest import (  # noqa: E402
    MANIFEST_NAME,
    MAX_FILE_BYTES,
    MAX_FILES,
    extract_archive,
    parse_json,
)
from qualification.evidence.sign import GITHUB_OIDC_ISSUER  # noqa: E402
from qualification.evidence.verdict import Headline, scope_text  # noqa: E402
from qualification.evidence.verify import TrustPolicy, VerificationResult, verify_bundle  # noqa: E402

PROG = "render_validation_doc"
SUMMARY_NAME = "summary.json"
MAX_OBSERVATIONS = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """One verified bundle: the verifier's result, its manifest predicate, and the engine's summary if it has one."""

    source: str
    verification: VerificationResult
    predicate: dict[str, Any]
    summary: dict[str, Any] | None
    current_commit: bool
    """Made from the commit this page is about (``--expected-commit``), or from one that differs from it only in
    evidence files (then ``evidence_only``)."""
    evidence_only: bool = False
    """Made from an ancestor of the page's commit, which changes nothing since but evidence files
    (:func:`qualification.evidence.freshness.evidence_only`): committed evidence, one commit behind by
    construction, still describes the code of the commit holding it."""

    @property
    def commit(self) -> str:
        return str(self.predicate["source"]["digest"]["gitCommit"])

    @property
    def ran_cells(self) -> int:
        counts = self.predicate["summary"]
        return int(counts["passed"]) + int(counts["failed"]) + int(counts.get("measured", 0))

    @property
    def partial(self) -> str | None:
        """``PARTIAL 1 of 4 cells (...)`` for a narrowed run, a note for a bundle that records no scope, else None."""
        return scope_text(self.predicate.get("scope"))

    @property
    def headline(self) -> Headline:
        return self.verification.headline

    @property
    def is_current(self) -> bool:
        """Current qualification: this commit, head of main, clean tree, not FAILED, the whole campaign, and
        something actually ran."""
        return (
            self.current_commit
            and self.verification.exit_code == 0
            and self.ran_cells > 0
            and self.verification.freshness.covers_head
            and self.partial is None
        )

    def label(self) -> str:
        """What this evidence is, in one sentence that never overstates it."""
        short = self.commit[:12]
        freshness = self.verification.freshness
        state = str(freshness.state)
        older = "" if self.current_commit else "historical, "
        if self.predicate["source"]["dirty"]:
            return f"{older}evidence from a dirty tree at commit {short}: not current qualification"
        if self.ran_cells == 0:
            return f"{older}nothing ran at commit {short} (every cell was skipped): shows nothing"
        if self.predicate["result"] == "FAILED":
            return f"{older}a FAILED run at commit {short}: not a qualification"
        if self.partial is not None:
            return f"{older}{self.partial} at commit {short}: not a qualification of the whole campaign"
        if not self.current_commit:
            behind = (
                f", {freshness.commits_behind} commit(s) behind {freshness.main_ref}"
                if state == "STALE"
                else ""
            )
            return f"historical: evidence for commit {short}{behind}, not for the commit this page describes"
        if state in ("CURRENT", "CURRENT-EVIDENCE-ONLY"):
            result = self.predicate["result"]
            where = (
                f"commit {short} is the head of {freshness.main_ref}"
                if state == "CURRENT"
                else f"{freshness.main_ref} is {freshness.commits_behind} commit(s) past commit {short}, "
                "changing only evidence files"
            )
            if result == "PASSED-WITH-SKIPS":
                return (
                    f"current, PASSED-WITH-SKIPS: {where}; "
                    f"{self.predicate['summary']['skipped']} cell(s) skipped, and the claims they back are not "
                    "validated"
                )
            if result == "MEASURED":
                return f"current, MEASURED: {where}; read each target"
            return f"current qualification: {where}"
        if state == "STALE":
            return (
                f"stale: {freshness.main_ref} is {freshness.commits_behind} commit(s) past {short}"
            )
        if state == "NOT-ON-MAIN":
            return f"evidence for commit {short}, which is not on {freshness.main_ref}: not current qualification"
        return f"freshness unknown ({freshness.reason}): not current qualification"


class NotCurrent(QualificationError):
    """``--require-current`` and the evidence is not current qualification; exits 3 (STALE) or 6 (anything else)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _fail(message: str, exit_code: int) -> NoReturn:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(exit_code)


@contextmanager
def _bundle_dir(bundle: Path) -> Iterator[Path]:
    """The bundle as a directory: itself, or an archive unpacked (with the verifier's own safe intake) into a temp dir."""
    if bundle.is_dir():
        yield bundle
    elif bundle.is_file() and bundle.name.endswith((".tar.gz", ".tgz")):
        with tempfile.TemporaryDirectory(prefix="validation-doc-") as scratch:
            yield extract_archive(
                bundle, Path(scratch), max_files=MAX_FILES, max_file_bytes=MAX_FILE_BYTES
            )
    else:
        raise UsageError(f"bundle {bundle} is neither a directory nor a .tar.gz")


def _claimed_commit(root: Path) -> str:
    """The commit the manifest names, read only to choose what to verify it against; verification comes next."""
    try:
        document = parse_json((root / MANIFEST_NAME).read_bytes())
        return str(document["predicate"]["source"]["digest"]["gitCommit"]).lower()
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as exc:
        raise BundleInvalid(
            f"intake: {root / MANIFEST_NAME} is unreadable or names no commit ({exc})"
        ) from exc


def _read_verified(root: Path, name: str, expected_sha256: str) -> bytes:
    """``root/name``, but only if it still has the digest the verification accepted (no swap after the check)."""
    data = (root / name).read_bytes()
    if not hmac.compare_digest(hashlib.sha256(data).hexdigest(), expected_sha256):
        raise BundleInvalid(f"files: {name} changed after verification")
    return data


def load_evidence(
    bundle: Path, *, expected_commit: str, trust: TrustPolicy, repo: Path, main_ref: str
) -> Evidence:
    """Verify ``bundle`` and return what the page needs from it. Raises the verifier's errors unchanged."""
    with _bundle_dir(bundle) as root:
        claimed = _claimed_commit(root)
        current_commit = claimed == expected_commit.lower()
        evidence_only = not current_commit and _changes_only_evidence(
            repo, claimed, expected_commit
        )
        result = verify_bundle(
            root,
            expected_commit=claimed if evidence_only or not current_commit else expected_commit,
            trust=trust,
            repo=repo,
            main_ref=main_ref,
            allow_stale=False,
        )
        document = parse_json(_read_verified(root, MANIFEST_NAME, result.manifest_sha256))
        subjects = {s["name"]: s["digest"]["sha256"] for s in document["subject"]}
        summary = None
        if SUMMARY_NAME in subjects:
            summary = json.loads(_read_verified(root, SUMMARY_NAME, subjects[SUMMARY_NAME]))
            _check_summary_agrees(summary, document["predicate"])
    return Evidence(
        source=str(bundle),
        verification=result,
        predicate=document["predicate"],
        summary=summary,
        current_commit=current_commit or evidence_only,
        evidence_only=evidence_only,
    )


def _changes_only_evidence(repo: Path, old: str, new: str) -> bool:
    """``new`` descends from ``old`` and the two trees differ only in evidence files."""
    try:
        ancestor = subprocess.run(
            ["git", "-C", str(repo), "merge-base", "--is-ancestor", old, new],
            capture_output=True,
            timeout=30,
            check=False,
        )
        return ancestor.returncode == 0 and evidence_only(repo, old, new) == []
    except (OSError, subprocess.TimeoutExpired):
        return False


def _check_summary_agrees(summary: dict[str, Any], predicate: dict[str, Any]) -> None:
    counts = summary.get("counts", {})
    for key in ("total", "passed", "failed", "skipped", "measured"):
        if key not in predicate["summary"]:
            continue  # a 1.0.0 manifest counts no measured cells
        recorded = (
            counts.get(key, 0) if key == "measured" else counts.get(key)
        )  # older summaries count none
        if recorded != predicate["summary"][key]:
            raise BundleInvalid(
                f"consistency: {SUMMARY_NAME} counts {key}={recorded}, the manifest "
                f"{predicate['summary'][key]}"
            )


# ---------------------------------------------------------------------------------------------------------- page


def _cell_text(value: Any) -> str:
    """A value as table-safe Markdown text: one line, pipes escaped, no raw HTML from a run's output."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    text = " ".join(text.split()).replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return json.dumps(value) if isinstance(value, str) else json.dumps(value, sort_keys=True)


def key_observations(cell: dict[str, Any]) -> str:
    """The checked facts of a cell (its expectations, with what was observed), else its reason."""
    verdict = cell.get("verdict")
    observed = cell.get("observed") or {}
    expect = (cell.get("cell") or {}).get("expect") or {}
    parts = [f"{key}={_show(observed[key])}" for key in expect if key in observed][
        :MAX_OBSERVATIONS
    ]
    if not parts:
        parts = [
            f"{k}={_show(v)}"
            for k, v in sorted(observed.items())
            if isinstance(v, str | int | float | bool)
        ][:MAX_OBSERVATIONS]
    if verdict != "passed" and cell.get("reason"):
        parts.insert(0, str(cell["reason"]))
    recovery = observed.get(
        "fault_to_first_step_s"
    )  # measured from the kill's own record, not asserted
    if isinstance(recovery, int | float) and not isinstance(recovery, bool):
        parts.append(f"SIGKILL to first resumed step {recovery:.2f} s (measured)")
    return "; ".join(parts) or "-"


def _cells_table(evidence: Evidence) -> list[str]:
    lines = ["| cell | verdict | key observations |", "|---|---|---|"]
    if evidence.summary is not None:
        for cell in evidence.summary.get("cells", []):
            lines.append(
                f"| `{_cell_text(cell.get('id', '?'))}` | {_cell_text(str(cell.get('verdict', '?')).upper())} "
                f"| {_cell_text(key_observations(cell))} |"
            )
        return lines
    # A bundle sealed from facts (validation-evidence seal) has commands but no engine summary.
    for command in evidence.predicate["commands"]:
        verdict = "EXIT 0" if command["exitCode"] == 0 else f"EXIT {command['exitCode']}"
        lines.append(
            f"| `{_cell_text(command['id'])}` | {verdict} | `{_cell_text(' '.join(command['argv']))}` |"
        )
    return lines


def _evidence_table(evidence: Evidence) -> list[str]:
    p, v = evidence.predicate, evidence.verification
    counts, run, campaign, artifact = p["summary"], p["run"], p["campaign"], p["artifact"]
    freshness = v.freshness
    behind = f", {freshness.commits_behind} behind" if freshness.commits_behind else ""
    esc = _cell_text
    rows = [
        (
            "campaign",
            f"{esc(campaign['name'])} (tier {esc(campaign['tier'])}, `{esc(campaign['path'])}`)",
        ),
        ("commit", f"`{esc(evidence.commit)}`" + (" (dirty tree)" if p["source"]["dirty"] else "")),
        ("ref", esc(p["source"].get("ref") or "-")),
        ("verdict", f"**{esc(v.headline.text)}**"),
        (
            "result",
            f"{esc(p['result'])}: {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped, {counts.get('measured', 0)} measured of {counts['total']} cells",
        ),
        (
            "scope",
            esc(
                evidence.partial
                or f"complete: all {p['scope']['cellsInCampaign']} cells of the campaign"
            ),
        ),
        (
            "run",
            esc(
                f"{run['startedOn']} to {run['finishedOn']}, trigger {run['trigger']}, runner {run['runner']}"
            ),
        ),
        (
            "artifact",
            f"`{esc(artifact['name'])}`"
            + (f", workflow run {esc(artifact['runUrl'])}" if artifact.get("runUrl") else ""),
        ),
        ("verification", esc(f"{', '.join(v.checks_passed)}; signature {v.signature}")),
        (
            "freshness",
            esc(f"{freshness.state} against {freshness.main_ref}{behind}: {freshness.reason}"),
        ),
        ("manifest sha256", f"`{v.manifest_sha256}`"),
    ]
    return ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]


def _boundaries(evidence: Evidence) -> list[str]:
    """Claims as the verified manifest records them: validated only with the cells that back them, every other one
    with its reason (a 1.0.0 manifest's plain lists are shown as they were, marked as unbacked)."""
    bounds = evidence.predicate["boundaries"]
    old = evidence.predicate["schemaVersion"].startswith("1.0.")
    headline = (
        "**Validated** (schema 1.0.0: the campaign's list, not checked against its cells):"
        if old
        else "**Validated by this run** (every backing cell ran and passed):"
    )
    lines = [headline, ""]
    for item in bounds["validated"]:
        if isinstance(item, str):
            lines.append(f"- {_cell_text(item)}")
        else:
            lines.append(f"- {_cell_text(item['claim'])} ({len(item['backedBy'])} backing cell(s))")
    if not bounds["validated"]:
        lines.append("- nothing")
    lines += ["", "**Not validated:**", ""]
    for item in bounds["notValidated"]:
        if isinstance(item, str):
            lines.append(f"- {_cell_text(item)}")
        else:
            lines.append(f"- {_cell_text(item['claim'])} — {_cell_text(item['reason'])}")
    if not bounds["notValidated"]:
        lines.append("- nothing declared")
    return lines


def _environment(evidence: Evidence) -> list[str]:
    env, topology, package = (evidence.predicate[k] for k in ("environment", "topology", "package"))
    gpus = (
        ", ".join(f"{g['index']}: {g['name']} ({g['memoryMiB']} MiB)" for g in env["gpus"])
        or "none"
    )
    facts = [
        ("package", f"{package['name']} {package['version']}"),
        ("python", f"{env['python']} ({env['implementation']}) on {env['platform']}"),
        ("torch", env["torch"] or "not installed"),
        ("CPU", f"{env['cpu']['count']} x {env['cpu']['model'] or 'unknown model'}"),
        ("GPUs", gpus),
        (
            "topology",
            f"{topology['hosts']} host(s), world size {topology['worldSize']}, backends "
            f"{', '.join(topology['backends'])}, devices {', '.join(sorted(set(topology['devices'])))}",
        ),
    ]
    variables = env.get("variables") or {}
    if variables:
        facts.append(("variables", ", ".join(f"{k}={v}" for k, v in sorted(variables.items()))))
    return [f"- {name}: {_cell_text(value)}" for name, value in facts]


def _section(evidence: Evidence, level: str) -> list[str]:
    p = evidence.predicate
    lines = [
        f"{level} {p['campaign']['name']} at `{evidence.commit[:12]}`",
        "",
        f"**{_cell_text(evidence.label())}.**",
        "",
    ]
    lines += _evidence_table(evidence) + [""]
    lines += [f"{level}# Cells", ""] + _cells_table(evidence) + [""]
    lines += [f"{level}# Boundaries", ""] + _boundaries(evidence) + [""]
    lines += [f"{level}# Environment", ""] + _environment(evidence) + [""]
    return lines


def render(evidence: Sequence[Evidence], *, commit: str) -> str:
    """The Markdown page for ``evidence`` about ``commit``. Deterministic: the same bundles give the same bytes."""
    current = [e for e in evidence if e.current_commit]
    historical = [e for e in evidence if not e.current_commit]
    finished = max((e.predicate["run"]["finishedOn"] for e in current or evidence), default="")
    lines = [
        "# Validation",
        "",
        "<!-- Generated by scripts/render_validation_doc.py from verified evidence bundles. Do not edit by hand:",
        "     regenerate it (see the end of this page). -->",
        "",
        f"Date: {finished[:10]} UTC (the newest run {'for this commit' if current else 'below'} finished at "
        f"{finished}).",
        f"Commit: `{commit}`.",
        f"Campaigns: {', '.join(e.predicate['campaign']['name'] for e in current) or 'none for this commit'}"
        + (
            f"; historical: {', '.join(e.predicate['campaign']['name'] for e in historical)}"
            if historical
            else ""
        )
        + ".",
        "",
    ]
    if current and all(e.is_current for e in current):
        measured = [
            e.predicate["campaign"]["name"] for e in current if e.predicate["result"] == "MEASURED"
        ]
        verb = "is a measurement" if len(measured) == 1 else "are measurements"
        outcome = (
            "and passed"
            if not measured
            else (
                f"and passed, except that {', '.join(measured)} {verb} (MEASURED: read each target, met or missed)"
            )
        )
        ran_at = sorted({e.commit[:12] for e in current})
        since = (
            f"`{commit[:12]}`, the head of main"
            if ran_at == [commit[:12]]
            else f"{', '.join(f'`{c}`' for c in ran_at)}, from which `{commit[:12]}`, the head of main, "
            "differs only in evidence files"
        )
        lines += [
            f"**Status: current qualification.** Every campaign below was run at {since}, from a clean tree, "
            f"{outcome}; each claim holds only within its boundaries.",
            "",
        ]
    else:
        lines += ["**Status: not current qualification.**", ""]
        lines += [
            f"- {e.predicate['campaign']['name']}: {_cell_text(e.label())}" for e in evidence
        ] or ["- no evidence was given for this commit"]
        lines += [""]
    lines += [
        "A result applies only to the commit in its manifest. Verify a downloaded bundle yourself with",
        "`validation-evidence verify BUNDLE --expected-commit <sha>` before treating it as current.",
        "",
    ]
    lines += ["## Evidence for this commit", ""]
    for item in current:
        lines += _section(item, "###")
    if not current:
        lines += ["No bundle for this commit was given.", ""]
    if historical:
        lines += [
            "## Historical evidence",
            "",
            "Each bundle here verified intact against its own commit, which is not the commit above. Its results",
            "describe that commit only and are not current qualification.",
            "",
        ]
        for item in historical:
            lines += _section(item, "###")
    lines += [
        "## How this page is made",
        "",
        "`python scripts/render_validation_doc.py BUNDLE... --expected-commit <sha>` verifies every bundle (a bundle",
        "that fails verification stops it, and no page is written) and renders only what the verified manifests and",
        "their sealed `summary.json` files say. On every push to main, the `sign` job of `.github/workflows/ci.yml`",
        "signs the cpu-matrix bundle, verifies it, and runs this script on it with `--require-current`, the Sigstore",
        "trusted root (fetched over TUF) and the workflow's exact identity; the page is uploaded as the `validation-doc-<sha>`",
        "artifact and a maintainer commits it. `--require-current` writes nothing for evidence that is stale, from a",
        "dirty tree, not on main, failed, or in which nothing ran. Older bundles (the weekly GPU run, say) can be",
        "passed too: they are verified against their own commit and listed as historical.",
        "",
        "The bundles committed under `docs/evidence/` are made by `scripts/regenerate_evidence.sh CAMPAIGN...` (a clean",
        "clone at the commit, each campaign run and verified against it, then this page and the generated blocks",
        "re-rendered) and committed in the next commit, so they name the commit before the one that holds them; how",
        "to read that is in `docs/evidence/README.md`.",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------- cli


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see {self.prog} --help)", 2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="Render docs/validation.md from verified evidence bundles."
    )
    parser.add_argument(
        "bundles", nargs="*", type=Path, metavar="BUNDLE", help="bundle directory or .tar.gz"
    )
    parser.add_argument(
        "--update-blocks",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="rewrite the generated figures blocks of these Markdown files from their bundles",
    )
    parser.add_argument(
        "--expected-commit", metavar="SHA", help="full commit the page is about (default: HEAD)"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "docs" / "validation.md", help="page to write"
    )
    parser.add_argument(
        "--repo", type=Path, default=REPO_ROOT, help="git clone for freshness (default: checkout)"
    )
    parser.add_argument(
        "--main-ref", default="main", help="ref that is main (default: main; fetch first)"
    )
    parser.add_argument(
        "--public-key", type=Path, help="P-256 public key (PEM) of key-signed bundles"
    )
    parser.add_argument("--trusted-root", type=Path, help="pinned Sigstore trusted_root.json")
    parser.add_argument(
        "--cert-identity", help="exact signer identity (SAN) of Sigstore signatures"
    )
    parser.add_argument(
        "--cert-oidc-issuer", default=GITHUB_OIDC_ISSUER, help="OIDC issuer of that identity"
    )
    parser.add_argument("--require-signature", action="store_true", help="refuse unsigned bundles")
    parser.add_argument(
        "--require-current",
        action="store_true",
        help="write nothing unless the evidence for this commit is current qualification",
    )
    return parser


def _head(repo: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        raise UsageError(f"cannot read HEAD of {repo}; pass --expected-commit")
    return done.stdout.strip()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _behind_head(repo: Path, commit: str) -> int | None:
    done = subprocess.run(
        ["git", "-C", str(repo), "rev-list", "--count", f"{commit}..HEAD"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return (
        int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip().isdigit() else None
    )


def block_body(
    evidence: Evidence, bundle: str, *, behind: int | None, evidence_only_since: bool = False
) -> str:
    """The Markdown of a generated figures block: what the bundle says, with its commit, and nothing typed by hand."""
    p = evidence.predicate
    commit = evidence.commit
    # Always historical: the commit that holds this block comes after the one the bundle was sealed at, and a later
    # commit is never covered by an earlier run.
    when = (
        "historical: sealed at the HEAD this block was rendered at; later commits are not covered"
        if behind == 0
        else f"historical: HEAD was {behind} commit(s) past it when this block was rendered, changing only "
        "evidence files; a later change to anything else is not covered"
        if behind is not None and evidence_only_since
        else f"historical: HEAD was {behind} commit(s) past it when this block was rendered"
        if behind is not None
        else "historical: its commit is not an ancestor of HEAD"
    )
    lines = [
        f"*Generated by `scripts/render_validation_doc.py --update-blocks` from the sealed bundle `{bundle}` "
        f"(campaign {p['campaign']['name']}, commit `{commit[:12]}`, {when}; "
        f"`validation-evidence verify {bundle} --expected-commit {commit}`). "
        f"Verdict: {_cell_text(evidence.headline.text)}.*",
        "",
        "| cell | verdict | duration (s) | key observations |",
        "|---|---|---|---|",
    ]
    for cell in (evidence.summary or {}).get("cells", []):
        duration = cell.get("duration_s")
        shown = f"{duration:.1f}" if isinstance(duration, int | float) else "-"
        lines.append(
            f"| `{_cell_text(cell.get('id', '?'))}` | {_cell_text(str(cell.get('verdict', '?')).upper())} "
            f"| {shown} | {_cell_text(key_observations(cell))} |"
        )
    return "\n".join(lines + _targets_table(evidence))


def _targets_table(evidence: Evidence) -> list[str]:
    """Every target of the bundle's measurement cells, with the figure the cell measured and whether it was met:
    the figures a page cites, as sealed, not a summary of the missed ones."""
    rows = [
        f"| `{_cell_text(cell.get('id', '?'))}` | {_cell_text(target.get('name', '?'))} "
        f"| {_cell_text(target.get('detail') or '-')} | {'met' if target.get('met') else 'MISSED'} |"
        for cell in (evidence.summary or {}).get("cells", [])
        for target in cell.get("targets") or []
        if isinstance(target, dict)
    ]
    if not rows:
        return []
    return ["", "| cell | target | measured | met |", "|---|---|---|---|", *rows]


def update_blocks(
    files: Sequence[Path], *, trust: TrustPolicy, repo: Path, main_ref: str
) -> list[str]:
    """Rewrite every generated block of ``files`` from its bundle; return one line per block written."""
    from qualification.report.docblocks import blocks, replace_body

    written = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for block in blocks(path):
            bundle = REPO_ROOT / block.bundle
            evidence = load_evidence(
                bundle,
                expected_commit=_claimed_commit(bundle),
                trust=trust,
                repo=repo,
                main_ref=main_ref,
            )
            text = replace_body(
                text,
                block.bundle,
                block_body(
                    evidence,
                    block.bundle,
                    behind=_behind_head(repo, evidence.commit),
                    evidence_only_since=_changes_only_evidence(repo, evidence.commit, "HEAD"),
                ),
            )
            written.append(f"{path}:{block.line}: {block.bundle} ({evidence.commit[:12]})")
        _write_atomic(path, text)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.update_blocks:
        trust = TrustPolicy(public_key=args.public_key, require_signature=args.require_signature)
        try:
            for line in update_blocks(
                args.update_blocks, trust=trust, repo=args.repo, main_ref=args.main_ref
            ):
                print(f"wrote {line}")
        except QualificationError as exc:
            _fail(str(exc), exc.exit_code)
        except (OSError, ValueError) as exc:
            _fail(str(exc), 2)
        return 0
    if not args.bundles:
        _fail("give at least one BUNDLE, or --update-blocks FILE... (see --help)", 2)
    trust = TrustPolicy(
        public_key=args.public_key,
        trusted_root=args.trusted_root,
        cert_identity=args.cert_identity,
        cert_issuer=args.cert_oidc_issuer,
        require_signature=args.require_signature,
    )
    try:
        commit = args.expected_commit or _head(args.repo)
        evidence = [
            load_evidence(
                bundle, expected_commit=commit, trust=trust, repo=args.repo, main_ref=args.main_ref
            )
            for bundle in args.bundles
        ]
        current = [e for e in evidence if e.current_commit]
        if args.require_current and not (current and all(e.is_current for e in current)):
            labels = "; ".join(f"{e.source}: {e.label()}" for e in evidence)
            stale = any(str(e.verification.freshness.state) == "STALE" for e in current)
            raise NotCurrent(
                f"not current qualification, no page written ({labels})",
                EXIT_STALE if stale else EXIT_NOT_ON_MAIN,
            )
        _write_atomic(args.out, render(evidence, commit=commit.lower()))
    except QualificationError as exc:
        _fail(str(exc), exc.exit_code)
    except OSError as exc:
        _fail(f"{exc.strerror or exc}: {exc.filename}", 1)
    for item in evidence:
        print(f"{item.source}: {item.label()}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
