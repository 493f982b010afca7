"""Property test: lint never crashes on mutated real configs and always returns a well-formed report."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtool.model.checkpoint import Checkpoint
from kvtool.io.jsonfile import JsonDocument
from kvtool.rules.runner import ModelReport, kv_summary
from kvtool.rules import load_all
from kvtool.rules.context import LintContext
from kvtool.rules.registry import CHECKERS, RULES, SEVERITY_ORDER, LintOptions
from kvtool.model.spec import build_spec

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
VALID = ["llama-3.1-8b.json", "qwen3-30b-a3b.json", "gemma-3-1b-it.json", "deepseek-v3.json", "gpt-oss-20b.json",
         "falcon-40b-shrunk.json", "mpt-7b-shrunk.json", "phi-3.5-mini-instruct.json", "qwen3.5-27b.json",
         "nemotron-h-56b-base-8k.json", "gpt2.json", "mistral-7b-instruct-v0.1.json"]
BASES = [json.loads((CONFIGS / n).read_text(), parse_constant=float) for n in VALID]

junk = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
# Keys worth hitting: the ones tables and rules read.
HOT_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "max_position_embeddings", "sliding_window", "layer_types", "rope_scaling",
            "rope_parameters", "rope_theta", "torch_dtype", "dtype", "eos_token_id", "kv_lora_rank",
            "qk_rope_head_dim", "num_experts_per_tok", "n_routed_experts", "use_sliding_window",
            "max_window_layers", "attn_config", "text_config", "model_type", "partial_rotary_factor",
            "hybrid_override_pattern", "tie_word_embeddings", "quantization_config"]


@st.composite
def mutated(draw):
    cfg = json.loads(json.dumps(draw(st.sampled_from(BASES)), allow_nan=True))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["drop", "junk", "negate", "huge", "retype", "nest"]))
        keys = list(cfg) or ["model_type"]
        key = draw(st.sampled_from(keys + HOT_KEYS))
        if op == "drop":
            cfg.pop(key, None)
        elif op == "junk":
            cfg[key] = draw(junk)
        elif op == "negate":
            v = cfg.get(key)
            cfg[key] = -v if isinstance(v, (int, float)) and not isinstance(v, bool) else -1
        elif op == "huge":
            cfg[key] = draw(st.sampled_from([2**63, 10**30, 1e308, float("inf"), 2**31 - 1]))
        elif op == "retype":
            v = cfg.get(key)
            cfg[key] = str(v) if not isinstance(v, str) else [v]
        else:
            cfg[key] = {"nested": draw(junk), key: cfg.get(key)}
    return cfg


def _lint_dict(config: dict) -> ModelReport:
    """lint_one without files: the same checkers, on an in-memory config."""
    load_all()
    doc = JsonDocument(path=Path("config.json"), data=config, text=json.dumps(config, indent=2, default=str))
    ckpt = Checkpoint(source="config.json", root=None, config_doc=doc)
    spec = build_spec(config)
    ctx = LintContext(ckpt, spec, LintOptions(tensor_parallel_size=4))
    for topic, fn in CHECKERS.values():
        fn(ctx)  # no try/except here: any exception fails the property
    return ModelReport(model="config.json", findings=ctx.findings, model_type=spec.model_type, kv=kv_summary(spec))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
# Crashes this test found once (kept as fixed examples): a negative hidden size gave negative KV bytes;
# an infinite partial_rotary_factor overflowed int().
@example({**BASES[10], "n_embd": -768})
@example({**BASES[4], "partial_rotary_factor": float("inf")})
@example({**BASES[3], "kv_lora_rank": float("inf")})  # MLA latent width: int(inf) in the KV summary
@example({**BASES[3], "qk_rope_head_dim": 1e308})
@example({**BASES[0], "rope_scaling": {"\n": None}})  # a key quoted in a message broke its one line
@example({**BASES[0], "rope_scaling": {"rope_type": "linear", "factor": 2.0, "\x1b[2J": 1}})
def test_lint_never_crashes_and_reports_are_well_formed(config):
    report = _lint_dict(config)
    out = json.loads(json.dumps(report.as_dict(), default=str))
    assert set(out) >= {"model", "findings", "kv_cache"}
    for f in report.findings:
        assert f.code in RULES and f.code != "KV000"
        assert f.severity in SEVERITY_ORDER and f.severity == RULES[f.code].severity.value
        assert isinstance(f.message, str) and f.message and "\n" not in f.message
        assert f.path is None or isinstance(f.path, str)
    if report.kv is not None:
        assert report.kv["bytes_per_token"] >= 0 and math.isfinite(report.kv["bytes_per_token"])
