"""vLLM's KV-scale name mapping, encoded as rules, applied to every name quantize-kv writes.

The rules, as vLLM's loader documents them (model_loader/weight_utils.py `maybe_remap_kv_scale_name`
and compressed-tensors' `get_cache_scale`), for a model whose attention layer lives at
`<prefix>.attn` and owns `k_scale` / `v_scale` parameters:
  1. a name that already is a model parameter is kept;
  2. the deprecated `<x>.kv_scale` becomes `<x>.attn.k_scale` (and is duplicated to v_scale);
  3. names ending in `.k_scale` / `.v_scale` take the first matching pattern:
     `.self_attn.{k,v}_proj.{k,v}_scale` -> `.self_attn.attn.{k,v}_scale` (ModelOpt),
     `.self_attn.qkv_proj.{k,v}_scale`   -> `.self_attn.attn.{k,v}_scale`,
     `.{q,k,v}_scale`                    -> `.attn.{q,k,v}_scale` (compressed-tensors / llm-compressor);
     a remapped name that is not a parameter is dropped (not loaded);
  4. compressed-tensors output activations `.{k,v}_proj.output_scale`: LlamaModel.hf_to_vllm_mapper
     renames `.k_proj` to `.qkv_proj`; `qkv_proj.output_scale` is no parameter, so they are dropped
     (vllm 0.33; tests/oracle/test_vllm_facts.py reads both from vLLM's source).
"""

from __future__ import annotations

import re

import pytest
import torch

from kvtool.model import kv_scale_names
from kvtool.model.architectures import lookup
from kvtool.quantize.calibrate import CalibrationResult
from kvtool.quantize.write import scale_tensors

RULES = (  # (pattern, replacement), first match wins (rule 3)
    (r"\.self_attn\.([kv])_proj\.([kv])_scale$", r".self_attn.attn.\2_scale"),
    (r"\.self_attn\.qkv_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),
    (r"\.([qkv])_scale$", r".attn.\1_scale"),
)
OUTPUT_SCALE = (r"\.[kv]_proj\.output_scale$", r".qkv_proj.output_scale")  # rule 4: the stacked-params rename


def vllm_name(name: str, params: set[str]) -> str | None:
    """Where vLLM loads checkpoint tensor `name`, or None when it is dropped."""
    if name in params:
        return name
    if name.endswith(".kv_scale"):
        out = name[: -len(".kv_scale")] + ".attn.k_scale"
        return out if out in params else None
    if re.search(OUTPUT_SCALE[0], name):
        out = re.sub(*OUTPUT_SCALE, name)
        return out if out in params else None
    if name.endswith((".k_scale", ".v_scale", ".q_scale")):
        for pattern, repl in RULES:
            if re.search(pattern, name):
                out = re.sub(pattern, repl, name)
                return out if out in params else None
    return name


def vllm_params(arch, layers: int) -> set[str]:
    return {f"{arch.attn_prefix(i)}.attn.{r}_scale" for i in range(layers) for r in ("k", "v")}


def _result(layers: int, heads: int) -> CalibrationResult:
    k = {i: torch.full((heads,), 0.01 * (i + 1)) for i in range(layers)}
    v = {i: torch.full((heads,), 0.02 * (i + 1)) for i in range(layers)}
    return CalibrationResult(k, v, k, v, "absmax:1", "attn_head", "e4m3", 1, 1, "cpu", 0.0)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
@pytest.mark.parametrize("per_head", [False, True])
def test_every_written_name_maps_to_an_attention_layers_scale(model_type, per_head):
    arch = lookup(model_type)
    layers, heads = 4, 2
    written = scale_tensors(_result(layers, heads if per_head else 1), arch.attn_prefix, per_head=per_head)
    params = vllm_params(arch, layers)
    assert len(written) == 2 * layers
    targets = {}
    for name, t in written.items():
        target = vllm_name(name, params)
        assert target is not None and target in params, name
        targets[name] = target
        assert t.dtype == torch.float32
        assert tuple(t.shape) == ((heads, 1, 1) if per_head else (1,))
    assert sorted(targets.values()) == sorted(params)  # one tensor for every K and V scale, none twice
    for i in range(layers):
        assert targets[f"{arch.attn_prefix(i)}.k_scale"] == f"{arch.attn_prefix(i)}.attn.k_scale"


def test_every_spelling_lint_and_eval_accept_is_one_vllm_loads():
    arch = lookup("llama")
    params = vllm_params(arch, 1)
    prefix = arch.attn_prefix(0)
    for sp in kv_scale_names.SPELLINGS:
        target = vllm_name(f"{prefix}.{sp.suffix}", params)
        role = "k" if sp.role == "kv" else sp.role
        if sp.vllm_loads:
            assert target == f"{prefix}.attn.{role}_scale", sp.suffix
        else:
            assert target is None, sp.suffix  # dropped: vLLM runs the layer with 1.0


def test_a_name_vllm_cannot_place_is_dropped_not_misloaded():
    params = vllm_params(lookup("llama"), 1)
    assert vllm_name("model.layers.7.self_attn.k_scale", params) is None  # no such layer
    assert vllm_name("model.layers.0.mlp.weight", params) == "model.layers.0.mlp.weight"  # not a scale: untouched
