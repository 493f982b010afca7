"""The core: what a checkpoint is (config spec, architecture tables, layer types, RoPE parameters,
KV-cache sizes, numeric bounds, the checkpoint reader). It imports no feature."""
