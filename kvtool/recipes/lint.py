"""`kvtool lint recipe.yaml`: a recipe checked without running it (rules KV961 / KV962, kvtool/rules/recipe.py)."""

from __future__ import annotations

from kvtool.errors import InputError

from kvtool.recipes.load import FILE_KEYS, RecipeError, load_recipe
from kvtool.rules import load_all
from kvtool.rules.runner import ModelReport, select
from kvtool.rules.registry import RULES, Finding, LintOptions


def lint_recipe(path: str, options: LintOptions) -> ModelReport:
    """`kvtool lint recipe.yaml`: the findings options select, per-file ignores applied (like lint_one)."""
    return select(lint_recipe_file(path), options, path)


def lint_recipe_file(path: str) -> ModelReport:
    """Findings for a recipe file (a ModelReport with the recipe as the model)."""
    load_all()

    def finding(code, message, field, line):
        r = RULES[code]
        return Finding(code, r.name, r.severity.value, message, field, path, r.hint, line)

    report = ModelReport(model=path, model_type="recipe")
    try:
        recipe = load_recipe(path)
    except RecipeError as exc:  # the recipe's content: a finding at its line (the error's fields, not its words)
        report.findings.append(finding("KV961", exc.detail, exc.field, exc.lineno))
        return report
    except InputError as exc:  # the file itself (missing, unreadable, not UTF-8): nothing to lint
        report.error = exc.line()
        return report
    for step in recipe.steps:
        named = [("text file", t, resolved) for sec in (step.options, step.options.get("calibration"))
                 for t, resolved in recipe.text_files(sec)]
        named += [(key, step.options[key], recipe.resolve(step.options[key])) for key in FILE_KEYS
                  if isinstance(step.options.get(key), str)]
        for what, t, resolved in named:
            why = recipe.file_problem(t)
            if why:
                report.findings.append(finding(
                    "KV962", f"step {step.index} ({step.kind}): {what} {t!r} {why} (resolved to {resolved})",
                    f"steps[{step.index - 1}].{step.kind}", step.line))
    return report
