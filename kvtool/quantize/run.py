"""quantize-kv end to end: check inputs, calibrate, write the staged output, report quality."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtool import progress as kv_progress
from kvtool.errors import InputError
from kvtool.options.quantize_kv import MIN_CALIB_TOKENS, QuantizeOptions


@dataclass
class QuantizeResult:
    dst: Path
    calibration: object
    scale_tensors: dict
    linked: list[str]
    copied: list[str]
    quality: list = field(default_factory=list)  # EvalReport per row: original, scale 1.0, calibrated
    config: dict | None = None
    format: object = None  # kvtool.quantize.formats.Fp8Format
    ignoring: list[str] = field(default_factory=list)  # ignoring_lines(): the dtypes these scales do not serve


def read_texts(files: list[str], option: str) -> list:
    """The text files (kvtool.tokenstream.TextFile: checked now, read as far as the tokens are used); refused
    when all of them are blank."""
    from kvtool.datasets import text_file

    out = [text_file(f, option) for f in files]
    if all(t.blank() for t in out):
        raise InputError("the text is empty", file=files[0] if files else None, option=option)
    return out


def check_options(opts: QuantizeOptions) -> None:
    """The option checks that need no checkpoint; torch-free (`--dry-run` runs them too). The declared choices
    and bounds are the options object's own check (kvtool/options/fields.py), run again after a caller's edits."""
    from kvtool.quantize.formats import check_combination, get_format
    from kvtool.quantize.observer_specs import parse_spec

    from kvtool.datasets import check_calibration_source

    opts.check()
    check_calibration_source(opts.calib_text, opts.calib_dataset)
    fmt = get_format(opts.format)
    entry, _ = parse_spec(observer_of(opts))
    check_combination(fmt, opts.strategy, entry.name)


def observer_of(opts: QuantizeOptions) -> str:
    """--observer, or the format's default (kvtool.quantize.formats.FORMATS `default_observer`)."""
    from kvtool.quantize.formats import get_format

    return opts.observer or get_format(opts.format).default_observer


def ignoring_lines() -> list[str]:
    """One line per --kv-cache-dtype that does not read the scales quantize-kv writes (kv_emulations.json rows
    whose `scales` is not "checkpoint"); torch-free."""
    from kvtool.model import kv_emulations

    return [f"{name}: ignores checkpoint scales ({kv_emulations.SCALES_WORDS[row.scales]})"
            for name, row in kv_emulations.table().items() if row.scales != "checkpoint"]


def tokenize_windows(tokenizer, texts: list, n_tokens: int, seq_len: int):
    """Calibration batches of the first n_tokens of the joined texts (calibration_windows), and their count."""
    from kvtool.tokenstream import first_tokens

    ids = first_tokens(tokenizer, texts, n_tokens).ids.tolist()
    return calibration_windows(tokenizer, ids, seq_len), len(ids)


def calibration_windows(tokenizer, ids: list[int], seq_len: int):
    """Calibration batches: ids in windows of seq_len tokens, each window starting with BOS when the tokenizer
    adds one (as every served request does)."""
    import torch

    probe = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id] else None
    step = seq_len - (1 if bos is not None else 0)
    wins = [([bos] if bos is not None else []) + ids[i:i + step] for i in range(0, len(ids), step)]
    # equal-length windows are stacked into batches of up to 8 (the last, shorter one alone)
    batches, group = [], []
    for w in wins:
        if group and (len(group) == 8 or len(w) != len(group[0])):
            batches.append(torch.tensor(group))
            group = []
        group.append(w)
    if group:
        batches.append(torch.tensor(group))
    return batches


