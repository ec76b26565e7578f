"""What git says about a commit: the source facts recorded at seal time, and freshness against main at verify time.

Freshness is a separate dimension from validity: a bundle can be perfectly valid and still describe a commit that main
has moved past. The states, in the order they are decided:

* UNKNOWN: no repository, git missing, main ref or commit not in the clone (shallow?), or the bundle was sealed from
  a dirty tree (its contents match no commit, so nothing can make it current).
* CURRENT: the commit is main's head.
* CURRENT-EVIDENCE-ONLY: the commit is an ancestor of main's head, and the two trees differ only in evidence files
  (:func:`evidence_only`): the code, tests, campaigns and prose at main's head are exactly those the bundle ran.
  This is how committed evidence always stands: a bundle sealed at X is committed in X+1, which adds only evidence.
  ``commits_behind`` still says how far main has moved; ``non_evidence`` is empty.
* STALE: the commit is an ancestor of main's head and something else changed since; ``commits_behind`` says by how
  much, ``non_evidence`` names the first paths that are not evidence.
* NOT-ON-MAIN: anything else (a side branch, unmerged work, or main was rewritten).

Evidence files, exactly (:data:`EVIDENCE_DIRS`, :data:`EVIDENCE_FILES`): anything under ``docs/evidence/``;
``docs/validation.md``; and a Markdown file (``*.md``, anywhere) whose text is the same at both commits once the body
and the recorded digest of every generated figures block (:mod:`qualification.report.docblocks`) are set aside, so a
re-rendered README block passes and one word of prose outside a block does not. The comparison is between the two
trees (``git diff X HEAD``), not commit by commit: the evidence describes a tree, so a change made and reverted in
between leaves it exact. A rename, a mode change or a deleted file counts like any other change to its paths.

The verifier never fetches: run ``git fetch`` first and pass ``--main-ref origin/main`` to judge against the remote.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from qualification.errors import UsageError

GIT_TIMEOUT = timedelta(seconds=30)
# Inherited from a git hook, these would point every command at another repository than the one we were given.
_GIT_LOCATION_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY")


EVIDENCE_DIRS = ("docs/evidence/",)
EVIDENCE_FILES = ("docs/validation.md",)
MAX_LISTED = 5
"""Non-evidence paths named in a STALE reason (the rest are counted)."""


class Freshness(StrEnum):
    CURRENT = "CURRENT"
    CURRENT_EVIDENCE_ONLY = "CURRENT-EVIDENCE-ONLY"
    STALE = "STALE"
    NOT_ON_MAIN = "NOT-ON-MAIN"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True, slots=True, kw_only=True)
class FreshnessReport:
    """Freshness of one commit against ``main_ref`` (resolved to ``main_head``); ``reason`` is a human sentence."""

    state: Freshness
    commits_behind: int | None
    main_ref: str
    main_head: str | None
    reason: str
    non_evidence: tuple[str, ...] = ()
    """STALE only: the paths changed since the commit that are not evidence files (all of them, sorted)."""

    @property
    def covers_head(self) -> bool:
        """The bundle describes main's head: CURRENT, or CURRENT-EVIDENCE-ONLY."""
        return self.state in (Freshness.CURRENT, Freshness.CURRENT_EVIDENCE_ONLY)


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceFacts:
    """The checkout a bundle is sealed from. ``repository`` never carries credentials (userinfo is stripped)."""

    root: Path
    commit: str
    ref: str | None
    dirty: bool
    repository: str | None


def _git(repo: Path, *args: str, timeout: timedelta) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in _GIT_LOCATION_VARS}
    env["LC_ALL"] = "C"
    return subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout.total_seconds(),
        check=False,
    )


