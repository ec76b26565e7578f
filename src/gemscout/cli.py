"""``gemscout``: the operator's view of a checkpoint directory.

``gemscout inspect DIR`` lists, per rank, the generations on disk, the replicas it holds for peers and their trust
states, checks them as recovery would (``--verify``: every tensor digest too), and prints the decision a restarted
job would make (:mod:`gemscout.inventory`). Exit codes: 0 a restart would restore (or start fresh) and every file
checked is usable; 2 bad usage (not a checkpoint directory, a bad flag); 3 some file or durable promotion is unusable
(recovery would skip it); 4 a restart would STOP (nothing restorable: the job would exit 4 too); 1 an internal error
(a bug: please report it). Errors are one line on stderr, never a traceback, whatever the folder holds (FIFOs,
links, malformed or hostile files are reported as unusable, exit 3).

Standard library only (argparse): the runtime's command needs none of the harness's dependencies.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import NoReturn

from gemscout.config import TrustState
from gemscout.errors import ConfigError, GemscoutError, IntegrityError, RecoveryError
from gemscout.gemini.recovery import RecoveryMode
from gemscout.inventory import Inventory, inventory


def version() -> str:
    """The installed distribution's version (the source tree's when it is not installed)."""
    try:
        return metadata.version("gemscout")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints usage first)
        self.exit(ConfigError.exit_code, f"gemscout: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gemscout",
        description="Inspect gemscout checkpoints (the qualification harness is `qualify`).",
    )
    parser.add_argument("--version", action="version", version=f"gemscout {version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inspect = commands.add_parser(
        "inspect", help="what DIR holds and what a restarted job would restore from it"
    )
    inspect.add_argument("directory", type=Path, help="the job's CheckpointConfig.directory")
    inspect.add_argument(
        "--durable", type=Path, default=None, help="the job's CheckpointConfig.durable_directory"
    )
    inspect.add_argument(
        "--verify", action="store_true", help="read every file whole and check every tensor digest"
    )
    inspect.add_argument(
        "--json", dest="as_json", action="store_true", help="print the inventory as JSON"
    )
    inspect.add_argument(
        "--world-size", type=int, default=None, help="the job's ranks, if a rank's folder is gone"
    )
    inspect.add_argument(
        "--min-trust", default="candidate", help="the job's CheckpointConfig.min_trust"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    args = _parser().parse_args(argv)
    try:
        trust = TrustState(args.min_trust)
    except ValueError:
        print(
            f"gemscout inspect: --min-trust must be one of {[s.value for s in TrustState]}, got {args.min_trust!r}",
            file=sys.stderr,
        )
        return ConfigError.exit_code
    if args.world_size is not None and args.world_size < 1:
        print(
            f"gemscout inspect: --world-size must be >= 1, got {args.world_size}", file=sys.stderr
        )
        return ConfigError.exit_code
    try:
        inv = inventory(
            args.directory,
            durable_directory=args.durable,
            verify=args.verify,
            world_size=args.world_size,
            min_trust=trust,
        )
        text = json.dumps(inv.to_dict(), indent=1, sort_keys=True) if args.as_json else render(inv)
    except GemscoutError as exc:
        print(_one_line(str(exc)), file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # the directory itself cannot be read (permissions, a vanished mount)
        print(_one_line(f"gemscout inspect: cannot read {args.directory}: {exc}"), file=sys.stderr)
        return ConfigError.exit_code
    except Exception as exc:  # a bug, never a traceback: one line, exit 1
        print(
            _one_line(
                f"gemscout inspect: internal error ({type(exc).__name__}: {exc}); please report it"
            ),
            file=sys.stderr,
        )
        return 1
    print(text)
    if inv.decision.mode == RecoveryMode.STOP:
        return RecoveryError.exit_code
    if inv.unusable:
        return IntegrityError.exit_code
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())[:2000]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i == 0 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def render(inv: Inventory) -> str:
    """The inventory as text: one row per step, one column per rank, then durable steps, faults, the decision."""
    lines = [
        f"{inv.directory}  run {inv.run_id or '?'}  {inv.world_size} ranks  "
        f"topology {inv.topology_digest[:12] or '?'}  files {'verified' if inv.verified else 'by header'}"
    ]
    steps = sorted(
        {f.step for r in inv.ranks for f in r.files} | {s for r in inv.ranks for s in r.trust},
        reverse=True,
    )
    rows = [
        [
            "step",
            "trust",
            *(
                f"rank {r.rank}" + ("" if r.node is not None else " (folder gone)")
                for r in inv.ranks
            ),
        ]
    ]
    for step in steps:
        states = {r.trust[step] for r in inv.ranks if step in r.trust}
        trust = (
            "rejected"
            if "rejected" in states
            else max(states, key=lambda s: TrustState(s).rank, default="-")
        )
        cells = []
        for r in inv.ranks:
            own = [f for f in r.files if f.step == step and f.kind == "own"]
            held = [
                f"holds {f.owner}" + ("" if f.status != "unusable" else " ✗")
                for f in r.files
                if f.step == step and f.kind == "replica"
            ]
            mine = (["own"] if own[0].status != "unusable" else ["own ✗"]) if own else []
            mem = [
                ("mem" if f.kind == "memory" else f"mem holds {f.owner}")
                + ("" if f.status != "unusable" else " ✗")
                for f in r.files
                if f.step == step and f.kind in ("memory", "memory_replica")
            ]
            cells.append(", ".join(mine + held + mem) or "-")
        rows.append([str(step), trust, *cells])
    lines += _table(rows)
    for d in inv.durable:
        lines.append(
            f"durable step {d['step']}: {d['status']}"
            + (f" ({d['reason']})" if d["reason"] else "")
        )
    if inv.faults:
        lines.append(f"fault reports ({len(inv.faults)}, oldest first):")
        for f in inv.faults[-20:]:
            where = f" recipe {f['recipe']}" if f.get("recipe") else ""
            lines.append(
                f"  step {f.get('step')} {f.get('kind')} {f.get('scope')} {f.get('ranks')}{where}: "
                f"{f.get('reason')} (reported by {sorted(f.get('reported_by', []))})"
            )
    lines += [f"unusable {bad}" for bad in inv.unusable]
    dec = inv.decision
    sources = ", ".join(f"rank {k}: {v}" for k, v in sorted(dec.sources.items()))
    what = f"{dec.mode.value.upper()}" + (f" step {dec.step}" if dec.step is not None else "")
    lines.append(
        f"a restart would {what}" + (f" ({sources})" if sources else "") + f" — {dec.reason}"
    )
    lines.append(
        "(from disk and the memory tier its anchors name: a job run with memory_directory=None whose processes still "
        "live may hold a newer step in their slots)"
    )
    return "\n".join(lines)
