"""Issue 39 class 7: every parser of an untrusted value has one error type, and an option's pattern accepts only what
its parser accepts.

The classes, generated rather than listed: digits str.isdigit() or float() accept and int() does not (or the
other way round: every non-ASCII decimal digit, superscripts, full-width), integers past Python's 4300-digit
int() limit, sizes past 4 EiB and numbers float() makes inf, each in every option and file field that reads a
number. The in-process sweep calls `kvtool.cli.main` (what the entry point runs) and asserts the contract of
tests/hostile/harness.py: exit 2, one line naming the option, never an internal error; the subprocess cases go
through the harness itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import check_refusal, run_kvtool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool import units
from kvtool.cli import main
from tests.hostile.models import LLAMA, llama

# every character str.isdigit() accepts that is not 0-9 (Nd non-ASCII, superscripts, circled digits...)
NON_ASCII_DIGITS = [c for c in map(chr, range(0x80, 0x30000)) if c.isdigit()]
SAMPLE = ["²", "٣", "３", "१", "𝟘", "①", "᠑"]  # the sweep's fixed picks (hypothesis draws from all of them)
assert all(c in NON_ASCII_DIGITS for c in SAMPLE)
HUGE = ["9" * 4301, "1" * 5000, "7" * 20000]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return llama(tmp_path_factory.mktemp("parsers") / "m")


# option value templates: (command line with {v}, the option the line names)
OPTION_CASES = [
    (["kv-budget", "{m}", "--gpu-memory", "{v}GiB"], "--gpu-memory"),
    (["kv-budget", "{m}", "--gpu", "L4", "--reserve", "{v}GiB"], "--reserve"),
    (["kv-budget", "{m}", "--max-model-len", "{v}"], "--max-model-len"),
    (["kv-budget", "{m}", "--batch", "{v}"], "--batch"),
    (["kv-budget", "{m}", "--engine", "vllm==0.{v}"], "--engine"),
    (["lint", "{m}", "--engine", "transformers=={v}.0"], "--engine"),
    (["lint", "{m}", "--engine", "vllm>={v}"], "--engine"),
    (["rope", "{m}", "--show", "--engine", "vllm=={v}"], "--engine"),
    (["convert", "{m}", "--to", "mla", "--dry-run", "--kv-budget", "{v}KiB"], "--kv-budget"),
    (["convert", "{m}", "--to", "mla", "--dry-run", "--kv-budget", "0.{v}"], "--kv-budget"),
    (["convert", "{m}", "--to", "mla", "--dry-run", "--kv-budget", "{v}%"], "--kv-budget"),
    (["convert", "{m}", "--to", "gqa", "--dry-run", "--groups", "{v}"], "--groups"),
    (["convert", "{m}", "--to", "mqa", "--dry-run", "--max-shard-size", "{v}MB"], "--max-shard-size"),
]


def _refused(capsys, args: list[str], option: str) -> str:
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (args[:4], rc, err[-500:])
    assert len(lines) == 1 and "internal error" not in lines[0] and "Traceback" not in err, lines
    assert option in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("template,option", OPTION_CASES, ids=[" ".join(t[2:]) for t, _ in OPTION_CASES])
@pytest.mark.parametrize("value", [*SAMPLE, "1" + "²", *HUGE], ids=lambda v: v if len(v) < 9 else f"{len(v)}-digits")
def test_numbers_no_parser_reads_are_one_line(capsys, model, template, option, value):
    if template[-1] == "0.{v}" and value.isascii():
        return  # 0.999...9 is a fraction, however long: read, not refused
    args = [a.format(m=model, v=value) for a in template]
    _refused(capsys, args, option)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(OPTION_CASES), digit=st.sampled_from(NON_ASCII_DIGITS),
       ascii_digits=st.text("0123456789", max_size=3))
def test_any_non_ascii_digit_anywhere_in_a_number(capsys, model, case, digit, ascii_digits):
    template, option = case
    value = ascii_digits + digit
    _refused(capsys, [a.format(m=model, v=value) for a in template], option)


@pytest.mark.parametrize("size", [f"{10 ** k}KiB" for k in (16, 19, 30)] + ["9" * 400 + "B", "4100000000TiB",
                                                                           "1" + "0" * 309 + "B"])
@pytest.mark.parametrize("option", ["--gpu-memory", "--reserve", "--kv-budget", "--max-shard-size"])
def test_sizes_past_4_eib(capsys, model, size, option):
    args = {"--gpu-memory": ["kv-budget", model, "--gpu-memory", size],
            "--reserve": ["kv-budget", model, "--gpu", "L4", "--reserve", size],
            "--kv-budget": ["convert", model, "--to", "mla", "--dry-run", "--kv-budget", size],
            "--max-shard-size": ["convert", model, "--to", "mqa", "--dry-run", "--max-shard-size", size]}[option]
    _refused(capsys, args, option)


# --- the parsers themselves: one error type --------------------------------------------------------------
@given(st.text(max_size=40))
def test_parse_size_raises_only_value_refused(text):
    try:
        n = units.parse_size(text)
    except units.ValueRefused:
        return
    assert 0 <= n < 2**62 and text.strip().isascii()


@given(st.text(max_size=40))
def test_parse_kv_budget_raises_only_value_refused(text):
    try:
        kind, value = units.parse_kv_budget(text)
    except units.ValueRefused:
        return
    assert kind in ("bytes", "fraction") and value == value and value != float("inf")
    assert kind == "bytes" or 0 < value <= 1


@given(st.one_of(st.text(max_size=12), st.sampled_from(HUGE), st.integers().map(str)))
def test_plain_int_reads_what_int_reads_the_same_everywhere(text):
    got = units.plain_int(text)
    if got is None:
        return
    assert text.isascii() and got == int(text) and len(text.lstrip("-")) <= units.INT_MAX_DIGITS


def test_the_kv_budget_pattern_accepts_only_what_its_parser_reads():
    """The declaration is the validator: what the pattern lets through goes to the parser in the same check."""
    from kvtool.options.convert import ConvertOptions
    from kvtool.options.fields import field_named

    f = field_named(ConvertOptions, "kv_budget")
    assert f.spec.parse is units.parse_kv_budget


# --- files: token-id keys, engine requirements in pyproject.toml and recipes --------------------------------
@pytest.mark.parametrize("key", [*SAMPLE, *HUGE, "-5", "1_000", " 7"], ids=lambda v: v if len(v) < 9 else f"{len(v)}-digits")
def test_token_id_keys_lint_reads_as_transformers_does(tmp_path, key):
    m = llama(tmp_path / "m")
    (m / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        key: {"content": "<x>", "special": True}, "3": {"content": "<y>", "special": True}}}))
    r = run_kvtool(["lint", m, "--format", "json"])
    assert r.rc in (0, 1) and "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    json.loads(r.stdout)


@pytest.mark.parametrize("value", [*SAMPLE[:3], *HUGE[:2]], ids=lambda v: v if len(v) < 9 else f"{len(v)}-digits")
def test_engine_in_pyproject_toml(tmp_path, value):
    m = llama(tmp_path / "m")
    (tmp_path / "pyproject.toml").write_text(f'[tool.kvtool]\nengine = ["vllm=={value}"]\n')
    r = check_refusal(["lint", m, "--config", tmp_path / "pyproject.toml"], sources=[m])
    assert "engine" in r.lines[0] and "internal error" not in r.lines[0]


@pytest.mark.parametrize("value", [*SAMPLE[:3], *HUGE[:2]], ids=lambda v: v if len(v) < 9 else f"{len(v)}-digits")
def test_engine_in_a_recipe(tmp_path, value):
    m = llama(tmp_path / "m")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nname: r\nsteps:\n  - lint: {{engine: ['vllm=={value}']}}\n")
    r = check_refusal(["apply", recipe, m, tmp_path / "out", "--dry-run"], sources=[m])
    assert "engine" in r.lines[0]


# --- float overflow: a yarn factor whose product with the context is inf --------------------------------
@pytest.mark.parametrize("factor", [1e308, 1.7976931348623157e308, 1e300, 1e200])
def test_lint_compat_on_a_factor_that_overflows(tmp_path, factor):
    m = llama(tmp_path / "m", {**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": factor,
                                                         "original_max_position_embeddings": 256}})
    for args, code in ((["lint", m, "--compat"], 0), (["lint", m, "--format", "json"], 1)):  # --compat: a table
        r = run_kvtool(args)
        assert r.rc == code and "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    check_refusal(["kv-budget", m], sources=[m], names=["factor"])


def test_served_context_is_none_where_vllm_overflows():
    from kvtool.model.rope.types import served_context

    params = {"rope_type": "yarn", "factor": 1e308, "original_max_position_embeddings": 4096}
    assert served_context(params, 1 << 20, "llama") == 1 << 20  # yarn's max_position_embeddings is served as is
    assert served_context(params, 1 << 20, "llama", yarn_from_original=True) is None
    assert served_context({"rope_type": "linear", "factor": 1e308}, 1 << 20, "llama") is None
    assert served_context({"rope_type": "linear", "factor": 4.0}, 4096, "llama") == 16384


# --- the MLA solve on a model whose attention inputs are zero ---------------------------------------------------
@pytest.mark.torch
@pytest.mark.parametrize("solve", ["mqa-seed", "joint"])
def test_mla_converts_a_model_with_zeroed_layer_norms(tmp_path, smollm2_path, solve):
    """Zeroed input layer norms make every attention input zero: a zero calibration covariance, which the solve's
    ridge (a fraction of its mean diagonal) left singular. The aware merge converts such a model; so does MLA."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.hostile.models import llama_with_tokenizer

    src = llama_with_tokenizer(tmp_path / "src", smollm2_path)
    for f in src.glob("*.safetensors"):
        t = load_file(f)
        save_file({k: torch.zeros_like(v) if k.endswith("norm.weight") else v for k, v in t.items()}, f,
                  metadata={"format": "pt"})
    out = tmp_path / "out"
    r = run_kvtool(["convert", src, out, "--to", "mla", "--kv-rank", "8", "--mla-solve", solve, "--no-eval",
                     "--engine", "transformers"],
                   timeout=600)
    assert r.rc == 0, r.stderr
    lint = run_kvtool(["lint", out, "--ignore", "KV404"])  # the row is written for transformers (--engine transformers)
    assert lint.rc == 0, lint.stdout
    for f in out.glob("*.safetensors"):
        assert all(bool(torch.isfinite(v).all()) for v in load_file(f).values())
