"""Capture and replay in one process (no process group): a replay reproduces the live step bit for bit and leaves the
live parameters, gradients, RNG stream and module modes exactly as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gemscout.scout import ScoutConfig
from gemscout.scout.capture import CaptureHooks, capture_optimizer
from gemscout.scout.capture_wire import pack, unpack
from gemscout.scout.recipes import build_catalog, optimizer_params
from gemscout.scout.replay import ReplayContext, ReplayHooks, replay_forward, replay_optimizer
from qualification.workloads import build_model, lm_loss, synthetic_batch

STEP = 5


def live_step() -> dict[str, object]:
    torch.manual_seed(0)
    model = build_model("three-block", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    catalog = build_catalog(
        model, opt, ScoutConfig(hidden_per_cycle=None, optimizer_slices_per_cycle=None)
    )
    modules = {r.name: [model.get_submodule(p) for p in r.modules] for r in catalog.recipes}
    hooks = CaptureHooks(modules, {r.name: r for r in catalog.recipes})
    hooks.arm(STEP, {"embedding", "hidden.1", "output"})
    live_out: dict[str, torch.Tensor] = {}
    model.blocks[1].register_forward_hook(
        lambda m, a, out: live_out.__setitem__("hidden.1", out.detach().clone())
    )
    model.head.register_forward_hook(
        lambda m, a, out: live_out.__setitem__("output", out.detach().clone())
    )
    inputs, targets = synthetic_batch(seed=0, step=STEP, rank=0)
    lm_loss(model(inputs), targets).backward()  # dropout is active: replay must draw the same masks
    return {
        "model": model,
        "opt": opt,
        "catalog": catalog,
        "modules": modules,
        "hooks": hooks,
        "live": live_out,
    }


def ctx(name: str) -> ReplayContext:
    return ReplayContext(recipe=name, kind=name.split(".")[0], step=STEP, rank=0, source_rank=0)


def over_the_wire(captured: object, name: str) -> object:
    header, payload = pack(STEP, {name: captured})  # type: ignore[dict-item]
    return unpack(header, payload, STEP)[name]


def test_block_and_output_replays_are_bitwise_equal_to_the_live_step() -> None:
    s = live_step()
    model: nn.Module = s["model"]  # type: ignore[assignment]
    hooks: CaptureHooks = s["hooks"]  # type: ignore[assignment]
    grads_before = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng_before = torch.get_rng_state()
    for name, params in (("hidden.1", "blocks.1"), ("output", "head")):
        captured = over_the_wire(hooks.take(name, STEP), name)
        hooks.paused = True
        outcome = replay_forward(
            s["modules"][name], s["catalog"][name].modules, captured, ctx(name), ReplayHooks()
        )
        hooks.paused = False
        assert torch.equal(outcome.outputs["output"], s["live"][name]), name  # type: ignore[index]
        for key, grad in outcome.outputs.items():
            if key.startswith(f"grad.param.{params}."):
                live_name = key[len("grad.param.") :]
                assert torch.equal(grad, grads_before[live_name]), key
        assert any(k.startswith("grad.input.") for k in outcome.outputs)
    embedding = replay_forward(
        s["modules"]["embedding"],
        ("embed",),
        over_the_wire(hooks.take("embedding", STEP), "embedding"),
        ctx("embedding"),
        ReplayHooks(),
    )
    assert torch.equal(embedding.outputs["grad.param.embed.weight"], grads_before["embed.weight"])
    assert set(embedding.outputs) == {
        "output",
        "grad.param.embed.weight",
    }  # ids are integers: no input gradient
    # Nothing live moved: gradients, the RNG stream, train mode.
    assert all(torch.equal(p.grad, grads_before[n]) for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(m.training for m in model.modules())


def test_capture_is_taken_only_when_armed_and_says_why_not() -> None:
    s = live_step()
    hooks: CaptureHooks = s["hooks"]  # type: ignore[assignment]
    assert (
        hooks.take("hidden.0", STEP).error
        == f"no forward of step {STEP} reached 'hidden.0' on this rank (not armed)"
    )
    assert "captured for step 5, not 6" in str(hooks.take("hidden.1", STEP + 1).error)
    hooks.remove()
    assert hooks.take("hidden.1", STEP).error is not None


def test_optimizer_replay_equals_the_live_update_and_leaves_it_alone() -> None:
    s = live_step()
    model: nn.Module = s["model"]  # type: ignore[assignment]
    opt: torch.optim.Optimizer = s["opt"]  # type: ignore[assignment]
    params = optimizer_params(model, opt)
    for warm in range(2):  # give AdamW a non-empty state, then check the third update
        opt.step()
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01 * (warm + 1))
    recipe = s["catalog"]["optimizer.1"]  # type: ignore[index]
    captured = over_the_wire(capture_optimizer(recipe, params, opt, STEP), "optimizer.1")
    before = {n: params[n].detach().clone() for n in recipe.params}
    outcome = replay_optimizer(type(opt), opt.defaults, captured, ctx("optimizer.1"), ReplayHooks())
    assert all(
        torch.equal(params[n], before[n]) for n in recipe.params
    )  # the live parameters did not move
    opt.step()
    for name in recipe.params:
        assert torch.equal(outcome.outputs[f"param.{name}"], params[name]), name
        assert torch.equal(
            outcome.outputs[f"state.{name}#exp_avg"], opt.state[params[name]]["exp_avg"]
        )


def test_replay_hooks_replace_inputs_and_outputs_and_can_be_removed() -> None:
    s = live_step()
    hooks: CaptureHooks = s["hooks"]  # type: ignore[assignment]
    captured = over_the_wire(hooks.take("hidden.1", STEP), "hidden.1")
    seams = ReplayHooks()
    seen: list[tuple[str, int]] = []
    h_in = ReplayHooks.add(seams.inputs, lambda c, t: {k: v * 0 for k, v in t.items()})
    h_out = ReplayHooks.add(seams.outputs, lambda c, t: seen.append((c.recipe, c.step)) or None)
    run = replay_forward(s["modules"]["hidden.1"], ("blocks.1",), captured, ctx("hidden.1"), seams)
    clean = replay_forward(
        s["modules"]["hidden.1"], ("blocks.1",), captured, ctx("hidden.1"), ReplayHooks()
    )
    assert not torch.equal(run.outputs["output"], clean.outputs["output"]) and seen == [
        ("hidden.1", STEP)
    ]
    h_in.remove()
    h_out.remove()
    again = replay_forward(
        s["modules"]["hidden.1"], ("blocks.1",), captured, ctx("hidden.1"), seams
    )
    assert torch.equal(again.outputs["output"], clean.outputs["output"]) and len(seen) == 1
    assert ctx("hidden.1").role == "source"


@pytest.mark.timeout(60)
def test_consuming_optimizer_replay_equals_the_copying_one_and_spares_what_a_hook_returned() -> (
    None
):
    """``consume=True`` (what the engine passes: its received inputs are views nobody reads again) updates the
    received tensors in place instead of cloning them; the outputs must be bitwise those of the copying replay, and an
    input a hook replaced (the hook may keep it) must stay untouched."""
    s = live_step()
    model: nn.Module = s["model"]  # type: ignore[assignment]
    opt: torch.optim.Optimizer = s["opt"]  # type: ignore[assignment]
    params = optimizer_params(model, opt)
    opt.step()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.02)
    recipe = s["catalog"]["optimizer.1"]  # type: ignore[index]
    copying = replay_optimizer(
        type(opt),
        opt.defaults,
        over_the_wire(capture_optimizer(recipe, params, opt, STEP), "optimizer.1"),
        ctx("optimizer.1"),
        ReplayHooks(),
    )
    received = over_the_wire(capture_optimizer(recipe, params, opt, STEP), "optimizer.1")
    first = recipe.params[0]
    kept = {}

    def keep_first(c: ReplayContext, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kept["param"] = t[f"param.{first}"].clone()
        return {**t, f"param.{first}": kept["param"]}

    hooks = ReplayHooks()
    ReplayHooks.add(hooks.inputs, keep_first)
    before = {k: t.clone() for k, t in received.tensors.items()}  # type: ignore[attr-defined]
    consumed = replay_optimizer(
        type(opt),
        opt.defaults,
        received,
        ctx("optimizer.1"),
        hooks,  # type: ignore[arg-type]
        consume=True,
    )
    kept_before = before[f"param.{first}"]
    assert set(consumed.outputs) == set(copying.outputs)
    for key, tensor in copying.outputs.items():
        assert torch.equal(consumed.outputs[key], tensor), key
    assert torch.equal(kept["param"], kept_before)  # what the hook returned was copied, not updated
    second = recipe.params[1]
    assert not torch.equal(received.tensors[f"param.{second}"], before[f"param.{second}"])  # type: ignore[attr-defined]
    assert torch.equal(received.tensors[f"grad.{second}"], before[f"grad.{second}"])  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_pack_into_a_given_buffer_writes_the_same_payload() -> None:
    """The exchange packs the payload straight into its send buffer: the bytes and header must be those of a plain
    pack, and unpacking them must give the same tensors and the same received digest."""
    s = live_step()
    hooks: CaptureHooks = s["hooks"]  # type: ignore[assignment]
    captures = {name: hooks.take(name, STEP) for name in ("embedding", "hidden.1", "output")}
    header, payload = pack(STEP, captures)
    buffer = torch.full((payload.numel() + 256,), 7, dtype=torch.uint8)
    asked = []

    def out(header_bytes: int, payload_bytes: int) -> torch.Tensor:
        asked.append((header_bytes, payload_bytes))
        return buffer[128 : 128 + payload_bytes]

    header2, written = pack(STEP, captures, out=out)
    assert header2 == header and asked == [(len(header), payload.numel())]
    assert written.data_ptr() == buffer[128:].data_ptr() and torch.equal(written, payload)
    a, b = unpack(header, payload, STEP), unpack(header2, written, STEP)
    for name in captures:
        assert a[name].received_digest == b[name].received_digest
        assert all(torch.equal(a[name].tensors[k], b[name].tensors[k]) for k in a[name].tensors)


@pytest.mark.timeout(60)
def test_flat_optimizer_slice_replays_the_live_update_and_falls_back_per_kind() -> None:
    """``capture_optimizer(flat=True)`` (what the engine sends) copies each kind of per-parameter tensor into one flat
    tensor; replayed over the wire and consumed in place, its flat outputs must be the live update bit for bit, and a
    kind that cannot be flattened (a missing gradient) must stay per parameter and still replay."""
    s = live_step()
    model: nn.Module = s["model"]  # type: ignore[assignment]
    opt: torch.optim.Optimizer = s["opt"]  # type: ignore[assignment]
    params = optimizer_params(model, opt)
    opt.step()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.03)
    recipe = s["catalog"]["optimizer.1"]  # type: ignore[index]
    flat = capture_optimizer(recipe, params, opt, STEP, flat=True)
    assert {k for k in flat.tensors if not k.startswith("hyper.")} == {
        "flat.param",
        "flat.grad",
        "flat.state#exp_avg",
        "flat.state#exp_avg_sq",
        "flat.state#step",
    }
    live_before = {n: params[n].detach().clone() for n in recipe.params}
    first = recipe.params[0]
    flat.tensors["flat.param"][0] += (
        1.0  # the flat tensor is a copy: writing it never reaches the live parameter
    )
    flat.tensors["flat.param"][0] -= 1.0
    assert torch.equal(params[first], live_before[first])
    wire = over_the_wire(flat, "optimizer.1")
    outcome = replay_optimizer(
        type(opt),
        opt.defaults,
        wire,
        ctx("optimizer.1"),
        ReplayHooks(),  # type: ignore[arg-type]
        consume=True,
    )
    assert all(torch.equal(params[n], live_before[n]) for n in recipe.params)
    # Consumed: the update ran in the received flat tensors, which are the outputs (nothing copied).
    assert outcome.outputs["flat.param"].data_ptr() == wire.tensors["flat.param"].data_ptr()  # type: ignore[attr-defined]
    opt.step()
    names = recipe.params
    assert torch.equal(
        outcome.outputs["flat.param"], torch.cat([params[n].detach().reshape(-1) for n in names])
    )
    assert torch.equal(
        outcome.outputs["flat.state#exp_avg"],
        torch.cat([opt.state[params[n]]["exp_avg"].reshape(-1) for n in names]),
    )
    assert set(outcome.outputs) == {
        "flat.param",
        "flat.state#exp_avg",
        "flat.state#exp_avg_sq",
        "flat.state#step",
    }
    # One parameter without a gradient: the gradients stay per parameter, the other kinds are still flat.
    params[names[1]].grad = None
    partial = capture_optimizer(recipe, params, opt, STEP, flat=True)
    assert "flat.grad" not in partial.tensors and f"grad.{names[0]}" in partial.tensors
    assert "flat.param" in partial.tensors and partial.meta["flat"]["flat.param"][0] == [
        f"param.{names[0]}",
        list(params[names[0]].shape),
    ]
    replayed = replay_optimizer(
        type(opt),
        opt.defaults,
        over_the_wire(partial, "optimizer.1"),  # type: ignore[arg-type]
        ctx("optimizer.1"),
        ReplayHooks(),
        consume=True,
    )
    assert "flat.param" in replayed.outputs
