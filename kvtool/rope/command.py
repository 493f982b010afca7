"""What `kvtool rope` does once its options are parsed: show, plan, lint the result, write it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from kvtool import console
from kvtool.model.checkpoint import open_checkpoint
from kvtool.model.preflight import preflight
from kvtool.errors import EXIT_OK, InputError, UsageError
from kvtool.io.jsonfile import dump_json_like
from kvtool.io import outputfile
from kvtool.model.numbers import require_valid_numbers
from kvtool.model.spec import build_spec
from kvtool.options.rope import RopeOptions
from kvtool.rope import show as sh
from kvtool.rope.apply import Plan, lint_findings, plan_rope, target_params


def plan_change(config: dict, source: str, a: RopeOptions) -> Plan:
    """The RoPE change `kvtool rope` and a recipe's rope step make, with every refusal: the planner's and a
    result that would fail `kvtool lint` where the input did not."""
    spec = build_spec(config)
    require_valid_numbers(spec, source)
    plan = plan_rope(spec, a, source=source)
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
    assert dst is not None  # the command and recipes pass DST unless in_place
    return _write_dst(ckpt, Path(dst), text, link=link)


def run(a: RopeOptions, echo: Callable[[str], None] = console.out) -> int:
    """Show, preview or write the RoPE change `a` asks for; each line of the account goes to `echo`."""
    writes = a.dst is not None or a.in_place
    if a.type is None:
        if writes or a.factor is not None or a.target_context is not None:
            raise UsageError("give --type to change the RoPE scaling (or --show alone to explain it)", option="type")
        if not a.show and not a.plot:
            raise UsageError("nothing to do: give --type with DST or --in-place, or --show / --plot", option="type")
    elif not writes and not a.show and not a.plot:
        raise UsageError("give DST, --in-place, or --show (to preview the change)", option="dst")
    if a.dst is not None and a.in_place:
        raise UsageError("give DST or --in-place, not both", option="in_place")

    if writes and Path(a.src).is_dir():  # DST gets SRC's weight files: refuse any a reader would refuse
        ckpt = preflight(a.src, read_side_files=False, require_weights=False)
    else:
        ckpt = open_checkpoint(a.src, read_weights=False)
    spec = build_spec(ckpt.config)
    source = str(ckpt.config_path)
    require_valid_numbers(spec, source)
    from kvtool.engines.releases import vllm_max_len_switches

    vllm, switches = vllm_max_len_switches(a.engine)  # the served context of --show follows this release

    if a.type is None:
        states = sh.current_states(spec, switches=switches)
        if not states or spec.position != "rope":
            raise UsageError(f"{spec.model_type or 'this model'} does not use RoPE (position: {spec.position})", file=source)
        if a.show:
            echo(f"{source}: {spec.model_type}, {len(spec.layer_types)} layers; served context as "
                 f"{vllm.describe()} derives it")
            for st in states:
                echo(sh.describe(st))
        if a.plot:
            _plot(a.plot, states[0], None, f"{spec.model_type}: current RoPE")
            echo(f"plot written to {a.plot}")
        return EXIT_OK

    plan = plan_change(ckpt.config, source, a)

    key, rp = target_params(spec, a.layer_type)
    assert plan.spec is not None  # plan_change always builds it
    new_key, new_rp = target_params(plan.spec, a.layer_type)
    st_before = sh.state_of(spec, key, rp, switches=switches)
    st_after = sh.state_of(plan.spec, new_key, new_rp, params=plan.new, switches=switches)
    if a.show:
        echo(sh.describe(st_before, st_after, original=plan.original))
    if a.plot:
        _plot(a.plot, st_before, st_after, f"{spec.model_type}: {plan.new['rope_type']} x{plan.factor:g}")

    summary = (f"{plan.new['rope_type']} factor {plan.factor:g} on {plan.layer_type} layers "
               f"(original {plan.original} -> {int(plan.original * plan.factor)} tokens)")
    if st_after.attention is not None:
        summary += f", attention scaling {st_after.attention:.4f}"
    if not writes:
        echo(f"preview only (give DST or --in-place to write): {summary}")
        return EXIT_OK
    written = write(ckpt, plan, dst=a.dst, in_place=a.in_place, link=a.link)
    echo(f"rope: {summary}")
    for note in plan.notes:
        echo(f"  {note}")
    for f in plan.findings:
        if f.code.startswith("KV2") and f.severity != "info":
            echo(f"  note: {f.code} [{f.severity}] {f.message}")
    from kvtool.engines.compat import intended_by

    echo("  read as written by: " + "; ".join(f"{e} {lines}" for e, lines in intended_by(plan.spec).items())
         + " (kvtool lint --compat DST)")
    echo(f"  {written}")
    return EXIT_OK


def _plot(path: str, before, after, title: str) -> None:
    try:  # rendered into a fresh file beside the target, renamed over it when complete
        outputfile.replace(path, lambda fh: sh.plot(fh, before, after, title))
    except OSError as exc:
        raise UsageError(f"cannot write the plot: {exc.strerror or exc}", file=path) from None


def _write_in_place(ckpt, text: str) -> str:
    if ckpt.hub:
        raise UsageError("--in-place needs a local model folder or config.json, not a hub id", file=ckpt.source)
    cfg = ckpt.config_path
    if cfg.is_symlink():  # renaming over it would replace the link, writing to it would edit its target
        raise UsageError("is a symlink; --in-place never edits through a link (write the change to a DST)",
                         file=str(cfg))
    try:
        original, ident = _validated_bytes(cfg, ckpt.config_doc.text)
        # config.json.bak, .bak.1, ...: a new file each time (a link planted at a name counts as taken)
        backup = outputfile.create_first_free(
            lambda n: cfg.with_name(f"{cfg.name}.bak" + (f".{n}" if n else "")), original)
        try:
            outputfile.check_unchanged(cfg, ident)  # still the file planned on and backed up
            outputfile.replace(cfg, text)
        except BaseException:
            backup.unlink()
            raise
    except OSError as exc:
        raise InputError(f"cannot write: {exc.strerror or exc}; {cfg.name} is unchanged", file=str(cfg)) from None
    return f"{cfg} rewritten (backup: {backup.name})"


def _validated_bytes(cfg: Path, text: str) -> tuple[bytes, "outputfile.Identity"]:
    """config.json's bytes for the backup, read once, and its identity; the bytes must still be the text the
    change was planned on."""
    fd, ident = outputfile.open_source(cfg)
    limit = len(text.encode("utf-8")) + 3  # the text read, and a BOM: anything longer has changed
    data = b""
    try:
        while len(data) <= limit and (chunk := os.pread(fd, limit + 1 - len(data), len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > limit or data.decode("utf-8-sig", "replace") != text:
        raise outputfile.SourceChanged(cfg, ident, outputfile.identity_of(os.stat(cfg)))
    return data, ident


def _write_dst(ckpt, dst: Path, text: str, *, link: bool = False) -> str:
    from kvtool.io.staging import check_destination, check_inside, staged_output

    if ckpt.hub:
        raise UsageError("writing needs a local model folder; download it first (huggingface-cli download)",
                         file=ckpt.source)
    if ckpt.root is None and dst.suffix == ".json":
        # a lone config.json in, a lone config.json out
        if dst.exists() or dst.is_symlink():
            raise UsageError("destination exists; choose another name", file=str(dst))
        try:
            outputfile.write_new(dst, text)
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
    validated = outputfile.identities(ckpt.headers)  # the weights as preflight checked them
    from functools import partial

    from kvtool.rules.output_check import verify_output

    with staged_output(dst, protect=protect, verify=partial(verify_output, source=ckpt.root or ckpt.config_path)) as tmp:
        outputfile.write_new(tmp / "config.json", text)
        if ckpt.root is not None:
            for p in sorted(ckpt.root.rglob("*")):
                rel = p.relative_to(ckpt.root)
                if rel.parts[0].startswith(".") or rel == Path("config.json") or not p.is_file():
                    continue
                check_inside(ckpt.root, p)
                outputfile.make_subdirs(tmp, rel.parent)
                # a copy (reflink where the file system can) by default: editing DST never changes SRC
                how = outputfile.copy_source(p, tmp / rel, expect=validated.get(rel.as_posix()), link=link)
                if how == "link":
                    linked += 1
                else:
                    copied += 1
    if not link:
        return f"{dst}/config.json written; {copied} other file(s) copied"
    return f"{dst}/config.json written; {linked} other file(s) hard-linked, {copied} copied"
