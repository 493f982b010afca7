"""Quality of the training-free GQA -> MLA solve (kvtool.convert.mla.solve) on SmolLM2-135M, against the aware MQA merge.

The converted model is built in memory as transformers' DeepseekV3ForCausalLM from a config (no remote code:
model_type deepseek_v3, q_lora_rank null, every layer dense, tied embeddings) and the source's MLP, norms and
embeddings plus the solved attention tensors, then scored with kvtool.eval against the source: PPL ratio (± SE),
KLD and top-1 agreement, on the same-source text (the pydoc evaluation part) and texts of other genres
(bench/other_texts.py: *Persuasion* and Luke; never used for calibration or tuning). The aware MQA row is
`kvtool convert --to mqa --method aware` (training-free, its defaults) scored in the same run.

    python bench/mla_quality.py [--calib-tokens 4096] [--seq-len 512] [--eval-tokens 4096] \
        [--case 128:64] [--case 192:32 ...] [--norm constant|none|identity] [--other persuasion,luke] [--no-mqa] \
        [--converted MLA_DIR ...] [--mqa MQA_DIR] [--json ROWS.json] [--plot CURVE.png]

A case is CACHED:ROPE (cached dims per token and layer, of which the shared rope key; the latent is the rest),
optionally :KEY=VALUE,... for kvtool.convert.mla.solve.SolveOptions fields (e.g. 128:32:rotating_pairs=nope,
128:64:seed=mqa), and nope=N for qk_nope_head_dim (default head_dim - ROPE).

--converted scores checkpoints `kvtool convert --to mla` wrote (refined or distilled ones too: the label says how,
from their kvtool.json); with --converted and no --case nothing is solved in process. --mqa and --merged likewise
score head-merged checkpoints already made.

--json writes {"title", "date", "command", "rows"}: per conversion its label, kind ("mla", or "merge" for the
original and aware MQA), cached dims, KV bytes per token (bf16) and per text the PPL ratio, KLD and top-1 with
their SEs; --plot draws it (bench/mla_curve.py: PPL ratio against KV bytes, one panel per text).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from kvtool.convert.mla.rope import SourceRope, mla_rope_parameters
from kvtool.convert.mla.shape import MlaShape
from kvtool.convert.mla.solve import SolveOptions, mla_output, solve_layer
from kvtool.convert.mla.stats import collect_stats

ATTN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_proj.bias", "k_proj.bias",
        "v_proj.bias", "o_proj.bias")


def deepseek_config(src: dict, shape: MlaShape, rope: SourceRope):
    """A DeepseekV3Config with the source's dims, the MLA attention of shape and every layer dense."""
    from transformers import DeepseekV3Config

    layers = src["num_hidden_layers"]
    rp = mla_rope_parameters(rope, shape.qk_rope_head_dim)
    return DeepseekV3Config(
        vocab_size=src["vocab_size"], hidden_size=src["hidden_size"], intermediate_size=src["intermediate_size"],
        moe_intermediate_size=src["intermediate_size"], num_hidden_layers=layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_heads, n_shared_experts=1,
        n_routed_experts=1, num_experts_per_tok=1, first_k_dense_replace=layers, kv_lora_rank=shape.kv_lora_rank,
        q_lora_rank=None, qk_rope_head_dim=shape.qk_rope_head_dim, qk_nope_head_dim=shape.qk_nope_head_dim,
        v_head_dim=shape.v_head_dim, hidden_act=src.get("hidden_act", "silu"),
        max_position_embeddings=src.get("max_position_embeddings", 8192), rms_norm_eps=src["rms_norm_eps"],
        tie_word_embeddings=src.get("tie_word_embeddings", False), attention_bias=False,
        rope_parameters=rp["rope_parameters"], rope_interleave=rp["rope_interleave"],
        bos_token_id=src.get("bos_token_id"), eos_token_id=src.get("eos_token_id"),
        pad_token_id=src.get("pad_token_id"))


def mla_model(src_state: dict, src_config: dict, attn: dict[int, dict], shape: MlaShape, rope: SourceRope,
              identity_norm: bool = False):
    """DeepseekV3ForCausalLM (float32) with the source's non-attention weights and the solved attention."""
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(deepseek_config(src_config, shape, rope))
    state = {k: v for k, v in src_state.items() if ".self_attn." not in k}
    for i, t in attn.items():
        state.update({f"model.layers.{i}.self_attn.{n}": w for n, w in t.items()})
    if src_config.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    rotary = model.model.rotary_emb  # buffers on meta: rebuild them on the CPU
    model.model.rotary_emb = type(rotary)(config=model.config)
    if identity_norm:  # measurement only: the latent as if DeepSeek had no kv_a_layernorm
        for layer in model.model.layers:
            layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    return model.eval().to(torch.float32)


