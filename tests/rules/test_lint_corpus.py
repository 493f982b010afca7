"""Every real config in tests/data/configs/ lints without errors, except the two known-defective ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.rules.runner import lint_one
from kvtool.rules.registry import LintOptions

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
# Real defects (tests/data/configs/README.md): the error code prefix each must produce.
DEFECTIVE = {
    "glm-5.2.json": "KV4",  # head_dim 192 vs qk_rope_head_dim 64 (MLA), huggingface/transformers#46739
    "gpt-j-6b.json": "KV2",  # rope_scaling {"rope_type": "gptj"}: no such RoPE type
}
FILES = sorted(CONFIGS.glob("*.json"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_real_config_lints(path: Path) -> None:
    report = lint_one(str(path), LintOptions())
    assert report.error is None, report.error
    codes = [f.code for f in report.findings]
    assert "KV000" not in codes, [f.message for f in report.findings if f.code == "KV000"]
    errors = [f for f in report.findings if f.severity == "error"]
    if path.name in DEFECTIVE:
        prefix = DEFECTIVE[path.name]
        assert any(f.code.startswith(prefix) for f in errors), (
            f"{path.name} must produce an error whose code starts with {prefix}; got {[f.code for f in errors]}")
    else:
        assert not errors, [(f.code, f.message) for f in errors]
    assert report.kv is not None and report.kv["bytes_per_token"] > 0


def test_known_quirks_are_reported() -> None:
    """The corpus README's quirks that are findings, not errors."""
    def codes(name: str) -> set[str]:
        return {f.code for f in lint_one(str(CONFIGS / name), LintOptions()).findings}

    assert "KV002" in codes("nemotron-h-56b-base-8k.json")  # Infinity in time_step_limit
    assert "KV003" in codes("qwen3-vl-8b-instruct.json")  # linted as its text_config
    assert "KV001" in codes("baichuan2-7b-chat.json")  # no table: generic
    assert "KV001" not in codes("kimi-k2-instruct.json")  # kimi_k2 is an alias of the deepseek_v3 table
