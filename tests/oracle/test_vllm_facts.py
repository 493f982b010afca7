"""Each vLLM rule lint, kv-budget and quantize-kv rely on, checked against vLLM 0.33's own source.

vLLM's GPU wheel cannot run here, so tests/data/vllm/0.33.0/ keeps verbatim excerpts of the functions
kvtool restates (tests/data/vllm/extract.py copies them from the wheel). Pure functions are executed
as vLLM wrote them (scale-name remapping, the stacked-parameter rename, the sliding-window block
bound, the per-GPU KV-head count); the others are read with `ast` (which RoPE types get_rope knows and
which keys it indexes, which types keep max_position_embeddings, the fp8 scheme it accepts).
"""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest

from kvtool.model import kv_scale_names as ksn
from kvtool.model import kvcache
from kvtool.model.engine_tables import newest_read
from kvtool.model.rope import types as rt
from kvtool.rules.quantization import SUPPORTED_SCHEME

pytestmark = pytest.mark.oracle
VERSION = newest_read("vllm")  # the release the Python tables cite (schemas/engines/releases.json "read")
EXCERPTS = Path(__file__).resolve().parents[1] / "data" / "vllm" / VERSION


def _segments(source: str) -> dict[str, str]:
    """qualified name -> code of one excerpt file."""
    name = source.replace("/", "__") + ".txt"
    text = (EXCERPTS / name).read_text(encoding="utf-8")
    assert text.startswith(f"# vLLM {VERSION}, {source}")
    out: dict[str, str] = {}
    for block in text.split("\n# --- ")[1:]:
        head, _, code = block.partition("\n")
        out[head.split(" (lines")[0]] = code
    return out


def _function(source: str, qualname: str, **env):
    """Execute one excerpted function as vLLM wrote it, in a namespace holding `env`."""
    ns = {"re": re, **env}
    code = _segments(source)[qualname]
    exec(compile(code, f"vllm/{source}:{qualname}", "exec"), ns)  # noqa: S102 - vLLM's own code, vendored
    return ns[qualname.rsplit(".", 1)[-1]]


def _quiet_logger():
    return types.SimpleNamespace(**{m: (lambda *a, **k: None) for m in
                                    ("warning", "warning_once", "info", "debug", "debug_once", "info_once")})


# --- RoPE: the types get_rope dispatches, and the keys it indexes -------------------------------------
ROPE = "vllm/model_executor/layers/rotary_embedding/__init__.py"


