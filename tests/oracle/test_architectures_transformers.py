"""Architecture tables agree with transformers 5.x: field names, defaults, module names, per-layer attention
types, and every real config in tests/data/configs/ (moved out of tests/model/test_architectures.py: torch-free lane)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
from kvtest import unique_tables

pytestmark = pytest.mark.oracle

from kvtool.model.layer_types import ALIASES
from kvtool.model.spec import build_spec

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
# Tables whose weight names are the hub checkpoints', which transformers renames at load
# (transformers/conversion_mapping.py): the module-name test cannot compare them.
HUB_NAMES = {"exaone": "transformer.h.* / attn.attention.* (remote-code names)", "nemotron_h": "backbone.*"}
# Config keys every transformers class accepts: pre-v5 spellings folded into dtype / rope_parameters,
# and PreTrainedConfig's own fields (text configs nested in a wrapper declare them on the wrapper).
PRE_V5_KEYS = {"torch_dtype", "rope_theta", "rope_scaling", "partial_rotary_factor",
               "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "dtype"}
_READ = re.compile(r"""(?:config|self)\.(\w+)|getattr\(\s*(?:config|self)\s*,\s*["'](\w+)["']|kwargs\.pop\(\s*["'](\w+)["']""")


def _keys_transformers_reads(cls) -> set[str]:
    """Dataclass fields, attribute_map names, and every key its configuration / modeling files read."""
    known = {f.name for f in dataclasses.fields(cls)}
    amap = getattr(cls, "attribute_map", {})
    known |= set(amap) | set(amap.values())
    folder = Path(sys.modules[cls.__module__].__file__).parent
    for src in list(folder.glob("configuration_*.py")) + list(folder.glob("modeling_*.py")):
        for m in _READ.finditer(src.read_text(encoding="utf-8")):
            known.add(next(g for g in m.groups() if g))
    return known

transformers = pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING  # noqa: E402


TABLES = unique_tables()
TF_TABLES = [a for a in TABLES if a.model_type in CONFIG_MAPPING]


def _quiet():
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)


# --- agreement with transformers' config classes ----------------------------------------------

def _source_keys(arch):
    for name, sources in arch.fields.items():
        for src in sources:
            if isinstance(src, str):
                yield name, src
            elif isinstance(src, dict):
                if "key" in src:
                    yield name, src["key"]
                for k in src.get("when", {}):
                    yield name, k


@pytest.mark.parametrize("arch", TF_TABLES, ids=lambda a: a.model_type)
def test_field_source_keys_exist_in_transformers(arch):
    _quiet()
    cls = CONFIG_MAPPING[arch.model_type]
    known = _keys_transformers_reads(cls)
    bad = []
    for name, key in _source_keys(arch):
        top = key.split(".")[0]
        if key in arch.legacy_keys or key in PRE_V5_KEYS or top in known:
            continue
        bad.append(f"{name}: {key}")
    assert not bad, f"keys transformers' {cls.__name__} does not define (list them in legacy_keys if real): {bad}"


@pytest.mark.parametrize("arch", TF_TABLES, ids=lambda a: a.model_type)
def test_table_defaults_equal_transformers_defaults(arch):
    cls = CONFIG_MAPPING[arch.model_type]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    checked = 0
    for key, value in arch.defaults.items():
        if key == "rope_theta" and isinstance(getattr(cls, "default_theta", None), (int, float)):
            assert value == cls.default_theta, key
            checked += 1
            continue
        f = fields.get(key)
        if f is None or f.default is dataclasses.MISSING:
            continue  # a remote-code / legacy key, or a resolver setting (documented in the description)
        assert value == f.default, f"{arch.model_type}.defaults[{key!r}] = {value!r}, transformers says {f.default!r}"
        checked += 1
    if arch.model_type == "falcon":
        assert arch.defaults["multi_query"] is True  # FalconConfig's default: 7B-style MQA
    assert checked or not arch.defaults


