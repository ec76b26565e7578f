"""``gemscout``: the operator's view of a checkpoint directory.

``gemscout inspect DIR`` lists, per rank, the generations on disk, the replicas it holds for peers and their trust
states, checks them as recovery would (``--verify``: every tensor digest too), and prints the decision a restarted
job would make (:mod:`gemscout.inventory`). Exit codes: 0 a restart would restore (or start fresh) and every file
checked is usable; 2 bad usage (not a checkpoint directory, a bad flag); 3 some file or durable promotion is unusable
(recovery would skip it); 4 a restart would STOP (nothing restorable: the job would exit 4 too). Errors are one
line on stderr, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gemscout.config import TrustState
from gemscout.errors import GemscoutError, IntegrityError, RecoveryError
from gemscout.gemini.recovery import RecoveryMode
from gemscout.inventory import Inventory, inventory

app = typer.Typer(name="gemscout", help="Inspect gemscout checkpoints.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _main() -> None:
    """gemscout's operator commands (the qualification harness is ``qualify``)."""


@app.command()
def inspect(
    directory: Annotated[Path, typer.Argument(help="the job's CheckpointConfig.directory")],
    durable: Annotated[Path | None, typer.Option(help="the job's CheckpointConfig.durable_directory")] = None,
    verify: Annotated[bool, typer.Option(help="read every file whole and check every tensor digest")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the inventory as JSON")] = False,
    world_size: Annotated[int | None, typer.Option(min=1, help="the job's ranks, if a rank's folder is gone")] = None,
    min_trust: Annotated[str, typer.Option(help="the job's CheckpointConfig.min_trust")] = "candidate",
) -> None:
    """What DIR holds and what a restarted job would restore from it."""
    try:
        trust = TrustState(min_trust)
    except ValueError:
        typer.echo(f"gemscout inspect: --min-trust must be one of {[s.value for s in TrustState]}, got {min_trust!r}",
                   err=True)
        raise typer.Exit(2) from None
    try:
        inv = inventory(directory, durable_directory=durable, verify=verify, world_size=world_size, min_trust=trust)
    except GemscoutError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(exc.exit_code) from None
    if as_json:
        typer.echo(json.dumps(inv.to_dict(), indent=1, sort_keys=True))
    else:
        _print(inv)
    if inv.decision.mode == RecoveryMode.STOP:
        raise typer.Exit(RecoveryError.exit_code)
    if inv.unusable:
        raise typer.Exit(IntegrityError.exit_code)


def _print(inv: Inventory) -> None:
    console = Console(highlight=False)
    console.print(f"[bold]{inv.directory}[/]  run {inv.run_id or '?'}  {inv.world_size} ranks  "
                  f"topology {inv.topology_digest[:12] or '?'}  files {'verified' if inv.verified else 'by header'}")
    steps = sorted({f.step for r in inv.ranks for f in r.files} | {s for r in inv.ranks for s in r.trust},
                   reverse=True)
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("step", justify="right")
    table.add_column("trust")
    for r in inv.ranks:
        table.add_column(f"rank {r.rank}" + ("" if r.node is not None else " (folder gone)"))
    for step in steps:
        states = {r.trust[step] for r in inv.ranks if step in r.trust}
        trust = "rejected" if "rejected" in states else max(states, key=lambda s: TrustState(s).rank, default="-")
        cells = []
        for r in inv.ranks:
            own = [f for f in r.files if f.step == step and f.kind == "own"]
            held = [f"holds {f.owner}" + ("" if f.status != "unusable" else " ✗")
                    for f in r.files if f.step == step and f.kind == "replica"]
            mine = (["own"] if own[0].status != "unusable" else ["own ✗"]) if own else []
            mem = [("mem" if f.kind == "memory" else f"mem holds {f.owner}") + ("" if f.status != "unusable" else " ✗")
                   for f in r.files if f.step == step and f.kind in ("memory", "memory_replica")]
            cells.append(", ".join(mine + held + mem) or "-")
        table.add_row(str(step), trust, *cells)
    console.print(table)
    for d in inv.durable:
        console.print(f"durable step {d['step']}: {d['status']}" + (f" ({d['reason']})" if d["reason"] else ""))
    if inv.faults:
        console.print(f"fault reports ({len(inv.faults)}, oldest first):")
        for f in inv.faults[-20:]:
            where = f" recipe {f['recipe']}" if f.get("recipe") else ""
            console.print(f"  step {f.get('step')} [bold]{f.get('kind')}[/] {f.get('scope')} {f.get('ranks')}{where}: "
                          f"{f.get('reason')} (reported by {sorted(f.get('reported_by', []))})")
    for bad in inv.unusable:
        console.print(f"[red]unusable[/] {bad}")
    dec = inv.decision
    sources = ", ".join(f"rank {k}: {v}" for k, v in sorted(dec.sources.items()))
    what = f"{dec.mode.value.upper()}" + (f" step {dec.step}" if dec.step is not None else "")
    console.print(f"[bold]a restart would {what}[/]" + (f" ({sources})" if sources else "") + f" — {dec.reason}")
    console.print("(from disk alone: a job whose surviving processes still hold their in-memory slots may restore a "
                  "newer step)")


def main() -> None:
    app()
