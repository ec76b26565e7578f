"""The out-of-band watchdog: reads every rank's progress from the store and reports stalls.

It runs on its own thread (in any rank, or outside the job) and needs nothing from the training threads: it only reads
authenticated progress records through an :class:`~gemscout.watch.channel.OobChannel`. Staleness is measured on the
watchdog's own monotonic clock (when it last *saw* a rank's counters change), so clock skew between hosts is harmless.
Each poll feeds completed DataLoader / checkpoint-I/O rounds to a :class:`~gemscout.watch.stalls.StallDetector`
(through :class:`~gemscout.watch.stalls.SectionRounds`), and when a rank made no progress for ``stall_threshold`` (or
its heartbeat stopped) names the root with :func:`~gemscout.watch.rootcause.locate_root`; one verdict on
``confirmations`` consecutive polls becomes a :class:`~gemscout.watch.findings.StallFinding`, once per episode,
delivered to callbacks (a raising callback is logged).

Only authenticated messages are evidence. A slot the channel saw forged, replayed, deleted or oversized is *tampered*
for ``heartbeat_timeout`` after the last sign of it: its rank's staleness is unknown (the forger may be hiding its
heartbeats), so it is never counted as dead or stuck, and a hang is called only when a rank with an untouched slot has
stopped (a rank that was never seen, e.g. because its slot is deleted as fast as it is written, can join a hang as a
root but never start one). Each tampered slot (and each sweep of foreign keys from a store the watchdog owns) becomes one ``tamper``
finding naming the slot, recommendation ``observe`` (:class:`~gemscout.watch.tamper_findings.TamperEpisodes`): an
outsider can make noise, never a verdict or a restart.

Given the :class:`~gemscout.watch.store_server.StoreServer` that serves the store, each poll first reads its status:
keys the store process swept become a ``foreign_keys`` tamper event, and a store process that is gone becomes one
``tamper`` finding of kind ``store_lost`` per outage, naming the cause and whether it is being restarted; the watchdog
reads nothing while it is down (training goes on, its process group has a store of its own). The server restarts it on
the same port a bounded number of times; when one serves again, a ``tamper`` finding of kind ``store_restored`` says
the outage ended and watching resumes. Past the restart limit the store stays down, said once (in the ``store_lost``
finding, or in a second one when the restarts of an outage all failed). A watchdog without the store process (every
other rank's) reports ``store_lost`` when its reads have failed for ``store_unreachable``, once per outage, reconnects
on its own when the store answers again, and then reports ``store_restored``.

After any time in which the store could not be read (a restart serves an empty store), no rank's silence is evidence:
every rank's heartbeat clock starts again when reads resume, a rank is not stuck until a fresh heartbeat of it has been
read (its counters were not observed across the outage), and a slot that is absent then is not "deleted" (the channel
forgets which slots it saw; the sequence numbers it accepted are kept, so a message replayed from before the outage is
still refused). While foreign keys were swept within the window, a rank's silence is no evidence of its death (a store
filled to its cap refuses genuine messages too): a hang then needs authentic records whose counters stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import DistNetworkError

from gemscout.errors import CollectiveTimeout, ConfigError
from gemscout.watch.channel import OobChannel
from gemscout.watch.findings import StallFinding
from gemscout.watch.outage import StoreOutage
from gemscout.watch.records import PROGRESS_KEY, ProgressRecord
from gemscout.watch.rootcause import locate_root
from gemscout.watch.stalls import SectionRounds, StallConfig, StallDetector
from gemscout.watch.store_health import StoreHealth
from gemscout.watch.tamper import TamperEvent
from gemscout.watch.tamper_findings import TamperEpisodes, TamperIdent

logger = logging.getLogger(__name__)

FindingCallback = Callable[[StallFinding], None]
_STORE_DEATH_S = 1.0  # from a connection reset by a dying store process to its exit being visible


@dataclass(kw_only=True, slots=True, frozen=True)
class WatchdogConfig:
    """When the watchdog calls a stall."""

    stall_threshold: timedelta = timedelta(seconds=120)
    """A rank whose progress counters have not changed for this long is stuck (keep it below collective timeouts)."""
    poll_interval: timedelta = timedelta(seconds=1)
    """Time between two reads of the store."""
    confirmations: int = 2
    """Consecutive polls that must give the same verdict before it is reported."""
    heartbeat_timeout: timedelta | None = None
    """No new heartbeat for this long (none at all since start included) means dead; ``None``: ``stall_threshold``."""
    store_unreachable: timedelta = timedelta(seconds=10)
    """A watchdog without the store process at hand (every rank but the one serving it) reports ``store_lost`` when
    every read failed for this long."""

    def __post_init__(self) -> None:
        if self.stall_threshold <= timedelta(0):
            raise ConfigError(
                f"WatchdogConfig.stall_threshold must be > 0, got {self.stall_threshold}"
            )
        if not timedelta(0) < self.poll_interval < self.stall_threshold:
            raise ConfigError("WatchdogConfig.poll_interval must be > 0 and < stall_threshold")
        if self.confirmations < 1:
            raise ConfigError(
                f"WatchdogConfig.confirmations must be >= 1, got {self.confirmations}"
            )
        if self.store_unreachable <= self.poll_interval:
            raise ConfigError("WatchdogConfig.store_unreachable must be > poll_interval")
        if self.heartbeat_timeout is not None and self.heartbeat_timeout <= self.poll_interval:
            raise ConfigError("WatchdogConfig.heartbeat_timeout must be > poll_interval (or None)")


class Watchdog:
    """Watches ranks ``0 .. world_size-1`` through ``channel`` (which may be an observer channel)."""

    def __init__(
        self,
        channel: OobChannel,
        *,
        world_size: int,
        config: WatchdogConfig | None = None,
        stall_config: StallConfig | None = None,
        callbacks: Iterable[FindingCallback] = (),
        clock: Callable[[], float] = time.monotonic,
        sweep: bool = False,
        store: StoreHealth | None = None,
    ) -> None:
        """``sweep``: the store belongs to this job's OOB channel alone, so each poll deletes keys that are not the
        ranks' slots (leftovers; a bound on memory only against a writer slower than the sweeps). ``store``: the
        process serving the store (see the module docstring)."""
        if world_size < 1:
            raise ConfigError(f"Watchdog world_size must be >= 1, got {world_size}")
        self._channel = channel
        self._world_size = world_size
        self._config = config or WatchdogConfig()
        self._rounds = SectionRounds(StallDetector(stall_config), world_size)
        self._callbacks: list[FindingCallback] = list(callbacks)
        self._clock = clock
        self._lock = threading.Lock()
        self._findings: list[StallFinding] = []
        self._started_at: float | None = None
        self._records: dict[int, ProgressRecord] = {}
        self._seen: dict[
            int, tuple[int, float, int, float]
        ] = {}  # rank -> (events, changed_at, heartbeat, beat_at)
        self._pending: tuple[str, tuple[int, ...]] | None = None
        self._agreeing = 0
        self._episode_reported = False
        self._sweep = sweep
        self._store = store
        self._store_swept = 0
        self._outage = StoreOutage(clock)
        self._read_failed = False  # the last poll could not read the store
        self._resumed_at: float | None = None  # when reads last resumed after an outage
        self._awaiting: set[int] = set()  # ranks without a fresh heartbeat since reads resumed
        self._poll_errors = 0
        self._tamper = TamperEpisodes(
            (self._config.heartbeat_timeout or self._config.stall_threshold).total_seconds()
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def findings(self) -> list[StallFinding]:
        """Every finding emitted so far, oldest first (a copy)."""
        with self._lock:
            return list(self._findings)

    def add_callback(self, callback: FindingCallback) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def start(self) -> Watchdog:
        """Start polling on a daemon thread (idempotent); return ``self``."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="gemscout-oob-watchdog", daemon=True
                )
                self._thread.start()
        return self

    def stop(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Stop polling. Raises :class:`CollectiveTimeout` if the thread is still running after ``timeout``."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout.total_seconds())
            if thread.is_alive():
                raise CollectiveTimeout(f"OOB watchdog did not stop within {timeout}")

    def poll_once(self) -> list[StallFinding]:
        """Read every rank once, update state, deliver and return new findings. Store reads never block on absence."""
        now = self._clock()
        if self._started_at is None:
            self._started_at = now
        early: list[StallFinding] = []  # the store's findings, delivered before the reads
        if self._store is not None:
            early = self._check_store(now)
            for finding in early:
                self._deliver(finding)
            if self._outage.down:
                return early
        if self._read_failed:
            self._resume(now)
        try:
            if self._sweep:
                self._channel.sweep((rank, PROGRESS_KEY) for rank in range(self._world_size))
            records = dict(self._read_records())
        except DistNetworkError as exc:
            self._read_failed = True
            # A dying store process resets connections a moment before it can be reaped: give it that moment, so
            # its loss is a finding rather than a failed poll. Without the process at hand, time the outage.
            if self._store is not None:
                lost = self._await_store_loss(now)
            else:
                one = self._outage.on_unreachable(
                    now, exc, self._config.store_unreachable.total_seconds()
                )
                lost = [one] if one is not None else []
                if not lost and self._outage.down:
                    return early  # reported once; the store may come back (reads then resume)
            if not lost:
                raise
            for finding in lost:
                self._deliver(finding)
            return early + lost
        new: list[StallFinding] = []
        if self._store is None:
            restored = self._outage.on_read(now)
            if restored is not None:
                new.append(restored)
        for rank, rec in records.items():
            prev = self._seen.get(rank)
            if prev is None:
                self._seen[rank] = (rec.events, now, rec.heartbeat, now)
                self._awaiting.discard(rank)
                continue
            events, changed_at, beat, beat_at = prev
            if rec.heartbeat != beat:
                self._awaiting.discard(rank)
            self._seen[rank] = (
                rec.events,
                changed_at if rec.events == events else now,
                rec.heartbeat,
                beat_at if rec.heartbeat == beat else now,
            )
        tampered = self._tamper.update(self._channel.tamper_events(), now)
        new += self._tamper.findings(tampered, records)
        new += self._rounds.feed(records)
        hang = self._check_stall(records, now, tampered)
        if hang is not None:
            new.append(hang)
        for finding in new:
            self._deliver(finding)
        return early + new

    def _await_store_loss(self, now: float) -> list[StallFinding]:
        if self._store is None:
            return []
        deadline = time.monotonic() + _STORE_DEATH_S
        while True:
            lost = self._check_store(now)
            if lost or self._outage.down or time.monotonic() >= deadline:
                return lost
            time.sleep(0.02)

    def _resume(self, now: float) -> None:
        """Reads resume after some that failed: nothing was observed meanwhile, and a restarted store is empty."""
        self._read_failed = False
        self._resumed_at = now
        # A heartbeat missed while the store was unreadable is no evidence: each rank's clock starts again now, and
        # no rank is stuck before a fresh heartbeat of it is read (its owner re-publishes its whole record then).
        self._seen = {r: (e, c, b, max(at, now)) for r, (e, c, b, at) in self._seen.items()}
        self._awaiting = set(range(self._world_size))
        self._channel.forget_presence()

    def _check_store(self, now: float) -> list[StallFinding]:
        """Turn the store process's sweeps into a tamper event; its loss (once per outage), giving up and
        restoration into findings."""
        assert self._store is not None
        status = self._store.status()
        if status.swept > self._store_swept:
            detail = "by the store process" + (
                ", which reached 90 % of its memory cap" if status.pressure else ""
            )
            self._channel.note_foreign_keys(
                status.swept - self._store_swept, status.sample, detail=detail
            )
            self._store_swept = status.swept
        found, restored = self._outage.on_status(status, now)
        if restored:
            self._read_failed = True  # nothing was read meanwhile: resume as after failed reads
        return found

    def _read_records(self) -> dict[int, ProgressRecord]:
        # Start from the last authentic records: a slot that now reads as absent or forged keeps the rank's last
        # known position (an overwritten slot must not erase the evidence); its frozen heartbeat shows it as dead.
        records = self._records
        for rank, payload in self._channel.read_many(range(self._world_size), PROGRESS_KEY).items():
            try:
                record = ProgressRecord.from_payload(payload)
                if record.rank != rank:
                    raise ValueError(f"record names rank {record.rank}")
            except (KeyError, TypeError, ValueError) as exc:
                # Authentic but malformed: a version skew or a bug in a publisher, not an attack; keep its last record.
                logger.warning("ignoring malformed progress record of rank %d: %s", rank, exc)
                continue
            records[rank] = record
        return records

    def _check_stall(
        self,
        records: Mapping[int, ProgressRecord],
        now: float,
        tampered: Mapping[TamperIdent, TamperEvent],
    ) -> StallFinding | None:
        cfg = self._config
        threshold = cfg.stall_threshold.total_seconds()
        beat_timeout = (cfg.heartbeat_timeout or cfg.stall_threshold).total_seconds()
        assert self._started_at is not None
        dead, stuck = [], []
        untrusted = sorted(r for r, k in tampered if r is not None and k == PROGRESS_KEY)
        # Foreign keys swept within the window: a store filled to its cap refuses genuine messages too, so silence is
        # no evidence of death now (else a flood would be a way to call a hang). Authentic frozen counters still are.
        flooded = (None, None) in tampered
        # After an outage, a rank never seen is judged from when reads resumed.
        since = max(self._started_at, self._resumed_at or self._started_at)
        for rank in range(self._world_size):
            rec = records.get(rank)
            if rec is not None and rec.closed:
                continue
            if rank in untrusted:
                continue  # its frozen heartbeat may be the forger's doing: no staleness from a tampered slot
            seen = self._seen.get(rank)
            if seen is None:
                if now - since >= beat_timeout and not flooded:
                    dead.append(rank)
                continue
            if now - seen[3] >= beat_timeout:
                if not flooded:
                    dead.append(rank)
            elif now - seen[1] >= threshold and rank not in self._awaiting:
                stuck.append(rank)
        # Absence alone is no evidence: a slot deleted faster than the polls looks like a rank that never published.
        # A hang needs a rank whose own authentic records show it stopped; never-seen ranks may join it as roots.
        if not any(rank in self._seen for rank in dead + stuck):
            self._pending, self._agreeing, self._episode_reported = None, 0, False
            return None
        if self._episode_reported:
            return None
        verdict = locate_root(
            {r: rec for r, rec in records.items() if r not in dead}, stuck=stuck, dead=dead
        )
        signature = (verdict.kind, verdict.ranks)
        self._agreeing = self._agreeing + 1 if signature == self._pending else 1
        self._pending = signature
        if self._agreeing < cfg.confirmations:
            return None
        self._episode_reported = True
        evidence = dict(verdict.evidence)
        evidence["seconds_without_progress"] = {
            str(r): round(now - s[1], 3) for r, s in sorted(self._seen.items())
        }
        evidence["stall_threshold_s"] = threshold
        if untrusted:
            evidence["tampered_slots"] = [tampered[(r, PROGRESS_KEY)].slot for r in untrusted]
        first = verdict.ranks[0] if verdict.ranks else None
        return StallFinding(
            kind=verdict.kind,
            ranks=verdict.ranks,
            step=verdict.step,
            evidence=evidence,
            confirmations=cfg.confirmations,
            reason=verdict.reason,
            host=records[first].host if first is not None and first in records else None,
            # The job has stopped: restart from a verified state. A timed section that is merely stuck may resume.
            recommendation="restart_from_verified" if verdict.kind == "hang" else "observe",
        )

    def _deliver(self, finding: StallFinding) -> None:
        with self._lock:
            self._findings.append(finding)
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(finding)
            except Exception:
                logger.exception("OOB watchdog callback %r raised; continuing", callback)

    def _run(self) -> None:
        interval = self._config.poll_interval.total_seconds()
        while not self._stop.wait(interval):
            try:
                self.poll_once()
                self._poll_errors = 0
            except Exception:  # a store hiccup must not end the watchdog; the next poll retries
                self._poll_errors += 1
                if (
                    self._poll_errors == 1 or self._poll_errors % 60 == 0
                ):  # a store that is gone fails every poll
                    logger.exception("OOB watchdog poll failed (%d in a row)", self._poll_errors)
