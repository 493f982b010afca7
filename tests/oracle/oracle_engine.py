"""transformers as an oracle: what the engine does with one config.json, and what kvtool says of it.

`transformers_verdict` loads a config dict the way `AutoConfig.from_pretrained` does (the config
class for its model_type, `from_dict`, trust_remote_code never involved), then, where it is cheap
(a tiny model), builds the model with `from_config` and runs one forward of four tokens. The
frequencies are the ones the model's rotary embedding holds (`inv_freq`, `attention_scaling`), or,
without a model, the ones transformers' ROPE_INIT_FUNCTIONS compute for the loaded config.

`kvtool_verdict` is lint's config checks (in-process) and `kvtool rope`'s frequency math for the
same dict. Only tests import this module: kvtool itself never imports transformers to lint.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass, field

import numpy as np

# A model is "cheap" when every size stays below these: one forward then takes milliseconds.
CHEAP = {"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 1024, "intermediate_size": 1024}


@dataclass
class EngineVerdict:
    loads: bool  # the config class accepted it
    error: str = ""  # why not (first line), config or forward
    forward: bool | None = None  # one forward ran (None: not tried)
    inv_freq: np.ndarray | None = None  # full-attention layers' frequencies, as transformers uses them
    attention_scaling: float | None = None

    @property
    def runs(self) -> bool:
        return self.loads and self.forward is not False


@dataclass
class KvtoolVerdict:
    errors: list[str]  # error-severity codes lint reports
    warnings: list[str]
    inv_freq: np.ndarray | None = None
    attention_scaling: float | None = None
    messages: dict = field(default_factory=dict)


def _quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    for name in ("transformers", "transformers.modeling_rope_utils", "transformers.configuration_utils"):
        logging.getLogger(name).setLevel(logging.ERROR)
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def is_cheap(cfg: dict) -> bool:
    inner = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    if inner is not None:
        return False  # wrappers: the vision tower makes a model too big to build per case
    return all(isinstance(cfg.get(k), int) and 0 < cfg[k] <= lim for k, lim in CHEAP.items() if k in cfg) \
        and "hidden_size" in cfg and "num_hidden_layers" in cfg


def config_class(model_type: str):
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None


def transformers_verdict(cfg: dict, *, forward: bool | None = None) -> EngineVerdict:
    """Load `cfg` with its transformers config class; build and run a tiny model when cheap."""
    import torch
    from transformers import AutoModelForCausalLM

    cls = config_class(cfg.get("model_type"))
    if cls is None:
        raise LookupError(f"transformers has no config class for model_type {cfg.get('model_type')!r}")
    with _quiet():
        try:
            conf = cls.from_dict(dict(cfg))
        except Exception as exc:  # noqa: BLE001 - every refusal is a verdict
            return EngineVerdict(False, _first_line(exc))
        verdict = EngineVerdict(True)
        if forward is None:
            forward = is_cheap(cfg)
        if forward:
            try:
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(conf)
                rot = _rotary(model)
                if rot is not None:
                    verdict.inv_freq = rot.inv_freq.detach().double().numpy().copy()
                    verdict.attention_scaling = float(rot.attention_scaling)
                with torch.no_grad():
                    model(torch.tensor([[1, 2, 3, 4]]))
                verdict.forward = True
            except Exception as exc:  # noqa: BLE001
                verdict.forward, verdict.error = False, _first_line(exc)
        if verdict.inv_freq is None:
            verdict.inv_freq, verdict.attention_scaling = _init_function_freqs(conf)
    return verdict


def _rotary(model):
    inner = getattr(model, "model", model)
    rot = getattr(inner, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        return None
    return rot


def _init_function_freqs(conf):
    """transformers' own init function for the full-attention RoPE of a loaded config (None if none)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = getattr(conf, "rope_parameters", None)
    if not isinstance(rp, dict) or not rp:
        return None, None
    if "full_attention" in rp and isinstance(rp["full_attention"], dict):
        rp, layer_type = rp["full_attention"], "full_attention"
    else:
        layer_type = None
    fn = ROPE_INIT_FUNCTIONS.get(rp.get("rope_type"))
    if fn is None:
        return None, None
    try:
        with _quiet():
            inv, att = fn(conf, "cpu", None, layer_type) if layer_type else fn(conf, "cpu")
    except Exception:  # noqa: BLE001 - no numbers to compare
        return None, None
    return inv.double().numpy().copy(), float(att)


def kvtool_verdict(cfg: dict) -> KvtoolVerdict:
    """lint's config checks and `kvtool rope`'s numbers for one config dict."""
    from kvtool.model.rope import types as rt
    from kvtool.rope.apply import lint_findings, target_params
    from kvtool.model.rope.params import geometry_for, raw_dict, rope_dict
    from kvtool.model.spec import build_spec

    findings = lint_findings(cfg, "config.json")
    out = KvtoolVerdict(sorted({f.code for f in findings if f.severity == "error"}),
                        sorted({f.code for f in findings if f.severity == "warning"}),
                        messages={f.code: f.message for f in findings})
    try:
        spec = build_spec(cfg)
    except Exception:  # noqa: BLE001 - lint reported it
        return out
    if spec.position != "rope":
        return out
    key, rp = target_params(spec, "full_attention")
    if rp is None:
        return out
    g = geometry_for(spec, rp)
    params = {**raw_dict(spec, rp, key), **rope_dict(rp, spec)}
    params.pop("type", None)
    if g is None or rt.validate(params, g):
        return out
    try:
        # transformers builds frequencies at init without a sequence length: compare like with like
        inv, att = rt.compute(params, rt.Geometry(g.dim, float(params.get("rope_theta", g.theta)),
                                                  spec.max_position, g.head_dim), seq_len=None)
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return out
    out.inv_freq, out.attention_scaling = np.asarray(inv, dtype=np.float64), float(att)
    return out
