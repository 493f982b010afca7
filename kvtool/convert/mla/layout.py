"""The converted MLA block as the engines read it: tensor names, RoPE row order, and the checks on a solve.

Names are those of DeepSeek's attention module (the deepseek_v3 architecture table's `weights.mla`), which
both engines read: transformers `DeepseekV3Attention.__init__` and vLLM 0.33.0
vllm/model_executor/models/deepseek_v2.py `DeepseekV2MLAAttention.__init__` (q_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj, all without bias), loaded under their checkpoint names by
`DeepseekV2Model.load_weights` (only q_a_proj / kv_a_proj_with_mqa are renamed, and only when q_lora_rank is
set). tests/data/vllm/0.33.0/ holds the excerpts; tests/convert/mla/test_mla_vllm.py checks them.

RoPE order: vLLM builds DeepSeek's rotary embedding with `is_neox_style=False` (GPT-J pairs: dimensions 2i and
2i + 1 turn together), whatever the config says; transformers does the same when `rope_interleave` is true
(`apply_rotary_pos_emb_interleave`). The solve (kvtool.convert.mla.solve) writes the rope rows in that order,
and the config says `rope_interleave: true` (kvtool/convert/mla/config.py).
"""

from __future__ import annotations

from kvtool.errors import listed

# the solve's output, by name under `self_attn.` (MlaShape.weight_shapes), in the order they are written
ATTENTION_TENSORS = ("q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                     "o_proj.weight")


def attention_prefix(arch, layer: int) -> str:
    """`model.layers.{layer}.self_attn`, from the output table (deepseek_v3)."""
    return arch.attn_prefix(layer)


# solve key's module -> (table section, role) in the deepseek_v3 table; kv_a_layernorm is named by no table
_TABLE_ROLES = {"q_proj": ("mla", "q"), "kv_a_proj_with_mqa": ("mla", "kv_a"), "kv_b_proj": ("mla", "kv_b"),
                "o_proj": (None, "o")}


def output_names(arch, layer: int) -> dict[str, str]:
    """Solve key -> checkpoint name for one layer, e.g. kv_b_proj.weight -> model.layers.3.self_attn.kv_b_proj.weight."""
    prefix = attention_prefix(arch, layer)
    out = {}
    for key in ATTENTION_TENSORS:
        module, _, suffix = key.partition(".")
        section, role = _TABLE_ROLES.get(module, (None, None))
        if role is not None:
            module = (arch.weights[section] if section else arch.weights)[role]
        out[key] = f"{prefix}.{module}.{suffix}"
    return out


def check_solved(tensors: dict, shape, layer: int) -> None:
    """The solve's result against MlaShape.weight_shapes(): every name, shape, and finite values (RuntimeError:
    a solve bug, not bad input)."""
    import torch

    want = shape.weight_shapes()
    problems = []
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected {', '.join(extra)} (vLLM's DeepseekV2MLAAttention has no such parameter)")
    for name, shp in want.items():
        t = tensors.get(name)
        if t is None:
            continue
        if tuple(t.shape) != tuple(shp):
            problems.append(f"{name} has shape {list(t.shape)}, expected {list(shp)}")
        elif not bool(torch.isfinite(t).all()):
            problems.append(f"{name} has non-finite values")
    if problems:
        raise RuntimeError(f"kvtool.convert.mla.solve.solve_layer returned bad tensors for layer {layer}: "
                           + listed(problems, sep="; "))
