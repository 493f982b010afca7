"""What `kvtool rope` does once its options are parsed: show, plan, lint the result, write it."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import typer

from kvtool.model.checkpoint import open_checkpoint
from kvtool.io.preflight import preflight
from kvtool.errors import EXIT_OK, InputError, UsageError
from kvtool.io.jsonfile import atomic_write_text, dump_json_like, parse_json, read_text
from kvtool.model.numbers import FACTOR_LIST_BOUND, problem, require_valid_numbers
from kvtool.rope import show as sh
from kvtool.rope.apply import Plan, RopeRequest, lint_findings, plan_rope, target_params
from kvtool.model.spec import build_spec


@dataclass
class RopeArgs:
    src: str
    dst: str | None = None
    rope_type: str | None = None
    factor: float | None = None
    target_context: int | None = None
    original: int | None = None
    theta: float | None = None
    options: dict = field(default_factory=dict)
    short_factor_file: str | None = None
    long_factor_file: str | None = None
    layer_type: str = "full_attention"
    layout: str = "both"
    in_place: bool = False
    link: bool = False  # hard-link unchanged files into DST instead of copying them
    show: bool = False
    plot: str | None = None


def request_from_args(a: RopeArgs) -> RopeRequest:
    """The planner's request for parsed options (factor files read and checked here)."""
    opts = dict(a.options)
    opts["short_factor"] = _factor_list(a.short_factor_file, "--short-factor-file")
    opts["long_factor"] = _factor_list(a.long_factor_file, "--long-factor-file")
    return RopeRequest(rope_type=a.rope_type, factor=a.factor, target_context=a.target_context, original=a.original,
                       theta=a.theta, options=opts, layer_type=a.layer_type, layout=a.layout)


def plan_change(config: dict, source: str, a: RopeArgs) -> Plan:
    """The RoPE change `kvtool rope` and a recipe's rope step make: every refusal, including a result that
    would fail `kvtool lint` where the input did not."""
    spec = build_spec(config)
    require_valid_numbers(spec, source)
    plan = plan_rope(spec, request_from_args(a), source=source)
    # the command lints its own output: refuse anything the edit made wrong
    before = {(f.code, f.path) for f in lint_findings(config, source) if f.severity == "error"}
    plan.findings = lint_findings(plan.config, source)
    new_errors = [f for f in plan.findings if f.severity == "error" and (f.code, f.path) not in before]
    if new_errors:
        f = new_errors[0]
        raise UsageError(f"refused: the result would fail `kvtool lint` with {f.code} {f.name}: {f.message}", file=source)
    return plan


def write(ckpt, plan: Plan, *, dst: str | Path | None = None, in_place: bool = False, link: bool = False) -> str:
    """Apply a planned change: SRC's config.json rewritten (in_place) or DST written; returns what was written."""
    text = dump_json_like(plan.config)
    if in_place:
        return _write_in_place(ckpt, text)
    return _write_dst(ckpt, Path(dst), text, link=link)


def run(a: RopeArgs) -> int:
    writes = a.dst is not None or a.in_place
    if a.rope_type is None:
        if writes or a.factor is not None or a.target_context is not None:
            raise UsageError("give --type to change the RoPE scaling (or --show alone to explain it)", field="--type")
        if not a.show and not a.plot:
            raise UsageError("nothing to do: give --type with DST or --in-place, or --show / --plot", field="--type")
    elif not writes and not a.show and not a.plot:
        raise UsageError("give DST, --in-place, or --show (to preview the change)", field="DST")
    if a.dst is not None and a.in_place:
        raise UsageError("give DST or --in-place, not both", field="--in-place")

    if writes and Path(a.src).is_dir():  # DST gets SRC's weight files: refuse any a reader would refuse
        ckpt = preflight(a.src, read_side_files=False, require_weights=False)
    else:
        ckpt = open_checkpoint(a.src, read_weights=False)
    spec = build_spec(ckpt.config)
    source = str(ckpt.config_path)
    require_valid_numbers(spec, source)

    if a.rope_type is None:
        states = sh.current_states(spec)
        if not states or spec.position != "rope":
            raise UsageError(f"{spec.model_type or 'this model'} does not use RoPE (position: {spec.position})", file=source)
        if a.show:
            typer.echo(f"{source}: {spec.model_type}, {len(spec.layer_types)} layers")
            for st in states:
                typer.echo(sh.describe(st))
        if a.plot:
            _plot(a.plot, states[0], None, f"{spec.model_type}: current RoPE")
            typer.echo(f"plot written to {a.plot}")
        return EXIT_OK

    plan = plan_change(ckpt.config, source, a)

    key, rp = target_params(spec, a.layer_type)
    new_key, new_rp = target_params(plan.spec, a.layer_type)
    st_before = sh.state_of(spec, key, rp)
    st_after = sh.state_of(plan.spec, new_key, new_rp, params=plan.new)
    if a.show:
        typer.echo(sh.describe(st_before, st_after, original=plan.original))
    if a.plot:
        _plot(a.plot, st_before, st_after, f"{spec.model_type}: {plan.new['rope_type']} x{plan.factor:g}")

    summary = (f"{plan.new['rope_type']} factor {plan.factor:g} on {plan.layer_type} layers "
               f"(original {plan.original} -> {int(plan.original * plan.factor)} tokens)")
    if st_after.attention is not None:
        summary += f", attention scaling {st_after.attention:.4f}"
    if not writes:
        typer.echo(f"preview only (give DST or --in-place to write): {summary}")
        return EXIT_OK
    written = write(ckpt, plan, dst=a.dst, in_place=a.in_place, link=a.link)
    typer.echo(f"rope: {summary}")
    for note in plan.notes:
        typer.echo(f"  {note}")
    for f in plan.findings:
        if f.code.startswith("KV2") and f.severity != "info":
            typer.echo(f"  note: {f.code} [{f.severity}] {f.message}")
    typer.echo(f"  {written}")
    return EXIT_OK


