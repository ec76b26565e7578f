"""Turn the ranks' raw JSON into one size's measurements, ratios and verdicts, and render them.

Conventions: times are seconds, throughputs GB/s (1e9 bytes per second), sizes bytes. Loop statistics drop the
first ``warmup`` steps (the first captures allocate and first-touch the slots). A ratio pairs numbers from the same
rank and the worse rank is reported; collective timings take the slower rank; peak RSS takes the ranks' mean.
"""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

TARGETS: dict[str, tuple[str, float]] = {
    "stall_vs_memcpy": ("<=", 0.25),
    "stall_overlap_vs_memcpy": ("<=", 0.25),
    "stall_tight_skip_vs_memcpy": ("<=", 0.25),
    "blocking_vs_async_save": ("<=", 0.1),
    "replication_vs_gloo": (">=", 0.7),
    "pipeline_memory_vs_memcpy": ("<=", 4.0),
    "restart_memory_speedup_vs_dcp_load": (">=", 3.0),
    "node_loss_recovery_vs_raw_transfer": (">=", 0.8),
    "loop_slowdown_overlap": ("<=", 1.03),
    "rss_extra_vs_state": ("<=", 4.2),
}
INFO_RATIOS = (
    "blocking_tight_vs_async_save",
    "blocking_vs_save",
    "capture_return_vs_async_save",
    "replication_in_loop_vs_gloo",
    "exchange_vs_gloo",
    "recovery_transfer_speedup_vs_dcp_load",
    "recovery_speedup_vs_dcp_load_cold",
    "recovery_floor_speedup_vs_dcp_load",
    "persist_vs_write",
    "rss_gemini_buffers_vs_state",
    "loop_slowdown_tight",
    "recovery_speedup_vs_dcp_load",
    "pipeline_vs_memcpy",
)
RATIO_KEYS = (*TARGETS, *INFO_RATIOS)
MEASUREMENT_KEYS = (
    "state_bytes",
    "params",
    "frame_bytes",
    "memcpy_s",
    "memcpy_gbps",
    "fwd_bwd_tight_s",
    "step_off_tight_s",
    "step_on_tight_s",
    "stall_tight_s",
    "stall_tight_pre_s",
    "stall_tight_post_s",
    "stall_tight_max_s",
    "reported_stall_tight_s",
    "step_on_tight_skip_s",
    "stall_tight_skip_s",
    "stall_tight_skip_max_s",
    "tight_skip_captured_fraction",
    "tight_skip_max_steps_lost",
    "overlap_micro_batches",
    "fwd_bwd_overlap_s",
    "step_off_overlap_s",
    "step_on_overlap_s",
    "stall_overlap_s",
    "stall_overlap_pre_s",
    "stall_overlap_post_s",
    "stall_overlap_max_s",
    "reported_stall_overlap_s",
    "capture_return_s",
    "capture_pipeline_s",
    "pipeline_estimate_s",
    "dcp_async_save_blocking_s",
    "dcp_async_save_total_s",
    "dcp_save_s",
    "dcp_load_s",
    "dcp_load_cold_s",
    "replicate_s",
    "replication_gbps",
    "replicate_in_loop_s",
    "replication_in_loop_gbps",
    "exchange_s",
    "exchange_gbps",
    "gloo_pair_s",
    "gloo_pair_gbps",
    "recover_s",
    "recover_transfer_s",
    "recover_transfer_recv_s",
    "recover_transfer_verify_s",
    "recover_transfer_restore_s",
    "recover_raw_recv_s",
    "survivor_files_verified",
    "survivor_files_verify_s",
    "survivor_files_inventory_s",
    "rss_off_bytes",
    "rss_on_bytes",
    "rss_extra_bytes",
    "gemini_buffer_bytes",
    "digest_s",
    "digest_gbps",
    "write_s",
    "write_gbps",
    "persist_s",
    "persist_gbps",
    "persist_in_loop_s",
    "capture_pipeline_memory_s",
    "capture_pipeline_disk_s",
    "restart_memory_s",
    "restart_memory_verify_s",
    "restart_memory_restore_s",
)


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _loop(rank: dict[str, Any], name: str, warmup: int) -> dict[str, float]:
    loop = rank["loops"][name]
    cut = min(warmup, len(loop["step_s"]) - 1)
    out = {"fwd_bwd": _med(loop["fwd_bwd_s"][cut:]), "step": _med(loop["step_s"][cut:])}
    if "pre_hook_s" in loop:
        pre, post = loop["pre_hook_s"][cut:], loop["post_hook_s"][cut:]
        stall = [a + b for a, b in zip(pre, post, strict=True)]
        out.update(
            stall=_med(stall),
            pre=_med(pre),
            post=_med(post),
            max=max(stall),
            reported=_med(loop["reported_stall_s"][cut:]),
        )
    return out