def check_model(ckpt, *, config: dict | None = None, tensors: dict | None = None):
    """The model-side refusals of quantize-kv (torch-free), on the checkpoint or, for a recipe step, on the
    config and tensors its earlier steps leave. Returns the spec."""
    from kvtool.model.architectures import is_known
    from kvtool.model.kv_scale_names import is_kv_scale

    config, tensors, spec = ckpt.planned(config, tensors)
    where = str(ckpt.config_path)
    if not is_known(spec.model_type):
        raise InputError(f"model_type {spec.model_type!r} has no architecture table; kvtool cannot name its "
                         "attention modules", file=where, field="model_type")
    if spec.is_mla:
        # vLLM 0.33: --kv-cache-dtype fp8 stores the latent with one scale per layer, initialised to 1.0 and
        # replaced only by a checkpoint's (vllm/model_executor/layers/attention/attention.py _init_kv_cache_quant,
        # called by mla_attention.py MLAAttention.__init__; used in MLAAttention.update_kv_cache); the sparse
        # backends' fp8_ds_mla format computes per-tile scales itself (mla_attention.py
        # _canonicalize_sparse_mla_kv_cache_dtype; vllm/third_party/flashmla/flash_mla_interface.py)
        raise InputError("MLA caches one latent row per token, not K and V heads: there are no per-head K/V scales "
                         "to calibrate; serve it with vLLM --kv-cache-dtype fp8 (one latent scale per layer, 1.0 "
                         "unless given) or fp8_ds_mla (sparse MLA backends; the kernel scales each tile)",
                         file=where, field="model_type")
    if not spec.num_kv_heads or not spec.num_layers:
        raise InputError("cannot tell the number of layers / KV heads", file=where,
                         field=spec.key("num_kv_heads") or "num_key_value_heads")
    already = [n for n in tensors if is_kv_scale(n)]
    if already:
        raise InputError(f"already carries KV-cache scales (e.g. {already[0]!r}); start from the checkpoint without them",
                         file=ckpt.source, field=already[0])
    from kvtool.quantize.config import check_mergeable

    check_mergeable(config, where)  # with_kv_cache_scheme checks it again; a recipe's plan stops here
    return spec


@dataclass
class QuantizePlan:
    """What quantize-kv will do, decided before any model is loaded: every refusal has been made."""

    src: str
    dst: str
    opts: QuantizeOptions
    ckpt: object  # kvtool.model.checkpoint.Checkpoint
    arch: object
    spec: object
    new_config: dict  # config.json with the kv_cache_scheme


def plan(src: str, dst: str, opts: QuantizeOptions) -> QuantizePlan:
    """All checks that need no model (the options, the checkpoint, DST). Raises exit-2 errors."""
    from kvtool.model.preflight import preflight
    from kvtool.io.staging import check_destination
    from kvtool.quantize.config import with_kv_cache_scheme
    from kvtool.quantize.observer_specs import parse_spec

    check_options(opts)
    src_path = Path(src)
    if not src_path.is_dir():
        raise InputError("is not a model folder (quantize-kv needs config.json and safetensors weights)", file=src)
    ckpt = preflight(src, model_code=True)  # before any load: corrupt weights, pickles, auto_map refused
    spec = check_model(ckpt)
    arch = spec.arch
    check_destination(Path(dst), force=opts.force, protect=[src_path])
    _check_servable(opts.format, spec, str(ckpt.config_path))
    entry, _ = parse_spec(observer_of(opts))
    new_config = with_kv_cache_scheme(ckpt.config, strategy=opts.strategy, observer_name=entry.name,
                                      config_file=str(ckpt.config_path))
    return QuantizePlan(src=src, dst=dst, opts=opts, ckpt=ckpt, arch=arch, spec=spec, new_config=new_config)


def _check_servable(format_name: str, spec, config_file: str) -> None:
    """Refuse scales for a format vLLM cannot serve at this head size (kv_dtypes.json's shape checks)."""
    from kvtool.model import kv_dtypes
    from kvtool.quantize.formats import get_format

    fmt = get_format(format_name)
    rows = [kv_dtypes.table()[d] for d in fmt.serves]  # formats.py names kv_dtypes rows (a test checks)
    problems = [row.slot_problem(spec.head_dim or 0, None) for row in rows]
    if all(problems):
        raise InputError(f"--format {fmt.name}: {problems[0]}", file=config_file, field="head_dim")


def quantize_kv(src: str, dst: str, opts: QuantizeOptions, *, log=None) -> QuantizeResult:
    """plan, then apply: bad input is refused before torch is imported."""
    return apply(plan(src, dst, opts), log=log)


