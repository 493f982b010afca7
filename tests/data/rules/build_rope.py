"""Write the RoPE rule fixtures tests/data/rules/KV2xx/{fail,pass}_*/config.json.

Run `python tests/data/rules/build_rope.py` after changing a fixture below; it rewrites only the KV2xx
folders. Real configs come from tests/data/rope/ (copies of the shared corpus, see its SOURCES.md).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
REAL = HERE.parent / "rope"


def real(name: str) -> dict:
    return json.loads((REAL / f"{name}.json").read_text())


def llama(**kw) -> dict:
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
           "max_position_embeddings": 4096, "rope_theta": 10000.0, "torch_dtype": "bfloat16"}
    cfg.update(kw)
    return cfg


def with_rs(base: dict, **rs) -> dict:
    cfg = copy.deepcopy(base)
    cfg["rope_scaling"] = {**cfg.get("rope_scaling", {}), **rs}
    return cfg


PHI = real("phi-3.5-mini-instruct")
L31 = real("llama-3.1-8b")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}

FIXTURES = {
    "KV201": {
        "fail_gptj_real": real("gpt-j-6b"),
        "fail_made_up_type": llama(rope_scaling={"rope_type": "ntk-by-parts", "factor": 2.0}),
        "pass_llama31": L31,
        "pass_plain": llama(),
    },
    "KV202": {
        "fail_yarn_without_original": llama(max_position_embeddings=16384, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        "fail_linear_without_factor": llama(rope_scaling={"rope_type": "linear"}),
        "pass_phi35_original_at_top_level": PHI,
        "pass_yarn": llama(max_position_embeddings=16384, rope_scaling=YARN),
    },
    "KV203": {
        "fail_linear_with_beta": llama(rope_scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 32}),
        "pass_linear": llama(rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "pass_olmo3_yarn": real("olmo-3.1-32b-instruct"),
    },
    "KV204": {
        "fail_below_one": llama(rope_scaling={"rope_type": "linear", "factor": 0.5}),
        "pass_one": llama(rope_scaling={"rope_type": "linear", "factor": 1.0}),
    },
    "KV205": {
        "fail_dynamic_vs_linear": llama(rope_scaling={"type": "dynamic", "rope_type": "linear", "factor": 2.0}),
        "pass_su_longrope": with_rs(PHI, type="su", rope_type="longrope"),
        "pass_deepseek_type_only": real("deepseek-v3"),
    },
    "KV206": {
        "fail_zero": llama(rope_theta=0),
        "fail_string": llama(rope_theta="1e4"),
        "fail_v5_negative": llama(rope_parameters={"rope_type": "default", "rope_theta": -5.0}, rope_theta=-5.0),
        "pass": llama(rope_theta=1e6),
    },
    "KV207": {
        "fail_short_too_short": with_rs(PHI, short_factor=PHI["rope_scaling"]["short_factor"][:-1]),
        "fail_long_too_long": with_rs(PHI, long_factor=PHI["rope_scaling"]["long_factor"] + [1.0]),
        "pass_phi35": PHI,
    },
    "KV208": {
        "fail_swapped": with_rs(L31, low_freq_factor=4.0, high_freq_factor=1.0),
        "pass_llama31": L31,
        "pass_llama4_equal_band": real("llama-4-scout-17b-16e-instruct"),
    },
    "KV209": {
        "fail_not_extended": {**L31, "max_position_embeddings": 8192},
        "pass_llama31": L31,
        "pass_exaone4": real("exaone-4.0-32b"),
    },
    "KV210": {
        "fail_double": llama(max_position_embeddings=65536, rope_scaling=YARN),
        "pass_deepseek_v3": real("deepseek-v3"),
        "pass_gpt_oss": real("gpt-oss-20b"),
        "pass_implicit_factor_one": llama(max_position_embeddings=4096, rope_scaling=YARN),
    },
    "KV211": {
        "fail_already_extended": llama(max_position_embeddings=16384, original_max_position_embeddings=4096,
                                       rope_scaling={"rope_type": "linear", "factor": 4.0}),
        "pass_original_length": llama(max_position_embeddings=4096, original_max_position_embeddings=4096,
                                      rope_scaling={"rope_type": "linear", "factor": 4.0}),
    },
    "KV212": {
        "fail_minicpm_dynamic": real("minicpm-2b"),
        "pass_llama2": real("llama-2-7b-hf"),
        "pass_llama31": L31,
    },
    "KV213": {
        "fail_glm5": real("glm-5"),
        "fail_qwen35": real("qwen3.5-27b"),
        "pass_v5_default": llama(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "pass_both_layouts": llama(rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        "pass_transformers5": real("qwen3.5-27b"),
    },
    "KV214": {
        "fail_theta": llama(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        "fail_factor": llama(rope_scaling={"rope_type": "linear", "factor": 2.0},
                             rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}),
        "pass_same": llama(rope_scaling={"rope_type": "linear", "factor": 2.0},
                           rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    },
    "KV216": {
        "fail_deepseek_yarn": with_rs(real("deepseek-v3"), type="deepseek_yarn"),
        "fail_ntk": llama(rope_scaling={"rope_type": "ntk", "factor": 2.0}),
        "pass_deepseek_v3": real("deepseek-v3"),
    },
    "KV217": {
        "fail_phi35_yarn": {**PHI, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 4096}},
        "fail_phi35_linear": {**PHI, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        "pass_phi35": PHI,
        "pass_llama_yarn": llama(max_position_embeddings=16384, rope_scaling=YARN),
    },
    "KV218": {
        "fail_llama_yarn_partial": llama(max_position_embeddings=16384, partial_rotary_factor=0.5, rope_scaling=YARN),
        "fail_llama_v5_linear_partial": llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                               "partial_rotary_factor": 0.5}),
        "pass_llama_yarn": llama(max_position_embeddings=16384, rope_scaling=YARN),
        "pass_plain_partial": llama(partial_rotary_factor=0.5),
    },
    "KV219": {
        "fail_llama_plain_partial": llama(partial_rotary_factor=0.5),
        "pass_llama_full": llama(partial_rotary_factor=1.0),
        "pass_phi_partial": {**PHI, "partial_rotary_factor": 0.5},
    },
    "KV215": {
        "fail_factor_string": llama(rope_scaling={"rope_type": "dynamic", "factor": "4"}),
        "fail_beta_order": llama(max_position_embeddings=16384, rope_scaling={**YARN, "beta_fast": 1, "beta_slow": 32}),
        "fail_partial_rotary": llama(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                      "partial_rotary_factor": 1.5}, rope_theta=1e4),
        "pass_gpt_oss": real("gpt-oss-20b"),
        "pass_kimi_k2": real("kimi-k2-instruct"),
    },
}


# kvtool-lint.json of a fixture: the engine releases it is about (KV213 holds for transformers < 5 only)
OPTIONS = {
    ("KV213", "fail_glm5"): {"engine": ["transformers==4.57.6"]},
    ("KV213", "fail_qwen35"): {"engine": ["transformers==4.57.6"]},
    ("KV213", "pass_both_layouts"): {"engine": ["transformers>=4.38,<5"]},
    ("KV213", "pass_transformers5"): {"engine": ["transformers==5.0.0"]},
}


def build() -> None:
    for code, cases in FIXTURES.items():
        shutil.rmtree(HERE / code, ignore_errors=True)
        for name, cfg in cases.items():
            (HERE / code / name).mkdir(parents=True)
            (HERE / code / name / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            if (code, name) in OPTIONS:
                (HERE / code / name / "kvtool-lint.json").write_text(json.dumps(OPTIONS[code, name]) + "\n")
    print(f"wrote {sum(map(len, FIXTURES.values()))} fixtures for {len(FIXTURES)} rules under {HERE}")


if __name__ == "__main__":
    build()
