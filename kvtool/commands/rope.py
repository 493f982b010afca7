"""`kvtool rope`: apply, verify and explain RoPE scaling (config edit only; never imports torch)."""

from __future__ import annotations

from typing import Optional

import typer

from kvtool.model.rope.types import applicable_types


def register(app: typer.Typer) -> None:
    @app.command("rope", help="Apply, verify and explain RoPE scaling (yarn, llama3, longrope, linear, dynamic); "
                              "writes config.json only, other files are copied unchanged.")
    def rope(
        src: str = typer.Argument(..., help="Model folder, config.json, or hub id (hub: --show only)."),
        dst: Optional[str] = typer.Argument(None, help="Output folder (new config.json, other files copied); required unless --in-place or --show (preview)."),
        rope_type: Optional[str] = typer.Option(None, "--type", help=" | ".join(applicable_types())),
        factor: Optional[float] = typer.Option(None, "--factor", help="Scaling factor (>= 1)."),
        target_context: Optional[int] = typer.Option(None, "--target-context", help="Target context N: factor = N / original length."),
        original: Optional[int] = typer.Option(None, "--original-max-position-embeddings", help="Pre-scaling context (default: from the config)."),
        theta: Optional[float] = typer.Option(None, "--theta", help="New RoPE base (default: keep)."),
        beta_fast: Optional[float] = typer.Option(None, "--beta-fast", help="yarn: extrapolation bound (default 32)."),
        beta_slow: Optional[float] = typer.Option(None, "--beta-slow", help="yarn: interpolation bound (default 1)."),
        attention_factor: Optional[float] = typer.Option(None, "--attention-factor", help="yarn / longrope: attention scaling (default: derived from factor)."),
        low_freq_factor: Optional[float] = typer.Option(None, "--low-freq-factor", help="llama3 (default 1.0)."),
        high_freq_factor: Optional[float] = typer.Option(None, "--high-freq-factor", help="llama3 (default 4.0)."),
        short_factor_file: Optional[str] = typer.Option(None, "--short-factor-file", help="longrope: JSON list of rotary_dim/2 factors."),
        long_factor_file: Optional[str] = typer.Option(None, "--long-factor-file", help="longrope: JSON list of rotary_dim/2 factors."),
        layer_type: str = typer.Option("full_attention", "--layer-type", help="Per-layer-type configs (gemma3): which layers to scale."),
        layout: str = typer.Option("both", "--layout", help="both (legacy rope_scaling + v5 rope_parameters) | legacy | v5"),
        in_place: bool = typer.Option(False, "--in-place", help="Edit SRC/config.json (after writing config.json.bak)."),
        link: bool = typer.Option(False, "--link", help="Hard-link unchanged files into DST instead of copying: saves "
                                  "disk, but editing either copy in place changes both."),
        show: bool = typer.Option(False, "--show", help="Explain the RoPE setup: wavelengths before/after, served context."),
        plot: Optional[str] = typer.Option(None, "--plot", help="Draw wavelength per dimension, before/after, to FILE.png (needs matplotlib)."),
    ) -> int:
        from kvtool.rope.command import RopeArgs, run

        return run(RopeArgs(
            src=src, dst=dst, rope_type=rope_type, factor=factor, target_context=target_context, original=original,
            theta=theta, options={"beta_fast": beta_fast, "beta_slow": beta_slow, "attention_factor": attention_factor,
                                  "low_freq_factor": low_freq_factor, "high_freq_factor": high_freq_factor},
            short_factor_file=short_factor_file, long_factor_file=long_factor_file, layer_type=layer_type,
            layout=layout, in_place=in_place, link=link, show=show, plot=plot,
        ))
