"""Each row of kvtool/model/kv_dtypes.json against vLLM 0.33.0's own source (tests/data/vllm/0.33.0/).

The names are vLLM's CacheDType, in its order; the storage is its STR_DTYPE_TO_TORCH_DTYPE; the attention kinds are
what its backends' supported_kv_cache_dtypes list; and the bytes per token come from running vLLM's packing code
(each backend's customize_spec, TurboQuantConfig, OctaveFormat, UltraQuant's slot_size, AttentionSpec's page
size) on stand-in specs, compared with what kvtool.model.kvcache computes for the same layer. No torch: vLLM's
functions run with a namespace that names torch dtypes by their strings.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import json
import math
import re
import sys
import types
from pathlib import Path

import pytest

from kvtool.errors import UsageError
from kvtool.model import kv_dtypes, kvcache
from kvtool.model.spec import build_spec
from tests.oracle.test_vllm_facts import _function

_FLASHINFER = "vllm/v1/attention/backends/flashinfer.py"

VERSION = kv_dtypes.release()  # the table is checked at the release it names (its excerpts)
DATA = Path(__file__).resolve().parents[1] / "data" / "vllm" / VERSION
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"  # real configs, with sources
BYTES = {"uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float16": 2, "half": 2, "bfloat16": 2, "float32": 4, "float": 4}
TORCH = types.SimpleNamespace(**{k: k for k in BYTES}, dtype=str)  # torch.uint8 -> "uint8"
HEAD_DIMS = (64, 72, 80, 96, 128, 192, 256)  # 72: a TurboQuant slot that rounds up to even


def _segments(source: str) -> dict[str, str]:
    text = (DATA / (source.replace("/", "__") + ".txt")).read_text(encoding="utf-8")
    assert text.startswith(f"# vLLM {VERSION}, {source}")
    out = {}
    for block in text.split("\n# --- ")[1:]:
        head, _, code = block.partition("\n")
        out[head.split(" (lines")[0]] = code
    return out


def _run(source: str, names: list[str], ns: dict) -> dict:
    """Execute excerpts of one file in ns (vLLM's own code, vendored), first to last."""
    seg = _segments(source)
    for name in names:
        exec(compile("from __future__ import annotations\n" + seg[name], f"vllm/{source}:{name}", "exec"), ns)  # noqa: S102
    return ns


def _value(source: str, name: str):
    """A literal assignment of an excerpt (a list, dict or Literal[...] of strings)."""
    node = ast.parse(_segments(source)[name]).body[0]
    value = node.value
    if isinstance(value, ast.Subscript):  # Literal[...]
        value = value.slice
    if isinstance(value, ast.Call):  # list(_NAME)
        return value
    if isinstance(value, ast.Dict):  # values may be names (torch.uint8): kept as their source text
        return {ast.literal_eval(k): (ast.literal_eval(v) if isinstance(v, ast.Constant) else ast.unparse(v))
                for k, v in zip(value.keys, value.values)}
    return ast.literal_eval(value)


# --- the names and their storage --------------------------------------------------------------------
def test_the_table_is_vllms_cache_dtype_literal_in_order():
    assert kv_dtypes.names() == _value("vllm/config/cache.py", "CacheDType")
    assert kvcache.KV_CACHE_DTYPES == kv_dtypes.names()
    assert kv_dtypes.release() == VERSION


def test_storage_is_vllms_torch_dtype_for_each_name():
    storage = _value("vllm/utils/torch_utils.py", "STR_DTYPE_TO_TORCH_DTYPE")
    for row in kv_dtypes.table().values():
        if row.name == "auto":
            assert row.storage is None and row.layout == "model"
            continue
        assert storage[row.name] == f"torch.{row.storage}", row.name
        if row.layout == "dense":  # plain values: the element is the storage dtype
            assert row.element_bits == 8 * BYTES[row.storage], row.name


# --- which attention kinds have a backend for it ------------------------------------------------------
def _backend_lists() -> dict[tuple[str, str], tuple[str, ...]]:
    """(kind, backend class) -> its supported_kv_cache_dtypes, from every backend excerpt."""
    out = {}
    for path in sorted(DATA.glob("vllm__v1__attention__backends__*.txt")):
        source = path.name[:-4].replace("__", "/")
        seg = _segments(source)
        consts = {}
        for name, code in seg.items():
            if name.endswith(".supported_kv_cache_dtypes"):
                continue
            node = ast.parse(code).body[0]
            node = getattr(node, "value", None)
            if (name.isupper() or name.startswith("_B12X")) and isinstance(node, (ast.List, ast.Tuple)):
                consts[name] = tuple(x for e in node.elts for x in (
                    consts[e.value.id] if isinstance(e, ast.Starred) else (ast.literal_eval(e),)))
        for name, code in seg.items():
            if not name.endswith(".supported_kv_cache_dtypes"):
                continue
            value = ast.parse(code).body[0].value
            names = consts[value.args[0].id] if isinstance(value, ast.Call) else ast.literal_eval(value)
            cls = name.split(".")[0]
            kind = ("mla_sparse" if "Sparse" in cls else "mla") if "/mla/" in source else "standard"
            out[(kind, cls)] = tuple(names)
    return out


def test_every_backend_that_lists_a_dtype_was_read():
    lists = _backend_lists()
    assert len(lists) >= 30 and {k for k, _ in lists} == {"standard", "mla", "mla_sparse"}
    assert all(set(v) <= set(kv_dtypes.names()) for v in lists.values())


@pytest.mark.parametrize("name", kv_dtypes.names())
def test_attention_kinds_are_the_backends_that_list_the_dtype(name):
    row = kv_dtypes.get(name)
    listed = {kind for (kind, _), names in _backend_lists().items() if name in names}
    if row.platform and not listed:  # fp8_inc: served by Intel Gaudi's plugin, no backend in vLLM itself
        assert "plugin" in row.platform
        return
    assert set(row.attention) == listed


# --- bytes per token: vLLM's packing code run on stand-in specs ----------------------------------------
@contextlib.contextmanager
def _modules(**modules):
    """The vLLM modules its functions import when called (name -> attributes), for the duration only."""
    saved = dict(sys.modules)
    try:
        for name, attrs in modules.items():
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
            for k, v in attrs.items():
                setattr(sys.modules[name], k, v)
        yield
    finally:
        for k in set(sys.modules) - set(saved):
            del sys.modules[k]


def _vllm() -> dict:
    """vLLM's KVQuantMode / get_kv_quant_mode / page size and each backend's customize_spec, runnable here."""
    ns: dict = {"IntEnum": enum.IntEnum, "dataclass": dataclasses.dataclass, "math": math, "torch": TORCH,
                "get_dtype_size": lambda d: BYTES[d], "logging": None,
                "replace": lambda spec, **kw: types.SimpleNamespace(**{**vars(spec), **kw})}
    if True:  # one indent for the reader: everything below is vLLM's code
        _run("vllm/v1/kv_cache_interface.py", ["KVQuantMode", "get_kv_quant_mode", "AttentionSpec.state_content_size_bytes",
                                               "AttentionSpec.unpadded_page_size_bytes"], ns)
        _run("vllm/model_executor/layers/quantization/turboquant/config.py", ["TQ_PRESETS", "TurboQuantConfig"], ns)
        ns["modules"] = {"vllm.config.cache": {"get_kv_cache_dtype_handler": lambda name: None},
                         "vllm.model_executor.layers.quantization.turboquant.config":
                             {"TurboQuantConfig": ns["TurboQuantConfig"]}}
        _run("vllm/v1/attention/ops/rocm_octave.py", ["HADAMARD_BLOCK", "ROPE_BITS", "NOPE_BITS", "OctaveFormat"], ns)
        _run("vllm/v1/attention/ops/ultraquant/format.py", ["GROUP_SIZE", "get_group_size", "k_codes_bytes", "n_groups",
                                                           "k_scales_bytes", "v_codes_bytes", "v_scales_bytes",
                                                           "slot_size"], ns)
        _run("vllm/utils/torch_utils.py", ["nvfp4_kv_cache_full_dim"], ns)
        backends = {}
        for layout, source, cls in (("per_token_head", "triton_attn.py", "TritonAttentionBackend"),
                                    ("nvfp4", "flashinfer.py", "FlashInferBackend"),
                                    ("turboquant", "turboquant_attn.py", "TurboQuantAttentionBackend"),
                                    ("octave", "rocm_octave_attn.py", "RocmOctaveAttentionBackend"),
                                    ("ultraquant", "ultraquant_attn.py", "UltraQuantAttentionBackend")):
            _run("vllm/v1/attention/backends/" + source, [f"{cls}.customize_spec"], ns)
            backends[layout] = ns["customize_spec"].__func__
        ns["backends"] = backends
        # the Octave backend asks `sq` (rocm_octave) for the format and the rotary dim registered for a head size
        ns["sq"] = types.SimpleNamespace(OctaveFormat=ns["OctaveFormat"], registered_rope_dim=lambda hd: ns["rope"])
    return ns


VLLM = None


def _page_per_token(name: str, head_dim: int, kv_heads: int, rope: int) -> int:
    """vLLM's page bytes for one token of one standard-attention layer (block_size 1, one state per token)."""
    global VLLM
    VLLM = VLLM or _vllm()
    ns, row = VLLM, kv_dtypes.get(name)
    ns["rope"] = rope
    with _modules(**ns["modules"]):
        spec = types.SimpleNamespace(head_size=head_dim, head_size_v=head_dim, num_kv_heads=kv_heads,
                                     dtype=row.storage, kv_quant_mode=ns["get_kv_quant_mode"](name),
                                     state_content_bytes=None, num_head_slots=None, num_states=1)
        if row.layout in ns["backends"]:
            spec = ns["backends"][row.layout](None, spec)
    spec.num_heads = spec.num_head_slots if spec.num_head_slots is not None else spec.num_kv_heads
    spec.state_content_size_bytes = ns["state_content_size_bytes"].fget(spec)
    return ns["unpadded_page_size_bytes"].fget(spec)


def _layer(kind: str, kv_heads: int, head_dim: int) -> kvcache.LayerKV:
    elements = head_dim if kind == "MLA" else 2 * kv_heads * head_dim
    return kvcache.LayerKV(5, "full_attention", kind, kv_heads, head_dim, None, elements, 32)


STANDARD = [n for n, r in kv_dtypes.table().items() if "standard" in r.attention and r.layout != "model"]


@pytest.mark.parametrize("name", STANDARD)
def test_bytes_per_token_are_vllms_page_bytes_on_standard_attention(name):
    row = kv_dtypes.get(name)
    for head_dim in HEAD_DIMS:
        for rope in {head_dim, head_dim // 2, 64}:
            if row.slot_problem(head_dim, rope):
                if row.layout == "nvfp4":  # vLLM's one NVFP4 backend refuses the head size before any page
                    sizes = _function(_FLASHINFER, "FlashInferBackend.get_supported_head_sizes").__func__(None)
                    assert head_dim not in sizes and tuple(sizes) == kv_dtypes.NVFP4_HEAD_SIZES, (name, head_dim)
                    continue
                with pytest.raises(ValueError):  # vLLM's own format refuses the shape kvtool refuses
                    _page_per_token(name, head_dim, 8, rope)
                continue
            fmt = kvcache.CacheFormat(row, rope_dim=rope)
            for kv_heads in (1, 8):
                want = _page_per_token(name, head_dim, kv_heads, rope)
                assert fmt.bytes_per_token(_layer("GQA", kv_heads, head_dim)) == want, (name, head_dim, rope, kv_heads)


def test_scales_are_counted_where_the_layout_has_them():
    """The figures people quote: per-token-head int8 = values + 8 B of float32 scales per head; nvfp4 = 4.5 bits."""
    assert _page_per_token("int8_per_token_head", 128, 1, 128) == 2 * 128 + 8
    assert _page_per_token("int4_per_token_head", 128, 1, 128) == 2 * 64 + 8
    assert _page_per_token("nvfp4", 128, 1, 128) == 2 * (64 + 8)
    assert _page_per_token("turboquant_k8v4", 128, 1, 128) == 128 + 64 + 4


def test_mla_rows_are_vllms_mla_spec():
    """MLA keeps one latent per token (num_kv_heads 1, head_size_v 0); the DeepSeek blobs are fixed sizes."""
    code = _segments("vllm/model_executor/layers/attention/mla_attention.py")["MLAAttention.get_kv_cache_spec"]
    blob = re.search(r"state_content_bytes=(\{[^}]*\})", code).group(1)
    assert {n: kv_dtypes.get(n).token_bytes for n, r in kv_dtypes.table().items() if r.layout == "token_blob"} \
        == ast.literal_eval(blob)
    assert kv_dtypes.get("fp8_ds_mla").token_bytes == 512 + 4 * 4 + 64 * 2  # the figure the brief quotes
    global VLLM
    VLLM = VLLM or _vllm()
    for name in ("bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        row = kv_dtypes.get(name)
        spec = types.SimpleNamespace(head_size=576, head_size_v=0, dtype=row.storage, state_content_bytes=None)
        assert kvcache.CacheFormat(row).bytes_per_token(_layer("MLA", 1, 576)) \
            == VLLM["state_content_size_bytes"].fget(spec), name


def test_boundary_layers_are_turboquants():
    global VLLM
    VLLM = VLLM or _vllm()
    tq = VLLM["TurboQuantConfig"]
    spec = build_spec(json.loads((CONFIGS / "llama-3.1-8b.json").read_text()))
    model_config = types.SimpleNamespace(is_hybrid=False, hf_text_config=types.SimpleNamespace(num_hidden_layers=32))
    want = {int(i) for i in tq.get_boundary_skip_layers(model_config)}
    for name in ("turboquant_k8v4", "turboquant_3bit_nc", "ultraquant_4bit"):
        fmt, _ = kvcache.cache_format(spec, name)
        assert fmt.skip == want == {0, 1, 30, 31}
    assert not kvcache.cache_format(spec, "nvfp4")[0].skip


# --- what auto becomes, and what vLLM refuses --------------------------------------------------------
def _spec(name: str, **extra):
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg.update(extra)
    return build_spec(cfg)


@pytest.mark.parametrize("qc", [
    {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"},
    {"quant_method": "modelopt", "quantization": {"kv_cache_quant_algo": "NVFP4"}},
    {"quant_method": "modelopt_fp4", "kv_cache_scheme": {"num_bits": 4, "type": "float"}},
    {"quant_method": "modelopt", "kv_cache_quant_algo": "INT8"},
    {"quant_method": "compressed-tensors", "kv_cache_quant_algo": "FP8"},
])
def test_modelopt_auto_is_vllms_mapping(qc):
    ns = {"MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP": _value("vllm/utils/torch_utils.py",
                                                          "MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP"),
          "logger": types.SimpleNamespace(warning=lambda *a, **k: None), "Any": object}
    want = _run("vllm/utils/torch_utils.py", ["get_kv_cache_quant_algo_string"], ns)["get_kv_cache_quant_algo_string"](qc)
    got = kvcache.modelopt_kv_dtype(_spec("llama-3.1-8b", quantization_config=qc))
    assert (got[0] if got else None) == want


def test_a_float_cache_that_is_not_the_model_dtype_is_refused_as_vllm_does():
    ns = _run("vllm/config/vllm.py", ["VllmConfig._reject_mismatched_float_kv_cache"], {})
    check = ns["_reject_mismatched_float_kv_cache"]
    vllm = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype="torch.bfloat16"),
                                 cache_config=types.SimpleNamespace(cache_dtype="float16"))
    with pytest.raises(ValueError):
        check(vllm)
    with pytest.raises(UsageError) as exc:
        kvcache.cache_format(_spec("llama-3.1-8b"), "float16")
    assert exc.value.option == "kv_cache_dtype" and "bfloat16" in exc.value.message
    vllm.cache_config.cache_dtype = "bfloat16"
    check(vllm)
    assert kvcache.cache_format(_spec("llama-3.1-8b"), "bfloat16")[0].name == "bfloat16"


def test_sparse_mla_takes_the_deepseek_blobs_and_dense_mla_does_not():
    v32, v3 = _spec("deepseek-v3.2"), _spec("deepseek-v3")
    assert kv_dtypes.attention_kind(v32) == "mla_sparse" and kv_dtypes.attention_kind(v3) == "mla"
    assert kvcache.bytes_per_token(v32, kvcache.cache_format(v32, "fp8_ds_mla")[0]) == 656 * 61
    assert kvcache.bytes_per_token(v32, kvcache.cache_format(v32, "nvfp4_ds_mla")[0]) == 352 * 61
    with pytest.raises(UsageError, match="sparse MLA"):
        kvcache.cache_format(v3, "fp8_ds_mla")
    # FLASHMLA_SPARSE serves any quantized cache as fp8_ds_mla (vLLM's _canonicalize_sparse_mla_kv_cache_dtype)
    ns = _run("vllm/model_executor/layers/attention/mla_attention.py", ["_canonicalize_sparse_mla_kv_cache_dtype"],
              {"is_quantized_kv_cache": lambda d: d not in ("auto", "bfloat16", "float16"), "CacheDType": str})
    backend = types.SimpleNamespace(get_name=lambda: "FLASHMLA_SPARSE")
    assert ns["_canonicalize_sparse_mla_kv_cache_dtype"](backend, "fp8") == "fp8_ds_mla"
    assert "fp8_ds_mla" in kvcache.cache_format(v32, "fp8")[1]
