"""Streaming checkpoint IO: lazy reader (reader.py), sharded writer (writer.py), staged output (staging.py),
numpy views of safetensors dtypes (arrays.py)."""
