"""The converted MLA block as the engines read it: tensor names, RoPE row order, and the checks on a solve.

Names are those of DeepSeek's attention module (the deepseek_v3 architecture table's `weights.mla`), which
both engines read: transformers `DeepseekV3Attention.__init__` and vLLM 0.33.0
vllm/model_executor/models/deepseek_v2.py `DeepseekV2MLAAttention.__init__` (q_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj, all without bias), loaded under their checkpoint names by
`DeepseekV2Model.load_weights` (only q_a_proj / kv_a_proj_with_mqa are renamed, and only when q_lora_rank is
set). tests/data/vllm/0.33.0/ holds the excerpts; tests/convert/mla/test_layout.py checks them.

RoPE order: vLLM builds DeepSeek's rotary embedding with `is_neox_style=False` (GPT-J pairs: dimensions 2i and
2i + 1 turn together), whatever the config says; transformers does the same when `rope_interleave` is true
(`apply_rotary_pos_emb_interleave`). The solve (kvtool.convert.mla.solve) returns the rope rows in
rotate_half order (dimension i pairs with i + r/2, as the source llama stores them); `to_engine_order`
interleaves them before they are written, and the config says `rope_interleave: true`.
"""

from __future__ import annotations

from dataclasses import dataclass

# the solve's output, by name under `self_attn.` (MlaShape.weight_shapes), in the order they are written
ATTENTION_TENSORS = ("q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                     "o_proj.weight")


@dataclass(frozen=True)
class MlaRope:
    """The RoPE a converted layer works with (what `solve_layer` gets as `rope`).

    source_inv_freq: the source's per-pair inverse frequencies (head_dim / 2, rotate_half order);
    rope_inv_freq: those the engines give the shared rope part from the written config (qk_rope_head_dim / 2):
    theta^(-2i / qk_rope_head_dim) = source pair i * head_dim / qk_rope_head_dim; attention_scaling: the cos / sin
    factor (1.0 for the default type, the only one converted); context: the longest context served."""

    source_inv_freq: tuple[float, ...]
    rope_inv_freq: tuple[float, ...]
    attention_scaling: float
    context: int

    @property
    def source_pairs(self) -> tuple[int, ...]:
        """The source pair each rope pair turns with (exactly: head_dim is a multiple of qk_rope_head_dim)."""
        k = len(self.source_inv_freq) // len(self.rope_inv_freq)
        return tuple(i * k for i in range(len(self.rope_inv_freq)))


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


def interleave_order(rope_dim: int) -> list[int]:
    """Row i of the interleaved (GPT-J) layout holds rotate_half row order[i]: pairs (j, j + r/2) -> (2j, 2j + 1)."""
    half = rope_dim // 2
    order = []
    for j in range(half):
        order += [j, j + half]
    return order


def to_engine_order(tensors: dict, shape) -> dict:
    """The solve's tensors with their rope rows interleaved (q_proj: the last qk_rope_head_dim rows of every
    head; kv_a_proj_with_mqa: its last qk_rope_head_dim rows); torch tensors, the others unchanged."""
    import torch

    r, qk, h = shape.qk_rope_head_dim, shape.qk_head_dim, shape.num_heads
    order = torch.tensor(interleave_order(r))
    out = dict(tensors)
    q = tensors["q_proj.weight"].reshape(h, qk, -1)
    out["q_proj.weight"] = torch.cat([q[:, : qk - r], q[:, qk - r:][:, order]], dim=1).reshape(h * qk, -1)
    kv_a = tensors["kv_a_proj_with_mqa.weight"]
    rank = shape.kv_lora_rank
    out["kv_a_proj_with_mqa.weight"] = torch.cat([kv_a[:rank], kv_a[rank:][order]], dim=0)
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
                           + "; ".join(problems))
