"""``gemscout inspect`` over a corpus of broken and hostile folders: every case prints its report or one error
line, ends with a documented exit code (0 restorable, 2 bad usage, 3 something unusable, 4 a restart would STOP)
and never a traceback. The folders are built with gemscout's own writers (tests/unit/storage_corpus.py), then
damaged the way issue 15 found crashes: FIFOs and links named like step files, ``owner-x``, ``own/`` as a file,
headers whose identity or dtype is a list, a string timestamp in ``faults.jsonl``, deep ``status.json`` /
``run.json`` / sidecar, wrong types in a sidecar, rich markup in a reason."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from gemscout.cli import main
from gemscout.gemini import store

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from storage_corpus import build, header_doc, rewrite_header  # noqa: E402


def inspect(*args: str) -> tuple[int, str]:
    """``gemscout inspect`` in-process: its exit code and everything it printed (stdout and stderr together). An
    exception escaping ``main`` is a failure of the one-line promise, turned into its traceback text here."""
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            code = main(["inspect", *args])
        except SystemExit as exc:  # argparse's own usage errors
            code = int(exc.code or 0)
        except BaseException:
            code = -1
            out.write(traceback.format_exc())
    return code, out.getvalue()


DEEP = "[" * 100_000 + "]" * 100_000
R1 = ("node-1", "rank-1")


def _r1(ckpt: Path) -> store.RankPaths:
    return store.RankPaths(ckpt.joinpath(*R1))


def _retyped_header(edit: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    def damage(ckpt: Path, durable: Path) -> None:
        path = store.step_file(_r1(ckpt).own, 2)
        doc = header_doc(path)
        edit(doc)
        rewrite_header(path, doc)

    return damage


def _own_is_a_file(ckpt: Path, durable: Path) -> None:
    own = _r1(ckpt).own
    shutil.rmtree(own)
    own.write_text("x")


def _fault_line(ckpt: Path, durable: Path) -> None:
    line = {
        "version": 1,
        "kind": "sdc",
        "scope": "rank",
        "ranks": [0],
        "step": 2,
        "recipe": None,
        "evidence": {},
        "confirmations": 1,
        "reason": "x",
        "host": None,
        "timestamp": "yesterday",
        "reported_by": 0,
    }
    with open(_r1(ckpt).root / "faults.jsonl", "a") as fh:
        fh.write(json.dumps(line) + "\n" + DEEP + "\n")


def _markup(ckpt: Path) -> None:
    line = json.loads((_r1(ckpt).root / "faults.jsonl").read_text().splitlines()[0])
    with open(_r1(ckpt).root / "faults.jsonl", "a") as fh:
        fh.write(json.dumps({**line, "reason": "closing [/red] with no opening [bold"}) + "\n")


def _sidecar(doc_edit: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    def damage(ckpt: Path, durable: Path) -> None:
        path = durable / "step-000000004" / "gemscout-sidecar.json"
        doc = json.loads(path.read_text())
        doc_edit(doc)
        path.write_text(json.dumps(doc))

    return damage


CASES: dict[str, tuple[Callable[[Path, Path], None], set[int]]] = {
    "healthy": (lambda c, d: None, {0}),
    "fifo step file": (lambda c, d: os.mkfifo(store.step_file(_r1(c).own, 9)), {3}),
    "link to /dev/zero": (
        lambda c, d: os.symlink("/dev/zero", store.step_file(_r1(c).own, 8)),
        {3},
    ),
    "owner-x folder": (lambda c, d: (_r1(c).root / "replicas" / "owner-x").mkdir(), {0}),
    "replicas is a file": (
        lambda c, d: (
            shutil.rmtree(_r1(c).root / "replicas"),
            (_r1(c).root / "replicas").write_text("x"),
        ),
        {3},
    ),
    "own is a file": (_own_is_a_file, {3}),
    "identity is a list": (_retyped_header(lambda d: d.update(identity=["corpus", 2])), {3}),
    "dtype is a list": (_retyped_header(lambda d: d["tensors"][0].update(dtype=["float32"])), {3}),
    "overlapping offsets": (_retyped_header(lambda d: d["tensors"][1].update(offset=0)), {3}),
    "string timestamp in faults.jsonl": (_fault_line, {0}),
    "deep status.json": (lambda c, d: _r1(c).status.write_text('{"states": ' + DEEP + "}"), {3}),
    "status.json is a fifo": (lambda c, d: (_r1(c).status.unlink(), os.mkfifo(_r1(c).status)), {3}),
    "deep run.json": (lambda c, d: (c / "run.json").write_text(DEEP), {0, 3}),
    "run.json is a list": (lambda c, d: (c / "run.json").write_text("[1]"), {0, 3}),
    "deep sidecar": (
        lambda c, d: (d / "step-000000004" / "gemscout-sidecar.json").write_text(DEEP),
        {3},
    ),
    "sidecar files is a list": (_sidecar(lambda s: s.update(files=[1])), {3}),
    "sidecar size is a string": (
        _sidecar(lambda s: next(iter(s["files"].values())).update(size="1")),
        {3},
    ),
    "sidecar file name escapes": (
        _sidecar(lambda s: s["files"].update({"../x": {"sha256": "0" * 64, "size": 0}})),
        {3},
    ),
    "a folder in a promotion": (lambda c, d: (d / "step-000000004" / "sub").mkdir(), {3}),
    "markup in a reason": (lambda c, d: _markup(c), {0}),
    "every file gone": (lambda c, d: [p.unlink() for p in c.rglob("*.gsc")], {0, 4}),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    build(root)
    return root


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(CASES))
def test_inspect_over_a_broken_folder_is_one_report_or_one_line(
    pristine: Path, tmp_path: Path, name: str
) -> None:
    ckpt, durable = tmp_path / "ckpt", tmp_path / "durable"
    shutil.copytree(pristine / "ckpt", ckpt, symlinks=True)
    shutil.copytree(pristine / "durable", durable, symlinks=True)
    damage, codes = CASES[name]
    damage(ckpt, durable)
    # --verify: every file read whole and every digest checked, the widest path through the readers.
    args = [str(ckpt), "--durable", str(durable), "--verify"]
    code, out = inspect(*args)
    assert "Traceback" not in out, out
    assert code in codes, (code, out)
    assert "a restart would" in out, out
    if name in ("healthy", "markup in a reason", "own is a file"):
        code, out = inspect(*args, "--json")
        assert code in codes and "Traceback" not in out, out
        json.loads(out)


@pytest.mark.timeout(30)
def test_a_directory_that_is_a_fifo_or_missing_is_one_line_and_exit_2(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    for target in (tmp_path / "fifo", tmp_path / "missing", tmp_path):
        code, out = inspect(str(target))
        assert code == 2 and len(out.strip().splitlines()) == 1, out
