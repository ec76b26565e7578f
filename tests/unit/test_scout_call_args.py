"""Recipe inputs as real model code passes them (gemscout.scout.call_args), in one process: nested tensors and plain
values survive the wire; a transformers decoder layer called with position embeddings, ids, a None mask, a bool and a
``DynamicCache`` is captured and replayed bit for bit without touching the live cache; what cannot be replayed says
why (never "did not return"); tied weights and model-specific norm classes get their recipes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gemscout.scout import ScoutConfig
from gemscout.scout.call_args import Unreplayable, decode, encode
from gemscout.scout.capture import CaptureHooks
from gemscout.scout.capture_wire import pack, unpack
from gemscout.scout.recipes import build_catalog
from gemscout.scout.replay import ReplayContext, ReplayHooks, replay_forward

transformers = pytest.importorskip("transformers")
STEP = 3


def test_nested_inputs_and_plain_values_round_trip_over_the_wire() -> None:
    a, b = torch.randn(2, 3, requires_grad=True), torch.arange(4)
    kwargs = {
        "pair": (a, b),
        "mask": None,
        "flag": True,
        "n": 7,
        "scale": math.inf,
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "nested": {"x": [a, {"y": b}], "name": "rope"},
    }
    tensors: dict[str, torch.Tensor] = {}
    specs, kw = encode(nn.Identity(), (a,), kwargs, tensors)
    assert set(tensors) == {
        "arg.0",
        "kwarg.pair.0",
        "kwarg.pair.1",
        "kwarg.nested.0.0",
        "kwarg.nested.0.1.0",
    }
    assert all(
        t is not a and t is not b for t in tensors.values()
    )  # copies, never the live tensors
    header, payload = pack(STEP, {"r": _captured(tensors, specs, kw)})
    got = unpack(header, payload, STEP)["r"]
    rebuilt = {k: decode(spec, got.tensors) for k, spec in got.meta["kwargs"].items()}
    assert torch.equal(rebuilt["pair"][0], a) and torch.equal(rebuilt["pair"][1], b)
    assert isinstance(rebuilt["pair"], tuple) and isinstance(rebuilt["nested"]["x"], list)
    assert (
        rebuilt["mask"] is None
        and rebuilt["flag"] is True
        and rebuilt["n"] == 7
        and rebuilt["scale"] == math.inf
    )
    assert rebuilt["dtype"] is torch.bfloat16 and rebuilt["device"] == torch.device("cpu")
    assert rebuilt["nested"]["name"] == "rope" and torch.equal(rebuilt["nested"]["x"][1]["y"], b)
    assert kw["pair"]["tuple"][0]["grad"] is True and kw["pair"]["tuple"][1]["grad"] is False


def _captured(tensors: dict[str, torch.Tensor], specs: list, kw: dict) -> object:
    from gemscout.scout.capture import Captured

    return Captured(step=STEP, tensors=dict(tensors), meta={"args": specs, "kwargs": kw})


def test_an_input_scout_cannot_send_is_refused_with_its_path_and_type() -> None:
    class Opaque:
        pass

    with pytest.raises(
        Unreplayable, match=r"kwarg\.extra\.1 is a .*Opaque, which SCOUT cannot send"
    ):
        encode(nn.Identity(), (), {"extra": (1, Opaque())}, {})
    with pytest.raises(Unreplayable, match="dict with a int key"):
        encode(nn.Identity(), ({1: 2},), {}, {})


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return transformers.LlamaForCausalLM(config)


def armed(model: nn.Module, names: set[str]) -> tuple[object, CaptureHooks, dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    catalog = build_catalog(model, opt, ScoutConfig(hidden_per_cycle=None))
    modules = {r.name: [model.get_submodule(p) for p in r.modules] for r in catalog.recipes}
    hooks = CaptureHooks(modules, {r.name: r for r in catalog.recipes})
    hooks.arm(STEP, names)
    return catalog, hooks, modules


def test_a_decoder_layer_with_a_cache_replays_bitwise_and_the_live_cache_is_untouched() -> None:
    model = tiny_llama()
    catalog, hooks, modules = armed(model, {"hidden.1"})
    seen: dict[str, object] = {}

    def keep(mod: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        seen.update(out=out.detach().clone(), cache=kwargs["cache"], kwargs=sorted(kwargs))

    model.model.layers[1].register_forward_hook(keep, with_kwargs=True)
    ids = torch.randint(3, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    live_grads = {n: p.grad.clone() for n, p in model.model.layers[1].named_parameters()}
    cache = seen["cache"]
    assert (
        type(cache).__name__ == "DynamicCache"
    )  # a training forward with the default use_cache=True passes one
    assert {"cache", "position_embeddings", "position_ids", "use_cache", "attention_mask"} <= set(
        seen["kwargs"]
    )
    live_keys = [layer.keys.clone() for layer in cache.layers]
    got = hooks.take("hidden.1", STEP)
    assert got.error is None, got.error
    assert got.meta["kwargs"]["cache"] == {"cache": "transformers.cache_utils:DynamicCache"}
    header, payload = pack(STEP, {"hidden.1": got})
    received = unpack(header, payload, STEP)["hidden.1"]
    ctx = ReplayContext(recipe="hidden.1", kind="hidden", step=STEP, rank=0, source_rank=0)
    hooks.paused = True
    outcome = replay_forward(
        modules["hidden.1"], catalog["hidden.1"].modules, received, ctx, ReplayHooks()
    )
    assert torch.equal(outcome.outputs["output"], seen["out"])
    for name, grad in live_grads.items():
        assert torch.equal(outcome.outputs[f"grad.param.model.layers.1.{name}"], grad), name
    # The live cache still holds exactly what the real forward put there: replay wrote into a fresh one.
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, live_keys, strict=True))


def test_a_cache_that_carries_past_tokens_is_refused_and_the_reason_is_not_masked() -> None:
    model = tiny_llama()
    _, hooks, _ = armed(model, {"hidden.0"})
    past = transformers.DynamicCache()
    with torch.no_grad():
        model(
            input_ids=torch.randint(3, 64, (1, 4)), cache=past, use_cache=True
        )  # a prefix: past tokens
    ids = torch.randint(3, 64, (1, 2))
    model(input_ids=ids, cache=past, use_cache=True).logits.sum().backward()
    got = hooks.take("hidden.0", STEP)
    assert got.meta.get("unreplayable") is True
    assert "layer 0 already holds 4 past positions" in str(got.error)
    assert "did not return" not in str(got.error)


def test_tied_head_and_model_norm_classes_get_recipes() -> None:
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=1,
        )
    )
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    opt = torch.optim.AdamW(gpt2.parameters(), lr=1e-3)
    catalog = build_catalog(gpt2, opt, ScoutConfig())
    assert catalog["embedding"].modules == ("transformer.wte",)
    assert catalog["output"].modules == ("transformer.ln_f", "lm_head")
    sliced = [p for r in catalog.recipes if not r.has_module for p in r.params]
    assert (
        sliced.count("transformer.wte.weight") == 1 and "lm_head.weight" not in sliced
    )  # the tied weight once
    llama = tiny_llama()
    assert build_catalog(llama, None, ScoutConfig(recipes=("output",)))["output"].modules == (
        "model.norm",
        "lm_head",
    )
