"""`kvtool kv-budget`: KV-cache cost and GPU fit, from a config and safetensors headers (no torch).

gpus.py (the GPU memory table), variants.py (--what-if), estimate.py (parameters from a config),
budget.py (the figures), report.py (text / JSON), plot.py (matplotlib, optional).
"""
