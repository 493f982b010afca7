"""Inputs of the oracle lane: every real config under tests/data/configs, and a generated mutation set.

Mutations start from tiny configs of ten architectures (small enough that transformers builds the
model and runs one forward in milliseconds) and change one thing each: RoPE type, factor, keys and
theta; partial rotary; head counts and head_dim; dtypes; MLA dimensions; sliding windows; MoE
routing; a multimodal wrapper's own keys. Each case has a stable id, so a failure names its input.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


@dataclass(frozen=True)
class Case:
    id: str
    config: dict
    base: str = ""  # the tiny base a mutation started from ("" for real configs)


def _tiny(model_type: str, arch: str, **kw) -> dict:
    cfg = {"model_type": model_type, "architectures": [arch], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
           "max_position_embeddings": 256, "rope_theta": 10000.0, "torch_dtype": "float32",
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
    cfg.update(kw)
    return {k: v for k, v in cfg.items() if v is not _DROP}


_DROP = object()

BASES: dict[str, dict] = {
    "llama": _tiny("llama", "LlamaForCausalLM"),
    "qwen2": _tiny("qwen2", "Qwen2ForCausalLM", use_sliding_window=False, sliding_window=None),
    "mistral": _tiny("mistral", "MistralForCausalLM", sliding_window=128),
    "qwen3": _tiny("qwen3", "Qwen3ForCausalLM", head_dim=16),
    "phi3": _tiny("phi3", "Phi3ForCausalLM", num_key_value_heads=4, original_max_position_embeddings=256),
    "gemma3_text": _tiny("gemma3_text", "Gemma3ForCausalLM", head_dim=16, sliding_window=32,
                         layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=10000.0,
                         query_pre_attn_scalar=16),
    "mixtral": _tiny("mixtral", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    "gpt_neox": _tiny("gpt_neox", "GPTNeoXForCausalLM", num_key_value_heads=_DROP, rotary_pct=0.25,
                      pad_token_id=_DROP),
    "deepseek_v3": _tiny("deepseek_v3", "DeepseekV3ForCausalLM", num_key_value_heads=4, kv_lora_rank=16,
                         q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=1, topk_group=1, torch_dtype="bfloat16"),
}
GQA_BASES = ("llama", "qwen2", "mistral", "qwen3", "mixtral")
ROPE_BASES = ("llama", "qwen2", "qwen3", "phi3", "mistral", "deepseek_v3")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _longrope(dim_half: int, n: int | None = None) -> dict:
    n = dim_half if n is None else n
    return {"rope_type": "longrope", "short_factor": [1.0] * n, "long_factor": [1.0 + i / n for i in range(n)],
            "original_max_position_embeddings": 64}


def _rope_mutations(base: dict) -> dict[str, dict]:
    """RoPE dicts (legacy rope_scaling) and a few v5 / top-level variants; name -> config edits."""
    hd = base.get("qk_rope_head_dim") or base.get("head_dim") or base["hidden_size"] // base["num_attention_heads"]
    m: dict[str, dict] = {
        "rope_linear_2": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        "rope_linear_half": {"rope_scaling": {"rope_type": "linear", "factor": 0.5}},
        "rope_linear_string": {"rope_scaling": {"rope_type": "linear", "factor": "2"}},
        "rope_linear_nofactor": {"rope_scaling": {"rope_type": "linear"}},
        "rope_dynamic_2": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        "rope_dynamic_alpha": {"rope_scaling": {"rope_type": "dynamic", "alpha": 2.0}},
        "rope_yarn": {"rope_scaling": YARN, "max_position_embeddings": 1024},
        "rope_yarn_nofactor": {"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 256},
                               "max_position_embeddings": 1024},
        "rope_yarn_noorig": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 1024},
        "rope_yarn_beta_swapped": {"rope_scaling": {**YARN, "beta_fast": 1, "beta_slow": 32},
                                   "max_position_embeddings": 1024},
        "rope_yarn_mscale": {"rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
                             "max_position_embeddings": 1024},
        "rope_yarn_attention_factor": {"rope_scaling": {**YARN, "attention_factor": 0.8},
                                       "max_position_embeddings": 1024},
        "rope_yarn_mpe_mismatch": {"rope_scaling": YARN, "max_position_embeddings": 4096},
        "rope_llama3": {"rope_scaling": LLAMA3, "max_position_embeddings": 512},
        "rope_llama3_swapped": {"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
                                "max_position_embeddings": 512},
        "rope_llama3_nolow": {"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"},
                              "max_position_embeddings": 512},
        "rope_longrope": {"rope_scaling": _longrope(hd // 2), "max_position_embeddings": 256},
        "rope_longrope_short_list": {"rope_scaling": _longrope(hd // 2, hd // 2 - 1), "max_position_embeddings": 256},
        "rope_longrope_nolists": {"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 64}},
        "rope_su": {"rope_scaling": {**_longrope(hd // 2), "rope_type": "su"}, "max_position_embeddings": 256},
        "rope_unknown_type": {"rope_scaling": {"rope_type": "ntk-by-parts", "factor": 2.0}},
        "rope_type_conflict": {"rope_scaling": {"type": "dynamic", "rope_type": "linear", "factor": 2.0}},
        "rope_legacy_type_only": {"rope_scaling": {"type": "linear", "factor": 2.0}},
        "rope_unknown_key": {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}},
        "rope_theta_zero": {"rope_theta": 0},
        "rope_theta_negative": {"rope_theta": -5.0},
        "rope_theta_string": {"rope_theta": "1e4"},
        "rope_theta_big": {"rope_theta": 1e6},
        "rope_v5_default": {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_theta": _DROP},
        "rope_v5_yarn": {"rope_parameters": {**YARN, "rope_theta": 1e4}, "max_position_embeddings": 1024},
        "rope_layouts_disagree": {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        "rope_partial_top": {"partial_rotary_factor": 0.5},
        "rope_partial_top_yarn": {"partial_rotary_factor": 0.5, "rope_scaling": YARN, "max_position_embeddings": 1024},
        "rope_partial_in_dict_linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0,
                                                         "partial_rotary_factor": 0.5}},
        "rope_partial_too_big": {"partial_rotary_factor": 1.5},
        "rope_deepseek_yarn": {"rope_scaling": {**YARN, "rope_type": "deepseek_yarn"}, "max_position_embeddings": 1024},
        "rope_ntk": {"rope_scaling": {"rope_type": "ntk", "factor": 2.0}},
        "rope_proportional": {"rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.5}},
    }
    return m


def _common_mutations(base: dict) -> dict[str, dict]:
    h = base["num_attention_heads"]
    return {
        "heads_kv1": {"num_key_value_heads": 1},
        "heads_kv3": {"num_key_value_heads": 3},
        "heads_kv_more": {"num_key_value_heads": h * 2},
        "heads_kv0": {"num_key_value_heads": 0},
        "heads_kv_negative": {"num_key_value_heads": -2},
        "heads_kv_float": {"num_key_value_heads": 2.0},
        "heads_q_odd": {"num_attention_heads": 5},
        "head_dim_explicit_match": {"head_dim": base["hidden_size"] // h},
        "head_dim_explicit_other": {"head_dim": 32},
        "head_dim_odd": {"head_dim": 15},
        "hidden_not_divisible": {"hidden_size": 66, "head_dim": _DROP},
        "dtype_bf16_name": {"torch_dtype": "bf16"},
        "dtype_typo": {"torch_dtype": "float17"},
        "dtype_int": {"torch_dtype": "int8"},
        "dtype_v5": {"torch_dtype": _DROP, "dtype": "bfloat16"},
        "dtype_conflict": {"dtype": "bfloat16", "torch_dtype": "float32"},
        "dtype_torch_prefix": {"torch_dtype": "torch.float16"},
        "sliding_zero": {"sliding_window": 0},
        "sliding_negative": {"sliding_window": -4},
        "sliding_one": {"sliding_window": 1},
        "sliding_huge": {"sliding_window": 1 << 20},
        "sliding_null": {"sliding_window": None},
        "vocab_eos_outside": {"eos_token_id": 500},
        "layers_zero": {"num_hidden_layers": 0},
        "mpe_zero": {"max_position_embeddings": 0},
    }


def _mla_mutations() -> dict[str, dict]:
    return {
        "mla_kv3": {"num_key_value_heads": 3},
        "mla_kv2": {"num_key_value_heads": 2},
        "mla_kv_more": {"num_key_value_heads": 8},
        "mla_rope_odd": {"qk_rope_head_dim": 7},
        "mla_rope_zero": {"qk_rope_head_dim": 0},
        "mla_kv_lora_zero": {"kv_lora_rank": 0},
        "mla_q_lora": {"q_lora_rank": 32},
        "mla_head_dim_mismatch": {"head_dim": 64},
        "moe_topk_over": {"num_experts_per_tok": 8},
        "moe_topk_zero": {"num_experts_per_tok": 0},
        "moe_groups": {"n_group": 2, "topk_group": 1},
        "moe_groups_bad": {"n_group": 3, "topk_group": 1},
        "mla_yarn": {"rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, "max_position_embeddings": 1024},
    }


def _moe_mutations() -> dict[str, dict]:
    return {
        "moe_topk_over": {"num_experts_per_tok": 8},
        "moe_topk_zero": {"num_experts_per_tok": 0},
        "moe_experts_one": {"num_local_experts": 1, "num_experts_per_tok": 1},
    }


def _gemma_mutations() -> dict[str, dict]:
    return {
        "layer_types_short": {"layer_types": ["full_attention"]},
        "layer_types_unknown": {"layer_types": ["sliding_attention", "global"]},
        "layer_types_all_sliding": {"layer_types": ["sliding_attention", "sliding_attention"]},
        "local_theta_zero": {"rope_local_base_freq": 0},
        "rope_v5_nested": {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                           "rope_theta": _DROP, "rope_local_base_freq": _DROP},
    }


def _apply(base: dict, edits: dict) -> dict:
    cfg = copy.deepcopy(base)
    for k, v in edits.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = copy.deepcopy(v)
    return cfg


def _wrappers() -> list[Case]:
    text = _tiny("llama", "LlamaForCausalLM")
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 16}
    wrap = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": text,
            "vision_config": vision, "image_token_index": 3}
    out = [Case("wrapper/llava", wrap, "llava")]
    for name, edits in {
        "top_dtype_typo": {"dtype": "float17"},
        "top_dtype_ok": {"dtype": "bfloat16"},
        "top_torch_dtype_int": {"torch_dtype": "int8"},
    }.items():
        out.append(Case(f"wrapper/llava/{name}", _apply(wrap, edits), "llava"))
    for name, edits in {
        "text_kv3": {"num_key_value_heads": 3},
        "text_dtype_typo": {"torch_dtype": "float17"},
        "text_rope_unknown": {"rope_scaling": {"rope_type": "ntk-by-parts", "factor": 2.0}},
        "text_yarn": {"rope_scaling": YARN, "max_position_embeddings": 1024},
    }.items():
        out.append(Case(f"wrapper/llava/{name}", {**wrap, "text_config": _apply(text, edits)}, "llava"))
    return out


def mutation_cases() -> list[Case]:
    out: list[Case] = []
    for name, base in BASES.items():
        out.append(Case(f"{name}/base", copy.deepcopy(base), name))
        muts: dict[str, dict] = {}
        if name in ROPE_BASES or name in ("gemma3_text", "gpt_neox", "mixtral"):
            muts.update(_rope_mutations(base))
        if name != "deepseek_v3":
            muts.update(_common_mutations(base))
        else:
            muts.update(_mla_mutations())
            muts.update({k: v for k, v in _common_mutations(base).items() if k.startswith(("dtype", "vocab"))})
        if name == "mixtral":
            muts.update(_moe_mutations())
        if name == "gemma3_text":
            muts.update(_gemma_mutations())
        if name == "gpt_neox":
            muts = {k: v for k, v in muts.items() if not k.startswith(("heads_kv", "sliding"))}
            muts.update({"rotary_pct_half": {"rotary_pct": 0.5}, "rotary_pct_zero": {"rotary_pct": 0.0}})
        for mname, edits in sorted(muts.items()):
            out.append(Case(f"{name}/{mname}", _apply(base, edits), name))
    return out + _wrappers()


def real_cases() -> list[Case]:
    return [Case(f"real/{p.stem}", json.loads(p.read_text())) for p in sorted(CONFIGS.glob("*.json"))]
