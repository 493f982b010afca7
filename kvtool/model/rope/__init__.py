"""RoPE knowledge: the type table, inverse frequencies, config layouts (no torch)."""
