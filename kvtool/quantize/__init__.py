"""FP8 KV-cache scale calibration (`kvtool quantize-kv`).

- `formats.py`: the FP8 formats a KV cache can use (e4m3: largest finite value 448).
- `observers.py`: the observer registry (absmax[:H], absmax-pow2[:H] (default), percentile:P, mse) turning
  observed K/V into scales.
- `calibrate.py`: reads and runs the decoder layers one at a time (kvtool.runtime.layerwise) on cached hidden
  states and feeds every layer's K (after RoPE and k_norm) and V, where they enter the cache, to one
  observer per layer and role.
- `config.py`: the compressed-tensors `quantization_config` (new or merged into an existing one).
- `write.py`: the output folder: original shards linked or copied unchanged, one new scale shard, the index.
"""