def parse_case(text: str) -> tuple[int, int, dict]:
    parts = text.split(":")
    opts = {}
    for kv in (parts[2].split(",") if len(parts) > 2 and parts[2] else []):
        k, v = kv.split("=")
        if k == "nope":
            opts[k] = int(v)
            continue
        kind = {f.name: f.type for f in fields(SolveOptions)}[k]
        opts[k] = v if "str" in str(kind) else float(v) if "float" in str(kind) else int(v)
    return int(parts[0]), int(parts[1]), opts


def trained(path: Path) -> str:
    """How a kvtool conversion was trained, from its kvtool.json: "training-free" or "refine N, distill M"."""
    prov = json.loads((path / "kvtool.json").read_text())
    rec = prov.get("solve") or prov.get("method_details") or {}
    refine = rec.get("refine", {}).get("steps") if isinstance(rec.get("refine"), dict) else rec.get("refine_steps")
    distill = rec.get("distill", {}).get("steps")
    parts = [f"refine {refine}" if refine else "", f"distill {distill}" if distill else ""]
    return ", ".join(p for p in parts if p) or "training-free"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calib-dataset", default="mixed")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--case", action="append", default=None, help="CACHED:ROPE[:opt=value,...] (default 128:64)")
    ap.add_argument("--other", default="persuasion,luke")
    ap.add_argument("--no-mqa", action="store_true", help="skip the aware MQA row")
    ap.add_argument("--mqa", type=Path, default=None, help="an aware MQA conversion already made (default: convert)")
    ap.add_argument("--source-stream", dest="sequential", action="store_false",
                    help="every layer's statistics from the source model's stream (default: sequential, each layer "
                         "calibrated on the stream of the layers already converted)")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--source", type=Path, default=None, help="the model to convert (default: the SmolLM2 fixture)")
    ap.add_argument("--merged", type=Path, action="append", default=[],
                    help="a head-merged conversion of the source (kvtool convert --to gqa ...) to score as a merge "
                         "point, at its own KV bytes")
    ap.add_argument("--converted", type=Path, action="append", default=[],
                    help="a `kvtool convert --to mla` output to score at its own cached dims (repeatable)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--plot", type=Path, default=None, help="draw the rows (bench/mla_curve.py): .png/.svg/.pdf")
    a = ap.parse_args()
    if a.plot and a.plot.suffix.lower() not in (".png", ".svg", ".pdf"):
        ap.error(f"--plot {a.plot}: use a .png, .svg or .pdf file name")  # before the conversions, not after
    sys.path.insert(0, str(Path(__file__).parent))
    from other_texts import write_texts

    from kvtool.cli import main as kvtool
    from kvtool.convert.aware.calibration_data import CalibrationData
    from kvtool.eval.api import Candidate, evaluate_many
    from kvtool.runtime.torch_utils import load_tokenizer
    from kvtool.testing.fixtures import smollm2_dir
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    work = a.work or Path(tempfile.mkdtemp(prefix="kvtool-mla-"))
    src = a.source or smollm2_dir()
    cfg = json.loads((src / "config.json").read_text())
    rope = SourceRope.of_config(cfg)
    names = [n for n in a.other.split(",") if n]
    others = write_texts(work / "texts", names)
    texts = {"same source": None, **{n: [others[n].read_text(encoding="utf-8")] for n in names}}

    t0 = time.perf_counter()
    data = CalibrationData.build(src, None, a.calib_dataset, a.calib_tokens, a.seq_len)
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    src_state = {k: v.clone() for k, v in source.state_dict().items()}
    stats = None if a.sequential else collect_stats(source, data.ids)
    print(f"calibration: {data.ids.shape[0]} x {data.ids.shape[1]} tokens of {data.label}, "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    hd, H = rope.head_dim, cfg["num_attention_heads"]
    cands = []
    series: dict[str, str] = {}  # a converted MLA row's line in the plot (bench/mla_curve.py): how it was trained
    for case in a.case or ([] if a.converted else ["128:64"]):
        cached, dr, opts = parse_case(case)
        nope = opts.get("nope", hd - dr)
        options = replace(SolveOptions(), **{k: v for k, v in opts.items() if k != "nope"})
        shape = MlaShape(hidden_size=cfg["hidden_size"], num_heads=H, kv_lora_rank=cached - dr, qk_rope_head_dim=dr,
                         qk_nope_head_dim=nope, v_head_dim=hd)
        t1 = time.perf_counter()
        attn = {}

        def solve(i, st, shape=shape, options=options, attn=attn):
            w = {n: src_state[f"model.layers.{i}.self_attn.{n}"] for n in ATTN
                 if f"model.layers.{i}.self_attn.{n}" in src_state}
            attn[i] = solve_layer(w, st, shape, rope, options)
            return lambda x: mla_output(x, attn[i], shape, rope, norm=options.norm)

        if stats is None:
            collect_stats(source, data.ids, convert=solve)
        else:
            for i, st in stats.items():
                solve(i, st)
        model = mla_model(src_state, cfg, attn, shape, rope, identity_norm=options.norm == "identity")
        label = (f"MLA {cached} (rope {dr}, latent {cached - dr}) {','.join(f'{k}={v}' for k, v in opts.items())}"
                 + ("" if a.sequential else " source-stream stats"))
        print(f"{label}: solved in {time.perf_counter() - t1:.1f} s", file=sys.stderr)
        cands.append((label, cached, Candidate(model, label=label)))
    if not a.no_mqa:
        dst = a.mqa or work / "mqa-aware"
        if a.mqa is None:
            with contextlib.redirect_stdout(io.StringIO()):
                rc = kvtool(["convert", str(src), str(dst), "--to", "mqa", "--method", "aware", "--no-eval",
                             "--no-progress", "--force"])
            if rc:
                raise SystemExit(f"aware MQA conversion failed ({rc})")
        cands.append((f"aware MQA ({trained(dst)})", 128,
                      Candidate(AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval(), label="mqa")))
    for m in a.merged:
        mcfg = json.loads((m / "config.json").read_text())
        kv = mcfg.get("num_key_value_heads", mcfg["num_attention_heads"])
        cands.append((f"head merging to {kv} KV heads ({m.name}, {trained(m)})", 2 * kv * hd,
                      Candidate(AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval(), label=m.name)))
    for m in a.converted:
        mcfg = json.loads((m / "config.json").read_text())
        cached = mcfg["kv_lora_rank"] + mcfg["qk_rope_head_dim"]
        label = (f"MLA {cached} (rope {mcfg['qk_rope_head_dim']}, latent {mcfg['kv_lora_rank']}) kvtool convert, "
                 f"{trained(m)} ({m.name})")
        cands.append((label, cached, Candidate(AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval(),
                                               label=m.name)))
        series[label] = f"MLA, {trained(m)}"
    tok = load_tokenizer(src)
    reports = {kind: evaluate_many([c for _, _, c in cands], baseline=source, texts=t, max_tokens=a.eval_tokens,
                                   max_length=a.window, device="cpu", dtype="float32", tokenizer=tok,
                                   layerwise=False, progress=False)
               for kind, t in texts.items()}
    print(f"\ncalibration: {data.ids.numel()} tokens of {data.label} (sequences of {a.seq_len}), {'sequential' if a.sequential else 'source-stream'} "
          f"statistics; eval: first {a.eval_tokens} tokens, windows of {a.window}; original PPL: "
          + ", ".join(f"{k} {r[0].baseline_ppl:.2f}" for k, r in reports.items()) + "\n")
    print("| conversion | cached dims / layer | " + " | ".join(f"{k}: PPL ratio | KLD | top-1" for k in texts) + " |")
    print("| --- | --- | " + " | ".join("--- | --- | ---" for _ in texts) + " |")
    per_dim = 2 * cfg["num_hidden_layers"]  # bf16 bytes per cached dim and token, all layers
    rows = [{"conversion": "original", "kind": "merge", "cached_dims": 2 * cfg["num_key_value_heads"] * hd,
             "kv_bytes_per_token": 2 * cfg["num_key_value_heads"] * hd * per_dim,
             **{k: {"ppl_ratio": 1.0, "ppl_ratio_se": 0.0} for k in texts}}]
    for i, (label, cached, _) in enumerate(cands):
        cells, row = [], {"conversion": label, "kind": "mla" if label.startswith("MLA") else "merge",
                          "cached_dims": cached, "kv_bytes_per_token": cached * per_dim,
                          **({"series": series[label]} if label in series else {})}
        for k, r in reports.items():
            m = r[i].metrics
            row[k] = {x: m[x] for x in ("ppl_ratio", "ppl_ratio_se", "kld_mean", "kld_se", "top1_agreement", "top1_se")}
            cells.append(f"{m['ppl_ratio']:.3f} ± {m['ppl_ratio_se']:.3f} | {m['kld_mean']:.3f} ± {m['kld_se']:.3f} | "
                         f"{m['top1_agreement']:.3f} ± {m['top1_se']:.3f}")
        rows.append(row)
        print(f"| {label} | {cached} | {' | '.join(cells)} |")
    data = {"title": f"{src.name}: {a.calib_tokens} calibration tokens (sequences of {a.seq_len}), first "
                     f"{a.eval_tokens} tokens of each text, windows of {a.window}",
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(data, indent=1))
    if a.plot:
        from mla_curve import write_curve_plot

        write_curve_plot(data, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
