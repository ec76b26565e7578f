"""``qualify``: run qualification campaigns, seal their evidence, render and verify it.

Exit codes (see ``qualification.errors``): 0 success; 1 a cell failed or a bundle is invalid; 2 bad usage or a
malformed campaign (nothing ran); 3-6 verification outcomes (stale, commit mismatch, signature, not on main).
Every harness error ends as one line on stderr and its exit code, never a traceback.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from qualification import campaign as campaigns
from qualification import engine
from qualification.errors import CellFailure, QualificationError, UsageError
from qualification.outcome import CellOutcome, Verdict, now

app = typer.Typer(
    name="qualify",
    help="Run gemscout qualification campaigns and seal their results into revision-bound evidence bundles.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable[..., Any])


def _print_version(asked: bool) -> None:
    if asked:
        from gemscout.cli import version

        typer.echo(f"qualify {version()}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    pass


class SignMode(enum.StrEnum):
    NONE = "none"
    KEY = "key"
    SIGSTORE = "sigstore"


def _handled(command: F) -> F:
    """The CLI's one error handler: a QualificationError becomes one line on stderr and its exit code."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except QualificationError as exc:
            typer.echo(f"qualify: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("qualify: interrupted; running cells were terminated", err=True)
            raise typer.Exit(130) from None
        except (
            OSError
        ) as exc:  # an unreadable file or a full disk: the environment's fault, said in one line
            typer.echo(f"qualify: {exc.strerror or exc}: {exc.filename}", err=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


@app.command("list")
@_handled
def list_campaigns() -> None:
    """List the campaigns in campaigns/ with their tier and cell count. Exits 2 if any file is malformed."""
    broken = 0
    for path in campaigns.campaign_files():
        try:
            loaded = campaigns.load(path)
        except QualificationError as exc:
            broken += 1
            typer.echo(f"{path.stem:<20} INVALID  {exc}")
            continue
        typer.echo(
            f"{loaded.name:<20} {loaded.tier:<4} {len(loaded.cells):>4} cells  {loaded.description}"
        )
    if broken:
        raise UsageError(f"{broken} campaign file(s) are malformed")


@app.command()
@_handled
def run(
    campaign: Annotated[
        str, typer.Argument(help="Campaign name (campaigns/NAME.toml) or path to a campaign file.")
    ],
    out: Annotated[
        Path | None,
        typer.Option(help="Run directory, absent or empty.", show_default="runs/NAME-UTCTIME"),
    ] = None,
    jobs: Annotated[
        int,
        typer.Option("--jobs", "-j", min=1, help="Cells run at once (capped at the CPU count)."),
    ] = 1,
    seed: Annotated[
        int | None, typer.Option(help="Run every cell with this seed instead of the file's.")
    ] = None,
    filter_expr: Annotated[
        str | None,
        typer.Option(
            "--filter",
            help="Only cells whose id matches: substring or glob; comma-separated alternatives.",
        ),
    ] = None,
    sign: Annotated[
        SignMode, typer.Option(help="Sign the manifest: none, key (with --key), sigstore.")
    ] = SignMode.NONE,
    key: Annotated[Path | None, typer.Option(help="Private key (PEM) for --sign key.")] = None,
    archive: Annotated[
        Path | None, typer.Option(help="Also pack the sealed bundle into this .tar.gz.")
    ] = None,
    no_seal: Annotated[
        bool, typer.Option("--no-seal", help="Leave the run directory unsealed.")
    ] = False,
    no_report: Annotated[
        bool, typer.Option("--no-report", help="Do not render the HTML report.")
    ] = False,
    grace_s: Annotated[
        float,
        typer.Option(
            "--grace", min=0.0, help="Seconds between SIGTERM and SIGKILL when a cell times out."
        ),
    ] = 5.0,
) -> None:
    """Run a campaign: every cell as its own process tree, then seal the run directory and render the report.

    Exit 0: no cell failed (skipped cells do not fail a campaign).
    Exit 1: a cell failed. Exit 2: bad campaign file or flag; nothing ran.
    """
    loaded = campaigns.load(campaign)
    cells = campaigns.select(loaded.cells, filter_expr)
    if seed is not None:
        cells = campaigns.override_seed(cells, seed)
    signer = (
        None if no_seal else _signer(sign, key)
    )  # a bad key must fail before hours of cells, not after
    out_dir = (
        out or Path("runs") / f"{loaded.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    )
    if archive is not None and archive.resolve().is_relative_to(out_dir.resolve()):
        raise UsageError(
            f"--archive {archive} must be outside the run directory {out_dir}, which it seals"
        )
    engine.prepare_out_dir(out_dir, loaded)
    typer.echo(
        f"campaign {loaded.name}: {len(cells)} cell(s), {jobs} at a time -> {out_dir}", err=True
    )

    started = now()
    outcomes = _run_with_progress(
        cells, out_dir, engine.EngineOptions(jobs=jobs, grace=timedelta(seconds=grace_s))
    )
    invocation = {
        "argv": ["qualify", *sys.argv[1:]],
        "cwd": os.getcwd(),
        "jobs": jobs,
        "seed_override": seed,
        "filter": filter_expr,
        "grace_s": grace_s,
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
    typer.echo(
        f"{loaded.name}: {summary['verdict'].upper()}: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped, {counts['measured']} measured in {summary['duration_s']:.1f} s"
        f"{partial}; results in {out_dir / 'summary.json'}"
    )
    for claim in summary["boundaries"]["not_validated"]:
        if claim["reason"] != "declared not validated by the campaign":
            typer.echo(
                f"not validated by this run: {claim['claim'][:100]} [{claim['reason'][:200]}]",
                err=True,
            )

    if no_seal:
        typer.echo("not sealed (--no-seal)", err=True)
    else:
        try:
            _seal(out_dir, summary, signer=signer, archive=archive)
        except QualificationError as exc:
            raise QualificationError(
                f"the cells ran (see {out_dir / 'summary.json'}) but sealing failed: {exc}"
            ) from exc
    if not no_report:
        _report(out_dir, out_dir.with_name(out_dir.name + ".html"))
    if counts["failed"]:
        raise CellFailure(
            f"{counts['failed']} of {counts['total']} cells failed (see {out_dir / 'summary.json'})"
        )


@app.command()
@_handled
def seal(
    directory: Annotated[
        Path, typer.Argument(help="A run directory written by `qualify run --no-seal`.")
    ],
    sign: Annotated[
        SignMode, typer.Option(help="Sign the manifest: none, key (with --key), sigstore.")
    ] = SignMode.NONE,
    key: Annotated[Path | None, typer.Option(help="Private key (PEM) for --sign key.")] = None,
    archive: Annotated[
        Path | None, typer.Option(help="Also pack the bundle into this .tar.gz.")
    ] = None,
) -> None:
    """Seal a run directory into an evidence bundle, from its summary.json."""
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
    _seal(directory, summary, signer=_signer(sign, key), archive=archive)


@app.command()
@_handled
def verify(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory or .tar.gz.")],
    expected_commit: Annotated[str, typer.Option(help="Full SHA the bundle must be bound to.")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the verification result as JSON.")
    ] = False,
    public_key: Annotated[
        Path | None, typer.Option(help="Public key (PEM) of a key-signed bundle.")
    ] = None,
    require_signature: Annotated[
        bool, typer.Option("--require-signature", help="Reject an unsigned bundle.")
    ] = False,
    main_ref: Annotated[
        str, typer.Option(help="The ref that is main, for freshness (fetch first).")
    ] = "main",
    allow_stale: Annotated[
        bool, typer.Option("--allow-stale", help="Exit 0 for a valid STALE bundle.")
    ] = False,
    require_complete: Annotated[
        bool,
        typer.Option(
            "--require-complete", help="Exit 7 for a PARTIAL run (narrowed by --filter or --seed)."
        ),
    ] = False,
) -> None:
    """Verify an evidence bundle (signature, schema, digests, consistency, commit, freshness).

    The same check as `validation-evidence verify`, with the same exit codes: 0 valid and CURRENT, 1 invalid,
    3 STALE, 4 commit mismatch, 5 signature, 6 NOT-ON-MAIN or UNKNOWN, 7 PARTIAL under --require-complete.
    """
    if importlib.util.find_spec("qualification.evidence.cli") is None:
        raise QualificationError(
            "the bundle verifier (qualification.evidence.cli) is not part of this build yet"
        )
    from qualification.evidence.cli import main as evidence_main

    argv = ["verify", str(bundle), "--expected-commit", expected_commit, "--main-ref", main_ref]
    argv += ["--public-key", str(public_key)] if public_key else []
    argv += [
        flag
        for flag, on in (
            ("--json", as_json),
            ("--require-signature", require_signature),
            ("--allow-stale", allow_stale),
            ("--require-complete", require_complete),
        )
        if on
    ]
    code = evidence_main(argv)
    if code:
        raise typer.Exit(code)


@app.command()
@_handled
def report(
    bundle: Annotated[Path, typer.Argument(help="A run directory or sealed bundle.")],
    out: Annotated[
        Path | None, typer.Option(help="HTML file to write.", show_default="BUNDLE.html")
    ] = None,
    expected_commit: Annotated[
        str | None,
        typer.Option(
            help="Verify the bundle against this full SHA first and show the verdict (VALID + freshness, or INVALID).",
        ),
    ] = None,
    public_key: Annotated[
        Path | None, typer.Option(help="Public key (PEM) of a key-signed bundle.")
    ] = None,
    main_ref: Annotated[
        str, typer.Option(help="The ref that is main, for freshness (fetch first).")
    ] = "main",
) -> None:
    """Render the HTML report of a run directory or bundle.

    With --expected-commit the bundle is verified first (the checks of `qualify verify`) and the report shows the
    result; an invalid bundle is still rendered, marked INVALID with the reason, and the command exits with the
    verifier's code so a pipeline cannot mistake it for evidence.
    """
    if not (bundle / "summary.json").is_file() and not (bundle / "manifest.json").is_file():
        raise UsageError(
            f"{bundle} has neither summary.json nor manifest.json; is it a run directory or bundle?"
        )
    target = out or bundle.with_name(bundle.name + ".html")
    if expected_commit is None:
        if not _report(bundle, target):
            raise QualificationError(
                "the HTML report renderer (qualification.report) is not part of this build yet"
            )
        return
    from qualification.errors import BundleInvalid
    from qualification.evidence.verify import TrustPolicy, verify_bundle
    from qualification.report import render

    try:
        result = verify_bundle(
            bundle,
            expected_commit=expected_commit,
            trust=TrustPolicy(public_key=public_key),
            repo=Path("."),
            main_ref=main_ref,
        )
    except BundleInvalid as exc:
        render(bundle, target, verification_error=str(exc))
        typer.echo(f"report: {target} (bundle INVALID: {exc})", err=True)
        raise typer.Exit(exc.exit_code) from None
    render(bundle, target, verification=result)
    typer.echo(
        f"report: {target} (bundle VALID, {result.freshness.state}: {result.message})", err=True
    )
    if result.exit_code:
        raise typer.Exit(result.exit_code)


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


def _signer(mode: SignMode, key: Path | None) -> Any:
    from qualification.evidence.sign import make_signer

    if mode is not SignMode.KEY and key is not None:
        raise UsageError("--key is only used with --sign key")
    return make_signer(str(mode), key=key, identity_token=os.environ.get("SIGSTORE_ID_TOKEN"))


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
    typer.echo(
        f"sealed {sealed.subjects} files: {sealed.result} at commit {sealed.commit[:12]}"
        f"{' (dirty tree)' if sealed.dirty else ''}{signed}; manifest sha256 {sealed.manifest_sha256[:16]}",
        err=True,
    )


def _report(bundle: Path, out_file: Path) -> bool:
    """Render the report if the renderer exists; say so and return False if it does not."""
    if importlib.util.find_spec("qualification.report") is None:
        typer.echo(
            "HTML report not available in this build (qualification.report is missing)", err=True
        )
        return False
    import qualification.report

    qualification.report.render(bundle, out_file)  # type: ignore[attr-defined]
    typer.echo(f"report: {out_file}", err=True)
    return True