def apply(p: QuantizePlan, *, log=None) -> QuantizeResult:
    """Calibrate, report quality and write DST (staged) for a plan."""
    src, dst, opts, arch, spec, new_config = p.src, p.dst, p.opts, p.arch, p.spec, p.new_config
    from kvtool import __version__
    from kvtool.model import kv_scale_names
    from kvtool.datasets import calibration_texts
    from kvtool.io.outputfile import identities
    from kvtool.io.staging import staged_output
    from kvtool.runtime.layerwise import describe, open_layerwise, release_free_memory
    from kvtool.quantize.calibrate import calibrate_layers
    from kvtool.quantize.formats import get_format
    from kvtool.quantize.observer_specs import canonical
    from kvtool.quantize.write import scale_tensors, write_output
    from kvtool.runtime.torch_utils import load_tokenizer, pick_device, pick_dtype
    from kvtool.tokenstream import first_tokens

    if opts.calib_text:
        calib, calib_label = read_texts(opts.calib_text, "calib_text"), [str(f) for f in opts.calib_text]
    else:
        calib, label = calibration_texts(opts.calib_dataset)
        calib_label = [label]
    eval_texts = read_texts(opts.eval_text, "eval_text") if opts.eval_text else None
    fmt = get_format(opts.format)
    device = pick_device(opts.device)
    dtype = pick_dtype(opts.dtype, device)
    with kv_progress.task("calibrate", total=spec.num_layers, unit="layers") as bar:
        bar.set_note("loading the tokenizer")
        tok = load_tokenizer(src)
        bar.set_note("tokenizing the calibration text")
        used = first_tokens(tok, calib, opts.calib_tokens)  # only the text these tokens need is read
        n = len(used.ids)
        batches = calibration_windows(tok, used.ids.tolist(), opts.seq_len)
        if n < MIN_CALIB_TOKENS:
            raise InputError(f"the calibration text has {n} tokens; at least {MIN_CALIB_TOKENS} are needed",
                             file=calib_label[0], option="calib_text" if opts.calib_text else "calib_dataset")
        if opts.no_eval:
            del tok
            release_free_memory()  # the tokenizer (~100 MB for a 49k vocabulary) is gone before the weights come
        layers_path = arch.weights["layer"].split(".{layer}")[0]
        model = None
        bar.set_note(f"building the model, {n} calibration tokens")
        # one decoder layer's weights at a time, read onto the device (kvtool.runtime.layerwise)
        with open_layerwise(src, device=device, dtype=dtype, attn="sdpa", layers_path=layers_path,
                            layerwise=opts.layerwise) as lm:
            result = calibrate_layers(lm, batches, observer=canonical(observer_of(opts)), strategy=opts.strategy,
                                      fmt=fmt, num_kv_heads=spec.num_kv_heads, bar=bar, q_scales=opts.q_scales)
            held = describe(lm)
            if lm.mode == "whole_model" and not opts.no_eval:
                model = lm.model  # already whole: the quality report reuses it
    del lm
    release_free_memory()
    if not result.k:
        raise InputError("no attention layer wrote K/V during calibration", file=src)
    if n < opts.calib_tokens:
        result.notes.append(f"the calibration text has only {n} tokens (asked for {opts.calib_tokens})")
    scales = scale_tensors(result, arch.attn_prefix, per_head=opts.strategy == "attn_head")
    meta = {kv_scale_names.SCALE_POINT_METADATA_KEY: "post_rope", "kvtool_version": __version__,
            "kvtool_observer": result.observer, "kvtool_strategy": opts.strategy, "kvtool_format": fmt.name}
    prov = _provenance(p, result, scales, used.sha256, calib_label, n, held, fmt)
    quality = []
    if not opts.no_eval:
        if model is None:  # the folder: the report reads one decoder layer at a time (kvtool.eval.layerwise)
            model = src
        quality = quality_report(model, tok, result, eval_texts, opts, device, fmt)
        prov["quality"] = [{"label": r.label, **{k: r.metrics.get(k) for k in
                            ("ppl", "baseline_ppl", "ppl_ratio", "ppl_ratio_se", "kld_mean", "kld_se", "top1_agreement",
                             "tokens")}}
                           for r in quality]
    del model
    from functools import partial

    from kvtool.rules.output_check import verify_output

    with staged_output(Path(dst), force=opts.force, protect=[Path(src)],
                       verify=partial(verify_output, source=Path(src))) as tmp:
        summary = write_output(Path(src), tmp, config=new_config, scales=scales, metadata=meta, provenance=prov,
                               link=opts.link, validated=identities(p.ckpt.headers))
    return QuantizeResult(dst=Path(dst), calibration=result, scale_tensors=summary.scale_tensors,
                          linked=summary.linked, copied=summary.copied, quality=quality, config=new_config,
                          format=fmt, ignoring=ignoring_lines())


