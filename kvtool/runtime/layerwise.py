"""A transformers causal LM whose decoder layers hold real weights one at a time.

`open_layerwise(src, device=...)` builds the model skeleton with no weights (accelerate's
`init_empty_weights(include_buffers=False)`: parameters on the meta device, buffers such as RoPE's
inv_freq computed for real), loads the small non-layer parameters (final norm, ...) from the
safetensors files, and `materialised(i)` reads exactly layer i's tensors (kvtool.io.reader: plain
positional reads, no memory map) onto the device for the duration of a `with` block, then returns
them to the meta device.

`capture(input_ids)` runs the model once with every decoder layer replaced by a recorder: it
yields the hidden states entering layer 0 and each layer's call arguments (position embeddings
of that layer's type, that layer's mask, ...), without running any layer. Of the input embedding
only the rows of the tokens in `input_ids` are read. Callers then replay layer by layer:

    lm = open_layerwise(src, device=torch.device("cpu"))
    hidden, calls = lm.capture(ids)
    for i in range(lm.num_layers):
        with lm.materialised(i) as layer:
            hidden = run_layer(layer, hidden, calls[i])

Memory: one decoder layer, the non-layer parameters except the embedding, the embedding rows of
the calibration tokens, and whatever activations the caller keeps. When the checkpoint's tensor
names are not the module's state-dict names (transformers converts them at load: stacked MoE
experts of mixtral / qwen2_moe / qwen3_moe, renamed prefixes), the whole model is loaded with
transformers instead (`mode == "whole_model"`, the reason in `note`); the same API then works on
the loaded layers.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from kvtool.errors import InputError

LayerCall = tuple[tuple, dict]  # (positional args after the hidden states, keyword args)
MODES = ("layerwise", "whole_model")


def run_layer(layer: nn.Module, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
    """One decoder layer on `hidden` with the arguments `capture` recorded for it."""
    args, kwargs = call
    out = layer(hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def find_layers(model: nn.Module, layers_path: str | None = None) -> tuple[str, nn.ModuleList]:
    """(path, ModuleList) of the decoder layers: `layers_path` when given, else the ModuleList
    holding every attention module (those carrying `layer_idx`)."""
    if layers_path:
        try:
            mod = model.get_submodule(layers_path)
        except AttributeError:
            raise InputError(f"{type(model).__name__} has no module {layers_path!r}", field="layers") from None
        if not isinstance(mod, nn.ModuleList):
            raise InputError(f"{layers_path} is a {type(mod).__name__}, not the list of decoder layers", field="layers")
        return layers_path, mod
    from kvtool.runtime.kv_hooks import attention_modules

    attn = {id(m) for m in attention_modules(model)}
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and attn and attn <= {id(m) for layer in mod for m in layer.modules()}:
            if best is None or len(name) > len(best[0]):  # the innermost list that holds them all
                best = (name, mod)
    if best is None:
        raise InputError(f"{type(model).__name__}: cannot find the list of decoder layers", field="layers")
    return best


def _skeleton(src: Path, dtype: torch.dtype, attn: str | None):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvtool.model.preflight import check_loadable
    from kvtool.runtime.torch_utils import kv_cache_only_quantization, load_error

    check_loadable(src)
    try:
        config = AutoConfig.from_pretrained(str(src), trust_remote_code=False)
        if kv_cache_only_quantization(getattr(config, "quantization_config", None)):
            del config.quantization_config  # plain weights; only the KV cache is described
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn,
                                                     trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise load_error(exc, src, "cannot build the model with transformers") from None
    return model.eval()


class LayerwiseModel:
    """See the module docstring. `mode` is "layerwise" or "whole_model" (then `note` says why)."""

    def __init__(self, model, layers_path: str, layers: nn.ModuleList, device: torch.device, dtype: torch.dtype,
                 reader=None, mode: str = "layerwise", note: str | None = None, own_reader: bool = False):
        self.model, self.layers_path, self.layers = model, layers_path, layers
        self.device, self.dtype, self.mode, self.note = device, dtype, mode, note
        self._reader, self._own_reader = reader, own_reader
        self.bytes_read = 0  # tensor bytes read from the checkpoint (layerwise mode)
        self._layer_output: str | None = None  # what the decoder layers return: "tensor" | "tuple" (logits_from_hidden)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def base(self) -> nn.Module:
        return self.model.base_model

    # --- weights ---------------------------------------------------------------------------
    def _read(self, name: str) -> torch.Tensor:
        t = self._reader.get(name)
        self.bytes_read += t.numel() * t.element_size()
        dtype = self.dtype if t.is_floating_point() else t.dtype
        return t.to(device=self.device, dtype=dtype)

    def _load_into(self, module: nn.Module, prefix: str, keep: Callable[[str], bool] = lambda name: True) -> None:
        """Give every meta parameter of `module` (named `prefix` in the model) its checkpoint tensor on
        the device and move its real buffers there; only names for which keep(name) holds."""
        for mname, sub in module.named_modules():
            mfull = ".".join(x for x in (prefix, mname) if x)
            for pname, p in list(sub.named_parameters(recurse=False)):
                full = f"{mfull}.{pname}" if mfull else pname
                if p.device.type == "meta" and keep(full):
                    sub._parameters[pname] = nn.Parameter(self._read(full), requires_grad=False)
            for bname, b in list(sub.named_buffers(recurse=False)):
                if b is not None and b.device.type != "meta" and b.device != self.device and keep(f"{mfull}.{bname}"):
                    sub._buffers[bname] = b.to(self.device)

    @contextlib.contextmanager
    def materialised(self, i: int) -> Iterator[nn.Module]:
        """Layer i with real weights on the device inside the block (back to meta after it)."""
        layer = self.layers[i]
        if self.mode == "whole_model":
            yield layer
            return
        try:
            self._load_into(layer, f"{self.layers_path}.{i}")
            yield layer
        finally:
            _to_meta(layer)
            release_free_memory()

    def real_layers(self) -> list[int]:
        """Indices of the decoder layers that hold any real (non-meta) parameter now."""
        return [i for i, layer in enumerate(self.layers)
                if any(p.device.type != "meta" for p in layer.parameters())]

    # --- the cheap forward -----------------------------------------------------------------
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self.model.get_input_embeddings()
        ids = input_ids.to(self.device)
        if self.mode == "whole_model" or emb.weight.device.type != "meta":
            return emb(ids)
        # only the rows of the tokens used: the embedding can be larger than a decoder layer (big vocabularies)
        name = self._param_name(emb.weight)
        used, local = torch.unique(ids, return_inverse=True)
        rows_stored = self._reader.info(name).shape[0]
        if used.numel() and (int(used[0]) < 0 or int(used[-1]) >= rows_stored):
            bad = int(used[-1]) if int(used[-1]) >= rows_stored else int(used[0])
            raise InputError(f"token id {bad} is outside the {rows_stored}-row input embedding (a tokenizer of "
                             "another model?)", file=str(self._reader.folder), field=name)
        rows = torch.stack([self._reader.get_slice(name, int(t), int(t) + 1)[0] for t in used.tolist()])
        self.bytes_read += rows.numel() * rows.element_size()
        meta_weight, padding_idx = emb.weight, emb.padding_idx
        emb.weight = nn.Parameter(rows.to(device=self.device, dtype=self.dtype), requires_grad=False)
        emb.padding_idx = None  # it indexes the full vocabulary (and only matters for gradients)
        try:
            return emb(local)
        finally:
            emb.weight, emb.padding_idx = meta_weight, padding_idx

    def _param_name(self, param: torch.Tensor) -> str:
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if p is param:
                return name
        raise InputError("the input embedding is not a parameter of the model", field="embed")

    def capture(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[LayerCall]]:
        """(hidden states entering layer 0, [(args, kwargs) per layer]) for input_ids [batch, seq]; no layer runs."""
        calls: list[LayerCall | None] = [None] * len(self.layers)
        # what enters layer 0: the embeddings after any scaling in the base model's forward (granite's multiplier)
        first: list[torch.Tensor] = []

        def recorder(i):
            def forward(*args, **kwargs):
                hidden = args[0] if args else kwargs.pop("hidden_states")
                calls[i] = (args[1:], kwargs)
                if i == 0:
                    first.append(hidden)
                return hidden
            return forward

        with self._layers_replaced(recorder), torch.no_grad():
            embeds = self._embed(input_ids)
            self.base(inputs_embeds=embeds, use_cache=False)
        missing = [i for i, c in enumerate(calls) if c is None]
        if missing:
            raise InputError(f"decoder layer {missing[0]} was never called by {type(self.base).__name__}.forward",
                             field="layers")
        return first[0], calls  # type: ignore[return-value]

    # --- the LM head -----------------------------------------------------------------------
    @contextlib.contextmanager
    def head(self) -> Iterator[None]:
        """The parameters outside the base model (the LM head) with real weights inside the block; a
        head tied to the input embedding reads the embedding's tensor. Whole-model mode: nothing to do."""
        if self.mode == "whole_model":
            yield
            return
        aliases: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        base = None if self.model.base_model is self.model else self.model.base_model_prefix + "."
        restore = []
        try:
            for mname, sub in self.model.named_modules():
                for pname, p in list(sub._parameters.items()):
                    full = f"{mname}.{pname}" if mname else pname
                    if p is None or p.device.type != "meta" or base is None or full.startswith(base):
                        continue
                    names = aliases.get(id(p), [full]) + self._tied_sources(full, p)
                    stored = next((n for n in names if n in self._reader), None)
                    if stored is None:
                        raise InputError(f"the checkpoint lacks {full!r} (and it is not tied to a stored tensor)",
                                         file=str(self._reader.folder), field=full)
                    sub._parameters[pname] = nn.Parameter(self._read(stored), requires_grad=False)
                    restore.append((sub, pname, p))
            yield
        finally:
            for sub, pname, p in restore:
                sub._parameters[pname] = p  # the meta parameter back: ties with the embedding stay intact
            release_free_memory()

    def _tied_sources(self, name: str, param) -> list[str]:
        """The tensors a tied parameter is read from when the skeleton did not tie it (transformers ties
        at load, and only when the config says tie_word_embeddings): its _tied_weights_keys source, or
        the input embedding for the output embedding."""
        text = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        if not getattr(text, "tie_word_embeddings", False):
            return []  # _tied_weights_keys lists what *may* be tied; an untied head is its own tensor
        tied = getattr(self.model, "_tied_weights_keys", None)
        out = [tied[name]] if isinstance(tied, dict) and isinstance(tied.get(name), str) else []
        out_emb = self.model.get_output_embeddings()
        if out_emb is not None and out_emb.weight is param:
            out.append(self._param_name(self.model.get_input_embeddings().weight))
        return out

    def logits_from_hidden(self, hidden: torch.Tensor, grad: bool = False) -> torch.Tensor:
        """The model's own output computation (final norm, LM head, any logit scaling or softcapping) on
        the hidden states leaving the last decoder layer, [batch, n, hidden] -> [batch, n, vocab]: the
        model's forward runs with every decoder layer replaced by one that returns `hidden`. Positions
        are independent there, so any slice of positions gives the same rows as the full sequence.
        Inside `head()` in layerwise mode. grad: differentiable in `hidden` (distillation)."""
        if self._layer_output is None:
            # a decoder layer returns its hidden states or a tuple of them (falcon's model takes outputs[0]):
            # the stand-in must return what the model expects; found once, the tensor tried first
            first: Exception | None = None
            for kind in ("tensor", "tuple"):
                try:
                    out = self._head_forward(hidden[:, :1].detach(), tuple_out=kind == "tuple")
                except (IndexError, RuntimeError, ValueError, TypeError) as exc:
                    first = first or exc
                    continue
                if out.dim() == 3 and out.shape[:2] == hidden[:, :1].shape[:2]:
                    self._layer_output = kind
                    break
            else:
                if first is not None:
                    raise first
                raise InputError(f"{type(self.model).__name__}: the LM head does not give [batch, tokens, vocab] "
                                 "logits for the last hidden states", field="architectures")
        return self._head_forward(hidden, tuple_out=self._layer_output == "tuple", grad=grad)

    def _head_forward(self, hidden: torch.Tensor, tuple_out: bool, grad: bool = False) -> torch.Tensor:
        out = (hidden,) if tuple_out else hidden
        with self._layers_replaced(lambda i: lambda *args, **kwargs: out), torch.set_grad_enabled(grad):
            return self.model(inputs_embeds=torch.zeros_like(hidden), use_cache=False).logits

    @contextlib.contextmanager
    def _layers_replaced(self, forward_of: Callable[[int], Callable]) -> Iterator[None]:
        """Inside the block, decoder layer i's forward is forward_of(i); afterwards each layer has its own back."""
        saved = [layer.__dict__.get("forward") for layer in self.layers]
        for i, layer in enumerate(self.layers):
            layer.forward = forward_of(i)
        try:
            yield
        finally:
            for layer, fwd in zip(self.layers, saved):
                if fwd is None:
                    del layer.forward  # back to the class's forward
                else:
                    layer.forward = fwd

    def close(self) -> None:
        if self._own_reader and self._reader is not None:
            self._reader.close()
        self._reader = None

    def __enter__(self) -> "LayerwiseModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    glibc raises its mmap threshold to the size of the largest block freed so far, so after the
    first layer is freed, later layers' tensors are carved from the heap; the holes they leave are
    not returned by themselves and resident memory would creep up layer after layer."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        try:
            import ctypes
            import ctypes.util

            name = ctypes.util.find_library("c")
            fn = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                _malloc_trim = fn
        except OSError:
            pass
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None  # glibc's malloc_trim once looked up (False where there is none), None before


