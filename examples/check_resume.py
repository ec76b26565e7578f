"""Check that a restarted gemscout job resumed exactly: every rank bit for bit equal to the uninterrupted run.

For each ``--resumed MODE=OUT`` (the restart's ``rank<r>.json`` files, MODE ``candidate`` or ``verified``) and every
rank: the final parameters and optimizer state digest equals the reference's; the digest of the sample ids trained
on, in order, and their count equal the reference's (no sample skipped, none repeated); the job restored from a
checkpoint (not a fresh start) at the step MODE says: the newest step every rank had a copy of before the restart
(``--held``, from gemscout's inventory of the folder it restarted from) that the trust ledger the crash left in
``--crashed`` allows — ``candidate`` any step not rejected, ``verified`` a RECOVERY_VERIFIED (or durable) one. Exit 0 when all hold,
1 otherwise (one line per failure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def newest(crashed: Path, held: dict[str, list[int]], mode: str) -> int | None:
    """The newest step every rank holds a copy of (``held``: what the folder the restart used held, by rank) that
    ``mode`` may restore: ``candidate`` any step no rank's ledger under ``crashed`` rejected (a capture still in
    memory may have no ledger entry on disk yet), ``verified`` one every ledger records as recovery-verified or
    durable."""
    ledgers = [
        json.loads(p.read_text())["states"]
        for p in sorted(crashed.glob("node-*/rank-*/status.json"))
    ]
    common = set.intersection(*(set(steps) for steps in held.values())) if held else set()
    if mode == "verified":
        ok = [
            s
            for s in common
            if all(ledger.get(str(s)) in {"recovery_verified", "durable"} for ledger in ledgers)
        ]
    else:
        ok = [s for s in common if all(ledger.get(str(s)) != "rejected" for ledger in ledgers)]
    return max(ok, default=None) if ledgers else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", type=Path, required=True)
    ap.add_argument(
        "--crashed",
        type=Path,
        required=True,
        help="the crashed job's checkpoint folder, as it left it",
    )
    ap.add_argument("--resumed", action="append", required=True, help="MODE=OUT (repeat)")
    ap.add_argument(
        "--held",
        action="append",
        required=True,
        help="MODE=JSON: the steps each rank had a copy of before that restart (repeat)",
    )
    ap.add_argument("--nproc", type=int, required=True)
    args = ap.parse_args()
    helds = dict(spec.split("=", 1) for spec in args.held)
    failures: list[str] = []
    for spec in args.resumed:
        mode, _, out = spec.partition("=")
        expected = newest(args.crashed, json.loads(Path(helds[mode]).read_text()), mode)
        for rank in range(args.nproc):
            ref = json.loads((args.reference / f"rank{rank}.json").read_text())
            got = json.loads((Path(out) / f"rank{rank}.json").read_text())
            decision = got["decision"] or {}
            sources = sorted(set((decision.get("sources") or {}).values()))
            line = (
                f"{mode} rank {rank}: resumed at step {got['resume_step']} from {sources} "
                f"({decision.get('mode')}), expected step {expected}"
            )
            checks = {
                "restored from a checkpoint": decision.get("mode") == "restore"
                and got["resume_step"] >= 1,
                f"resumed at the newest {mode} step": got["resume_step"] == expected,
                "parameters and optimizer state bitwise equal": got["state_digest"]
                == ref["state_digest"],
                "same samples in the same order": (got["samples_digest"], got["samples"])
                == (ref["samples_digest"], ref["samples"]),
            }
            bad = [name for name, ok in checks.items() if not ok]
            print(f"check_resume: {line}: {'ok' if not bad else 'FAILED: ' + '; '.join(bad)}")
            failures += bad
    print(
        f"check_resume: {'all ranks resumed bitwise' if not failures else f'{len(failures)} check(s) failed'}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