def _rank_figures(r: dict[str, Any], warmup: int) -> dict[str, float]:
    """One rank's figures (``--role on`` output); each is later reduced over ranks."""
    t_off, o_off = _loop(r, "tight_off", warmup), _loop(r, "overlap_off", warmup)
    t_on, o_on = _loop(r, "tight_on", warmup), _loop(r, "overlap_on", warmup)
    quiet, loops = r["window"], r["loops"]
    skip = _loop(r, "tight_skip_on", warmup)
    steps, skipped = loops["tight_skip_on"]["steps"], set(loops["tight_skip_on"]["skipped_steps"])
    run, lost = 0, 0
    for s in steps:  # a failure right before a capture loses the steps since the previous one
        run = run + 1 if s in skipped else 0
        lost = max(lost, run + 1)
    return {
        "step_on_tight_skip_s": skip["step"],
        "stall_tight_skip_s": skip["stall"],
        "stall_tight_skip_max_s": skip["max"],
        "tight_skip_captured_fraction": 1 - len(skipped) / max(1, len(steps)),
        "tight_skip_max_steps_lost": lost,
        "memcpy_s": r["memcpy_s"],
        "digest_s": r["digest_s"],
        "write_s": r["write_s"],
        "fwd_bwd_tight_s": t_off["fwd_bwd"],
        "step_off_tight_s": t_off["step"],
        "step_on_tight_s": t_on["step"],
        "stall_tight_s": t_on["stall"],
        "stall_tight_pre_s": t_on["pre"],
        "stall_tight_post_s": t_on["post"],
        "stall_tight_max_s": t_on["max"],
        "reported_stall_tight_s": t_on["reported"],
        "overlap_micro_batches": loops["overlap_on"]["micro_batches"],
        "fwd_bwd_overlap_s": o_off["fwd_bwd"],
        "step_off_overlap_s": o_off["step"],
        "step_on_overlap_s": o_on["step"],
        "stall_overlap_s": o_on["stall"],
        "stall_overlap_pre_s": o_on["pre"],
        "stall_overlap_post_s": o_on["post"],
        "stall_overlap_max_s": o_on["max"],
        "reported_stall_overlap_s": o_on["reported"],
        "capture_return_s": _med(quiet["capture_return_s"]),
        "capture_pipeline_s": _med(quiet["pipeline_s"]),
        # Split by whether the capture was also written to disk (every persist_every-th): the memory-only pipeline
        # is copy + digest + publish + replicate into the peer's memory + verify + publish there.
        "capture_pipeline_memory_s": _med(
            [
                t
                for t, d in zip(quiet["pipeline_s"], quiet.get("persisted", []), strict=False)
                if not d
            ]
        ),
        "capture_pipeline_disk_s": _med(
            [t for t, d in zip(quiet["pipeline_s"], quiet.get("persisted", []), strict=False) if d]
        ),
        "restart_memory_s": r["restart_memory_s"],
        "restart_memory_verify_s": r["restart_memory_verify_s"],
        "restart_memory_restore_s": r["restart_memory_restore_s"],
        "pipeline_estimate_s": r["calibration"]["pipeline_estimate_s"],
        "persist_s": _med(quiet["persist_s"]),
        "persist_in_loop_s": _med(
            loops["tight_on"]["persist_s"] + loops["overlap_on"]["persist_s"]
        ),
        "exchange_s": r["exchange_s"],
        "gloo_pair_s": r["gloo_pair_s"],
        **{
            k: r[k]
            for k in (
                "dcp_async_save_blocking_s",
                "dcp_async_save_total_s",
                "dcp_save_s",
                "dcp_load_s",
                "dcp_load_cold_s",
            )
        },
    }


def _fastest_per_capture(ranks: list[list[float]]) -> list[float]:
    """Per capture, the faster rank's time: the rank that reaches the exchange first also times its wait for the
    other, so the faster figure is the transfer itself (plus the digest check of what arrived)."""
    return [min(xs) for xs in zip(*ranks, strict=False)]


