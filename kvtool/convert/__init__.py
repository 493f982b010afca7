"""`kvtool convert`: the driver (driver.py), K/V pooling (pooling.py), merge-method registry (methods.py),
unfused per-layer weights (layout.py), fused QKV layouts (fused.py), config rewrite (config_edit.py)."""