# Class defaults that cannot build a model as they stand (transformers 5.24): DbrxAttentionConfig lacks
# rope_theta; Glm4MoeConfig's 4096 / 96 heads has no integral head_dim.
TINY_OVERRIDES = {"dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0}}, "glm4_moe": {"head_dim": 128}}


def _tiny_config(model_type):
    kwargs = dict(TINY_OVERRIDES.get(model_type, {}))
    if model_type != "nemotron_h":  # its layer count is the length of its block pattern
        kwargs["num_hidden_layers"] = 4
    return CONFIG_MAPPING[model_type](**kwargs)


def _meta_model(arch):
    """(config, model on the meta device, {parameter name: shape}) with the table's naming prefix."""
    torch = pytest.importorskip("torch")
    _quiet()
    from transformers import AutoModel, AutoModelForCausalLM

    cfg = _tiny_config(arch.model_type)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            model = AutoModel.from_config(cfg)  # text towers of multimodal models (qwen3_vl_text)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    base = getattr(model, "base_model_prefix", "")
    if not any(n.startswith(arch.weights["layer"].split("{")[0]) for n in shapes) and base:
        shapes = {f"{base}.{n}": sh for n, sh in shapes.items()}  # a bare base model: names lack its prefix
    return cfg, model, shapes


@pytest.mark.parametrize("arch", [a for a in TF_TABLES if a.model_type not in HUB_NAMES], ids=lambda a: a.model_type)
def test_weight_names_are_transformers_module_names(arch):
    """Instantiate the model on the meta device (no memory) and look for every name the table gives."""
    cfg, model, shapes = _meta_model(arch)
    names = set(shapes)
    spec = build_spec(cfg.to_dict())
    layer = next(i for i, t in enumerate(spec.layer_types) if t in ("full_attention", "sliding_attention",
                                                                    "chunked_attention"))
    w = arch.weights
    expected = [arch.tensor_name(r, layer) for r in ("q", "k", "v", "o", "qkv") if w.get(r)]
    if w.get("q_norm") and getattr(cfg, "use_qk_norm", getattr(cfg, "qk_layernorm", True)) is True:
        expected += [arch.tensor_name("q_norm", layer), arch.tensor_name("k_norm", layer)]
    for role, local in w.get("mla", {}).items():
        if role == "indexer":
            expected.append(f"{arch.attn_prefix(layer)}.{local}.wk.weight")
        elif role != "q" or not getattr(cfg, "q_lora_rank", None):
            if role not in ("q_a", "q_b") or getattr(cfg, "q_lora_rank", None):
                expected.append(f"{arch.attn_prefix(layer)}.{local}.weight")
    expected.append(w["embed"])
    has_head = hasattr(model, "lm_head") or hasattr(model, "embed_out")
    if has_head and not spec.get("tie_word_embeddings", False) and w.get("lm_head") != "embed_out.weight":
        expected.append(w["lm_head"])  # gpt_neox: hub files say embed_out, transformers renames it to lm_head
    missing = [e for e in expected if e and e not in names]
    assert not missing, f"not in {type(model).__name__}: {missing}"
    for role in w.get("bias", []):
        assert f"{arch.attn_prefix(layer)}.{w[role]}.bias" in names, role


@pytest.mark.parametrize("arch", [a for a in TF_TABLES if a.model_type not in HUB_NAMES and a.attention["kind"] == "gqa"],
                         ids=lambda a: a.model_type)
def test_projection_shapes_follow_the_spec(arch):
    """heads x head_dim from ModelSpec equals the rows of transformers' q/k/v (or fused qkv) weights."""
    cfg, model, shapes = _meta_model(arch)
    spec = build_spec(cfg.to_dict())
    h, kv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    layer = spec.layer_types.index("full_attention") if "full_attention" in spec.layer_types else 0
    w = arch.weights
    gate = 2 if w.get("q_gated") else 1  # qwen3_next / 3.5: q_proj also yields the output gate
    if w.get("qkv"):
        rows = shapes[arch.tensor_name("qkv", layer)]
        assert (h + 2 * kv) * hd in rows, (rows, h, kv, hd)
    else:
        assert shapes[arch.tensor_name("q", layer)][0] == gate * h * hd
        assert shapes[arch.tensor_name("k", layer)][0] == kv * hd
        assert shapes[arch.tensor_name("v", layer)][0] == kv * hd


# --- layer-type resolvers against transformers' own default layer_types ------------------------

RESOLVER_CASES = [
    ("gemma2", {"num_hidden_layers": 6}),
    ("gpt_oss", {"num_hidden_layers": 6}),
    ("cohere2", {"num_hidden_layers": 8}),
    ("olmo3", {"num_hidden_layers": 8}),
    ("exaone4", {"num_hidden_layers": 8}),
    ("gemma3_text", {"num_hidden_layers": 12}),
    ("qwen2", {"num_hidden_layers": 8, "use_sliding_window": True, "max_window_layers": 3, "sliding_window": 64}),
    ("qwen3", {"num_hidden_layers": 8, "use_sliding_window": True, "max_window_layers": 5, "sliding_window": 64}),
    ("qwen2_moe", {"num_hidden_layers": 8, "use_sliding_window": True, "max_window_layers": 5, "sliding_window": 64}),
    ("qwen2", {"num_hidden_layers": 8, "use_sliding_window": False, "sliding_window": 64}),
    ("smollm3", {"num_hidden_layers": 8, "use_sliding_window": True, "sliding_window": 64}),
    ("llama4_text", {"num_hidden_layers": 8}),
    ("qwen3_next", {"num_hidden_layers": 8}),
    ("qwen3_5_text", {"num_hidden_layers": 8}),
]


@pytest.mark.parametrize("model_type,config", RESOLVER_CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(RESOLVER_CASES)])
def test_layer_type_resolvers_match_transformers(model_type, config):
    _quiet()
    tf = CONFIG_MAPPING[model_type](**config)
    want = [ALIASES.get(t, t) for t in tf.layer_types]
    spec = build_spec({"model_type": model_type, **config})  # no layer_types key: the resolver decides
    assert spec.layer_types == want


