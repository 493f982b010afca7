"""The one gate every command passes before it reads tensors or hands a folder to transformers.

`preflight` refuses, with one line naming the file and field, before anything is loaded:
- weights any reader would refuse (kvtool.io.weight_files: corrupt safetensors by the library's own
  rules, an index that escapes the folder, names missing shards or tensors, or stores a tensor twice,
  several files with no index);
- a folder whose weights exist only as pickle files (kvtool never unpickles: transformers would call
  torch.load on them);
- with `model_code=True` or `require_weights` (the command loads the model with transformers, or computes
  with its weights): a config value outside its bound or a RoPE dict transformers cannot build
  (kvtool.model.numbers.require_valid_numbers), weights that contradict the config (kvtool.model.weight_shapes);
- with `model_code=True`: an auto_map in
  config.json or tokenizer_config.json, which names Python files shipped with the checkpoint. kvtool
  passes trust_remote_code=False as well, but refuses by name rather than let a loader decide; and
  every other JSON file transformers parses while loading (generation_config.json, tokenizer.json...)
  goes through kvtool's bounded reader first, so a FIFO, a file leading outside the folder, 100,000
  levels of nesting or a 5000-digit integer is one line here, never a hang or a RecursionError inside
  transformers.

The loaders (kvtool.runtime.torch_utils, kvtool.runtime.layerwise) call `check_loadable` again, so a caller that skips
the command-level gate is still refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtool.errors import InputError
from kvtool.io.weight_files import raise_first_error

# Files whose auto_map makes transformers import code from the checkpoint folder.
CODE_MAPS = ("config.json", "tokenizer_config.json")
# Other JSON files transformers' AutoModel / AutoTokenizer / GenerationConfig read from the folder.
LOADED_JSON = ("generation_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
               "chat_template.json")


def preflight(source: str | os.PathLike, *, model_code: bool = False, read_side_files: bool = True,
              require_weights: bool = True):
    """Open a checkpoint and refuse it if any reader would; returns the kvtool.model.checkpoint.Checkpoint.

    require_weights=False accepts a folder with no weights at all (a config-only recipe) or with Git LFS
    pointers in their place (kv-budget then estimates the weights), never one whose weights are pickles only."""
    from kvtool.model.checkpoint import open_checkpoint

    ckpt = open_checkpoint(source, read_side_files=read_side_files)
    if require_weights:  # a pointer is a file not pulled, not a corrupt one: say so first
        ckpt.require_pulled_weights()
    if ckpt.root is not None:
        raise_first_error(ckpt, ckpt.root, require_weights=require_weights)
        if model_code:
            from kvtool.io.model_files import check_model_files

            check_model_files(ckpt.root, loaded=True)  # FIFOs, devices, unreadable files transformers would open
            refuse_auto_map(ckpt.root)
            refuse_unreadable_json(ckpt.root)
            refuse_named_files(ckpt.root)
    elif model_code:
        _refuse_entries(ckpt.config.get("auto_map"), str(ckpt.config_path) if not ckpt.hub else ckpt.source)
    if model_code or require_weights:  # transformers builds this config, or the command computes with it
        from kvtool.model.numbers import require_valid_numbers
        from kvtool.model.spec import build_spec
        from kvtool.model.weight_shapes import require_weights_match_config

        spec = build_spec(ckpt.config)
        require_valid_numbers(spec, str(ckpt.config_path) if not ckpt.hub else ckpt.source)
        if require_weights and ckpt.has_weights:  # the same check as lint's KV601 / KV603
            require_weights_match_config(ckpt, spec)
    return ckpt


def check_loadable(*paths: str | os.PathLike | None) -> None:
    """Each folder or hub id among `paths` must pass preflight with model code refused (None passes): a bad
    folder, a missing path, or a hub id without a network (kvtool.io.hub) is one line here.

    Loaders call it, and commands that import torch call it first so a refusal costs no torch import."""
    for path in paths:
        if path is not None and (Path(path).is_dir() or not Path(path).exists()):
            preflight(path, model_code=True, read_side_files=False)


def refuse_auto_map(root: Path) -> None:
    from kvtool.io.jsonfile import load_json_object

    for name in CODE_MAPS:
        path = root / name
        if path.is_file():
            _refuse_entries(load_json_object(path).data.get("auto_map"), str(path))


def refuse_unreadable_json(root: Path) -> None:
    """Each JSON file transformers would parse must be inside the folder and pass kvtool's reader."""
    from kvtool.io.staging import check_inside
    from kvtool.io.jsonfile import load_json_object

    for name in (*CODE_MAPS, *LOADED_JSON):
        path = root / name
        if not path.exists() and not path.is_symlink():
            continue
        if path.is_file():
            check_inside(root, path)
        load_json_object(path, what=name.removesuffix(".json").replace("_", " "))


# Lists in a JSON file naming other files for transformers to open (transformers 5.24 configuration_utils.py
# get_configuration_file, tokenization_utils_base.py get_fast_tokenizer_file pick one by version and open it
# joined to the folder): each entry must be a plain file name, so the file is one of the folder's own.
NAMED_FILES = (("config.json", "configuration_files"), ("tokenizer_config.json", "fast_tokenizer_files"))


def refuse_named_files(root: Path) -> None:
    from kvtool.io.jsonfile import load_json_object
    from kvtool.io.weight_files import is_inside

    for name, key in NAMED_FILES:
        path = root / name
        if not path.is_file():
            continue
        listed = load_json_object(path).data.get(key)
        if listed is None:
            continue
        if not isinstance(listed, list):
            raise InputError(f"must be a list of file names, got {type(listed).__name__}", file=str(path), field=key)
        for i, entry in enumerate(listed):
            if not isinstance(entry, str) or "/" in entry or not is_inside(root, entry):
                raise InputError(f"names {entry!r:.80}, not a file of the model folder; transformers would open it",
                                 file=str(path), field=f"{key}[{i}]")


def _refuse_entries(auto_map, file: str) -> None:
    if auto_map is None or auto_map == {}:
        return
    if not isinstance(auto_map, dict):
        raise InputError(f"names checkpoint code ({auto_map!r:.60}); kvtool never runs it", file=file, field="auto_map")
    key, target = next(iter(auto_map.items()))
    shown = ", ".join(str(t) for t in target if t) if isinstance(target, list) else str(target)
    raise InputError(f"names checkpoint code ({shown[:80]}); kvtool never runs it", file=file, field=f"auto_map.{key}")