def _to_meta(module: nn.Module) -> None:
    """Put every parameter of module back on the meta device, freeing its memory (buffers stay: they
    are small and were computed at construction, not read)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and p.device.type != "meta":
                sub._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)


def layerwise_problem(model, layers_path: str, reader) -> str | None:
    """Why the checkpoint cannot be read layer by layer into `model` (None when it can): every
    parameter must be stored under its module name with its shape, unquantized."""
    from kvtool.runtime.torch_utils import kv_cache_only_quantization

    qc = getattr(model.config, "quantization_config", None)
    if qc is not None and not kv_cache_only_quantization(qc):
        return "quantized weights (transformers dequantizes or wraps them at load)"
    prefix = model.base_model_prefix
    base_names = {f"{prefix}.{n}" if prefix else n for n, _ in model.base_model.named_parameters()}
    for name, p in model.named_parameters():
        if name not in base_names:
            continue  # the LM head: not needed to produce layer inputs
        if name not in reader:
            return f"the checkpoint does not store {name!r} under the module's name (transformers converts its " \
                   "tensor names at load)"
        shape = tuple(reader.info(name).shape)
        if shape != tuple(p.shape):
            return f"{name!r} is stored as {list(shape)}, the module expects {list(p.shape)}"
    try:
        layers = model.get_submodule(layers_path)
    except AttributeError:
        return f"no module {layers_path!r}"
    if not isinstance(layers, nn.ModuleList) or not layers:
        return f"{layers_path} is not a list of decoder layers"
    return None


def open_layerwise(src: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   attn: str | None = None, layers_path: str | None = None, reader=None,
                   layerwise: bool = True, before_whole: Callable[[str], None] | None = None) -> LayerwiseModel:
    """The model at `src` (a folder with config.json + safetensors) for layer-by-layer replay.

    attn: transformers' attention implementation (None: its default for the model, sdpa where supported).
    reader: an open kvtool.io.reader.CheckpointReader of src to reuse (else one is opened and closed
    with the LayerwiseModel). layerwise=False loads the whole model with transformers (the reference).
    before_whole(reason): called before the checkpoint is loaded whole because it cannot be read layer by
    layer (a memory check may refuse there).
    """
    src = Path(src)
    device = torch.device(device)
    if not layerwise:
        return _whole(src, device, dtype, attn, layers_path, "layer-by-layer loading was turned off")
    model = _skeleton(src, dtype, attn)
    path, layers = find_layers(model, layers_path)
    own = reader is None
    if own:
        from kvtool.io.reader import CheckpointReader

        reader = CheckpointReader(src)
    problem = layerwise_problem(model, path, reader)
    if problem:
        if own:
            reader.close()
        del model
        if before_whole is not None:
            before_whole(problem)
        return _whole(src, device, dtype, attn, layers_path, problem)
    lm = LayerwiseModel(model, path, layers, device, dtype, reader=reader, own_reader=own)
    try:
        emb = model.get_input_embeddings()
        skip = lm._param_name(emb.weight) if isinstance(emb, nn.Embedding) else None
        base = "" if model.base_model is model else model.base_model_prefix + "."
        # everything of the base model outside the decoder layers (norms, rotary buffers, ...), except the
        # embedding, of which capture reads only the rows it needs
        lm._load_into(model, "", lambda n: n.startswith(base) and not n.startswith(path + ".") and n != skip)
    except BaseException:
        lm.close()
        raise
    return lm


def _whole(src: Path, device, dtype, attn: str | None, layers_path: str | None, note: str) -> LayerwiseModel:
    """Load the whole model with transformers (which applies its tensor-name conversions); a checkpoint
    that lacks tensors the model needs is refused rather than silently filled with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvtool.model.preflight import check_loadable
    from kvtool.runtime.torch_utils import kv_cache_only_quantization, load_error, quiet_transformers

    check_loadable(src)
    quiet_transformers()  # kvtool's own progress line is showing
    try:
        config = AutoConfig.from_pretrained(str(src), trust_remote_code=False)
        if kv_cache_only_quantization(getattr(config, "quantization_config", None)):
            del config.quantization_config  # plain weights; only the KV cache is described
        model, info = AutoModelForCausalLM.from_pretrained(str(src), config=config, dtype=dtype,
                                                           attn_implementation=attn, output_loading_info=True,
                                                           trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise load_error(exc, src, "cannot load the model with transformers") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise InputError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[0]!r}",
                         file=str(src))
    model.to(device).eval()
    path, layers = find_layers(model, layers_path)
    return LayerwiseModel(model, path, layers, device, dtype, mode="whole_model", note=note)


def describe(lm: LayerwiseModel) -> dict[str, Any]:
    """What provenance records about how the model was held in memory."""
    out: dict[str, Any] = {"mode": lm.mode}
    if lm.note:
        out["note"] = lm.note
    return out