def summarize(
    off: list[dict[str, Any]], on: list[dict[str, Any]], *, warmup: int, victim: int
) -> dict[str, Any]:
    """One size's entry: ``measurements``, ``ratios``, ``targets``, ``met`` and ``checks`` (booleans, sources)."""
    state = on[0]["state_bytes"]
    per_rank = [_rank_figures(r, warmup) for r in on]
    m: dict[str, Any] = {
        "state_bytes": state,
        "params": on[0]["params"],
        "frame_bytes": on[0]["frame_bytes"],
    }
    m.update({key: max(r[key] for r in per_rank) for key in per_rank[0]})
    # Two ranks running the same program differ by up to ~30 MiB of peak RSS from run to run (allocator timing),
    # so the ranks' means are compared.
    m["rss_off_bytes"] = statistics.fmean(r["peak_rss_bytes"] for r in off)
    m["rss_on_bytes"] = statistics.fmean(r["peak_rss_bytes"] for r in on)
    m["rss_extra_bytes"] = m["rss_on_bytes"] - m["rss_off_bytes"]
    m["gemini_buffer_bytes"] = statistics.fmean(r["gemini_buffer_bytes"] for r in on)
    m["replicate_s"] = _med(_fastest_per_capture([r["window"]["replicate_s"] for r in on]))
    m["replicate_in_loop_s"] = _med(
        _fastest_per_capture(
            [
                r["loops"]["tight_on"]["replicate_s"] + r["loops"]["overlap_on"]["replicate_s"]
                for r in on
            ]
        )
    )
    v, survivor = on[victim], on[1 - victim]
    for key in (
        "recover_s",
        "recover_transfer_s",
        "recover_transfer_recv_s",
        "recover_transfer_verify_s",
        "recover_transfer_restore_s",
        "recover_raw_recv_s",
    ):
        m[key] = v[key]
    m["survivor_files_verified"] = survivor["disk_files_verified"]
    m["survivor_files_verify_s"] = survivor["disk_files_verify_s"]
    m["survivor_files_inventory_s"] = survivor["disk_files_inventory_s"]
    for name in ("memcpy", "digest", "write", "exchange", "gloo_pair"):
        m[f"{name}_gbps"] = _gbps(state, m[f"{name}_s"])
    m["replication_gbps"] = _gbps(state, m["replicate_s"])
    m["replication_in_loop_gbps"] = _gbps(state, m["replicate_in_loop_s"])
    m["persist_gbps"] = _gbps(m["frame_bytes"], m["persist_s"])

    def worst(num: str, den: str) -> float:
        return max(r[num] / r[den] for r in per_rank)

    ratios = {
        "stall_vs_memcpy": worst("stall_tight_s", "memcpy_s"),
        "stall_overlap_vs_memcpy": worst("stall_overlap_s", "memcpy_s"),
        "stall_tight_skip_vs_memcpy": worst("stall_tight_skip_s", "memcpy_s"),
        "blocking_vs_async_save": worst("stall_overlap_s", "dcp_async_save_blocking_s"),
        "replication_vs_gloo": m["replication_gbps"] / m["gloo_pair_gbps"],
        "recovery_speedup_vs_dcp_load": v["dcp_load_s"] / v["recover_s"],
        "rss_extra_vs_state": m["rss_extra_bytes"] / state,
        "blocking_tight_vs_async_save": worst("stall_tight_s", "dcp_async_save_blocking_s"),
        "blocking_vs_save": worst("stall_overlap_s", "dcp_save_s"),
        "capture_return_vs_async_save": worst("capture_return_s", "dcp_async_save_blocking_s"),
        "replication_in_loop_vs_gloo": m["replication_in_loop_gbps"] / m["gloo_pair_gbps"],
        "exchange_vs_gloo": m["exchange_gbps"] / m["gloo_pair_gbps"],
        "recovery_transfer_speedup_vs_dcp_load": v["dcp_load_s"] / v["recover_transfer_s"],
        "recovery_speedup_vs_dcp_load_cold": v["dcp_load_cold_s"] / v["recover_s"],
        "recovery_floor_speedup_vs_dcp_load": v["dcp_load_s"] / v["recover_raw_recv_s"],
        "persist_vs_write": worst("persist_s", "write_s"),
        "rss_gemini_buffers_vs_state": m["gemini_buffer_bytes"] / state,
        "loop_slowdown_tight": worst("step_on_tight_s", "step_off_tight_s"),
        "pipeline_memory_vs_memcpy": worst("capture_pipeline_memory_s", "memcpy_s"),
        "pipeline_vs_memcpy": worst("capture_pipeline_s", "memcpy_s"),
        "restart_memory_speedup_vs_dcp_load": min(
            r["dcp_load_s"] / r["restart_memory_s"] for r in per_rank
        ),
        "node_loss_recovery_vs_raw_transfer": v["recover_raw_recv_s"] / v["recover_s"],
        "loop_slowdown_overlap": worst("step_on_overlap_s", "step_off_overlap_s"),
    }
    targets = {k: {"op": op, "value": val} for k, (op, val) in TARGETS.items()}
    met = {
        k: (ratios[k] <= val if op == "<=" else ratios[k] >= val)
        for k, (op, val) in TARGETS.items()
    }
    checks = {
        "recovered_bitwise_equal": all(
            r["recovered_bitwise_equal"]
            and r["recovered_again_bitwise_equal"]
            and r["restart_memory_bitwise_equal"]
            for r in on
        ),
        "recovery_sources": v["recover_decision"]["sources"],
        "recovery_step": v["recover_decision"]["step"],
        "gemini_errors": [e for r in on for e in r["errors"]],
    }
    return {
        "state_mib": round(state / 2**20, 1),
        "measurements": m,
        "ratios": ratios,
        "targets": targets,
        "met": met,
        "checks": checks,
    }


