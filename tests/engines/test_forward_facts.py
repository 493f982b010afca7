"""The engine facts about the first forward and about a release's required rope keys (schemas/engines/facts.json),
through `lint --compat`'s verdict per release line. The engine lane (tests/oracle/test_engine_releases.py) checks
the same rows against the releases themselves, running the forward."""

from __future__ import annotations

import json
from pathlib import Path

from kvtool.engines.compat import rows
from kvtool.model.spec import build_spec

RULES = Path(__file__).resolve().parents[1] / "data" / "rules"


def _lines(cfg: dict) -> dict[str, tuple[str, str]]:
    return {r.releases: (r.verdict, r.text()) for r in rows(build_spec(cfg), ("transformers",))}


def _cfg(path: str) -> dict:
    return json.loads((RULES / path / "config.json").read_text(encoding="utf-8"))


def test_llama_partial_rotary_fails_at_the_first_forward_in_4_43_to_4_57():
    cfg = _cfg("KV010/fail_partial_rotary_forward")
    lines = _lines(cfg)
    assert lines["4.38-4.42"][0] == "differently"  # its own rotary embedding: the whole head, no error
    assert lines["4.43-4.57"][0] == "refuses" and "first forward" in lines["4.43-4.57"][1]
    assert lines["5.0-5.25"] == ("differently", "reads it differently: ignores partial_rotary_factor = 0.5 with "
                                                "default RoPE and rotates the whole head")
    yarn = dict(cfg, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                max_position_embeddings=256)
    assert _lines(yarn)["5.0-5.25"][0] == "refuses"  # 5.x's scaled inits read the factor


def test_partial_rotary_rows_start_where_the_class_takes_the_shared_init():
    base = _cfg("KV010/fail_partial_rotary_forward")
    for model_type, first_refusing in (("qwen2", "4.45"), ("mistral", "4.48")):
        cfg = dict(base, model_type=model_type, architectures=[f"{model_type.title()}ForCausalLM"])
        verdicts = {r.first: r.verdict for r in rows(build_spec(cfg), ("transformers",))}
        refusing = [v for v, k in verdicts.items() if k == "refuses" and v.startswith("4.")]
        assert refusing and min(refusing, key=lambda v: tuple(map(int, v.split(".")))).startswith(first_refusing)


def test_classes_that_rotate_part_of_the_head_are_left_alone():
    cfg = dict(_cfg("KV010/fail_partial_rotary_forward"), model_type="phi3", architectures=["Phi3ForCausalLM"])
    assert all("first forward" not in text for _, text in _lines(cfg).values())


def test_phi3_su_with_the_top_level_original_is_refused_by_5_0_to_5_24():
    lines = _lines(_cfg("KV010/fail_phi3_su_original_top"))
    assert lines["5.0-5.24"][0] == "refuses" and "original_max_position_embeddings" in lines["5.0-5.24"][1]
    assert lines["5.25"][0] == "as written" and lines["4.41-4.57"][0] == "as written"
    longrope = _cfg("KV010/fail_phi3_su_original_top")
    longrope["rope_scaling"] = dict(longrope["rope_scaling"], type="longrope")  # filled in: read by every 5.x
    assert all(v != "refuses" for k, (v, _) in _lines(longrope).items() if k.startswith("5"))
