"""kvtool.convert.mla.train: refinement of a solved MLA block, the FP8-friendly renormalisation, and distillation
through the source model with the MLA block installed (its loss and gradients against transformers' own
DeepseekV3ForCausalLM loaded from the written checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kvtool.cli import main
from kvtool.convert.mla.rope import SourceRope
from kvtool.convert.mla.shape import MlaShape
from kvtool.convert.mla.solve import SolveOptions, latent_of, mla_output, solve_layer
from kvtool.convert.mla.stats import MlaStats
from kvtool.convert.mla.train import MlaBlock, refine_layer, renormalise, source_hidden
from mla_helpers import tiny_llama
from test_solve import HD, HEADS, HIDDEN, THETA, _deepseek, _inputs, _llama, _source, _weights

SHAPE = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=6, qk_rope_head_dim=4, qk_nope_head_dim=4,
                 v_head_dim=HD)
ROPE = SourceRope(theta=THETA, head_dim=HD, rotary_dim=HD)


def _solved(seed: int = 0):
    _, attn, rotary = _llama(2, seed)
    x = _inputs(batch=6)
    y = _source(attn, rotary, x)
    stats = MlaStats.of(x, y, attn.scaling)
    options = SolveOptions(seed="mqa", residual_angle=1.0, seed_values="source", horizon=64)
    return x, y, stats, solve_layer(_weights(attn), stats, SHAPE, ROPE, options)


def _err(t, x, y) -> float:
    with torch.no_grad():
        return float((mla_output(x, t, SHAPE, ROPE) - y).pow(2).mean() / y.pow(2).mean())


def _cached_rms(t, x) -> torch.Tensor:
    """Each cached latent dim's RMS over x: kv_a_layernorm of the latent, times its weight (what vLLM stores)."""
    c = latent_of(x.reshape(-1, HIDDEN).double(), t["kv_a_proj_with_mqa.weight"][:SHAPE.kv_lora_rank].double(),
                  "constant")
    return (c * t["kv_a_layernorm.weight"].double()).pow(2).mean(0).sqrt()


def test_refinement_lowers_the_error_and_keeps_the_cache_at_unit_rms():
    x, y, stats, t = _solved()
    before = _err(t, x, y)
    new, info = refine_layer(t, stats, SHAPE, ROPE, steps=40, lr=5e-3)
    after = _err(new, x, y)
    assert after < 0.9 * before  # a 6-dim latent for 2 KV heads of 8: the solve leaves room
    assert info["loss_start"] == pytest.approx(before, rel=1e-4) and info["loss_end"] == pytest.approx(after, rel=1e-4)
    torch.testing.assert_close(_cached_rms(new, x), torch.ones(SHAPE.kv_lora_rank, dtype=torch.float64), rtol=1e-4,
                               atol=0)
    # what is written is what transformers computes
    assert float((_deepseek(SHAPE, ROPE, new, x) - mla_output(x, new, SHAPE, ROPE)).norm() / y.norm()) < 1e-5


def test_refinement_that_cannot_help_keeps_the_solve():
    x, y, stats, t = _solved(seed=3)
    new, info = refine_layer(t, stats, SHAPE, ROPE, steps=6, lr=30.0)  # steps far too large: the loss rises
    assert info["loss_end"] == info["loss_start"]
    for n in t:
        torch.testing.assert_close(new[n], t[n])


def test_renormalise_changes_the_cache_scale_not_the_block():
    x, y, _, t = _solved(seed=1)
    off = {**t, "kv_a_layernorm.weight": t["kv_a_layernorm.weight"] * torch.linspace(0.1, 30.0, SHAPE.kv_lora_rank)}
    assert not torch.allclose(_cached_rms(off, x), torch.ones(SHAPE.kv_lora_rank, dtype=torch.float64), rtol=0.1)
    fixed = renormalise(off, x, SHAPE)
    torch.testing.assert_close(_cached_rms(fixed, x), torch.ones(SHAPE.kv_lora_rank, dtype=torch.float64), rtol=1e-4,
                               atol=0)
    def run(t):  # in float64: the check is of the algebra, not of float32 rounding
        return mla_output(x.double(), {n: w.double() for n, w in t.items()}, SHAPE, ROPE)

    assert float((run(fixed) - run(off)).norm() / run(off).norm()) < 1e-6


