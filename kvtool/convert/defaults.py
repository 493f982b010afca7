"""Convert's choices and the aware method's measured defaults, written once: the options declaration
(kvtool/options/convert.py: choices, help strings), the driver and the aware method all read them here.
No imports: the options declaration loads this at CLI start-up."""

from __future__ import annotations

# --mla-solve -> the kvtool.convert.mla.solve.SolveOptions fields it sets (measured in docs/convert-mla.md, Quality and
# "The curve": mqa-seed's values are the source's own, better than the MQA value head at every budget measured)
MLA_SOLVES = {"mqa-seed": {"seed": "mqa", "residual_angle": 1.0, "seed_values": "source"}, "joint": {"seed": "none"}}
MLA_SOLVE = "mqa-seed"
# --preset: (kv_lora_rank, qk_rope_head_dim) the MLA kernels fix (kvtool/convert/mla/backends.py cites them)
MLA_PRESETS = {"flashmla": (512, 64)}
# the aware method's declared options (kvtool/options/convert.py): any other method refuses them by name
AWARE_FIELDS = ("calib_text", "calib_dataset", "calib_tokens", "refine_steps", "distill_steps", "seq_len", "grouping",
                "serve_context")

# Which KV heads share a group (kvtool/convert/aware/grouping.py). `error` measures candidate groups: on the trained
# tiny MHA model 8 -> 4 it took the training-free PPL from +1.9% to +0.5% (KLD 0.013 -> 0.004), where `similarity`
# was within noise of `contiguous` (docs/convert-quality.md).
GROUPINGS = ("error", "contiguous", "similarity")
GROUPING = "error"

# Calibration sequence length when not given. Measured on SmolLM2 MQA (4096 tokens, 2047 held-out tokens in
# windows of 1024): the closed-form merge is best on short sequences (more sequence starts: 3.43x at 256, 3.75x
# at 512), refinement on long ones, whose attention spans what serving sees (64 steps: 2.17x at 256, 2.06x at
# 512, 1.93x at 1024).
SEQ_LEN_CLOSED_FORM, SEQ_LEN_REFINE = 256, 1024
# The shortest calibration sequence: one RoPE turn of the fastest pairs needs a few positions, and the
# per-layer statistics are over sequence positions (the same floor as quantize-kv's and eval's windows).
MIN_SEQ_LEN = 8
# Calibration tokens when not given. --refine-steps alone takes more (its steps visit the sequences in turn, the
# sources interleaved): measured on SmolLM2 MQA with 64 steps (dev texts, docs/convert-quality.md), 4096 / 8192 /
# 16384 tokens gave licences 3.11x / 2.98x / 2.73x and fortunes 2.09x / 1.90x / 1.84x, for 1.7x the calibration
# time at 16384. --distill-steps keeps 4096 (not measured with more).
CALIB_TOKENS, CALIB_TOKENS_REFINE = 4096, 16384
# At least one calibration sequence of the shortest length.
MIN_CALIB_TOKENS = MIN_SEQ_LEN


def seq_len(refine_steps: int, distill_steps: int) -> int:
    """--seq-len when not given."""
    return SEQ_LEN_REFINE if refine_steps or distill_steps else SEQ_LEN_CLOSED_FORM


def calib_tokens(refine_steps: int, distill_steps: int) -> int:
    """--calib-tokens when not given."""
    return CALIB_TOKENS_REFINE if refine_steps and not distill_steps else CALIB_TOKENS