# --- every real config ------------------------------------------------------------------------

def _corpus():
    return sorted(CONFIGS.glob("*.json"))


# Expected (layers, heads, kv_heads, head_dim) for configs whose model type transformers does not ship,
# from their remote-code modeling files.
REMOTE = {
    "internlm2-chat-7b.json": ("internlm2", 32, 32, 8, 128),
    "minicpm-2b.json": ("minicpm", 40, 36, 36, 64),
    "minicpm-moe-8x2b.json": ("minicpm", 40, 36, 36, 64),
    "mimo-7b-base.json": ("mimo", 36, 32, 8, 128),
    "kimi-k2-instruct.json": ("deepseek_v3", 61, 64, 64, None),
    "kimi-k2.5.json": ("deepseek_v3", 61, 64, 64, None),
    "chatglm3-6b.json": ("generic", 28, 32, 2, 128),
    "baichuan2-7b-chat.json": ("generic", 32, 32, 32, 128),
    "qwen-1.8b-chat.json": ("generic", 24, 16, 16, 128),
    "phi-2-msft-remote-code.json": ("generic", 32, 32, 32, 80),
    "deepseek-moe-16b.json": ("generic", 28, 16, 16, 128),
    "llama-3.3-nemotron-super-49b-v1.json": ("generic", 80, 64, 64, 128),
}


def test_corpus_is_complete():
    files = {p.name for p in _corpus()}
    assert len(files) == 70 and (CONFIGS / "README.md").is_file()


@pytest.mark.parametrize("path", _corpus(), ids=lambda p: p.name)
def test_corpus_spec_matches_transformers(path):
    _quiet()
    spec = build_spec(json.loads(path.read_text(), parse_constant=float))
    if path.name in REMOTE:
        table, layers, heads, kv, hd = REMOTE[path.name]
        assert (spec.arch.model_type, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (table, layers, heads, kv)
        if hd is not None:
            assert spec.head_dim == hd
        assert spec.layer_types and set(spec.layer_types) == {"full_attention"}
        return
    mt = spec.config.get("model_type")
    assert mt in CONFIG_MAPPING, f"{path.name}: add its expectations to REMOTE"
    tf = CONFIG_MAPPING[mt](**spec.config)
    assert spec.num_layers == tf.num_hidden_layers
    assert spec.num_heads == tf.num_attention_heads
    kv_attr = "num_kv_heads" if mt == "falcon" else "num_key_value_heads"
    tf_kv = getattr(tf, kv_attr, None)
    if mt == "falcon" and not tf.new_decoder_architecture and tf.multi_query:
        tf_kv = 1  # FalconAttention: multi_query means one KV head whatever num_kv_heads says
    assert spec.num_kv_heads == (tf_kv if tf_kv is not None else tf.num_attention_heads)
    if getattr(tf, "head_dim", None) is not None and not spec.is_mla:
        assert spec.head_dim == tf.head_dim
    if isinstance(getattr(tf, "layer_types", None), list):
        norm = {"mamba": "linear_attention"}  # kvtool keeps Mamba layers apart; both hold no KV cache
        assert Counter(norm.get(t, t) for t in spec.layer_types) == Counter(ALIASES.get(t, t) for t in tf.layer_types)
    if hasattr(tf, "sliding_window") and mt not in ("qwen2_moe",):
        assert spec.sliding_window == (tf.sliding_window or None)


