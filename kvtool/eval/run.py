"""`kvtool eval` as a library: `plan` makes every refusal that needs no model (the text, the gate limits, the
window, batch and memory options, the model folders) and holds what will be evaluated and its estimated cost;
`apply` evaluates. The command (its --dry-run prints the plan) and a recipe's eval step call both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from kvtool import console
from kvtool.errors import UsageError
from kvtool.eval.windows import check_settings
from kvtool.io.urls import redact
from kvtool.options.eval import EvalOptions

READ = object()  # plan(texts=READ): read the options' --text / --dataset


@dataclass(frozen=True)
class EvalPlan:
    model: str
    baseline: str | None
    options: EvalOptions
    texts: list | None  # str or kvtool.tokenstream.TextFile each (read when evaluated); None: the built-in text
    text_name: str | None
    gates: dict[str, float]
    max_memory: dict | None
    tokens: int  # tokens scored: max_tokens, else the text's characters (a file's bytes) / 4 (no tokenizer)
    tokens_exact: bool  # False: the characters / 4 estimate
    shape: object = None  # kvtool.model.costs shape of the model; None: read from `model` when estimated

    def model_shape(self):
        from kvtool.model import costs

        return self.shape if self.shape is not None else costs.for_checkpoint(self.model)

    def estimate(self, shape=None):
        """kvtool.model.costs.evaluate: peak memory and time, candidate (and baseline) layer by layer."""
        from kvtool.model import costs

        return costs.evaluate(shape or self.model_shape(), self.tokens, models=2 if self.baseline else 1)


def gate_limits(o: EvalOptions) -> dict[str, float]:
    """The command's gates: --max-ppl-increase (2% by default, 'off' disables) and the others, all against
    --baseline; without one, PPL alone (an explicit baseline gate is refused)."""
    from kvtool.eval.gate import parse_limits

    off = o.max_ppl_increase.strip().lower() in ("off", "none", "")
    gates = parse_limits(None if off else o.max_ppl_increase, o.max_kld, o.min_top1)
    if o.baseline is None and o.baseline_server is None:
        explicit = [g for g in gates if g != "max_ppl_increase"]
        if explicit:
            raise UsageError("compares against a baseline; give --baseline" + (" or --baseline-server" if o.server
                                                                                 else ""), option=explicit[0])
        return {}  # the default PPL gate needs a baseline
    return gates


# what a server decides itself (its engine's flags), so eval --server refuses them: option -> its default
_LOCAL_ONLY = {"device": "auto", "dtype": "auto", "device_map": None, "max_memory": None, "batch_size": None,
               "kv_cache_dtype": "auto", "kv_scales": "checkpoint", "fp8_attention": "cache-only"}


# what the local side of a mixed run (a served side and a local folder) takes from them
_LOCAL_SIDE = ("device", "dtype", "kv_cache_dtype", "kv_scales")


def local_paths(model: str, o: EvalOptions) -> list[str]:
    """The model folders this evaluation runs here: both (no server), or the local side of a mixed run
    (kvtool.eval.served.sides): MODEL without --server, a --baseline folder with --server and no --baseline-server."""
    from kvtool.eval.served import local_folder

    if not o.server and not o.baseline_server:
        return [p for p in (model, o.baseline) if p is not None]
    if not o.server:
        return [model]
    return [o.baseline] if o.baseline_server is None and local_folder(o.baseline) else []


def check_served(o: EvalOptions) -> None:
    """The served options' refusals: options only the local path has (a mixed run's local side takes device,
    dtype and the KV-cache emulation), a mixed run without the baseline's served name, bounds."""
    if not o.server and not o.baseline_server:
        for name in ("served_kv_cache_dtype", "served_chunk"):
            if getattr(o, name) is not None:
                raise UsageError("describes a server; it goes with --server or --baseline-server", option=name)
        return
    if not o.server and o.baseline is None:
        raise UsageError("names the baseline served at --baseline-server (MODEL is then the local candidate "
                         "folder); give it, or give --server for a served candidate", option="baseline")
    mixed = bool(local_paths("", o)) or not o.server
    for name, default in _LOCAL_ONLY.items():
        if getattr(o, name) != default and not (mixed and name in _LOCAL_SIDE):
            raise UsageError("the server decides this (its own flags, e.g. vLLM's --kv-cache-dtype); it does not "
                             "go with --server" + (" (a mixed run's local side takes --device, --dtype, "
                                                    "--kv-cache-dtype and --kv-scales)" if mixed else ""),
                             option=name)
    if not 1 <= o.top_logprobs <= 1000:
        raise UsageError(f"must be between 1 and 1000, got {o.top_logprobs}", option="top_logprobs")
    if not 1 <= o.server_timeout <= 86400:
        raise UsageError(f"must be between 1 and 86400 seconds, got {o.server_timeout:g}", option="server_timeout")