def _fmt(x: float) -> str:
    if x != x:  # NaN
        return "n/a"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


SHOWN = (
    ("memcpy_s", "raw memcpy of the state (s)"),
    ("stall_tight_s", "stall per capture, tight loop (s)"),
    ("fwd_bwd_tight_s", "  fwd/bwd per step, tight (s)"),
    ("stall_tight_skip_s", "stall per capture, tight loop, when_busy=skip (s)"),
    ("tight_skip_captured_fraction", "  steps captured, when_busy=skip"),
    ("tight_skip_max_steps_lost", "  most steps a failure could lose, when_busy=skip"),
    ("stall_overlap_s", "stall per capture, overlap loop (s)"),
    ("fwd_bwd_overlap_s", "  fwd/bwd per step, overlap (s)"),
    ("capture_pipeline_s", "capture pipeline, quiet: capture to drained (s)"),
    (
        "capture_pipeline_memory_s",
        "  memory only: copy+digest+publish+replicate+verify+publish (s)",
    ),
    ("capture_pipeline_disk_s", "  a persist_every capture: the same + both files fsynced (s)"),
    ("restart_memory_s", "restart after SIGKILL: adopt shm slot, verify, restore (s)"),
    ("step_off_tight_s", "step without GEMINI, tight (s)"),
    ("step_on_tight_s", "step with GEMINI, tight (s)"),
    ("step_off_overlap_s", "step without GEMINI, overlap (s)"),
    ("step_on_overlap_s", "step with GEMINI, overlap (s)"),
    ("capture_return_s", "capture() return, quiet (s)"),
    ("dcp_async_save_blocking_s", "DCP async_save blocking (s)"),
    ("dcp_save_s", "DCP save (s)"),
    ("dcp_load_s", "DCP load, page cache (s)"),
    ("dcp_load_cold_s", "DCP load, evicted (s)"),
    ("replication_gbps", "replication, quiet (GB/s)"),
    ("replication_in_loop_gbps", "replication, in loop (GB/s)"),
    ("gloo_pair_gbps", "raw gloo pair exchange (GB/s)"),
    ("recover_s", "recover() from peer memory (s)"),
    ("recover_transfer_s", "  transfer+verify+restore only (s)"),
    ("recover_raw_recv_s", "  raw one-way gloo transfer of the frame (s)"),
    ("survivor_files_verify_s", "  survivor's files read + verified whole (s)"),
    ("survivor_files_inventory_s", "  survivor's files read by header, as recover() does (s)"),
    ("digest_gbps", "BLAKE3 digest (GB/s)"),
    ("write_s", "raw file write + fsync (s)"),
    ("persist_s", "GEMINI persist own file (s)"),
    ("rss_extra_bytes", "peak RSS extra with GEMINI (MiB)"),
    ("gemini_buffer_bytes", "  of which GEMINI's slots and held replicas (MiB)"),
)


def render(sizes: list[dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    heads = [f"{s['state_mib']:g} MiB" for s in sizes]
    ratios = Table(title="GEMINI vs references (ratios)")
    ratios.add_column("ratio")
    ratios.add_column("target")
    for h in heads:
        ratios.add_column(h, justify="right")
    for key in RATIO_KEYS:
        tgt = TARGETS.get(key)
        cells = []
        for s in sizes:
            mark = "" if tgt is None else (" [green]ok[/]" if s["met"][key] else " [red]MISS[/]")
            cells.append(_fmt(s["ratios"][key]) + mark)
        ratios.add_row(key, f"{tgt[0]} {tgt[1]:g}" if tgt else "-", *cells)
    console.print(ratios)
    meas = Table(title="measurements")
    meas.add_column("measurement")
    for h in heads:
        meas.add_column(h, justify="right")
    for key, label in SHOWN:
        scale = 2**-20 if key.endswith("_bytes") else 1.0
        meas.add_row(label, *(_fmt(s["measurements"][key] * scale) for s in sizes))
    console.print(meas)
