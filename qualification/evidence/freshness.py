"""What git says about a commit: the source facts recorded at seal time, and freshness against main at verify time.

Freshness is a separate dimension from validity: a bundle can be perfectly valid and still describe a commit that main
has moved past. The states, in the order they are decided:

* UNKNOWN: no repository, git missing, main ref or commit not in the clone (shallow?), or the bundle was sealed from
  a dirty tree (its contents match no commit, so nothing can make it current).
* CURRENT: the commit is main's head.
* STALE: the commit is an ancestor of main's head; ``commits_behind`` says by how much.
* NOT-ON-MAIN: anything else (a side branch, unmerged work, or main was rewritten).

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


class Freshness(StrEnum):
    CURRENT = "CURRENT"
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
    return FreshnessReport(
        state=Freshness.STALE,
        commits_behind=behind,
        main_ref=main_ref,
        main_head=head,
        reason=f"{main_ref} is {behind} commit(s) ahead of {commit[:12]} (now at {head[:12]})",
    )
