"""`kvtool eval MODEL --kv-sweep`: every KV-cache option on one frontier, against one baseline pass.

The options (`options_for`, torch-free, what the plan and --dry-run list): MODEL at its own dtype and under every
KV-cache dtype eval emulates (kvtool.model.kv_dtypes.emulated) that vLLM serves for its attention kind
(kvtool.model.kvcache.dtype_refusal is None), and each --candidate (a converted checkpoint) the same way. Two
dtypes whose emulation is the same (their kv_dtypes rows differ only in name and citation, fp8 and fp8_e4m3; a
kv_emulations.json row that is an `alias_of` another) are one option, listed with both names. KV bytes per token
come from kvtool.model.kvcache (`cache_format`, the figure kv-budget prints), never from a second formula.

The scoring (`run`): each model is loaded once and the baseline (--baseline, default MODEL at its own dtype) runs
once per window. A model's options then run together: the window batch is repeated along the batch dimension,
one copy per option, and one hook (`RowCodecs`) applies each option's K/V round trip to its own rows
(kvtool.eval.api._emulation builds each, the single-dtype eval's hook; the codecs work per batch slice), so one
forward scores several options. Rows per forward are bounded by the logits they hold (`LOGITS_BYTES`).

What it prints (`render_text`, `as_dict`, kvtool.eval.sweep_plot): per option its KV bytes per token, PPL ratio
and KLD with standard errors, top-1 agreement and the gates; the Pareto frontier of bytes against PPL ratio and
against KLD; the smallest option that passes the gates (`recommend`); and for each conversion whether it beats
MODEL's dtypes at no more bytes (`conversion_verdicts`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtool import console
from kvtool.errors import InputError, UsageError
from kvtool.eval.gate import GateResult, check
from kvtool.model import kv_dtypes, kvcache

LOGITS_BYTES = 1 << 30  # logits of one multi-option forward (rows x scored positions x vocabulary x 4 bytes)
OWN_DTYPE = "off"  # eval's kv_cache_dtype for "the model at its own dtype": no emulation


@dataclass
class SweepOption:
    model: str  # the checkpoint folder
    kv_cache_dtype: str  # OWN_DTYPE, or a kv_dtypes name
    bytes_per_token: float  # KV bytes one token costs over all layers (kvtool.model.kvcache)
    cache: str  # what vLLM stores: the model's dtype name, or the kv_dtypes name
    candidate: bool  # a --candidate (a conversion), not MODEL
    same_as: list[str] = field(default_factory=list)  # dtypes with the identical emulation, scored as this one
    metrics: dict | None = None
    gates: list[GateResult] = field(default_factory=list)
    frontier_ppl: bool = False
    frontier_kld: bool = False

    @property
    def label(self) -> str:
        name = self.cache if self.kv_cache_dtype == OWN_DTYPE else self.kv_cache_dtype
        return f"{Path(self.model).name} + {name}" if self.candidate else name

    @property
    def passed(self) -> bool:
        return self.metrics is not None and all(g.passed for g in self.gates)

    def as_dict(self) -> dict:
        return {"model": self.model, "label": self.label, "kv_cache_dtype": self.kv_cache_dtype,
                "cache": self.cache, "candidate": self.candidate, "same_as": self.same_as,
                "kv_bytes_per_token": self.bytes_per_token, "metrics": self.metrics,
                "gates": [g.as_dict() for g in self.gates], "passed": self.passed,
                "frontier": {"ppl_ratio": self.frontier_ppl, "kld": self.frontier_kld}}


@dataclass
class Skipped:
    model: str
    kv_cache_dtype: str
    why: str


# --- the options (torch-free) ---------------------------------------------------------------------------------


def _spec(path: str):
    from kvtool.model.preflight import preflight
    from kvtool.model.spec import build_spec

    return build_spec(preflight(path, model_code=True, read_side_files=False).config)


def kv_bytes(spec, name: str) -> tuple[float, str]:
    """(KV bytes per token over all layers, the cache's dtype name) for kv_cache_dtype `name` (OWN_DTYPE: the
    dtype vLLM serves the model in), from kvtool.model.kvcache: the figure kv-budget prints."""
    if name == OWN_DTYPE:
        name = kvcache.native_kv_dtype(spec)[0]
    fmt, _ = kvcache.cache_format(spec, name)
    return float(sum(fmt.bytes_per_token(layer) for layer in kvcache.layers(spec))), fmt.name


def emulation_key(name: str) -> str:
    """Two dtypes with the same key are emulated identically: their kv_dtypes rows without name and citation,
    and their kv_emulations.json rows (through `alias_of`): codec, params, scales, the reads."""
    from kvtool.model import kv_emulations

    row = {k: v for k, v in dataclasses.asdict(kv_dtypes.table()[name]).items()
           if k not in ("name", "citation", "platform")}
    key: dict = {"row": row}
    emu, seen = kv_emulations.get(name), {name}
    while emu is not None and emu.alias_of and emu.alias_of not in seen:
        seen.add(emu.alias_of)
        emu = kv_emulations.get(emu.alias_of)
    if emu is not None:
        key["emulation"] = {"codec": emu.codec, "params": dict(emu.params), "scales": emu.scales,
                            "first_prefill": emu.first_prefill, "fp8_attention": emu.fp8_attention}
    return json.dumps(key, sort_keys=True, default=str)


def sweep_dtypes(spec) -> tuple[list[list[str]], list[tuple[str, str]]]:
    """([[dtype, its identical aliases...], ...] to score, [(dtype, why not), ...]) for one model: the dtypes
    eval emulates that vLLM serves for its attention kind, deduplicated; the refused and the not emulated."""
    groups: dict[str, list[str]] = {}
    skipped: list[tuple[str, str]] = []
    emulated = set(kv_dtypes.emulated())
    kind = kv_dtypes.attention_kind(spec)
    for name, row in kv_dtypes.table().items():
        if row.layout == "model" or kind not in row.attention:
            continue
        if name not in emulated:
            if not row.must_match_model:  # float16 / bfloat16: the model's own dtype, or refused by vLLM
                skipped.append((name, "not emulated by eval" + (f" ({row.platform})" if row.platform else "")))
            continue
        problem = kvcache.dtype_refusal(spec, row)
        if problem:
            skipped.append((name, problem))
            continue
        groups.setdefault(emulation_key(name), []).append(name)
    return list(groups.values()), skipped


def options_for(model: str, candidates: list[str], *, baseline: str | None = None
                ) -> tuple[list[SweepOption], list[Skipped]]:
    """Every option of the sweep, MODEL's first, and the dtypes left out (why). baseline: MODEL when None."""
    out: list[SweepOption] = []
    skipped: list[Skipped] = []
    seen: set[str] = set()
    for i, path in enumerate([model, *candidates]):
        key = str(Path(path).resolve())
        if key in seen:
            raise UsageError(f"{path} is given twice (as MODEL or another --candidate)", option="candidate")
        seen.add(key)
        spec = _spec(path)
        own, cache = kv_bytes(spec, OWN_DTYPE)
        out.append(SweepOption(path, OWN_DTYPE, own, cache, candidate=i > 0))
        groups, left = sweep_dtypes(spec)
        for names in groups:
            b, cache = kv_bytes(spec, names[0])
            out.append(SweepOption(path, names[0], b, cache, candidate=i > 0, same_as=names[1:]))
        skipped += [Skipped(path, n, why) for n, why in left]
    return out, skipped


