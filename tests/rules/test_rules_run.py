"""kvtool.rules.run: `kvtool lint`'s plan (options over [tool.kvtool]) and apply, shared with recipe lint steps."""

from __future__ import annotations

import pytest

from kvtest import write_checkpoint
from kvtool.errors import UsageError
from kvtool.options.lint import LintOptions
from kvtool.rules.config_file import LintSettings
from kvtool.rules.run import apply, plan, recipe_step_options


def test_flags_override_settings_and_codes_are_upper_cased():
    settings = LintSettings(select=("KV2",), ignore=("KV703",), strict=True, tensor_parallel_size=4, format="json")
    p = plan(LintOptions(paths=["m"], select="kv1, kv3", strict=False), settings, formats=("text", "json"))
    assert p.engine.selection.select == ("KV1", "KV3") and p.engine.selection.ignore == ("KV703",)
    assert p.engine.strict is False and p.engine.tensor_parallel_size == 4 and p.format == "json"
    p = plan(LintOptions(paths=["m"], ignore=""), settings)
    assert p.engine.selection.select == ("KV2",) and p.engine.selection.ignore == () and p.engine.strict


def test_defaults_without_settings():
    p = plan(LintOptions(paths=["m"]), LintSettings())
    assert (p.engine.selection.select, p.engine.selection.ignore, p.engine.strict, p.format) == (("KV",), (), False,
                                                                                                  "text")


@pytest.mark.parametrize(("opts", "settings", "where"), [
    (LintOptions(paths=[], select="KV999"), LintSettings(), (None, None, "select")),
    (LintOptions(paths=[], ignore="KV1,E501"), LintSettings(), (None, None, "ignore")),
    (LintOptions(paths=[]), LintSettings(per_file_ignores={"old/*": ("ZZ1",)}, source="p/pyproject.toml"),
     ("p/pyproject.toml", "tool.kvtool.per-file-ignores.old/*", None)),
])
def test_a_code_matching_no_rule_is_refused_where_it_was_written(opts, settings, where):
    with pytest.raises(UsageError, match="matches no rule code") as got:
        plan(opts, settings)
    assert (got.value.file, got.value.field, got.value.option) == where


def test_bad_format_and_tensor_parallel_size():
    with pytest.raises(UsageError, match="unknown format 'xml'") as got:
        plan(LintOptions(paths=[]), LintSettings(format="xml"), formats=("text", "json"))
    assert got.value.option == "format"
    with pytest.raises(UsageError, match="must be a positive integer, got 0"):
        plan(LintOptions(paths=[], tensor_parallel_size=0), LintSettings())


def test_a_recipe_step_is_the_command_with_the_same_flags(tmp_path, tiny_llama_config):
    src = write_checkpoint(tmp_path / "m", tiny_llama_config)
    step = recipe_step_options({"select": ["KV1"], "ignore": ["KV103"], "strict": True}, str(src))
    assert (step.select, step.ignore, step.strict, step.paths) == ("KV1", "KV103", True, [str(src)])
    cmd = plan(LintOptions(paths=[str(src)], select="KV1", ignore="KV103", strict=True), LintSettings())
    assert plan(step, LintSettings()) == cmd
    (report,) = apply(cmd)
    assert not report.error and all(f.code.startswith("KV1") and f.code != "KV103" for f in report.findings)