def _factor_list(path: str | None, option: str) -> list[float] | None:
    """A JSON list of positive numbers, or a JSON object holding one under short_factor / long_factor."""
    if path is None:
        return None
    data = parse_json(read_text(Path(path), what="factor list"), path, what="factor list")
    if isinstance(data, dict):
        data = data.get(option.strip("-").replace("-file", "").replace("-", "_"))
    if not (isinstance(data, list) and data and not problem(data, FACTOR_LIST_BOUND)):
        raise InputError(f"{option} expects a JSON list of finite numbers > 0 and <= 1e6", file=path)
    return [float(x) for x in data]


def _plot(path: str, before, after, title: str) -> None:
    target = Path(path)
    tmp = target.with_name(f".{target.name}.kvtool-tmp-{os.getpid()}.png")
    try:
        sh.plot(str(tmp), before, after, title)
        os.replace(tmp, target)
    except OSError as exc:
        raise UsageError(f"cannot write the plot: {exc.strerror or exc}", file=path) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_in_place(ckpt, text: str) -> str:
    if ckpt.hub:
        raise UsageError("--in-place needs a local model folder or config.json, not a hub id", file=ckpt.source)
    cfg = ckpt.config_path
    backup = cfg.with_name(cfg.name + ".bak")
    n = 1
    while backup.exists():
        backup = cfg.with_name(f"{cfg.name}.bak.{n}")
        n += 1
    try:
        shutil.copy2(cfg, backup)
        atomic_write_text(cfg, text)
    except OSError as exc:
        raise InputError(f"cannot write: {exc.strerror or exc}; {cfg.name} is unchanged", file=str(cfg)) from None
    return f"{cfg} rewritten (backup: {backup.name})"


def _write_dst(ckpt, dst: Path, text: str, *, link: bool = False) -> str:
    from kvtool.io.staging import check_destination, check_inside, link_or_copy, staged_output

    if ckpt.hub:
        raise UsageError("writing needs a local model folder; download it first (huggingface-cli download)",
                         file=ckpt.source)
    if ckpt.root is None and dst.suffix == ".json":
        # a lone config.json in, a lone config.json out
        if dst.exists():
            raise UsageError("destination exists; choose another name", file=str(dst))
        try:
            atomic_write_text(dst, text)
        except OSError as exc:
            raise InputError(f"cannot write: {exc.strerror or exc}", file=str(dst)) from None
        return f"{dst} written"
    # a lone config.json: the file is the input (a DST folder beside it is fine, one holding it is not)
    protect = [ckpt.root] if ckpt.root is not None else [ckpt.config_path]
    check_destination(dst, force=True, protect=protect)  # the input itself, or a file: refused
    if dst.is_symlink():  # never written through, and without --force never replaced
        raise UsageError("destination is a symlink; give a new DST, or --in-place", file=str(dst))
    if dst.is_dir() and any(dst.iterdir()):  # rope has no --force (staging's message names it): never replaces
        raise UsageError("destination folder is not empty; give a new or empty DST, or --in-place", file=str(dst))
    linked = copied = 0
    with staged_output(dst, protect=protect) as tmp:
        (tmp / "config.json").write_text(text, encoding="utf-8")
        if ckpt.root is not None:
            for p in sorted(ckpt.root.rglob("*")):
                rel = p.relative_to(ckpt.root)
                if rel.parts[0].startswith(".") or rel == Path("config.json") or not p.is_file():
                    continue
                check_inside(ckpt.root, p)
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                # a copy (reflink where the file system can) by default: editing DST never changes SRC
                if link_or_copy(p, out, link=link):
                    linked += 1
                else:
                    copied += 1
    if not link:
        return f"{dst}/config.json written; {copied} other file(s) copied"
    return f"{dst}/config.json written; {linked} other file(s) hard-linked, {copied} copied"
