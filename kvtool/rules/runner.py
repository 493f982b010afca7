"""lint's rule runner: open a checkpoint, build its spec, run every checker, filter by selection."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtool.model.checkpoint import open_checkpoint
from kvtool.errors import InputError
from kvtool.rules import load_all
from kvtool.rules.context import LintContext
from kvtool.rules.registry import CHECKERS, SEVERITY_ORDER, Finding, LintOptions
from kvtool.model.spec import build_spec


@dataclass
class ModelReport:
    model: str
    findings: list[Finding] = field(default_factory=list)
    model_type: str | None = None
    kv: dict | None = None  # KV-cache cost summary
    error: str | None = None  # input unusable: the one-line reason (exit 2)
    engines: tuple = ()  # the engine releases checked (kvtool.engines.releases.Checked)

    def checked(self) -> str:
        """'transformers 5.24.0 (installed), vllm 0.33.0 (newest known)' for the summary line."""
        return ", ".join(c.describe() for c in self.engines)

    def failing(self, strict: bool) -> list[Finding]:
        floor = SEVERITY_ORDER["warning" if strict else "error"]
        return [f for f in self.findings if SEVERITY_ORDER[f.severity] >= floor]

    def as_dict(self) -> dict:
        d = {"model": self.model, "model_type": self.model_type,
             "findings": [f.as_dict() for f in self.findings], "kv_cache": self.kv}
        if self.error is not None:
            d["error"] = self.error
        if self.engines:
            d["engines"] = [{"engine": c.engine, "versions": list(c.versions), "source": c.source,
                             "requirement": c.requirement} for c in self.engines]
        return d


def check_selectors(selectors, *, file: str | None = None, field: str | None = None,
                    option: str | None = None) -> None:
    """A selector that matches no rule is a typo: refuse it rather than silently check nothing
    (`kvtool lint --select/--ignore` and a recipe's lint step)."""
    from kvtool.errors import UsageError
    from kvtool.rules.registry import REDIRECTS, RULES

    load_all()
    known = list(RULES) + list(REDIRECTS)
    for sel in selectors:
        if not any(code.startswith(sel) for code in known):
            raise UsageError(f"{sel!r} matches no rule code (`kvtool rules` lists them)", file=file, field=field,
                             option=option)


def lint_one(source: str, options: LintOptions, *, names: tuple[str, ...] = ()) -> ModelReport:
    """Lint one model (folder, config.json, hub id). Per-file ignores match `source`, any of `names` (what the
    caller calls the model: a recipe's lint step names the recipe's input model) and each finding's file.
    Recipe files: kvtool.recipes.lint.lint_recipe (the recipe loader sits above the engine)."""
    return select(_lint(source, options), options, source, *names)


def select(report: ModelReport, options: LintOptions, *names: str) -> ModelReport:
    """Keep the findings options.selection allows and per-file ignores for `names` (or the finding's file) keep."""
    def kept(f: Finding) -> bool:
        if not options.selection.allows(f.code):
            return False
        if not options.per_file_ignores:
            return True
        from kvtool.io.locations import display_path
        from kvtool.rules.config_file import ignored_codes

        codes = ignored_codes(options.per_file_ignores, *names, *map(display_path, names), display_path(f.file))
        return not any(f.code.startswith(c) for c in codes)

    report.findings = [f for f in report.findings if kept(f)]
    return report


def _lint(source: str, options: LintOptions) -> ModelReport:
    load_all()
    try:
        ckpt = open_checkpoint(source)
    except InputError as exc:
        return ModelReport(model=source, error=exc.line())
    spec = build_spec(ckpt.config)
    if ckpt.headers:
        from kvtool.model.architectures import fit_weight_names

        outer = ckpt.config.get("model_type") if spec.wrapper_key else None
        spec.arch = fit_weight_names(spec.arch, ckpt.tensors, outer if isinstance(outer, str) else None)
    ctx = LintContext(ckpt, spec, options)
    for topic, fn in CHECKERS.values():
        try:
            fn(ctx)
        except Exception as exc:  # a checker bug must not hide the other findings
            ctx.report("KV000", f"internal error in the {topic} checks: {type(exc).__name__}: {exc}")
    findings = _drop_schema_duplicates([f for f in ctx.findings if options.selection.allows(f.code)])
    findings.sort(key=lambda f: (f.file or "", f.line or 0, f.code, f.path or ""))
    from kvtool.engines.releases import checked_default

    return ModelReport(model=source, findings=findings, model_type=spec.model_type, kv=kv_summary(spec),
                       engines=options.engines or checked_default())


def _drop_schema_duplicates(findings: list[Finding]) -> list[Finding]:
    """A schema violation (KV90x) on a key another rule already reports as an error adds nothing: keep the
    specific one (a warning such as KV002 on the key does not replace an error). The number bound (KV906)
    is the most generic of all: any other error left on its key replaces it."""
    from kvtool.rules.numbers import NUMBER_CODE
    from kvtool.rules.schema import SCHEMA_CODES

    generic = (*SCHEMA_CODES, NUMBER_CODE)
    covered = {f.path for f in findings if f.path and f.code not in generic and f.severity == "error"}
    kept = [f for f in findings if not (f.code in SCHEMA_CODES and f.path in covered)]
    errors = {f.path for f in kept if f.path and f.code != NUMBER_CODE and f.severity == "error"}
    return [f for f in kept if not (f.code == NUMBER_CODE and f.path in errors)]


def kv_summary(spec) -> dict | None:
    from kvtool.model import kvcache

    if not spec.layer_types:
        return None
    # the cache vLLM allocates with --kv-cache-dtype auto: the same figure `kvtool kv-budget` prints
    dtype, eb, why = kvcache.serving_kv_dtype(spec)
    per_token = kvcache.bytes_per_token(spec, eb)
    if not per_token:
        return None
    max_len = spec.max_position
    return {
        "dtype": dtype,
        "dtype_note": why,
        "bytes_per_token": per_token,
        "max_len": max_len,
        "bytes_per_max_len_sequence": kvcache.bytes_per_sequence(spec, max_len, eb) if max_len else None,
    }
