"""Impossible numbers in config.json and on the command line: refused with one line naming file and field.

lint reports them as findings (exit 1, KV906 or the more specific rule on the key); kv-budget, convert
--dry-run and rope refuse the config (exit 2). Integers too long to parse refuse everywhere (exit 2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from harness import check_refusal, run_kvtool

TINY = Path(__file__).resolve().parents[2] / "examples" / "llama-gqa-tiny"
INF, NAN = float("inf"), float("nan")

# (config key, bad value): every kind of impossible (type, bool, finite, range, huge)
BAD = [
    ("num_key_value_heads", 0), ("num_key_value_heads", -2), ("num_key_value_heads", "two"),
    ("num_key_value_heads", INF), ("num_key_value_heads", 2.5), ("num_attention_heads", NAN),
    ("num_attention_heads", 2**62), ("num_attention_heads", True), ("max_position_embeddings", -INF),
    ("num_hidden_layers", 10**9), ("num_hidden_layers", 1e308), ("num_hidden_layers", 10**30),
    ("num_hidden_layers", INF), ("hidden_size", 0), ("head_dim", -64), ("vocab_size", 2.5),
    ("rope_theta", 1e308), ("rope_theta", 0), ("intermediate_size", "big"),
]
COMMANDS = {
    "kv-budget": lambda m: ["kv-budget", m],
    "convert": lambda m: ["convert", m, "--dry-run", "--to", "gqa", "--groups", "1"],
    "rope": lambda m: ["rope", m, "--show"],
}


def _ids(cases):
    return [f"{k}={json.dumps(v)}" for k, v in cases]


@pytest.fixture
def model(tmp_path):
    def make(key: str, value, raw: str | None = None) -> Path:
        folder = tmp_path / "m"
        shutil.copytree(TINY, folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg[key] = "__BAD__" if raw is not None else value
        text = json.dumps(cfg, indent=2)
        (folder / "config.json").write_text(text.replace('"__BAD__"', raw) if raw is not None else text)
        return folder
    return make


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("key,value", BAD, ids=_ids(BAD))
def test_commands_refuse(model, command, key, value) -> None:
    m = model(key, value)
    check_refusal(COMMANDS[command](str(m)), sources=[m], names=[str(m / "config.json"), key])


@pytest.mark.parametrize("key,value", BAD, ids=_ids(BAD))
def test_lint_reports_an_error_on_the_key(model, key, value) -> None:
    m = model(key, value)
    r = run_kvtool(["lint", str(m), "--format", "json"])
    assert r.rc == 1, r.stderr
    findings = json.loads(r.stdout)["models"][0]["findings"]
    assert any(f["severity"] == "error" and f["path"] == key for f in findings), findings
    assert not any(f["code"] == "KV000" for f in findings), findings


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_integer_too_long_to_parse(model, command) -> None:
    m = model("num_hidden_layers", None, raw="9" * 5000)
    r = check_refusal(COMMANDS[command](str(m)), sources=[m],
                      names=[str(m / "config.json"), "num_hidden_layers", "5000 digits"])
    assert r.seconds < 10


def test_lint_integer_too_long_to_parse(model) -> None:
    """lint cannot read the model: one error line on stderr, exit 2."""
    m = model("num_hidden_layers", None, raw="-" + "9" * 5000)
    check_refusal(["lint", str(m)], sources=[m],
                  names=[f"{m / 'config.json'}: num_hidden_layers: an integer with 5000 digits"])


def test_kv_budget_answers_nothing_for_zero_kv_heads(model) -> None:
    """The reported bug: 'KV per token 0 B ... fits: 100000 sequences' with exit 0."""
    m = model("num_key_value_heads", 0)
    r = check_refusal(["kv-budget", str(m), "--gpu-memory", "H100-80GB"], sources=[m],
                      names=["num_key_value_heads"])
    assert "fits" not in r.stdout


def test_convert_dry_run_with_2_62_heads_is_quick(model) -> None:
    m = model("num_attention_heads", 2**62)
    r = check_refusal(COMMANDS["convert"](str(m)), sources=[m], names=["num_attention_heads"], timeout=20)
    assert r.seconds < 10


# Options: out-of-range numbers are usage errors naming the option.
OPTIONS = [
    (["kv-budget", "{m}", "--max-model-len", "99999999999999999999999"], "--max-model-len"),
    (["kv-budget", "{m}", "--batch", "0"], "--batch"),
    (["kv-budget", "{m}", "--block-size", "0"], "--block-size"),
    (["kv-budget", "{m}", "-tp", "0"], "--tensor-parallel-size"),
    (["kv-budget", "{m}", "--gpu-memory", "0"], "--gpu-memory"),
    (["kv-budget", "{m}", "--gpu-memory", "-1"], "--gpu-memory"),
    (["kv-budget", "{m}", "--gpu-memory", "H100-80GB", "--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
    (["kv-budget", "{m}", "--what-if", "gqa:0"], "--what-if"),
    (["convert", "{m}", "--dry-run", "--to", "gqa", "--groups", "0"], "--groups"),
    (["convert", "{m}", "--dry-run", "--to", "gqa", "--groups", str(2**62)], "--groups"),
    (["convert", "{m}", "--dry-run", "--to", "gqa", "--groups", "1", "--eval-tokens", "0"], "--eval-tokens"),
    (["convert", "{m}", "--dry-run", "--to", "gqa", "--groups", "1", "--max-kld", "nan"], "--max-kld"),
    (["convert", "{m}", "--dry-run", "--to", "gqa", "--groups", "1", "--max-ppl-increase", "inf%"],
     "--max-ppl-increase"),
    (["convert", "{m}", "--dry-run", "--to", "gqa", "--groups", "1", "--max-shard-size", "9" * 400 + "GB"],
     "--max-shard-size"),
    (["rope", "{m}", "--show", "--type", "linear", "--factor", "nan"], "--factor"),
    (["rope", "{m}", "--show", "--type", "linear", "--factor", "0"], "--factor"),
    (["rope", "{m}", "--show", "--type", "linear", "--factor", "inf"], "--factor"),
    (["rope", "{m}", "--show", "--type", "yarn", "--factor", "2", "--beta-fast", "nan"], "--beta-fast"),
    (["rope", "{m}", "--show", "--type", "linear", "--target-context", "0"], "--target-context"),
    (["rope", "{m}", "--show", "--type", "linear", "--factor", "2", "--theta", "inf"], "--theta"),
]


@pytest.mark.parametrize("args,option", OPTIONS, ids=[f"{a[0]} {' '.join(a[2:])[-40:]}" for a, _ in OPTIONS])
def test_option_numbers(tmp_path, args, option) -> None:
    m = tmp_path / "m"
    shutil.copytree(TINY, m)
    check_refusal([a.replace("{m}", str(m)) for a in args], sources=[m], names=[option])


@pytest.mark.parametrize("key,value", [("num_key_value_heads", 0), ("num_hidden_layers", 10**9),
                                       ("num_attention_heads", NAN)], ids=["kv0", "layers1e9", "headsNaN"])
def test_quantize_kv_refuses_before_loading_anything(tmp_path, model, key, value) -> None:
    m = model(key, value)
    out = tmp_path / "out"
    check_refusal(["quantize-kv", m, out, "--device", "cpu", "--calib-text", TINY / "config.json"],
                  sources=[m], dst=out, names=[str(m / "config.json"), key])


def test_eval_refuses_before_transformers_reads_the_config(model) -> None:
    m = model("num_key_value_heads", 0)
    check_refusal(["eval", m, "--device", "cpu"], sources=[m], names=[str(m / "config.json"), "num_key_value_heads"])