def read_source(
    repo: Path, *, exclude: Path | None = None, timeout: timedelta = GIT_TIMEOUT
) -> SourceFacts:
    """Commit, ref, dirty flag and remote of the checkout at ``repo``.

    ``exclude`` (the bundle being sealed, if it lies inside the checkout) does not count towards dirtiness; any other
    modified or untracked, non-ignored file does. Blocks on git for up to ``timeout`` per call. Raises
    :class:`UsageError` when ``repo`` is not a git checkout: evidence that names no commit cannot be sealed.
    """
    try:
        top = _git(repo, "rev-parse", "--show-toplevel", timeout=timeout)
        if top.returncode != 0:
            raise UsageError(
                f"{repo} is not a git checkout; evidence must be bound to a commit (use --repo)"
            )
        toplevel = Path(top.stdout.strip())
        head = _git(toplevel, "rev-parse", "--verify", "HEAD^{commit}", timeout=timeout)
        if head.returncode != 0:
            raise UsageError(f"{toplevel} has no commit yet; commit before sealing evidence")
        status_args = ["status", "--porcelain", "--untracked-files=normal"]
        if exclude is not None and exclude.resolve().is_relative_to(toplevel.resolve()):
            relative = exclude.resolve().relative_to(toplevel.resolve()).as_posix()
            status_args += ["--", f":(top,exclude){relative}"]
        status = _git(toplevel, *status_args, timeout=timeout)
        if status.returncode != 0:
            raise UsageError(f"git status failed in {toplevel}: {status.stderr.strip()}")
        symbolic = _git(toplevel, "symbolic-ref", "-q", "HEAD", timeout=timeout)
        remote = _git(toplevel, "config", "--get", "remote.origin.url", timeout=timeout)
    except FileNotFoundError as exc:
        raise UsageError("git is not installed; it is needed to bind evidence to a commit") from exc
    except subprocess.TimeoutExpired as exc:
        raise UsageError(
            f"git did not answer within {timeout.total_seconds():.0f} s in {repo}"
        ) from exc
    ref = (
        symbolic.stdout.strip()
        if symbolic.returncode == 0
        else os.environ.get("GITHUB_REF") or None
    )
    return SourceFacts(
        root=toplevel,
        commit=head.stdout.strip().lower(),
        ref=ref,
        dirty=bool(status.stdout.strip()),
        repository=_without_credentials(remote.stdout.strip()) if remote.returncode == 0 else None,
    )


def _without_credentials(url: str) -> str | None:
    """``url`` with any ``user:token@`` removed; a token in a remote URL must never reach a manifest."""
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme and "@" in parts.netloc:
        return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    return url


