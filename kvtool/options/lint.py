"""`kvtool lint` / the recipe's lint step: every option, declared once."""

from __future__ import annotations

from pathlib import Path

from kvtool.options.fields import argument, engine_option, operation, option

_CODES = {"type": "array", "items": {"type": "string", "pattern": "^KV[0-9]*$"}}  # a recipe lists codes


@operation("lint")
class LintOptions:
    paths: list[str] = argument(help="Model folders, config.json files or hub ids.")
    format: str | None = option(None, flags=("--format", "--output-format"), recipe=False,
                                choices=("text", "json", "sarif", "github"),
                                help="text | json | sarif | github (default: text).")
    select: str | None = option(None, schema=_CODES,
                                help="Comma-separated codes or prefixes to enable (default: all).")
    ignore: str | None = option(None, schema=_CODES, help="Comma-separated codes or prefixes to disable.")
    strict: bool | None = option(None, negatable=True, help="Warnings fail too (exit 1).")
    tensor_parallel_size: int | None = option(None, short="-tp", recipe=False,
                                              help="Check vLLM's divisibility rules for this TP size.")
    config: Path | None = option(None, recipe=False, help="Read [tool.kvtool] from this pyproject.toml.")
    isolated: bool = option(False, recipe=False, help="Ignore every pyproject.toml.")
    engine: list[str] = engine_option("lint checks every release they name (a range such as 'vllm>=0.6,<0.9' checks "
                                      "every known release in it). Default: [tool.kvtool] engines, else the installed "
                                      "releases, else the newest known.", recipe="engines")
    compat: bool = option(False, recipe=False,
                          help="Print one row per engine release (transformers 4.38.., vLLM 0.5..): reads it as "
                               "written, reads it differently, or refuses.")
    require_weights: bool = option(False, recipe=False,
                                   help="Git LFS pointers instead of weights (KV613) are an error, not an info.")
