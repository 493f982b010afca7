"""Calibrated K/V head merging (`kvtool convert --method aware`).

Modules: `calibration` (layer-by-layer replay over kvtool.runtime.layerwise with a per-layer merge hook),
`modules` (reading / installing a live attention module's projections, fused or not, per the
architecture table), `attention` (reference attention maths), `keys` (RoPE-aware complex key merge),
`values` (o-weighted value merge and o_proj least-squares refit), `closed_form` (both, into one layer's
projections), `grouping` (which heads share a group, and what a candidate group costs), `partition` (the
search for the cheapest split; no torch), `refine` (optional block reconstruction), `merge` (one layer, end to
end), `method` (the registered MergeMethod; merged layers wait on disk until written).
"""

from kvtool.convert.aware.method import AwareMerge  # noqa: F401  (registers "aware")