# --- scoring ---------------------------------------------------------------------------------------------------


class RowCodecs:
    """One kv_hook function for a batch that stacks several options: rows [i*rows, (i+1)*rows) go through
    fns[i] (None: K/V as they are). A codec works on any batch slice on its own (docs: kv41 contract), so each
    option's rows get exactly what a separate evaluation of that option gets."""

    def __init__(self, fns: list, rows: int):
        self.fns, self.rows = fns, rows
        for fn in fns:
            if fn is not None and (getattr(fn, "query", None) or getattr(fn, "attention", None)):
                raise UsageError("the sweep emulates the KV cache only (fp8_attention cache-only)",
                                 option="fp8_attention")
        latent = [fn for fn in fns if fn is not None and getattr(fn, "latent", None)]
        if latent:
            if len(latent) != sum(fn is not None for fn in fns):
                raise RuntimeError("an MLA model's options all emulate its latent cache")
            self.latent = self._latent

    def _split(self, call, layer, a, b):
        import torch

        outs_a, outs_b = [], []
        for i, fn in enumerate(self.fns):
            sa, sb = a[i * self.rows:(i + 1) * self.rows], b[i * self.rows:(i + 1) * self.rows]
            if fn is not None:
                sa, sb = call(fn)(layer, sa, sb)
            outs_a.append(sa)
            outs_b.append(sb)
        return torch.cat(outs_a), torch.cat(outs_b)

    def __call__(self, layer, key, value):
        return self._split(lambda fn: fn, layer, key, value)

    def _latent(self, layer, kv_c, k_pe):
        return self._split(lambda fn: fn.latent, layer, kv_c, k_pe)


