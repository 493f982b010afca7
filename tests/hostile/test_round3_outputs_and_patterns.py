"""Hostile round 3, classes 3 and 8 (issue 39), generated, through the harness.

- Class 3, outputs kvtool itself refuses: every model a write refuses to make valid is refused by the plan
  (one line, exit 2, nothing written); every output a write publishes passes kvtool's own lint (no new
  error) and kv-budget.
- Class 8, configs the engines refuse: every layer-pattern field kvtool reads, malformed as transformers
  refuses it, is refused by kv-budget (exit 2, one line naming the field) and reported by lint (exit 1).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from harness import check_refusal, run_kvtool

TINY = Path(__file__).resolve().parents[2] / "examples" / "llama-gqa-tiny"
NEMOTRON = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 128, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
            "conv_kernel": 4, "intermediate_size": 64, "max_position_embeddings": 256}
GEMMA3 = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 64,
          "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "vocab_size": 128, "intermediate_size": 64, "max_position_embeddings": 256, "sliding_window": 32}


def _bad_patterns():
    rng = random.Random(3908)
    out = {"unknown-letters": "MQ*Z", "lower-case": "m*", "numeric": 1184, "look-alike": "*\u2217", "empty": "",
           "null-byte": "M\x00*", "object": {"M": 1}}
    for i in range(4):
        pat = list("".join(rng.choice("ME*-") for _ in range(6)))
        pat[rng.randrange(6)] = rng.choice("0QXe ._")
        out[f"random-{i}"] = "".join(pat)
    return out


PATTERNS = _bad_patterns()
FIELDS = {
    **{f"hybrid_override_pattern-{k}": ({**NEMOTRON, "hybrid_override_pattern": v}, "hybrid_override_pattern")
       for k, v in PATTERNS.items()},
    "layers_block_type-unknown": ({**NEMOTRON, "layers_block_type": ["full_attention", "sliding_attention"]},
                                  "layers_block_type"),
    "layers_block_type-string": ({**NEMOTRON, "layers_block_type": "full_attention"}, "layers_block_type"),
    "layer_types-length": ({**GEMMA3, "layer_types": ["full_attention"] * 5}, "layer_types"),
    "layer_types-unknown": ({**GEMMA3, "layer_types": ["full_attention"] * 5 + ["global"]}, "layer_types"),
    "sliding_window_pattern-zero": ({**GEMMA3, "sliding_window_pattern": 0}, "sliding_window_pattern"),
    "sliding_window_pattern-text": ({**GEMMA3, "sliding_window_pattern": "6"}, "sliding_window_pattern"),
}


@pytest.mark.parametrize("case", sorted(FIELDS))
def test_a_layer_pattern_the_engines_refuse_is_refused(tmp_path, case):
    cfg, field = FIELDS[case]
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps(cfg))
    check_refusal(["kv-budget", m], sources=[m], names=[str(m / "config.json"), f": {field}"])
    lint = run_kvtool(["lint", m, "--format", "json"])
    assert lint.rc == 1, lint.stdout + lint.stderr
    codes = {f["code"] for r in json.loads(lint.stdout)["models"] for f in r["findings"]}
    assert codes & {"KV304", "KV305"}, lint.stdout


def _tiny_with(tmp_path: Path, **cfg) -> Path:
    m = tmp_path / "src"
    shutil.copytree(TINY, m)
    c = json.loads((m / "config.json").read_text())
    c.update(cfg)
    (m / "config.json").write_text(json.dumps(c))
    return m


def test_mla_from_heads_too_small_is_refused_before_any_work(tmp_path):
    """head_dim 2: no split into an even rope part and a latent key part; refused in the plan (no tokenizer
    is loaded, no calibration runs) naming head_dim, whatever latent size was asked for."""
    from tests.hostile import models

    cfg = {**models.LLAMA, "hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2,
           "intermediate_size": 16}
    src = models.llama(tmp_path / "hd2", cfg)
    for size in (["--kv-rank", "1"], ["--kv-budget", "0.5"], ["--kv-rank", "2", "--rope-dim", "2"]):
        check_refusal(["convert", src, tmp_path / "out", "--to", "mla", *size], sources=[src],
                      dst=tmp_path / "out", names=[str(src / "config.json"), ": head_dim: "])


def test_every_heads_output_passes_kvtools_own_checks(tmp_path):
    """The writes kvtool makes without torch (convert --to gqa / mqa / mha, rope): each output lints with no
    error and sizes in kv-budget."""
    src = TINY
    outs = []
    for to in (["--to", "mqa"], ["--to", "mha"], ["--to", "gqa", "--groups", "2"]):
        dst = tmp_path / f"out-{to[1]}"
        r = run_kvtool(["convert", src, dst, *to, "--no-eval", "--no-progress"])
        assert r.rc == 0, r.stderr
        outs.append(dst)
    dst = tmp_path / "out-rope"
    r = run_kvtool(["rope", src, dst, "--type", "yarn", "--factor", "4"])
    assert r.rc == 0, r.stderr
    outs.append(dst)
    for out in outs:
        lint = run_kvtool(["lint", out])
        assert lint.rc == 0, lint.stdout
        budget = run_kvtool(["kv-budget", out])
        assert budget.rc == 0, budget.stderr