def check_freshness(
    commit: str,
    *,
    repo: Path | None,
    main_ref: str = "main",
    dirty: bool = False,
    timeout: timedelta = GIT_TIMEOUT,
) -> FreshnessReport:
    """Where ``commit`` stands against ``main_ref`` in ``repo`` (see the module docstring). Never raises for git
    trouble: anything git cannot answer within ``timeout`` is UNKNOWN, with the reason."""

    def unknown(reason: str, head: str | None = None) -> FreshnessReport:
        return FreshnessReport(
            state=Freshness.UNKNOWN,
            commits_behind=None,
            main_ref=main_ref,
            main_head=head,
            reason=reason,
        )

    if repo is None:
        return unknown("no repository given to compare against main")
    try:
        if _git(repo, "rev-parse", "--git-dir", timeout=timeout).returncode != 0:
            return unknown(f"{repo} is not a git repository")
        resolved = _git(
            repo, "rev-parse", "--verify", "--quiet", f"{main_ref}^{{commit}}", timeout=timeout
        )
        if resolved.returncode != 0:
            return unknown(
                f"main ref {main_ref!r} is not in {repo} (git fetch, or pass --main-ref)"
            )
        head = resolved.stdout.strip().lower()
        if dirty:
            return unknown(
                f"sealed from a dirty tree: the payload matches no commit, not even {commit[:12]}",
                head,
            )
        if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}", timeout=timeout).returncode != 0:
            return unknown(
                f"commit {commit[:12]} is not in {repo} (shallow clone? git fetch --unshallow)",
                head,
            )
        if commit == head:
            return FreshnessReport(
                state=Freshness.CURRENT,
                commits_behind=0,
                main_ref=main_ref,
                main_head=head,
                reason=f"{commit[:12]} is the head of {main_ref}",
            )
        ancestor = _git(repo, "merge-base", "--is-ancestor", commit, head, timeout=timeout)
        if ancestor.returncode == 1:
            return FreshnessReport(
                state=Freshness.NOT_ON_MAIN,
                commits_behind=None,
                main_ref=main_ref,
                main_head=head,
                reason=f"{commit[:12]} is not on {main_ref} (side branch, unmerged, or history rewritten)",
            )
        count = _git(repo, "rev-list", "--count", f"{commit}..{head}", timeout=timeout)
        if ancestor.returncode != 0 or count.returncode != 0:
            return unknown(
                f"git could not relate {commit[:12]} to {main_ref}: {ancestor.stderr.strip()}", head
            )
    except FileNotFoundError:
        return unknown("git is not installed")
    except subprocess.TimeoutExpired:
        return unknown(f"git did not answer within {timeout.total_seconds():.0f} s")
    behind = int(count.stdout.strip())
    try:
        changed = evidence_only(repo, commit, head, timeout=timeout)
    except subprocess.TimeoutExpired:
        return unknown(f"git did not answer within {timeout.total_seconds():.0f} s", head)
    if changed is None:
        return unknown(f"git could not diff {commit[:12]} against {main_ref}", head)
    ahead = f"{main_ref} is {behind} commit(s) ahead of {commit[:12]} (now at {head[:12]})"
    listed = ", ".join(changed[:MAX_LISTED]) + (
        f" and {len(changed) - MAX_LISTED} more" if len(changed) > MAX_LISTED else ""
    )
    return FreshnessReport(
        state=Freshness.STALE if changed else Freshness.CURRENT_EVIDENCE_ONLY,
        commits_behind=behind,
        main_ref=main_ref,
        main_head=head,
        reason=f"{ahead} and changes more than evidence: {listed}"
        if changed
        else f"{ahead}, and they change only evidence files (docs/evidence/, docs/validation.md, "
        "generated blocks)",
        non_evidence=tuple(changed),
    )


def evidence_only(
    repo: Path, old: str, new: str, *, timeout: timedelta = GIT_TIMEOUT
) -> list[str] | None:
    """The paths that differ between commits ``old`` and ``new`` and are not evidence files (see the module
    docstring), sorted; empty when only evidence changed; None when git cannot say. Raises TimeoutExpired."""
    diff = _git(repo, "diff", "--name-only", "--no-renames", "-z", old, new, timeout=timeout)
    if diff.returncode != 0:
        return None
    others = []
    for path in sorted(p for p in diff.stdout.split("\0") if p):
        if path in EVIDENCE_FILES or path.startswith(EVIDENCE_DIRS):
            continue
        if path.endswith(".md") and _same_outside_blocks(repo, old, new, path, timeout):
            continue
        others.append(path)
    return others


def _same_outside_blocks(repo: Path, old: str, new: str, path: str, timeout: timedelta) -> bool:
    """``path`` exists at both commits and reads the same once generated blocks' bodies are set aside."""
    texts = []
    for commit in (old, new):
        shown = _git(repo, "show", f"{commit}:{path}", timeout=timeout)
        if shown.returncode != 0:
            return False  # added or deleted: a change of the prose itself
        texts.append(_outside_blocks(shown.stdout))
    return texts[0] is not None and texts[0] == texts[1]


def _outside_blocks(text: str) -> list[str] | None:
    """The lines of ``text`` with each generated block's body removed and its marker reduced to the bundle it names
    (its digest covers only the body); None for an unterminated block (not something a renderer wrote)."""
    # Here, not at the top: qualification.report imports the verifier, which imports this module.
    from qualification.report.docblocks import BEGIN, END

    kept: list[str] = []
    inside = False
    for line in text.splitlines():
        match = BEGIN.match(line)
        if inside:
            inside = line != END
            if not inside:
                kept.append(line)
        elif match:
            kept.append(f"<!-- BEGIN GENERATED figures bundle={match['bundle']} -->")
            inside = True
        else:
            kept.append(line)
    return None if inside else kept
