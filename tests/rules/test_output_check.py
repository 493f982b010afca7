"""kvtool.rules.output_check: every write ends with kvtool's own checks on the staged output (issue 39, class 3).

An output kv-budget or lint refuses is never published: one exit-2 line naming the output, the staging folder
removed, DST as it was. Every `staged_output` in the package passes the check (read from the AST)."""

from __future__ import annotations

import ast
import json
from functools import partial
from pathlib import Path

import pytest

from kvtest import DATA, REPO, write_config
from kvtool.errors import InputError
from kvtool.io.staging import staged_output
from kvtool.rules.output_check import verify_output

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
         "max_position_embeddings": 256, "rope_theta": 10000.0}


def _mla(**over) -> dict:
    cfg = json.loads((DATA / "budget" / "deepseek-v2-lite.json").read_text())
    cfg.update(over)
    return cfg


def test_a_valid_output_passes(tmp_path):
    write_config(tmp_path / "out", LLAMA)
    verify_output(tmp_path / "out")
    write_config(tmp_path / "mla", _mla())
    verify_output(tmp_path / "mla")


@pytest.mark.parametrize("cfg, names", [
    (_mla(qk_rope_head_dim=0), ["kv-budget", "qk_rope_head_dim"]),      # what convert --to mla once wrote
    (_mla(qk_nope_head_dim=0), ["kv-budget", "qk_nope_head_dim"]),
    (_mla(qk_rope_head_dim=63), ["KV404", "(and 1 more)"]),  # row 512 + 63 = 575 (KV404), odd rope (KV402)
    ({**LLAMA, "num_key_value_heads": 3}, ["num_key_value_heads", "kv-budget"]),  # heads that do not split
    ({**LLAMA, "rope_theta": -1.0}, ["rope_theta", "kv-budget"]),
])
def test_an_output_kvtool_refuses_is_refused(tmp_path, cfg, names):
    write_config(tmp_path / "out", cfg)
    with pytest.raises(InputError) as e:
        verify_output(tmp_path / "out")
    line = e.value.line()
    assert "kvtool's own checks refuse the output" in line and "nothing was written" in line
    assert all(n in line for n in names), line


def test_an_error_the_source_already_had_is_not_the_writes_doing(tmp_path):
    bad = _mla(qk_rope_head_dim=63)
    write_config(tmp_path / "src", bad)
    write_config(tmp_path / "out", bad)
    verify_output(tmp_path / "out", source=tmp_path / "src")  # the same KV402: lint's to report, not the write's
    write_config(tmp_path / "out2", _mla(qk_rope_head_dim=63, qk_nope_head_dim=0))
    with pytest.raises(InputError, match="qk_nope_head_dim"):  # a new error on top of the old one
        verify_output(tmp_path / "out2", source=tmp_path / "src")



def test_the_source_is_linted_for_the_releases_the_output_is(tmp_path):
    # under transformers 4.40.0 deepseek_v3 is unknown (KV010) in the source as in the output: not the write's doing
    write_config(tmp_path / "src", _mla())
    write_config(tmp_path / "out", _mla())
    verify_output(tmp_path / "out", source=tmp_path / "src", engines=("transformers==4.40.0",))
    with pytest.raises(InputError, match="KV010"):  # without a source that has it, it is the write's
        verify_output(tmp_path / "out", engines=("transformers==4.40.0",))

def test_staged_output_does_not_publish_a_refused_output(tmp_path):
    dst = tmp_path / "dst"
    with pytest.raises(InputError) as e:
        with staged_output(dst, verify=verify_output) as tmp:
            write_config(tmp, _mla(qk_rope_head_dim=0))
    assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == []  # no staging folder left
    assert str(dst) in e.value.line() and ".kvtool-tmp-" not in e.value.line()
    # an existing DST (--force) stays as it was
    write_config(dst, LLAMA)
    before = (dst / "config.json").read_text()
    with pytest.raises(InputError):
        with staged_output(dst, force=True, verify=partial(verify_output, source=dst)) as tmp:
            write_config(tmp, _mla(qk_nope_head_dim=0))
    assert (dst / "config.json").read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def _staged_output_calls():
    for path in sorted((REPO / "kvtool").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "staged_output":
                yield path.relative_to(REPO).as_posix(), node


def test_every_write_in_the_package_is_verified():
    calls = list(_staged_output_calls())
    assert len(calls) >= 5  # convert (heads, mla), rope, quantize-kv, apply
    bad = []
    for where, node in calls:
        kw = {k.arg: k.value for k in node.keywords}
        v = kw.get("verify")
        if v is None or (isinstance(v, ast.Constant) and v.value is None):
            bad.append(f"{where}:{node.lineno}")
    assert bad == []



def test_no_function_that_takes_verify_defaults_it():
    # verify= has no default anywhere it is passed on (staged_output, convert.run.apply, every plan's write): a
    # call that forgets it is a TypeError, never an unchecked publish
    takes = []
    for path in sorted((REPO / "kvtool").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                assert "verify" not in [a.arg for a in args.posonlyargs + args.args], f"{path}:{node.lineno}"
                for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                    if arg.arg == "verify":
                        takes.append(f"{path.relative_to(REPO).as_posix()}:{node.name}")
                        assert default is None, f"{path}:{node.lineno} {node.name}(verify=...) has a default"
    assert {"kvtool/io/staging.py:staged_output", "kvtool/convert/run.py:apply", "kvtool/convert/targets.py:write",
            "kvtool/convert/driver.py:write", "kvtool/convert/mla/plan.py:write"} <= set(takes), takes

def test_convert_apply_and_its_callers_pass_the_check():
    # convert cannot import lint (tests/test_layering.py), so its callers pass verify_output: the command and
    # the recipe step
    # the recipe step, with what the plan says its check needs (ConversionPlan.check_kwargs: no caller asks which
    # target it holds)
    for rel in ("kvtool/commands/convert.py", "kvtool/recipes/apply.py"):
        text = (REPO / rel).read_text(encoding="utf-8")
        assert "partial(verify_output, source=" in text and "**p.check_kwargs())" in text, rel
