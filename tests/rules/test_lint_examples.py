"""The lint demonstrations of README.md and docs/lint.md: the bundled examples are clean, the broken demo fails as shown."""

from __future__ import annotations

import json
from pathlib import Path

from kvtest import run_without_torch
from kvtool.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(str(p) for p in (REPO / "examples").iterdir() if p.is_dir())
BROKEN = str(REPO / "tests" / "data" / "lint_demo" / "broken-llama")


def test_examples_lint_clean_without_torch() -> None:
    assert len(EXAMPLES) >= 3
    out = run_without_torch(["lint", *EXAMPLES])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("0 error(s), 0 warning(s)") == len(EXAMPLES)


def test_examples_kv_cost(capsys) -> None:
    assert main(["lint", "--format", "json", *EXAMPLES]) == 0
    kv = {Path(m["model"]).name: m["kv_cache"] for m in json.loads(capsys.readouterr().out)["models"]}
    # llama: 4 layers x K,V x 2 KV heads x head_dim 8 x 2 bytes
    assert kv["llama-gqa-tiny"]["bytes_per_token"] == 4 * 2 * 2 * 8 * 2
    # MLA: 2 layers x (kv_lora_rank 304 + qk_rope_head_dim 16: a row vLLM serves, KV404) x 2 bytes
    assert kv["deepseek-mla-tiny"]["bytes_per_token"] == 2 * (304 + 16) * 2
    # gemma3: 3 sliding layers hold 512 tokens, 1 global layer the full 4096; 128 B per token and layer
    assert kv["gemma3-sliding-tiny"]["bytes_per_max_len_sequence"] == (3 * 512 + 4096) * 128


def test_broken_demo_reports_each_planted_defect(capsys) -> None:
    assert main(["lint", "--format", "json", BROKEN]) == 1
    (model,) = json.loads(capsys.readouterr().out)["models"]
    got = {f["code"] for f in model["findings"]}
    assert {"KV501", "KV504", "KV601", "KV702", "KV801"} <= got, got
    assert main(["lint", "--select", "KV7", BROKEN]) == 0
    assert main(["lint", "--select", "KV7", "--strict", BROKEN]) == 1