def planned_tokens(chars: int, max_tokens: int | None) -> tuple[int, bool]:
    """(tokens scored, whether that is exact) for a plan: no tokenizer is loaded, so a text counts as
    characters / 4 tokens; max_tokens below that is exact."""
    in_text = max(2, chars // 4)
    if max_tokens:
        return min(max_tokens, in_text), max_tokens <= in_text
    return in_text, False


def plan(model: str, o: EvalOptions, *, texts=READ, text_name: str | None = None,
         gates: Mapping | None = None, tokens: int | None = None, shape=None) -> EvalPlan:
    """Refusals in the command's order (exit 2). texts: READ reads o.text / o.dataset, else the texts themselves
    (None: the built-in one). gates: limits by name (parsed here, a recipe's thresholds); None: the command's
    (gate_limits). tokens / shape: a recipe's estimate of a model its earlier steps have not written yet (the
    folders are then not opened)."""
    from kvtool.eval.api import check_fp8_attention, parse_max_memory, refuse_unserved
    from kvtool.eval.gate import parse_limits

    o.check()  # the declared choices and bounds (kvtool/options/eval.py), again after a caller's edits
    check_served(o)
    check_sweep(o)
    limits = sweep_limits(o) if o.kv_sweep and gates is None else gate_limits(o) if gates is None \
        else parse_limits(**gates)
    if texts is READ:
        from kvtool.datasets import read_texts

        texts, text_name = read_texts(o.text, o.dataset)
    max_memory = parse_max_memory(o.max_memory) if o.max_memory is not None else None
    check_fp8_attention(o.fp8_attention, o.kv_cache_dtype)  # across two fields: not a declared bound
    check_settings(max_length=o.max_length, stride=o.stride, max_tokens=o.max_tokens, batch_size=o.batch_size,
                   max_memory=max_memory, device_map=o.device_map)
    if shape is None and local_paths(model, o):
        from kvtool.model.preflight import check_loadable

        check_loadable(*local_paths(model, o), *o.candidate)  # a bad folder: before torch and transformers
        refuse_unserved(local_paths(model, o)[0], o.kv_cache_dtype)  # the candidate (a mixed run: the local side)
    exact = tokens is not None
    if tokens is None:
        from kvtool.datasets import evaluation_text
        from kvtool.tokenstream import source_size

        sizes = [source_size(t) for t in (texts if texts is not None else [evaluation_text()])]
        tokens, exact = planned_tokens(sum(sizes), o.max_tokens)
    return EvalPlan(model=model, baseline=o.baseline, options=o, texts=texts, text_name=text_name, gates=limits,
                    max_memory=max_memory, tokens=tokens, tokens_exact=exact, shape=shape)


def apply(p: EvalPlan, *, device: str | None = None, progress: bool | None = None):
    """Evaluate a plan: the kvtool.eval.api.EvalReport (gates applied). Imports torch unless --server."""
    o = p.options
    if o.server or o.baseline_server:
        from kvtool.eval import served

        local = {"device": device or o.device, "dtype": o.dtype, "kv_cache_dtype": o.kv_cache_dtype,
                 "kv_scales": o.kv_scales}
        return served.evaluate(p.model, server=o.server, baseline=o.baseline, baseline_server=o.baseline_server,
                               texts=p.texts, text_name=p.text_name, max_length=o.max_length, stride=o.stride,
                               max_tokens=o.max_tokens, top_logprobs=o.top_logprobs, timeout=o.server_timeout,
                               gates=p.gates, progress=progress, local=local,
                               served_kv_cache_dtype=o.served_kv_cache_dtype, served_chunk=o.served_chunk)
    if o.kv_sweep:
        from kvtool.eval import sweep

        report = sweep.run(p.model, o.candidate, baseline=p.baseline, texts=p.texts, text_name=p.text_name,
                           max_length=o.max_length, stride=o.stride, max_tokens=o.max_tokens,
                           device=device or o.device, dtype=o.dtype, batch_size=o.batch_size,
                           device_map=o.device_map, max_memory=p.max_memory, kv_scales=o.kv_scales,
                           gates=p.gates, progress=progress)
        if o.plot:
            from kvtool.eval.sweep_plot import write_plot

            write_plot(report, o.plot)
        return report
    from kvtool.eval.api import evaluate

    return evaluate(p.model, p.baseline, texts=p.texts, text_name=p.text_name, max_length=o.max_length,
                    stride=o.stride, max_tokens=o.max_tokens, device=device or o.device, dtype=o.dtype,
                    kv_cache_dtype=o.kv_cache_dtype, kv_scales=o.kv_scales, fp8_attention=o.fp8_attention,
                    batch_size=o.batch_size,
                    device_map=o.device_map, max_memory=p.max_memory, gates=p.gates, progress=progress)


# what --kv-sweep decides itself (option -> the value it takes): the sweep chooses the KV-cache dtypes
_SWEEP_FIXED = {"server": None, "baseline_server": None, "kv_cache_dtype": "auto", "fp8_attention": "cache-only"}


def check_sweep(o: EvalOptions) -> None:
    """--kv-sweep's refusals: the options it decides itself, --candidate and --plot without it, a plot file
    kvtool cannot write (before any model loads)."""
    if not o.kv_sweep:
        for name in ("candidate", "plot"):
            if getattr(o, name):
                raise UsageError("goes with --kv-sweep", option=name)
        return
    for name, value in _SWEEP_FIXED.items():
        if getattr(o, name) != value:
            raise UsageError("--kv-sweep scores every KV-cache dtype of the model locally; it does not go with "
                             "this option", option=name)
    if o.plot:
        from kvtool.io.plotfile import check_target

        check_target(o.plot)


def sweep_limits(o: EvalOptions) -> dict[str, float]:
    """The sweep's gates: the command's, every option against the one baseline (MODEL itself by default)."""
    from kvtool.eval.gate import parse_limits

    off = o.max_ppl_increase.strip().lower() in ("off", "none", "")
    return parse_limits(None if off else o.max_ppl_increase, o.max_kld, o.min_top1)


def render_plan(p: EvalPlan) -> console.Text:
    """--dry-run: what will be evaluated and its estimated cost (kvtool.model.costs)."""
    about = "" if p.tokens_exact else "~"
    o = p.options
    if o.kv_sweep:
        from kvtool.eval.sweep import render_plan as sweep_plan

        return sweep_plan(p.model, o.candidate, p.baseline)
    if o.server or o.baseline_server:
        local = local_paths(p.model, o)
        cand = f"{p.model} (local)" if not o.server else f"{p.model} served at {redact(o.server)}"
        base = (f" against {o.baseline} (local)" if o.server and local else
                f" against {o.baseline or p.model} at {redact(o.baseline_server or o.server or '')}"
                if o.baseline or o.baseline_server else "")
        return console.lines([f"kvtool eval plan: {cand}{base}",
                              f"  tokens       {about}{p.tokens}, top {o.top_logprobs} log-probabilities each"])
    shape = p.model_shape()
    return console.lines([
        f"kvtool eval plan: {p.model}" + (f" against {p.baseline}" if p.baseline else ""),
        f"  tokens       {about}{p.tokens} through {shape.layers} layers"
        + (", candidate and baseline" if p.baseline else ""),
        f"  estimate     {p.estimate(shape).line()}"])
