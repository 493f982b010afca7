"""kvtool's vLLM facts per release, against each release's own source (verbatim excerpts under tests/data/vllm/).

vLLM's GPU wheels cannot run here; `pip download vllm==X --no-deps` gives each release's source, and
tests/data/vllm/extract.py --releases copies the functions whose behaviour changed between releases. Where the
function is pure it runs as vLLM wrote it (with vLLM's module-level helpers stubbed: a logger, envs, the platform):
vLLM's own `_get_and_verify_max_len` gives the max_model_len of each RoPE dict, which must equal
kvtool.model.rope.types.served_context under the arithmetic the facts table switches on for that release
(schemas/engines/facts.json, `vllm-yarn-max-len-from-original`). kv-budget and `rope --show` use that arithmetic.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest

from kvtool.engines.facts import arithmetic, facts
from kvtool.model.rope.types import served_context

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm"
# the releases whose max_model_len / paging functions were copied (`extract.py --releases`); a release folder
# holding other excerpts only (mla/ for tests/oracle/test_vllm_mla_backends.py, 0.32.0's scale-name function) is
# not one of them
RELEASES = sorted((p.name for p in DATA.iterdir() if p.is_dir() and p.name[:1].isdigit()
                   and any("\n# --- _get_and_verify_max_len (lines" in f.read_text(encoding="utf-8")
                           for f in p.glob("*.txt"))),
                  key=lambda v: tuple(int(x) for x in v.split(".")))


def _excerpt(version: str, name: str) -> str:
    for path in sorted((DATA / version).glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        head = f"\n# --- {name} (lines"
        if head in text:
            code = text.split(head, 1)[1].split("\n", 1)[1]
            return code.split("\n# --- ", 1)[0]
    raise LookupError(f"vLLM {version}: no excerpt of {name}")


def _quiet():
    return types.SimpleNamespace(**{m: (lambda *a, **k: None) for m in
                                    ("warning", "warning_once", "info", "info_once", "debug", "debug_once")})


def _nested(rp) -> bool:
    return isinstance(rp, dict) and bool(rp) and all(isinstance(v, dict) for v in rp.values())


def _max_len_function(version: str):
    """vLLM's _get_and_verify_max_len of `version`, executed as written; module helpers stubbed."""
    ns = {
        "logger": _quiet(), "Any": object, "Optional": object, "Union": object, "PretrainedConfig": object,
        "PreTrainedConfig": object, "ModelArchitectureConfig": object,
        "envs": types.SimpleNamespace(VLLM_ALLOW_LONG_MAX_MODEL_LEN=False),
        "current_platform": types.SimpleNamespace(is_tpu=lambda: False, check_max_model_len=lambda n: n),
        "get_min_sliding_window": lambda w: w,
        # transformers.configuration_utils (5.x), imported by 0.12's config/model.py: rope dict keys that are layer types
        "ALLOWED_LAYER_TYPES": ("full_attention", "sliding_attention", "chunked_attention", "linear_attention"),
        "is_rope_parameters_nested": _nested,
        "iter_rope_parameters": lambda cfg: list(cfg.rope_parameters.values()) if _nested(cfg.rope_parameters)
        else ([cfg.rope_parameters] if cfg.rope_parameters else []),
    }
    exec(compile(_excerpt(version, "_get_and_verify_max_len"), f"vllm-{version}", "exec"), ns)  # noqa: S102
    return ns["_get_and_verify_max_len"]


def vllm_max_len(version: str, rope: dict | None, mpe: int, model_type: str = "llama") -> int:
    fn = _max_len_function(version)
    cfg = types.SimpleNamespace(model_type=model_type, max_position_embeddings=mpe, rope_scaling=rope,
                                rope_parameters=({**rope, "rope_theta": 10000.0} if rope else None),
                                original_max_position_embeddings=None)
    arch = types.SimpleNamespace(derived_max_model_len_and_key=(float(mpe), "max_position_embeddings"))
    values = {"hf_config": cfg, "model_arch_config": arch, "tokenizer_config": None, "max_model_len": None,
              "disable_sliding_window": False, "sliding_window": None, "sliding_window_len": None,
              "spec_target_max_model_len": None, "encoder_config": None}
    params = inspect.signature(fn).parameters
    return int(fn(**{k: v for k, v in values.items() if k in params}))


ROPES = {
    "plain": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn-consistent": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn-unextended": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn-short": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "longrope-su": {"rope_type": "su", "short_factor": [1.0], "long_factor": [1.0],
                    "original_max_position_embeddings": 4096},
}


def test_at_least_six_releases_from_055_to_the_newest() -> None:
    assert len(RELEASES) >= 6 and RELEASES[0] == "0.5.5" and RELEASES[-1] == "0.33.0"


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_max_model_len_is_vllm_arithmetic_of_that_release(version: str, rope: str) -> None:
    d, mpe = ROPES[rope], 32768
    if rope == "longrope-su" and version == "0.33.0":
        mpe = 131072  # 0.33's longrope branch caps at original_max_position_embeddings when set at top level
    got = vllm_max_len(version, d, mpe)
    legacy = "yarn_from_original" in arithmetic("vllm", version)
    params = {**(d or {}), "rope_type": (d or {}).get("rope_type", "default")}
    assert served_context(params, mpe, "llama", yarn_from_original=legacy) == got, (version, rope, got)


def test_the_yarn_fact_is_where_the_arithmetic_changed() -> None:
    """The row's range ends at the first release whose own function keeps yarn's max_position_embeddings."""
    rows = [f for f in facts() if f.arithmetic == "yarn_from_original"]
    assert len(rows) == 1
    yarn = ROPES["yarn-unextended"]
    first_new = next(v for v in RELEASES if vllm_max_len(v, yarn, 32768) == 32768)
    last_old = [v for v in RELEASES if vllm_max_len(v, yarn, 32768) != 32768][-1]
    assert rows[0].applies_to(last_old) and not rows[0].applies_to(first_new)
    assert rows[0].citation.release == last_old


@pytest.mark.parametrize("version", RELEASES)
def test_get_rope_reads_rope_type_without_type(version: str) -> None:
    """vllm#9481 reports KeyError 'type' for a rope_type-only Llama-3.1 config in 0.5.5; every release read here
    (0.5.5 included) falls back to rope_type in get_rope, so kvtool tables no vLLM refusal for it."""
    import ast

    tree = ast.parse(_excerpt(version, "get_rope"))
    reads = [ast.unparse(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "scaling_type" for t in n.targets)]
    assert reads and all("'rope_type'" in r for r in reads), (version, reads)
    assert not any(f.engine == "vllm" and f.detector == "rope_scaling_two_fields" for f in facts())