@pytest.fixture(scope="module")
def trained(smollm2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mla-train")
    src = tiny_llama(tmp / "src", smollm2_path)
    dst = tmp / "mla"
    rc = main(["convert", str(src), str(dst), "--to", "mla", "--kv-budget", "50%", "--engine", "transformers", "--calib-tokens", "96",
               "--seq-len", "32", "--calib-dataset", "pydoc", "--refine-steps", "3", "--distill-steps", "2",
               "--no-eval", "--no-progress"])
    assert rc == 0
    return src, dst


def test_convert_refines_and_distils_and_records_it(trained):
    _, dst = trained
    prov = json.loads((dst / "kvtool.json").read_text())
    refine, distill = prov["solve"]["refine"], prov["solve"]["distill"]
    assert refine["steps"] == 3 and refine["target"] == "layer" and len(refine["loss_end"]) == 2
    assert all(b <= a for a, b in zip(refine["loss_start"], refine["loss_end"]))
    assert distill["steps"] == 2 and len(distill["step_losses"]) == 2 and distill["kl_end"] <= distill["kl_start"]
    assert prov["calibration"]["refine_steps"] == 3 and prov["calibration"]["distill_steps"] == 2


def test_distillation_gradients_are_those_of_the_written_model(trained):
    """The Distiller runs the source model with the MLA block installed in each attention module; its loss and
    gradients must be transformers' DeepseekV3ForCausalLM's on the converted checkpoint (whose other tensors are
    the source's), so what distillation trains is what is written and served."""
    from transformers import AutoModelForCausalLM

    from kvtool.convert.aware import distill as distill_mod
    from kvtool.runtime.layerwise import open_layerwise

    src, dst = trained
    cfg = json.loads((dst / "config.json").read_text())
    shape = MlaShape(hidden_size=cfg["hidden_size"], num_heads=cfg["num_attention_heads"],
                     kv_lora_rank=cfg["kv_lora_rank"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                     qk_nope_head_dim=cfg["qk_nope_head_dim"], v_head_dim=cfg["v_head_dim"])
    rope = SourceRope.of_config(json.loads((src / "config.json").read_text()))
    state = {}
    for f in json.loads((dst / "kvtool.json").read_text())["files"]:
        state.update(load_file(dst / f))
    layers = {i: {n.split(".self_attn.")[1]: t for n, t in state.items() if n.startswith(f"model.layers.{i}.self_attn.")}
              for i in range(cfg["num_hidden_layers"])}
    ids = torch.randint(100, 4000, (3, 24), generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([0, 2])
    # a random tiny model is nearly uniform and so is the KL of its conversion (~5e-5 nats, where the float32 KL's
    # rounding is visible): the attention outputs scaled up make the two models differ, on both sides alike
    for layer in layers.values():
        layer["o_proj.weight"] = layer["o_proj.weight"] * 30.0
    with open_layerwise(src, layerwise=False) as lm:
        teacher = distill_mod.teacher_targets(lm, source_hidden(lm, ids))
        d = distill_mod.Distiller(lm, ids, teacher, layers.__getitem__, block=MlaBlock(shape, rope), lr=1e-3)
        got = {}
        loss = d.gradients(rows, lambda i, st, g: got.__setitem__(i, g))
        d.close()
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.copy_(layers[i]["o_proj.weight"])
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    logits = model(input_ids=ids[rows]).logits
    want = sum(distill_mod._kl(logits[j], teacher.idx[r], teacher.logp[r], teacher.rest[r])
               for j, r in enumerate(rows.tolist())) / logits[..., 0].numel()
    want.backward()
    assert loss > 1e-4 and loss == pytest.approx(float(want.detach()), rel=1e-3)  # float32 KL of near-uniform models
    assert sorted(got) == sorted(layers)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for name, g in got[i].items():
            ref = attn.get_parameter(name).grad
            torch.testing.assert_close(g, ref, rtol=2e-3, atol=1e-8 + 1e-3 * float(ref.abs().max()))

