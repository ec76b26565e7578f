"""The ``qualify`` subcommands: what ``list``, ``run``, ``seal``, ``verify`` and ``report`` do once
``qualification.cli`` has parsed their flags.

Each handler takes the parsed ``argparse.Namespace`` and returns an exit code, or raises a
:class:`~qualification.errors.QualificationError` that the CLI's one handler turns into a line on stderr. Progress
and status lines go to stderr; the one-line results of ``list`` and ``run`` go to stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from qualification import campaign as campaigns
from qualification import engine
from qualification.errors import CellFailure, QualificationError, UsageError
from qualification.outcome import CellOutcome, Verdict, now


def _err(line: str) -> None:
    print(line, file=sys.stderr)


def list_campaigns(args: argparse.Namespace) -> int:
    """List the campaigns in campaigns/ with their tier and cell count. Exits 2 if any file is malformed."""
    broken = 0
    for path in campaigns.campaign_files():
        try:
            loaded = campaigns.load(path)
        except QualificationError as exc:
            broken += 1
            print(f"{path.stem:<20} INVALID  {exc}")
            continue
        print(
            f"{loaded.name:<20} {loaded.tier:<4} {len(loaded.cells):>4} cells  {loaded.description}"
        )
    if broken:
        raise UsageError(f"{broken} campaign file(s) are malformed")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run a campaign: every cell as its own process tree, then seal the run directory and render the report.

    Exit 0: no cell failed (skipped cells do not fail a campaign).
    Exit 1: a cell failed. Exit 2: bad campaign file or flag; nothing ran.
    """
    loaded = campaigns.load(args.campaign)
    cells = campaigns.select(loaded.cells, args.filter_expr)
    if args.seed is not None:
        cells = campaigns.override_seed(cells, args.seed)
    # A bad key must fail before hours of cells, not after.
    signer = None if args.no_seal else _signer(args.sign, args.key)
    out_dir: Path = (
        args.out or Path("runs") / f"{loaded.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    )
    archive: Path | None = args.archive
    if archive is not None and archive.resolve().is_relative_to(out_dir.resolve()):
        raise UsageError(
            f"--archive {archive} must be outside the run directory {out_dir}, which it seals"
        )
    engine.prepare_out_dir(out_dir, loaded)
    _err(f"campaign {loaded.name}: {len(cells)} cell(s), {args.jobs} at a time -> {out_dir}")

    started = now()
    outcomes = _run_with_progress(
        cells,
        out_dir,
        engine.EngineOptions(jobs=args.jobs, grace=timedelta(seconds=args.grace_s)),
    )
    invocation = {
        "argv": ["qualify", *sys.argv[1:]],
        "cwd": os.getcwd(),
        "jobs": args.jobs,
        "seed_override": args.seed,
        "filter": args.filter_expr,
        "grace_s": args.grace_s,
    }
    summary = engine.build_summary(
        loaded, outcomes, started_at=started, finished_at=now(), invocation=invocation
    )
    engine.write_json(out_dir / "summary.json", summary)
    counts, scope = summary["counts"], summary["scope"]
    partial = (
        ""
        if scope["complete"]
        else (
            f"; PARTIAL: {scope['campaign_cells_run']} of {scope['cells_in_campaign']} cells of the campaign"
        )
    )
    print(
        f"{loaded.name}: {summary['verdict'].upper()}: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped, {counts['measured']} measured in {summary['duration_s']:.1f} s"
        f"{partial}; results in {out_dir / 'summary.json'}"
    )
    for claim in summary["boundaries"]["not_validated"]:
        if claim["reason"] != "declared not validated by the campaign":
            _err(f"not validated by this run: {claim['claim'][:100]} [{claim['reason'][:200]}]")

    if args.no_seal:
        _err("not sealed (--no-seal)")
    else:
        try:
            _seal(out_dir, summary, signer=signer, archive=archive)
        except QualificationError as exc:
            raise QualificationError(
                f"the cells ran (see {out_dir / 'summary.json'}) but sealing failed: {exc}"
            ) from exc
    if not args.no_report:
        _report(out_dir, out_dir.with_name(out_dir.name + ".html"))
    if counts["failed"]:
        raise CellFailure(
            f"{counts['failed']} of {counts['total']} cells failed (see {out_dir / 'summary.json'})"
        )
    return 0


def seal(args: argparse.Namespace) -> int:
    """Seal a run directory into an evidence bundle, from its summary.json."""
    directory: Path = args.directory
    summary_path = directory / "summary.json"
    if not summary_path.is_file():
        raise UsageError(
            f"{directory} has no summary.json; is it a run directory of `qualify run`?"
        )
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise UsageError(
            f"{summary_path} is not the JSON `qualify run` writes ({reason}); seal a run directory"
        ) from None
    _seal(directory, summary, signer=_signer(args.sign, args.key), archive=args.archive)
    return 0


def verify(args: argparse.Namespace) -> int:
    """Verify an evidence bundle (signature, schema, digests, consistency, commit, freshness).

    The same check as `validation-evidence verify` (it runs that command's ``main``), with the same exit codes: 0
    valid and CURRENT, 1 invalid, 3 STALE, 4 commit mismatch, 5 signature, 6 NOT-ON-MAIN or UNKNOWN, 7 PARTIAL
    under --require-complete.
    """
    if importlib.util.find_spec("qualification.evidence.cli") is None:
        raise QualificationError(
            "the bundle verifier (qualification.evidence.cli) is not part of this build yet"
        )
    from qualification.evidence.cli import main as evidence_main

    argv = ["verify", str(args.bundle), "--expected-commit", args.expected_commit]
    argv += ["--main-ref", args.main_ref]
    argv += ["--public-key", str(args.public_key)] if args.public_key else []
    argv += [
        flag
        for flag, on in (
            ("--json", args.as_json),
            ("--require-signature", args.require_signature),
            ("--allow-stale", args.allow_stale),
            ("--require-complete", args.require_complete),
        )
        if on
    ]
    return evidence_main(argv)


def report(args: argparse.Namespace) -> int:
    """Render the HTML report of a run directory or bundle.

    With --expected-commit the bundle is verified first (the checks of `qualify verify`) and the report shows the
    result; an invalid bundle is still rendered, marked INVALID with the reason, and the command exits with the
    verifier's code so a pipeline cannot mistake it for evidence.
    """
    bundle: Path = args.bundle
    if not (bundle / "summary.json").is_file() and not (bundle / "manifest.json").is_file():
        raise UsageError(
            f"{bundle} has neither summary.json nor manifest.json; is it a run directory or bundle?"
        )
    target: Path = args.out or bundle.with_name(bundle.name + ".html")
    if args.expected_commit is None:
        if not _report(bundle, target):
            raise QualificationError(
                "the HTML report renderer (qualification.report) is not part of this build yet"
            )
        return 0
    from qualification.errors import BundleInvalid
    from qualification.evidence.verify import TrustPolicy, verify_bundle
    from qualification.report import render

    try:
        result = verify_bundle(
            bundle,
            expected_commit=args.expected_commit,
            trust=TrustPolicy(public_key=args.public_key),
            repo=Path("."),
            main_ref=args.main_ref,
        )
    except BundleInvalid as exc:
        render(bundle, target, verification_error=str(exc))
        _err(f"report: {target} (bundle INVALID: {exc})")
        return exc.exit_code
    render(bundle, target, verification=result)
    _err(f"report: {target} (bundle VALID, {result.freshness.state}: {result.message})")
    return result.exit_code


def _run_with_progress(
    cells: list[campaigns.Cell], out_dir: Path, options: engine.EngineOptions
) -> list[CellOutcome]:
    """Run the cells, showing a progress bar on a terminal and one line per finished cell everywhere."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False)
    style = {"passed": "green", "failed": "bold red", "skipped": "yellow", "measured": "cyan"}
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("cells", total=len(cells))

        def finished(outcome: CellOutcome) -> None:
            verdict = str(outcome.verdict)
            progress.console.print(
                f"[{style[verdict]}]{verdict.upper():<7}[/] {outcome.cell.id} ({outcome.duration_s:.1f} s)"
                + ("" if outcome.verdict is Verdict.PASSED else f": {outcome.reason}"),
                markup=True,
                soft_wrap=True,
            )
            progress.advance(task)

        return engine.run_cells(cells, out_dir, options, on_finish=finished)


def _signer(mode: str, key: Path | None) -> Any:
    from qualification.evidence.sign import make_signer

    if mode != "key" and key is not None:
        raise UsageError("--key is only used with --sign key")
    return make_signer(mode, key=key, identity_token=os.environ.get("SIGSTORE_ID_TOKEN"))


def _seal(out_dir: Path, run_record: dict[str, Any], *, signer: Any, archive: Path | None) -> None:
    """Seal ``out_dir`` into an evidence bundle (manifest.json + signature) from the run's summary record."""
    from qualification import _sealing
    from qualification.evidence.seal import seal_bundle

    try:
        facts = _sealing.seal_input(out_dir, run_record)
    except (
        KeyError,
        TypeError,
        AttributeError,
        ValueError,
    ) as exc:  # a summary.json edited or written by hand
        raise UsageError(
            f"{out_dir / 'summary.json'} is malformed ({type(exc).__name__}: {exc}); it must be the "
            "record `qualify run` wrote"
        ) from None
    sealed = seal_bundle(out_dir, facts, repo=campaigns.REPO_ROOT, signer=signer, archive=archive)
    signed = f", signature {sealed.signature.name}" if sealed.signature else ""
    if not facts.effective_scope.complete:
        scope = facts.effective_scope
        signed += f"; PARTIAL: {scope.campaign_cells_run} of {scope.cells_in_campaign} cells of the campaign"
    _err(
        f"sealed {sealed.subjects} files: {sealed.result} at commit {sealed.commit[:12]}"
        f"{' (dirty tree)' if sealed.dirty else ''}{signed}; manifest sha256 {sealed.manifest_sha256[:16]}"
    )


def _report(bundle: Path, out_file: Path) -> bool:
    """Render the report if the renderer exists; say so and return False if it does not."""
    if importlib.util.find_spec("qualification.report") is None:
        _err("HTML report not available in this build (qualification.report is missing)")
        return False
    import qualification.report

    qualification.report.render(bundle, out_file)  # type: ignore[attr-defined]
    _err(f"report: {out_file}")
    return True