@dataclass
class SweepReport:
    model: str
    baseline: str
    options: list[SweepOption]
    skipped: list[Skipped]
    limits: dict
    text: str
    tokens: int
    windows: int
    window: int
    stride: int
    device: str
    dtype: str
    seconds: float
    forwards: dict  # {"baseline": model calls, "options": model calls, "rows": option rows scored}
    recommended: SweepOption | None = None
    verdicts: list[dict] = field(default_factory=list)

    @property
    def passed(self) -> bool:  # the sweep's answer is its recommendation; there is always one (the baseline)
        return True

    failed_gates: list = field(default_factory=list)
    gates: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"model": self.model, "baseline": self.baseline, "text": self.text, "tokens": self.tokens,
                "windows": self.windows, "window": self.window, "stride": self.stride, "device": self.device,
                "dtype": self.dtype, "seconds": round(self.seconds, 3), "forwards": self.forwards,
                "limits": self.limits, "reads": READS,
                "options": [o.as_dict() for o in self.options],
                "skipped": [dataclasses.asdict(s) for s in self.skipped],
                "recommended": self.recommended.label if self.recommended else None,
                "conversions": self.verdicts, "passed": self.passed}


READS = "K/V read back from the cache for every token, as decoding reads them"


def run(model: str, candidates: list[str], *, baseline: str | None = None, texts=None, text_name: str | None = None,
        max_length: int = 1024, stride: int | None = None, max_tokens: int | None = None, device: str = "auto",
        dtype: str = "auto", batch_size: int | None = None, device_map=None, max_memory=None,
        kv_scales: str = "checkpoint", gates: dict | None = None, progress: bool | None = None,
        tokenizer=None, options: list[SweepOption] | None = None) -> SweepReport:
    """Score every option (options_for) on one token stream against one baseline pass; see the module doc.
    options: score these instead (a subset of options_for's, or its rows repeated: bench/kv_sweep_bench.py)."""
    import torch

    from kvtool import progress as kv_progress
    from kvtool.eval import api
    from kvtool.eval.metrics import add_many
    from kvtool.eval.windows import batches, check_settings, windows
    from kvtool.runtime.torch_utils import pick_device, pick_dtype

    stride = check_settings(max_length=max_length, stride=stride, max_tokens=max_tokens, batch_size=batch_size,
                            max_memory=max_memory, device_map=device_map)
    opts, skipped = options_for(model, list(candidates), baseline=baseline)
    if options is not None:
        opts = [dataclasses.replace(o, same_as=list(o.same_as)) for o in options]
    base_spec = baseline if baseline is not None else model
    dev = pick_device(device) if not device_map else None
    torch_dtype = pick_dtype(dtype, dev if dev is not None else pick_device("auto"))
    with api._ModelPool(dev, torch_dtype, device_map, progress, max_memory) as pool:
        base = pool.get(base_spec, tokenizer)
        loaded = {o.model: pool.get(o.model, tokenizer) for o in opts}
        sources = api._sources(texts)
        ids = api._encode(base, sources, max_tokens)
        for m in {id(m): m for m in loaded.values()}.values():
            if m is not base:
                api._same_tokenizer(base, m, sources, ids, max_tokens)
        if len(ids) < 2:
            raise InputError(f"the evaluation text has {len(ids)} token(s); at least 2 are needed", option="text")
        ws = windows(len(ids), max_length, stride)
        device_name = pool.device_name(base)
        bs = batch_size or (max(1, min(16, 8192 // max_length)) if device_name.startswith("cuda") else 1)

        # the baseline's own row (MODEL at its own dtype when it is the baseline) needs no forward of its own
        is_base = [loaded[o.model] is base and o.kv_cache_dtype == OWN_DTYPE for o in opts]
        fns = []
        for o, own in zip(opts, is_base):
            emu = None if own else api._emulation(api.Candidate(o.model, o.kv_cache_dtype, kv_scales), loaded[o.model])
            fns.append(emu.hook if emu else None)
        accs = [api._new_acc() for _ in opts]
        vocab = int(base.model.get_output_embeddings().weight.shape[0])
        keep = ws[0].n_scored
        per_row = max(1, keep * vocab * 4)
        rows_max = max(1, LOGITS_BYTES // (per_row * bs))
        by_model: dict[int, list[int]] = {}
        for i, o in enumerate(opts):
            if not is_base[i]:
                by_model.setdefault(id(loaded[o.model]), []).append(i)
        stream = torch.frombuffer(ids, dtype=torch.long)
        counts = {"baseline": 0, "options": 0, "rows": 0}
        t0 = time.perf_counter()
        with kv_progress.task(f"kv sweep ({len(opts)} options)", total=len(ids) - 1, unit="tok", enabled=progress,
                              rate=True) as bar, torch.inference_mode():
            for group in batches(ws, bs):
                batch = torch.stack([stream[w.begin:w.end] for w in group])
                keep = group[0].n_scored
                targets = batch[:, -keep:]
                base_logits = base.logits(batch, keep)
                counts["baseline"] += 1
                own_rows = [i for i, own in enumerate(is_base) if own]
                add_many([accs[i] for i in own_rows], [base_logits] * len(own_rows), targets, base_logits)
                for members in by_model.values():
                    m = loaded[opts[members[0]].model]
                    for s, chunk in _chunks(members, rows_max):
                        hook = RowCodecs([fns[i] for i in chunk], len(group))
                        stacked = batch.repeat(len(chunk), 1)
                        if all(fns[i] is None for i in chunk):
                            logits = m.logits(stacked, keep)
                        else:
                            with api._hooked(m, hook):
                                logits = m.logits(stacked, keep)
                        counts["options"] += 1
                        counts["rows"] += len(chunk)
                        add_many([accs[i] for i in chunk],
                                 [logits[r * len(group):(r + 1) * len(group)] for r in range(len(chunk))],
                                 targets, base_logits)
                        del logits
                        bar.set_note(f"{s + len(chunk)}/{len(members)} options of {m.name}")
                del base_logits
                bar.update(keep * len(group))
        seconds = time.perf_counter() - t0
    limits = dict(gates or {})
    for o, acc in zip(opts, accs):
        o.metrics = acc.summary()
        o.gates = check(o.metrics, limits) if limits else []
    mark_frontier(opts)
    report = SweepReport(model=model, baseline=base_spec, options=opts, skipped=skipped, limits=limits,
                         text=text_name or ("pydoc (built-in evaluation text)" if texts is None else "text"),
                         tokens=int((opts[0].metrics or {})["tokens"]), windows=len(ws), window=max_length, stride=stride,
                         device=device_name, dtype=str(torch_dtype).replace("torch.", ""), seconds=seconds,
                         forwards=counts)
    report.recommended = recommend(opts)
    report.verdicts = conversion_verdicts(opts)
    return report


def _chunks(members: list[int], rows_max: int) -> list[tuple[int, list[int]]]:
    """members in as few forwards as rows_max allows, of equal size (12 at 10 a forward: 6 and 6, not 10 and 2)."""
    n = -(-len(members) // rows_max)
    size = -(-len(members) // n)
    return [(s, members[s:s + size]) for s in range(0, len(members), size)]


# --- the frontier ----------------------------------------------------------------------------------------------


def _dominated(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """b dominates a: no more bytes and no worse, better in one."""
    return b[0] <= a[0] and b[1] <= a[1] and (b[0] < a[0] or b[1] < a[1])


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """Which (bytes, loss) points no other point dominates (NaN losses are never on it)."""
    ok = [not math.isnan(p[1]) for p in points]
    return [ok[i] and not any(ok[j] and _dominated(p, q) for j, q in enumerate(points) if j != i)
            for i, p in enumerate(points)]


def mark_frontier(opts: list[SweepOption]) -> None:
    for flag, metric in (("frontier_ppl", "ppl_ratio"), ("frontier_kld", "kld_mean")):
        marks = pareto([(o.bytes_per_token, _num(o.metrics, metric)) for o in opts])
        for o, on in zip(opts, marks):
            setattr(o, flag, on)


def _num(metrics: dict | None, key: str) -> float:
    v = (metrics or {}).get(key)
    return float(v) if isinstance(v, (int, float)) else float("nan")


def recommend(opts: list[SweepOption]) -> SweepOption | None:
    """The smallest option (KV bytes per token) that passes the gates; among equal bytes the lowest KLD."""
    passing = [o for o in opts if o.passed]
    if not passing:
        return None
    return min(passing, key=lambda o: (o.bytes_per_token, _num(o.metrics, "kld_mean"), _num(o.metrics, "ppl_ratio")))


def conversion_verdicts(opts: list[SweepOption]) -> list[dict]:
    """For each conversion option: does it beat MODEL's own options (dtypes) at no more KV bytes per token?
    beats: its PPL ratio and KLD are both lower than those of every MODEL option that costs no more bytes
    (None where none costs that little: nothing to compare); rival: the best such MODEL option (lowest KLD)."""
    mine = [o for o in opts if not o.candidate]
    out = []
    for c in (o for o in opts if o.candidate):
        cheaper = [o for o in mine if o.bytes_per_token <= c.bytes_per_token]
        rival = min(cheaper, key=lambda o: _num(o.metrics, "kld_mean")) if cheaper else None
        beats: bool | None = None
        if rival is not None:
            beats = all(_num(c.metrics, k) < min(_num(o.metrics, k) for o in cheaper) for k in ("ppl_ratio", "kld_mean"))
        out.append({"option": c.label, "kv_bytes_per_token": c.bytes_per_token, "beats_dtypes": beats,
                    "rival": rival.label if rival else None,
                    "rival_kv_bytes_per_token": rival.bytes_per_token if rival else None})
    return out


# --- output ----------------------------------------------------------------------------------------------------


def _fmt_bytes(b: float) -> str:
    return f"{b:,.0f}" if float(b).is_integer() else f"{b:,.1f}"


def render_plan(model: str, candidates: list[str], baseline: str | None) -> console.Text:
    """--dry-run: the options and their KV bytes, what is left out and why (no model loaded)."""
    opts, skipped = options_for(model, candidates, baseline=baseline)
    lines = [f"kvtool eval --kv-sweep plan: {model} against {baseline or model} (one baseline pass), "
             f"{len(opts)} options"]
    for o in opts:
        alias = f" (= {', '.join(o.same_as)})" if o.same_as else ""
        lines.append(f"  {o.label:<32} {_fmt_bytes(o.bytes_per_token):>10} B/token{alias}")
    for s in skipped:
        lines.append(f"  left out  {Path(s.model).name} {s.kv_cache_dtype}: {s.why}")
    return console.lines(lines)


def render_text(r: SweepReport) -> console.Text:
    lines = [f"kv sweep  {r.model} against {r.baseline}: {len(r.options)} options, one baseline pass",
             f"text      {r.text}: {r.tokens} tokens scored, {r.windows} windows of {r.window} (stride {r.stride}); "
             f"{READS}",
             f"device    {r.device}, {r.dtype}; {r.forwards['baseline']} baseline forwards, {r.forwards['options']} "
             f"option forwards ({r.forwards['rows']} option rows, several options per forward)"]
    head = f"  {'option':<30} {'KV B/token':>10} {'PPL ratio':>18} {'KLD (nats/token)':>22} {'top-1':>7}  front  gate"
    lines += ["", head]
    for o in r.options:
        m = o.metrics or {}
        ratio = f"{_num(m, 'ppl_ratio'):.5f} ± {_num(m, 'ppl_ratio_se'):.5f}"
        kld = f"{_num(m, 'kld_mean'):.6f} ± {_num(m, 'kld_se'):.6f}"
        front = ("P" if o.frontier_ppl else "-") + ("K" if o.frontier_kld else "-")
        gate = ("ok" if o.passed else "FAILED") if o.gates else "-"
        star = "*" if o is r.recommended else " "
        lines.append(f"{star} {o.label:<30} {_fmt_bytes(o.bytes_per_token):>10} {ratio:>18} {kld:>22} "
                     f"{_num(m, 'top1_agreement'):>7.4f}  {front:<5}  {gate}")
        if o.same_as:
            lines.append(f"    (the same emulation as {', '.join(o.same_as)}: scored once)")
    lines.append("  front: P on the Pareto frontier of KV bytes vs PPL ratio, K vs KLD")
    if r.limits:
        from kvtool.eval.gate import GATES

        shown = ", ".join(f"{GATES[k].flag} {GATES[k].fmt(v).lstrip('+')}" for k, v in r.limits.items())
        lines.append(f"gates     {shown}")
    if r.recommended is not None:
        base = next((o for o in r.options if o.kv_cache_dtype == OWN_DTYPE and not o.candidate), r.options[0])
        cut = 1 - r.recommended.bytes_per_token / base.bytes_per_token if base.bytes_per_token else 0
        lines.append(f"recommend {r.recommended.label}: {_fmt_bytes(r.recommended.bytes_per_token)} B/token "
                     f"({cut:.0%} less than {base.label}), the smallest option that passes the gates")
    else:
        lines.append("recommend none: no option passes the gates")
    for v in r.verdicts:
        if v["rival"] is None:
            lines.append(f"convert   {v['option']} ({_fmt_bytes(v['kv_bytes_per_token'])} B/token): no dtype of "
                         f"{Path(r.model).name} is that small")
        else:
            word = "beats" if v["beats_dtypes"] else "does not beat"
            lines.append(f"convert   {v['option']} ({_fmt_bytes(v['kv_bytes_per_token'])} B/token) {word} the "
                         f"dtypes at no more bytes (best: {v['rival']}, {_fmt_bytes(v['rival_kv_bytes_per_token'])} "
                         "B/token) on PPL ratio and KLD")
    for s in r.skipped:
        lines.append(f"left out  {Path(s.model).name} {s.kv_cache_dtype}: {s.why}")
    return console.lines(lines)
