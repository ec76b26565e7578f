"""The trust ledger and the fault log under the job's integrity key: a forgery without the key changes nothing.

Two real gloo ranks, real files, the job's integrity key. Steps 1-3 are captured, step 2 certified, step 3 not;
recovery asks for ``recovery_verified``. The session is closed (a restart: the next one reads the ledger from disk),
then, as someone who can write rank 1's folder but has no key: rank 1's ``status.json`` is rewritten to say step 3 is
verified (recovery takes the strongest trust any rank recorded, so without the MAC this forgery alone would make
the uncertified step 3 restorable), and a forged ``hang`` report is appended to its ``faults.jsonl`` next to an
authentic one. The next session must refuse rank 1's ledger (``load_problem`` names it), every rank must restore
step 2 (bitwise the state captured at step 2, rank 0's ledger being what remains), and the fault-log reader must
return the authentic report alone. Then rank 0's authentic ledger copied into rank 1's folder is refused too (the
MAC is bound to the rank folder)."""

from __future__ import annotations

from pathlib import Path

import pytest
from two_ranks import prelude, run_cases

PROGRAM = (
    prelude(60)
    + r"""
import shutil
from pathlib import Path
from gemscout import faultlog
from gemscout.gemini.lifecycle import TrustLedger, parse_ledger
from gemscout.config import TrustState
config = gemscout.CheckpointConfig(
    directory=sys.argv[1], run_id="forge", fsync=False, handle_signals=False, integrity_key="a7" * 32,
    persist_every=1,  # every capture, and so its trust, on disk: what the forger rewrites
    min_trust="recovery_verified")
s = gemscout.enable_resiliency(model, opt, checkpoint=config)
ck = s.checkpointer
at = {}
for i in range(1, 4):
    train(i)
    ck.drain(); at[i] = digest()
    if i == 2:
        s.certify(2)
root = ck.paths.root
authentic = {"version": 1, "kind": "straggler", "scope": "rank", "ranks": [1], "step": 2, "recipe": None,
             "evidence": {}, "confirmations": 4, "reason": "authentic", "host": None, "timestamp": 1.0,
             "reported_by": rank}
faultlog.FaultLog(root / faultlog.FILE_NAME, fsync=False).append(authentic)
s.close(release_memory=False)
dist.barrier()
if rank == 1:  # the forger: can write rank 1's folder, has no key
    doc = json.loads((root / "status.json").read_text())
    assert "mac" in doc and doc["states"]["3"] == "candidate", doc
    doc.pop("mac"); doc["states"]["3"] = "recovery_verified"
    (root / "status.json").write_text(json.dumps(doc))
    assert parse_ledger(doc)[1][3] == TrustState.RECOVERY_VERIFIED  # unauthenticated, it would be believed
    forged = {**authentic, "kind": "hang", "ranks": [0], "reason": "forged", "reported_by": 1}
    with open(root / faultlog.FILE_NAME, "a") as f:
        f.write(json.dumps(forged) + "\n")
dist.barrier()
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
s = gemscout.enable_resiliency(model, opt, checkpoint=config)
ck = s.checkpointer
problem = ck.ledger.load_problem
if rank == 1:
    assert problem and "not authenticated" in problem and "status.json" in problem, problem
    assert ck.ledger.states == {}, ck.ledger.states
else:
    assert problem is None and ck.ledger.states[2] == TrustState.RECOVERY_VERIFIED, (problem, ck.ledger.states)
d = s.recover(failure_kind="test")
assert d.step == 2, d
assert digest() == at[2], "restored state is not step 2's"
print("CASE LEDGER OK", flush=True)
kept = faultlog.read_reports(root)
assert [r["reason"] for r in kept] == ["authentic"], kept
print("CASE FAULTLOG OK", flush=True)
s.close(release_memory=False)
dist.barrier()
if rank == 1:  # an authentic ledger, but rank 0's
    other = next(Path(sys.argv[1]).glob("*/rank-0")) / "status.json"
    shutil.copy(other, root / "status.json")
    copied = TrustLedger.load(root / "status.json")
    assert copied.states == {} and "MAC does not match" in (copied.load_problem or ""), copied
    mine = TrustLedger.load(other)
    assert mine.load_problem is None and mine.states[2] == TrustState.RECOVERY_VERIFIED, mine
print("CASE COPY OK", flush=True)
dist.barrier()
os._exit(0)
"""
)


@pytest.mark.timeout(150)
def test_a_ledger_or_fault_log_forged_without_the_key_is_refused_and_recovery_uses_what_remains(
    tmp_path: Path,
) -> None:
    run_cases(PROGRAM, tmp_path, ("LEDGER", "FAULTLOG", "COPY"))