def _provenance(p: QuantizePlan, result, scales: dict, text_sha256: str, calib_label: list[str], n: int, held,
                fmt) -> dict:
    """kvtool.json's record of a calibration: inputs, settings, every scale and the amax it came from."""
    from kvtool import __version__

    prov = {
        "kvtool_version": __version__, "command": "quantize-kv", "source": str(p.src),
        "model_type": p.spec.model_type, "format": fmt.name, "vllm_kv_cache_dtype": fmt.vllm_cache_dtype,
        "serves": list(fmt.serves),
        "strategy": p.opts.strategy, "observer": result.observer, "scale_point": "post_rope",
        "q_scales": bool(result.q),
        "calibration": {"tokens": n, "sequences": result.sequences, "seq_len": p.opts.seq_len,
                        "text_sha256": "sha256:" + text_sha256, "files": calib_label,
                        "device": result.device, "seconds": round(result.seconds, 2), "model": held},
        "scales": {name: [round(float(x), 8) for x in t.reshape(-1)] for name, t in scales.items()},
        "amax": {"k": {str(i): [round(float(x), 6) for x in a] for i, a in result.k_amax.items()},
                 "v": {str(i): [round(float(x), 6) for x in a] for i, a in result.v_amax.items()},
                 **({"q": {str(i): [round(float(x), 6) for x in a] for i, a in result.q_amax.items()}}
                    if result.q_amax else {})},
    }
    if result.search:  # output-aware observers: every candidate tried and its attention-output error
        prov["search"] = {f"{i}.{role}": {"candidates": [[round(float(x), 8) for x in c] for c in cands],
                                          "errors": [float(e) for e in errors]}
                          for (i, role), (cands, errors) in sorted(result.search.items())}
    if result.peak_device_bytes is not None:
        prov["calibration"]["peak_device_bytes"] = result.peak_device_bytes
    return prov


def quality_report(model, tok, result, eval_texts, opts: QuantizeOptions, device, fmt=None) -> list:
    """Original vs the format's cache with scale 1.0 vs calibrated, on held-out text, via kvtool eval. A format eval
    does not emulate (kv_dtypes.emulated) gets no report: a note says so."""
    from kvtool.model import kv_dtypes
    from kvtool.quantize.formats import FORMATS

    from kvtool.eval.api import Candidate, evaluate_many
    from kvtool.eval.fp8 import KVScales

    if not isinstance(model, (str, Path)):
        model.to(device)
    calibrated = KVScales.from_mapping({i: (result.k[i], result.v[i], result.q.get(i)) for i in result.k},
                                       source="calibrated")
    fmt = fmt or FORMATS["e4m3"]
    kv = fmt.eval_dtype
    if kv not in kv_dtypes.emulated():
        result.notes.append(f"no quality report: kvtool eval does not emulate --kv-cache-dtype {kv}")
        return []
    window = min(1024, opts.eval_tokens)
    t0 = time.perf_counter()
    rows = evaluate_many(
        [Candidate(model, "off", label="original"),
         Candidate(model, kv, "one", label=f"{kv} scale 1.0"),
         Candidate(model, kv, calibrated, label=f"{kv} calibrated ({result.observer}, {result.strategy})")],
        baseline=model, texts=eval_texts, max_length=window, max_tokens=opts.eval_tokens,
        device=str(device), dtype=opts.dtype, tokenizer=tok,
        text_name=("--eval-text" if eval_texts else "pydoc (built-in held-out evaluation text)"))
    for r in rows:
        r.seconds = time.perf_counter() - t0
    return rows
