"""Calibrated K/V head merging (`kvtool convert --method aware`).

Modules: `calibration` (sequential forward with a per-layer merge hook), `attention` (reference
attention maths), `keys` (RoPE-aware complex key merge), `values` (o-weighted value merge and o_proj
least-squares refit), `grouping` (which heads share a group), `refine` (optional block
reconstruction), `merge` (one layer, end to end), `method` (the registered MergeMethod).
"""

from kvtool.convert.aware.method import AwareMerge  # noqa: F401  (registers "aware")
