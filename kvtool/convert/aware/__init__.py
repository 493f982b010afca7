"""Calibrated K/V head merging (`kvtool convert --method aware`).

Modules: `calibration` (layer-by-layer replay over kvtool.runtime.layerwise with a per-layer merge hook),
`modules` (reading / installing a live attention module's projections, fused or not, per the
architecture table), `attention` (reference attention maths), `keys` (RoPE-aware complex key merge),
`values` (o-weighted value merge and o_proj least-squares refit), `closed_form` (both, into one layer's
projections), `grouping` (which heads share a group, and what a candidate group costs), `partition` (the
search for the cheapest split; no torch), `refine` (optional block reconstruction), `merge` (one layer, end to
end), `calibration_data` (the token ids calibrated on, and their sources), `method` (the registered MergeMethod;
merged layers wait on disk until written).

Names: the KV heads after the merge are `target_kv_heads` everywhere (plan, job, weights, settings); inside the
maths a shape is written with H (query heads), KV (KV heads before), G (= target_kv_heads) and hd (head_dim).
"""

from kvtool.convert.aware.method import AwareMerge  # noqa: F401  (registers "aware")
