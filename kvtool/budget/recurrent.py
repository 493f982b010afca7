"""Recurrent state of Mamba / linear-attention layers as vLLM allocates it, and the attention block size it forces.

The data is recurrent_state.json: per state kind the shape formula vLLM's MambaStateShapeCalculator uses, per
model type the config keys it feeds in and the SSM-state dtype rule, each with its citation (the table's `release`).
vLLM keeps one state page per sequence per state layer (mamba_cache_mode none) and raises the attention
block size of a hybrid until an attention page holds a state page, then pads the state page to the attention
page (Platform._align_hybrid_block_size), so state and attention layers share one block pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvtool.model.engine_tables import Table, cited, load
from kvtool.model.kvcache import KV_DTYPE_BYTES, cdiv, dtype_bytes, native_kv_dtype
from kvtool.model.numbers import Bound, problem

STATE_TYPES = ("mamba", "linear_attention")

# Per-release rules (schemas/engines/facts.json `arithmetic` rows; no switch: the rules of the table's release)
# conv and SSM state both in the KV-cache dtype (0.10.0, before mamba_cache_dtype / mamba_ssm_cache_dtype)
STATE_IN_KV_DTYPE = "mamba_state_in_kv_cache_dtype"
# the SSM state in the conv state's dtype: no per-model default (Nemotron-H float32, Qwen3.5 mamba_ssm_dtype)
SSM_NO_MODEL_DEFAULT = "mamba_ssm_dtype_no_model_default"
# the attention block a multiple of 16, --block-size kept when larger (0.33: a multiple of --block-size)
BLOCK_MULTIPLE_OF_16 = "mamba_block_multiple_of_16"
SWITCHES = (STATE_IN_KV_DTYPE, SSM_NO_MODEL_DEFAULT, BLOCK_MULTIPLE_OF_16)


@lru_cache(maxsize=1)
def table() -> Table:
    return load("kvtool/budget/recurrent_state.json")


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


# Each config key a state row reads (a factor of its shape): vLLM builds tensors of these sizes.
KEY_BOUND = Bound("int", 1, 1 << 20, "a recurrent-state dimension; public models have <= 16,384")


def _whole(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


def key_problems(spec) -> list[tuple[str, str | None]]:
    """(config key, what is wrong) for each key spec's state row reads that the config sets to a value vLLM
    cannot build a state of (None instead of a message: the key is missing, transformers' default applies)."""
    row = _row(spec)
    if row is None:
        return []
    out: list[tuple[str, str | None]] = []
    for key in dict.fromkeys(k for expr in row["params"].values() for k in expr.split("*")):
        if key not in spec.config:
            out.append((spec.prefixed(key), None))
            continue
        bad = problem(_whole(spec.config[key]), KEY_BOUND)
        if bad:
            out.append((spec.prefixed(key), f"got {bad[0]}; it must be {bad[1]}"))
    key = row["ssm_dtype_key"]
    v = spec.config.get(key) if key else None
    if v is not None and not (isinstance(v, str) and (v == "auto" or v.lower() in KV_DTYPE_BYTES)):
        out.append((spec.prefixed(key), f"got {v!r}; it must be auto or a dtype name ({', '.join(sorted(KV_DTYPE_BYTES))})"))
    return out


def _param(config: dict, expr: str) -> int | None:
    """A config key or a product of keys ("mamba_num_heads*mamba_head_dim"); None when one is missing."""
    out = 1
    for key in expr.split("*"):
        v = _whole(config.get(key))
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


def layout(spec, tensor_parallel_size: int = 1, switches: frozenset = frozenset(),
           kv_cache: tuple[str, float] | None = None) -> StateLayout | None:
    """The state page of one of spec's state layers on one GPU, None when no table row or a size is missing.

    Conv state in the served model dtype (mamba_cache_dtype auto); SSM state in the dtype the model row's rule
    gives ("auto": the conv dtype). kv_cache: (name, bytes per element) of the KV cache, which a release with
    STATE_IN_KV_DTYPE stores the state in."""
    row = _row(spec)
    if row is None:
        return None
    p = {name: _param(spec.config, expr) for name, expr in row["params"].items()}
    if any(v is None for v in p.values()):
        return None
    conv_dtype = native_kv_dtype(spec)[0]
    conv_bytes = dtype_bytes(conv_dtype)
    ssm = spec.config.get(row["ssm_dtype_key"]) if row["ssm_dtype_key"] else None
    ssm = ssm if isinstance(ssm, str) and ssm != "auto" else row["ssm_dtype_default"]
    if ssm == "auto" or SSM_NO_MODEL_DEFAULT in switches:
        ssm = conv_dtype
    ssm_bytes = dtype_bytes(ssm)
    if STATE_IN_KV_DTYPE in switches and kv_cache is not None:
        ssm, conv_bytes, ssm_bytes = kv_cache[0], kv_cache[1], kv_cache[1]
    conv, temporal = _shapes(row["kind"], p, max(1, tensor_parallel_size))
    kind = table()["kinds"][row["kind"]]
    return StateLayout(row["kind"], conv, temporal, conv_bytes, ssm_bytes, ssm,
                       f"{cited(kind['citation'])}; {cited(row['citation'])}")


def attention_block_size(state_page: int, attn_bytes_per_token: float, block_size: int,
                         switches: frozenset = frozenset()) -> int:
    """The attention block size vLLM uses: the smallest multiple of block_size whose page holds a state page
    (Platform._align_hybrid_block_size; block_size stands for the backend's kernel block alignment), or with
    BLOCK_MULTIPLE_OF_16 the smallest multiple of 16, block_size when that is larger."""
    bs = max(1, block_size)
    if state_page <= 0 or attn_bytes_per_token <= 0:
        return bs
    align = 16 if BLOCK_MULTIPLE_OF_16 in switches else bs
    return max(bs, align * cdiv(state_page, int(align * attn_bytes_per_token)))
