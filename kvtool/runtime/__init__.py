"""torch-side plumbing shared by the commands that run a model (aware convert, quantize-kv, eval)."""