def _get_rope_branches() -> dict[str, set[str]]:
    """rope type -> keys its branch of get_rope reads unconditionally with rope_parameters[...] (KeyError)."""
    fn = ast.parse(_segments(ROPE)["get_rope"]).body[0]
    out: dict[str, set[str]] = {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
            continue
        left = node.test.left
        if not (isinstance(left, ast.Name) and left.id == "scaling_type"):
            continue
        comp = node.test.comparators[0]
        names = [comp.value] if isinstance(comp, ast.Constant) else [e.value for e in comp.elts]
        # statements of the branch itself; reads under a nested `if "key" in rope_parameters` are optional
        keys = {s.slice.value for stmt in node.body if not isinstance(stmt, ast.If) for s in ast.walk(stmt)
                if isinstance(s, ast.Subscript) and isinstance(s.value, ast.Name) and s.value.id == "rope_parameters"
                and isinstance(s.slice, ast.Constant)}
        for n in names:
            out[n] = keys
    return out


def test_rope_types_are_the_ones_get_rope_dispatches():
    vllm = set(_get_rope_branches())
    kvtool = {k.name for k in rt.KINDS.values() if "vllm" in k.engines}
    assert vllm == kvtool, (vllm - kvtool, kvtool - vllm)


def test_get_rope_raises_for_other_types():
    code = _segments(ROPE)["get_rope"]
    assert 'raise ValueError(f"Unknown RoPE scaling type {scaling_type}")' in code  # KV201's citation


@pytest.mark.parametrize("name", sorted(k.name for k in rt.KINDS.values() if "vllm" in k.engines))
def test_keys_get_rope_indexes_are_required_by_kvtool(name):
    """A key vLLM indexes directly fails its load when absent: kvtool must require it (KV202)."""
    required = set()
    for r in rt.KINDS[name].required:
        required.update(r if isinstance(r, tuple) else (r,))
    assert _get_rope_branches()[name] <= required, (name, _get_rope_branches()[name] - required)


def test_yarn_needs_original_max_position_embeddings_in_the_dict():
    assert {"factor", "original_max_position_embeddings"} <= _get_rope_branches()["yarn"]


def test_partial_rotary_factor_range():
    code = _segments(ROPE)["get_rope"]
    assert "partial_rotary_factor <= 0.0 or partial_rotary_factor > 1.0" in code  # KV215 / KV107: (0, 1]
    assert "rotary_dim = int(head_size * partial_rotary_factor)" in code  # what KV218 / KV219 say vLLM rotates


# --- max_model_len ---------------------------------------------------------------------------------------
MODEL = "vllm/config/model.py"


def test_types_that_keep_max_position_embeddings():
    fn = ast.parse(_segments(MODEL)["_get_and_verify_max_len"]).body[0]
    kept = next(set(ast.literal_eval(n.comparators[0])) for n in ast.walk(fn)
                if isinstance(n, ast.Compare) and isinstance(n.ops[0], ast.NotIn)
                and isinstance(n.left, ast.Name) and n.left.id == "rope_type")
    kvtool = {k.name for k in rt.KINDS.values() if k.context == "as_is" and k.scaling and "vllm" in k.engines}
    assert {rt.canonical(t) for t in kept} == kvtool
    code = _segments(MODEL)["_get_and_verify_max_len"]
    assert 'scaling_factor = rp.get("factor", scaling_factor)' in code  # the others multiply by factor
    for mt in rt.VLLM_UNSCALED_MODEL_TYPES:
        assert f'"{mt}" not in hf_config.model_type' in code


@pytest.mark.parametrize("params,mpe,served", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 32768, 32768),
    ({"rope_type": "linear", "factor": 4.0}, 4096, 16384),
    ({"rope_type": "dynamic", "factor": 2.0}, 4096, 8192),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0}, 131072, 131072),
    ({"rope_type": "default"}, 2048, 2048),
])
def test_served_context_is_vllms(params, mpe, served):
    """vLLM's own derivation, run on the rope dict, against kvtool's served_context."""
    code = _segments(MODEL)["_get_and_verify_max_len"]
    body = code[code.index("    rope_parameters = list("):code.index("    if encoder_config")]
    ns = {"iter_rope_parameters": lambda cfg: iter([params]), "hf_config": types.SimpleNamespace(model_type="llama"),
          "derived_max_model_len": mpe, "logger": _quiet_logger()}
    exec(compile("\n".join(line[4:] for line in body.splitlines()), "vllm/config/model.py", "exec"), ns)  # noqa: S102
    assert ns["derived_max_model_len"] == served == rt.served_context(params, mpe)


def test_float32_checkpoints_are_served_in_16_bits():
    code = _segments(MODEL)["_resolve_auto_dtype"]
    assert "if config_dtype == torch.float32:\n        config_dtype = preferred_dtype" in code
    from kvtool.model.spec import build_spec

    spec = build_spec({"model_type": "llama", "torch_dtype": "float32", "num_hidden_layers": 2})
    assert kvcache.serving_kv_dtype(spec)[:2] == ("bfloat16", 2)


# --- tensor parallelism ----------------------------------------------------------------------------------
def test_tp_rules():
    code = _segments(MODEL)["ModelConfig.verify_with_parallel_config"]
    assert "if total_num_attention_heads % tensor_parallel_size != 0:" in code  # KV103
    get_kv = _function(MODEL, "ModelConfig.get_num_kv_heads")
    for kv in (1, 2, 3, 4, 8, 16):
        for tp in (1, 2, 3, 4, 8, 16):
            if kvcache.tp_refusal(kv * 4, kv, tp) is not None:
                continue
            cfg = types.SimpleNamespace(use_mla=False, model_arch_config=types.SimpleNamespace(total_num_kv_heads=kv))
            vllm = get_kv(cfg, types.SimpleNamespace(tensor_parallel_size=tp))
            assert vllm == kvcache.kv_heads_per_gpu(kv, tp), (kv, tp)
    mla = types.SimpleNamespace(use_mla=True)
    assert get_kv(mla, types.SimpleNamespace(tensor_parallel_size=8)) == 1  # one latent, every GPU


# --- KV-cache page sizes ---------------------------------------------------------------------------------
CACHE = "vllm/v1/kv_cache_interface.py"


def test_page_size_is_k_plus_v_per_head():
    seg = _segments(CACHE)
    assert "return (self.head_size + self.head_size_v) * get_dtype_size(self.dtype)" in seg[
        "AttentionSpec.state_content_size_bytes"]
    assert "return self.num_heads * self.num_states * self.state_content_size_bytes" in seg[
        "AttentionSpec.unpadded_page_size_bytes"]
    assert "return cdiv(max_model_len, self.block_size) * self.page_size_bytes" in seg[
        "FullAttentionSpec.max_memory_usage_bytes"]


