"""Recurrent state of Mamba / linear-attention layers as vLLM allocates it, and the attention block size it forces.

The data is recurrent_state.json: per state kind the shape formula vLLM's MambaStateShapeCalculator uses, per
model type the config keys it feeds in and the SSM-state dtype rule, each with its citation (vLLM 0.33.0).
vLLM keeps one state page per sequence per state layer (mamba_cache_mode none) and raises the attention
block size of a hybrid until an attention page holds a state page, then pads the state page to the attention
page (Platform._align_hybrid_block_size), so state and attention layers share one block pool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvtool.model.kvcache import cdiv, dtype_bytes, native_kv_dtype

STATE_TYPES = ("mamba", "linear_attention")


@lru_cache(maxsize=1)
def table() -> dict:
    return json.loads((Path(__file__).with_name("recurrent_state.json")).read_text())


@dataclass(frozen=True)
class StateLayout:
    """One state layer's page on one GPU: conv and SSM state elements and their bytes per element."""

    kind: str
    conv_elements: int
    ssm_elements: int
    conv_bytes: float
    ssm_bytes: float
    ssm_dtype: str
    citation: str

    @property
    def page_bytes(self) -> int:
        """MambaSpec.page_size_bytes before padding: the sum of prod(shape) x dtype size."""
        return int(self.conv_elements * self.conv_bytes + self.ssm_elements * self.ssm_bytes)


def _row(spec) -> dict | None:
    types = {spec.model_type, spec.config.get("model_type")}
    return next((r for r in table()["models"] if types & set(r["model_types"])), None)


def _param(config: dict, expr: str) -> int | None:
    """A config key or a product of keys ("mamba_num_heads*mamba_head_dim"); None when one is missing."""
    out = 1
    for key in expr.split("*"):
        v = config.get(key)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            return None
        out *= v
    return out


def _extra_groups(n_groups: int, tp: int) -> int:
    """MambaStateShapeCalculator.extra_groups_for_head_shards: groups replicated so each head shard has its own."""
    return 0 if n_groups % tp == 0 else tp - n_groups


def _shapes(kind: str, p: dict, tp: int) -> tuple[int, int]:
    """(conv elements, SSM elements) of one layer on one of tp GPUs (the formulas in recurrent_state.json)."""
    if kind == "gated_delta_net":
        conv = (p["head_k_dim"] * p["num_k_heads"] * 2 + p["head_v_dim"] * p["num_v_heads"]) // tp
        return conv * (p["conv_kernel"] - 1), p["num_v_heads"] // tp * p["head_v_dim"] * p["head_k_dim"]
    if kind == "mamba2":
        groups = p["n_groups"] + _extra_groups(p["n_groups"], tp)
        conv = (p["intermediate_size"] + 2 * groups * p["state_size"]) // tp
        return conv * (p["conv_kernel"] - 1), p["num_heads"] // tp * p["head_dim"] * p["state_size"]
    if kind == "mamba1":
        inner = p["intermediate_size"] // tp
        return inner * (p["conv_kernel"] - 1), inner * p["state_size"]
    raise KeyError(kind)


def layout(spec, tensor_parallel_size: int = 1) -> StateLayout | None:
    """The state page of one of spec's state layers on one GPU, None when no table row or a size is missing.

    Conv state in the served model dtype (mamba_cache_dtype auto); SSM state in the dtype the model row's rule
    gives ("auto": the conv dtype)."""
    row = _row(spec)
    if row is None:
        return None
    p = {name: _param(spec.config, expr) for name, expr in row["params"].items()}
    if any(v is None for v in p.values()):
        return None
    conv_dtype = native_kv_dtype(spec)[0]
    ssm = spec.config.get(row["ssm_dtype_key"]) if row["ssm_dtype_key"] else None
    ssm = ssm if isinstance(ssm, str) and ssm != "auto" else row["ssm_dtype_default"]
    ssm = conv_dtype if ssm == "auto" else ssm
    conv, temporal = _shapes(row["kind"], p, max(1, tensor_parallel_size))
    kind = table()["kinds"][row["kind"]]
    return StateLayout(row["kind"], conv, temporal, dtype_bytes(conv_dtype), dtype_bytes(ssm), ssm,
                       f"{kind['citation']}; {row['citation']}")


def attention_block_size(state_page: int, attn_bytes_per_token: float, block_size: int) -> int:
    """The attention block size vLLM uses: the smallest multiple of block_size whose page holds a state page
    (Platform._align_hybrid_block_size; block_size stands for the backend's kernel block alignment)."""
    bs = max(1, block_size)
    if state_page <= 0 or attn_bytes_per_token <= 0:
        return bs
    return max(bs, bs * cdiv(state_page, int(bs * attn_bytes_per_token)))
