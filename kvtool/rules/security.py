"""Security (KV7xx): pickle files, remote code, index paths that leave the model folder.

Nothing here opens a pickle file: names are enough.
"""

from __future__ import annotations

from kvtool.model.architectures import is_known
from kvtool.rules.registry import checker, define

# Pickle files the HF Trainer writes next to a model; they are not weights.
TRAINER_ARTEFACTS = ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth")

define("KV701", "pickle-weights", "error",
       "The model's weights are stored only in pickle files (.bin / .pt / .pth / .ckpt / .pkl)",
       """
       What it does: flags a model folder whose weights exist only as pickle-based files
       (pytorch_model.bin and friends) with no safetensors. kvtool never opens them.
       Why it matters: loading a pickle runs arbitrary code from the file; transformers and vLLM
       fall back to these files when no safetensors exist.
       Example: a folder with config.json and pytorch_model.bin only.
       Fix: convert to safetensors in a sandbox (e.g. `torch.load(..., weights_only=True)` then
       `safetensors.torch.save_file`), publish those and delete the pickles.
       """, hint="convert the weights to safetensors in a sandbox and delete the pickle files", topic="security")

define("KV702", "pickle-files-present", "warning",
       "Pickle files sit next to the safetensors weights",
       """
       What it does: flags pickle-based files (.bin / .pt / .pth / .ckpt / .pkl) in a model folder
       that also has safetensors weights, including Trainer artefacts such as training_args.bin.
       Why it matters: current loaders prefer safetensors, but a tool that globs *.bin, an older
       loader, or a user running torch.load executes whatever the pickle contains.
       Example: model.safetensors plus pytorch_model.bin and training_args.bin.
       Fix: delete the pickle files from the deployment copy.
       """, hint="delete the pickle files from the deployed copy", topic="security")

define("KV703", "remote-code", "warning",
       "auto_map in config.json or tokenizer_config.json points at Python code in the repository (trust_remote_code)",
       """
       What it does: flags an auto_map in config.json (the model or config class) or in
       tokenizer_config.json (the tokenizer class): Python code shipped with the checkpoint.
       Why it matters: loading needs trust_remote_code=True, which executes that code with the
       server's privileges; the code can change with every revision of the repository. A
       tokenizer's auto_map runs code as surely as the model's: serving stacks load the tokenizer
       first. kvtool itself never runs it (trust_remote_code=False, stdin never read).
       Example: {"auto_map": {"AutoModelForCausalLM": "modeling_phi.PhiForCausalLM"}} in config.json,
       or {"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", null]}} in tokenizer_config.json.
       Fix: use the in-library model and tokenizer classes (remove auto_map if the model_type and
       tokenizer_class are supported), or pin and review the code revision.
       """, hint="prefer the in-library model class, or pin and review the remote code", topic="security")

define("KV704", "index-path-escape", "error",
       "The safetensors index names a file outside the model folder",
       """
       What it does: checks every file name in model.safetensors.index.json's weight_map: absolute
       paths, `..` components, backslashes and symlinks that resolve outside the folder are
       rejected, and kvtool does not open them.
       Why it matters: a crafted index can make a loader read arbitrary files on the server
       (e.g. ../../secrets) as tensors.
       Example: "model.embed_tokens.weight": "../../etc/passwd"
       Fix: regenerate the index with plain shard file names.
       """, hint="regenerate the index with plain shard file names", topic="security")


@checker("security")
def check_pickles(ctx) -> None:
    ckpt = ctx.checkpoint
    if not ckpt.pickle_files:
        return
    weights = [f for f in ckpt.pickle_files if f not in TRAINER_ARTEFACTS]
    has_safetensors = bool(ckpt.headers) or ckpt.index_doc is not None or bool(ckpt.lfs_pointers)
    if weights and not has_safetensors:
        ctx.report("KV701", f"weights only in pickle files: {', '.join(weights)} (not opened)",
                   file=ctx.file_of(weights[0]))
        return
    ctx.report("KV702", f"pickle files present: {', '.join(ckpt.pickle_files)} (not opened)",
               file=ctx.file_of(ckpt.pickle_files[0]))


def _auto_map_targets(am) -> str:
    """The Python classes an auto_map names, shortened for one line."""
    if isinstance(am, dict):
        vals = []
        for v in am.values():  # tokenizer entries are [slow, fast] pairs, either may be null
            vals.extend(x for x in (v if isinstance(v, list) else [v]) if x)
        targets = sorted({str(v) for v in vals})
    else:
        targets = [str(am)]
    return ", ".join(targets[:3]) + (" ..." if len(targets) > 3 else "")


@checker("security")
def check_remote_code(ctx) -> None:
    am = ctx.spec.full_config.get("auto_map")
    if am:
        mt = ctx.spec.model_type
        if is_known(mt):
            tail = f"with trust_remote_code it replaces the in-library {mt} class, so serve without that flag"
        else:
            tail = "loading needs trust_remote_code, which runs that code"
        ctx.report("KV703", f"auto_map names Python code in the repository ({_auto_map_targets(am)}); {tail}",
                   path="auto_map")
    tok_am = (ctx.checkpoint.tokenizer_config or {}).get("auto_map") if isinstance(
        ctx.checkpoint.tokenizer_config, dict) else None
    if tok_am:
        ctx.report("KV703", f"tokenizer_config.json auto_map names Python code in the repository "
                   f"({_auto_map_targets(tok_am)}); loading the tokenizer with trust_remote_code runs it",
                   path="auto_map", file=ctx.file_of("tokenizer_config.json"))


@checker("security")
def check_index_escape(ctx) -> None:
    for prob in ctx.checkpoint.problems:
        if prob.kind == "index-escape":
            ctx.report("KV704", prob.message, path=prob.tensor, file=ctx.file_of(prob.file) if prob.file else None)