@pytest.mark.parametrize("window", [1, 16, 100, 4096])
@pytest.mark.parametrize("seq_len", [1, 17, 1000, 131072])
def test_sliding_window_blocks_are_vllms(window, seq_len):
    cdiv = kvcache.cdiv
    fn = _function(CACHE, "SlidingWindowSpec.max_admission_blocks_per_request", cdiv=cdiv)
    spec = types.SimpleNamespace(sliding_window=window, extra_retained_tokens=0, block_size=16)
    blocks = fn(spec, max_in_flight_tokens=2048, max_model_len=seq_len)
    layer = kvcache.LayerKV(0, "sliding_attention", "GQA", 2, 64, window, 256)
    assert layer.paged_tokens(seq_len, 16, 2048) == blocks * 16


# --- FP8 KV-cache scale names ----------------------------------------------------------------------------
def _vllm_target(name: str, params: set[str]) -> str | None:
    """Where vLLM 0.33 loads checkpoint tensor `name` in a llama model: LlamaModel.hf_to_vllm_mapper's
    stacked rename (WeightsMapper._map_name_with_shard), then maybe_remap_kv_scale_name; None: dropped."""
    stacked_src = _segments("vllm/model_executor/models/llama.py")["LlamaModel.hf_to_vllm_mapper"]
    call = ast.parse(stacked_src).body[0].value
    stacked = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "orig_to_new_stacked"))
    mapper = types.SimpleNamespace(orig_to_new_renaming=[], orig_to_new_regex={}, orig_to_new_substr={},
                                   orig_to_new_stacked=stacked, orig_to_new_prefix={}, orig_to_new_suffix={})
    map_name = _function("vllm/model_executor/models/utils.py", "WeightsMapper._map_name_with_shard",
                         logger=_quiet_logger(), ShardIds=object)
    remap = _function("vllm/model_executor/model_loader/weight_utils.py", "maybe_remap_kv_scale_name",
                      logger=_quiet_logger())
    mapped = map_name(mapper, name)
    if mapped is None:
        return None
    target = remap(mapped[0], {p: None for p in params})
    return target if target in params else None


@pytest.mark.parametrize("spelling", ksn.SPELLINGS, ids=[s.suffix for s in ksn.SPELLINGS])
def test_scale_spellings_are_the_ones_vllm_loads(spelling):
    prefix = "model.layers.0.self_attn"
    params = {f"{prefix}.attn.k_scale", f"{prefix}.attn.v_scale"}
    role = "k" if spelling.role == "kv" else spelling.role
    got = _vllm_target(f"{prefix}.{spelling.suffix}", params)
    if spelling.vllm_loads:
        assert got == f"{prefix}.attn.{role}_scale"
    else:
        assert got is None  # k_proj.output_scale -> qkv_proj.output_scale: no such parameter, 1.0 is used


def test_quantize_kv_writes_a_name_vllm_loads():
    prefix = "model.layers.3.self_attn"
    params = {f"{prefix}.attn.k_scale", f"{prefix}.attn.v_scale"}
    for role in ("k", "v"):
        assert _vllm_target(ksn.canonical_name(prefix, role), params) == f"{prefix}.attn.{role}_scale"


def test_fp8_kv_scheme_vllm_accepts():
    code = _segments("vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py")[
        "CompressedTensorsKVCacheMethod.validate_kv_cache_scheme"]
    assert 'if type_ != "float" or num_bits != 8:' in code
    assert "QuantizationStrategy.TENSOR,\n        QuantizationStrategy.ATTN_HEAD," in code
    assert "if not is_symmetric:" in code
    assert SUPPORTED_SCHEME == {"num_bits": (8,), "type": ("float",), "strategy": ("tensor", "attn_head"),
                                "symmetric": (True,)}


def test_legacy_rope_type_rules():
    code = _segments("vllm/transformers_utils/config.py")["patch_legacy_rope_type"]
    assert '(rope_type_legacy == "su" and rope_type == "longrope")' in code  # rt.COMPATIBLE_PAIRS
    assert ("su", "longrope") in rt.COMPATIBLE_PAIRS and ("mrope", "default") in rt.COMPATIBLE_PAIRS
    assert 'rope_parameters["rope_type"] = "longrope"' in code and "su" in rt.VLLM_ONLY_ALIASES
    assert "Found conflicts between" in code  # KV205's citation
