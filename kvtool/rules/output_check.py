"""The check every write ends with: kvtool's own refusals, run on the staged output before it is published.

`verify_output(folder, source=...)` is what each writing operation hands to `kvtool.io.staging.staged_output`
(`verify=`): convert (every target), rope, quantize-kv and a recipe (each step and the final output). It
refuses (one exit-2 line naming the output's file and field, `...; nothing was written`) an output that

- kv-budget refuses: the config does not parse into a model kvtool can size (`kvtool.model.spec.build_spec`,
  `kvtool.model.numbers.require_valid_numbers`: the refusals of `kvtool kv-budget`'s plan);
- `kvtool lint` reports an error on (its checks of config.json and the safetensors headers, every rule at
  its default severity) that the source does not already have: an output must not be worse than its input
  by kvtool's own rules. An error the source carried is not the write's doing and is left to lint.

The staging folder is removed (it is kvtool's own, named `.DST.kvtool-tmp-...`) and DST is left as it was.
The core (kvtool.io) cannot import lint, so the operation passes this function in; tests/rules/test_output_check.py
checks that every `staged_output` call in the package passes it.
"""

from __future__ import annotations

from pathlib import Path

from kvtool.errors import InputError

REFUSED = "kvtool's own checks refuse the output"


def _errors(source: str, engines: tuple[str, ...] = ()) -> tuple[list, str | None]:
    """(error findings, the error line of a model lint cannot open) of `kvtool lint SOURCE [--engine ...]`,
    in-process."""
    from kvtool.rules.runner import lint_one
    from kvtool.rules.registry import LintOptions

    opts = LintOptions()
    if engines:
        from kvtool.engines.releases import resolve

        opts = LintOptions(engines=resolve(engines, source="--engine"))
    report = lint_one(source, opts)
    return [f for f in report.findings if f.severity == "error"], report.error


def _key(f) -> tuple:
    return f.code, f.path


def verify_output(folder: str | Path, *, source: str | Path | None = None, engines: tuple[str, ...] = (),
                  accept: tuple[str, ...] = ()) -> None:
    """Refuse the staged output in `folder` when kv-budget or lint (errors the source lacks) refuse it.
    engines: the releases the write was made for (`convert --to mla --engine vllm==X`: lint checks those);
    accept: codes the user asked for (`--engine transformers`: an MLA row no vLLM serves, KV404)."""
    from kvtool.model.checkpoint import open_checkpoint
    from kvtool.model.numbers import require_valid_numbers
    from kvtool.model.spec import build_spec

    folder = Path(folder)
    try:
        ckpt = open_checkpoint(str(folder), read_side_files=False)
        require_valid_numbers(build_spec(ckpt.config), str(ckpt.config_path))
    except InputError as exc:
        raise InputError(f"{REFUSED} (kv-budget: {exc.message}); nothing was written", file=exc.file,
                         field=exc.field) from None
    found, error = _errors(str(folder), engines)
    found = [f for f in found if f.code not in accept]
    if error:
        raise InputError(f"{REFUSED} (lint cannot read it: {error}); nothing was written", file=str(folder))
    if not found:
        return
    before: set = set()
    if source is not None:
        try:
            old, _ = _errors(str(source), engines)  # by the same releases as the output
            before |= {_key(f) for f in old}
        except InputError:
            pass
    new = [f for f in found if _key(f) not in before]
    if new:
        f = new[0]
        more = f" (and {len(new) - 1} more)" if len(new) > 1 else ""
        raise InputError(f"{REFUSED} (lint {f.code} {f.name}: {f.message}{more}); nothing was written",
                         file=f.file or str(folder / "config.json"), field=f.path)
