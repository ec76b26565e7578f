"""Recovery is total: whatever one rank finds in its folder, every rank gets the decision within seconds, never a
dead rank whose peers sit in a gather until the collective timeout (300 s here, the default).

Two real gloo ranks, real files built with gemscout's own writer, the default 300 s collective timeout; each case
asserts the decision, the restored bytes (bitwise equal to the step's own state) and that ``recover()`` returned on
both ranks in under 10 s. Rank 1's folder is poisoned with: a ``replicas/owner-x`` folder, a FIFO and a link to
``/dev/zero`` named like step files, a junk name of non-ASCII digits, headers (digests recomputed) whose identity
or a dtype is a list; then ``own/`` as a file; then a header forged with recomputed
digests and another shape, which verifies and then fails to load. The last case is an unexpected error inside
propose() on rank 1 (the one mock here: every real input is now refused per source, so a bug is simulated by
making the ledger's summary raise RecursionError): every rank stops with a RecoveryError naming it. The job runs
with an integrity key, so the keyed path (files, replicas over the wire, peer transfers) is exercised end to end;
the forgeries here are made inside the job, with its key, so they test the structural checks, not the MAC. First of
all, a byte of rank 1's step-3 slot file in the memory tier (/dev/shm) is flipped: refused on load, the ranks decide
again and rank 1 restores its disk file (fail closed for shared memory too)."""

from __future__ import annotations

from pathlib import Path

import pytest
from two_ranks import prelude, run_cases

PROGRAM = (
    prelude(300)
    + r"""
import time; T0 = time.monotonic()
from gemscout.errors import RecoveryError
from gemscout.gemini import store
from gemscout.state.layout import Layout, build_header, frame_prefix, tensor_digests
s = gemscout.enable_resiliency(model, opt, checkpoint=gemscout.CheckpointConfig(
    directory=sys.argv[1], run_id="total", fsync=False, handle_signals=False, max_recovery_attempts=10,
    persist_every=1,  # the poisoned sources include every step's files on disk
    integrity_key="5e" * 32))
ck = s.checkpointer
at = {}
for i in range(1, 4):
    train(i)
    ck.drain(); at[i] = digest()
own = ck.paths.own
assert store.step_file(own, 3).read_bytes()[:8] == b"GEMSCKK1"  # keyed: every frame, file and replica, has a MAC
def lose_memory():
    if rank == 1:
        for slot in ck.pool.ready_slots():
            slot.ready.clear()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
def forged(step, edit):
    # A header rewritten with gemscout's own writer, its header digest recomputed.
    parsed, data = store.read_verified(store.step_file(own, 3))
    doc = json.loads(build_header(parsed.layout, list(parsed.digests), parsed.skeleton, {**parsed.identity, "step": step}))
    edit(doc)
    store.write_checkpoint(store.step_file(own, step), frame_prefix(json.dumps(doc).encode()), data, fsync=False)
print(f"setup {time.monotonic() - T0:.1f}s", flush=True)
def recover(case):
    dist.barrier()
    t0 = time.monotonic()
    try:
        d = s.recover(failure_kind="test")
    except RecoveryError as exc:
        d = exc
    dt = time.monotonic() - t0
    assert dt < 10, f"{case}: recover took {dt:.1f}s"
    print(f"case {case}: recover returned in {dt:.2f}s", flush=True)
    return d
# E. A slot of the memory tier (a file in /dev/shm, mapped) mutated behind gemscout's back: one data byte flipped in
# the file, its header untouched. It is proposed as memory, refused when loaded, and rank 1 restores from its disk.
if rank == 1:
    (slot,) = [sl for sl in ck.pool.ready_slots() if sl.step == 3]
    assert slot.file is not None and str(slot.file.path).startswith("/dev/shm/")
    at_byte = slot.file.data_offset + 5
    fd = os.open(slot.file.path, os.O_RDWR)
    os.pwrite(fd, bytes([os.pread(fd, 1, at_byte)[0] ^ 0x10]), at_byte)
    os.close(fd)
d = recover("E")
assert d.step == 3 and d.sources == {0: "memory", 1: "local"}, d
assert digest() == at[3]
print("CASE E OK", flush=True)
# A. Poisoned sources beside good ones: each is refused on its own, step 3 restores (rank 1 from its own file).
if rank == 1:
    (ck.paths.root / "replicas" / "owner-x").mkdir(parents=True)
    os.mkfifo(store.step_file(own, 9))
    os.symlink("/dev/zero", store.step_file(own, 8))
    forged(7, lambda doc: doc.update(identity=["total", 7]))
    forged(6, lambda doc: doc["tensors"][0].update(dtype=["float32"]))
    (own / "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0665.gsc").write_bytes(b"junk")
lose_memory()
d = recover("A")
assert d.step == 3 and d.sources[1] == "local", d
assert "not a regular file" in d.reason and "symbolic link" in d.reason and "identity" in d.reason, d.reason
assert digest() == at[3]
assert 3 in store.list_steps(own) and (rank == 0 or 5 not in store.list_steps(own))
print("CASE A OK", flush=True)
# B. own/ is a file: rank 1's step 3 comes from the replica its peer holds.
if rank == 1:
    os.rename(own, own.with_name("own-aside")); own.write_text("not a folder")
lose_memory()
d = recover("B")
assert d.step == 3 and d.sources[1] == "peer:0", d
assert "own folder" in d.reason, d.reason
assert digest() == at[3]
if rank == 1:
    own.unlink(); os.rename(own.with_name("own-aside"), own)
print("CASE B OK", flush=True)
# C. A forged header (recomputed digests, another shape) verifies, then cannot be loaded: the ranks decide again.
if rank == 1:
    parsed, data = store.read_verified(store.step_file(own, 3))
    views = parsed.layout.views(data)
    i = next(i for i, v in enumerate(views) if v.shape == (4, 8))
    views[i] = views[i].reshape(8, 4)
    layout = Layout.of(views)
    header = build_header(layout, tensor_digests(layout, data), parsed.skeleton, parsed.identity)
    store.write_checkpoint(store.step_file(own, 3), frame_prefix(header), data, fsync=False)
lose_memory()
d = recover("C")
assert d.step == 3 and d.sources[1] == "peer:0", d
assert "restore failed" in d.reason, d.reason
assert digest() == at[3]
print("CASE C OK", flush=True)
# D. An unexpected error while proposing (simulated, see the module docstring): every rank stops, naming it.
if rank == 1:
    def broken():
        raise RecursionError("maximum recursion depth exceeded")
    ck.ledger.summary = broken
d = recover("D")
assert isinstance(d, RecoveryError) and "rank 1 cannot propose: RecursionError" in str(d), d
print("CASE D OK", flush=True)
s.close(); dist.barrier()
os._exit(0)
"""
)


@pytest.mark.timeout(150)
def test_a_poisoned_folder_on_one_rank_gives_every_rank_a_decision_within_seconds(
    tmp_path: Path,
) -> None:
    run_cases(PROGRAM, tmp_path, "EABCD")
