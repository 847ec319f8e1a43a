"""RoPE on both sides: the theta and frequency scaling transformers applies for the reference config, and
the scaling the Megatron / MindSpeed args say was trained; `check_rope_scaling` requires them to agree.

transformers 4.x keeps `rope_theta` and `rope_scaling`, 5.x one `rope_parameters` dict; a config may state
a value in several of them. Where statements differ, transformers versions differ on which one wins, so
the merged model's function would depend on who loads it: refused."""

from __future__ import annotations

import importlib.metadata
import math
from pathlib import Path

from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.model.model_shape import ModelShape, RopeScaling
from lora_merge.value_checks import is_number as _is_number
from lora_merge.shown import shown

# Keys transformers reads from a rope_scaling / rope_parameters dict (4.x and 5.x).
_ROPE_KEYS = frozenset({
    "rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
    "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
    "truncate", "short_factor", "long_factor",
})
_ROPE_SECTIONS = ("rope_scaling", "rope_parameters")
_TRANSFORMERS_MAJOR = int(importlib.metadata.version("transformers").split(".")[0])
SUPPORTED_SCALINGS = ("llama3", "yarn", "linear")


def hf_rope(raw: dict, config, path: Path, max_positions: int, notes: list[str],
            stated_only: bool = False) -> tuple[float | None, RopeScaling | None, float]:
    """rope_theta (None where neither the config nor its class states one), the scaling transformers
    applies and the fraction of each head's dims it rotates (partial_rotary_factor, 1.0 where none is
    given), from its config object; the statements in config.json must agree with each other and with it.
    `stated_only`: check only what config.json states (there is no config object)."""
    stated_theta, stated_scaling, stated_partial = _rope(raw, path, max_positions, notes)
    if stated_only:
        return stated_theta, stated_scaling, stated_partial
    applied = transformers_rope(config, path)
    applied_scaling = _scaling(applied, _section_name(raw), path, max_positions, [], stated=False) if applied else None
    if applied_scaling != stated_scaling:
        raise MergeError(f"{path}: transformers applies RoPE scaling {applied_scaling or 'none'}, config.json states "
                         f"{stated_scaling or 'none'}; expected one RoPE description")
    theta = applied.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None and (not _is_number(theta) or theta <= 0):
        raise MergeError(f"{path}: rope_theta={shown(theta)}; expected a positive number")
    if stated_theta is not None and theta is not None and not math.isclose(float(theta), stated_theta, rel_tol=1e-9):
        raise MergeError(f"{path}: transformers reads rope_theta={shown(theta)}, config.json states {shown(stated_theta)}")
    partial = applied.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else partial
    if not _is_number(partial) or not 0 < partial <= 1 or (stated_partial is not None and partial != stated_partial):
        raise MergeError(f"{path}: transformers reads partial_rotary_factor={shown(partial)}"
                         + (f", config.json states {shown(stated_partial)}" if stated_partial is not None else "")
                         + "; expected one fraction in (0, 1]")
    return (None if theta is None else float(theta)), applied_scaling, float(partial)


def rotated_fraction(config) -> float:
    """The fraction of each head's dims transformers rotates (1.0 with one RoPE per layer type)."""
    if per_layer_type_rope(config):
        return 1.0
    params = (getattr(config, "rope_parameters", None) if _TRANSFORMERS_MAJOR >= 5 else None) or {}
    fraction = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return float(fraction) if _is_number(fraction) and 0 < fraction <= 1 else 1.0


def per_layer_type_rope(config) -> bool:
    """transformers 5's rope_parameters keyed by layer type (Gemma 3: full and sliding attention), one RoPE each."""
    params = getattr(config, "rope_parameters", None) if _TRANSFORMERS_MAJOR >= 5 else None
    return isinstance(params, dict) and bool(params) and all(isinstance(v, dict) for v in params.values())


def transformers_rope(config, path: Path) -> dict:
    """The RoPE dict a transformers config object applies: 5.x's rope_parameters, or 4.x's rope_scaling with
    its rope_theta."""
    # transformers 4.x keeps a config.json "rope_parameters" as an attribute it never reads
    params = getattr(config, "rope_parameters", None) if _TRANSFORMERS_MAJOR >= 5 else None
    if per_layer_type_rope(config):
        raise UnsupportedInput(f"{path}: per-layer-type RoPE parameters are not supported: Megatron applies one RoPE to every layer")
    merged = {**(getattr(config, "rope_scaling", None) or {}), **(params or {})}
    if "rope_theta" not in merged and getattr(config, "rope_theta", None) is not None:
        merged["rope_theta"] = config.rope_theta
    return merged


def _section_name(raw: dict) -> str:
    return next((name for name in reversed(_ROPE_SECTIONS) if raw.get(name)), "rope_parameters")


def _rope(cfg: dict, path: Path, max_positions: int,
          notes: list[str]) -> tuple[float | None, RopeScaling | None, float | None]:
    """rope_theta (None where the config states none), the scaling transformers will use and the stated
    partial_rotary_factor (None where none is). Where the config states a value twice (top-level and
    inside a rope dict, or in both dicts), the statements must agree: transformers versions differ on which
    one wins, so a disagreement means the merged model's function depends on who loads it."""
    sections = {}
    for name in _ROPE_SECTIONS:
        value = cfg.get(name)
        if value is not None and not isinstance(value, dict):
            raise MergeError(f"{path}: {shown(name)} must be an object or null, found {shown(value)}")
        if value:
            sections[name] = value
    theta = _agreeing(path, "rope_theta", _inner({"": cfg, **sections}, "rope_theta", path))
    partial = _agreeing(path, "partial_rotary_factor", _inner({"": cfg, **sections}, "partial_rotary_factor", path))
    if partial is not None and partial > 1:
        raise MergeError(f"{path}: partial_rotary_factor={partial:g}; a fraction of the head's dims, expected at most 1")
    scalings = {name: _scaling(d, name, path, max_positions, notes) for name, d in sections.items()}
    if len(set(scalings.values())) > 1:
        raise MergeError(f"{path}: rope_scaling says {scalings['rope_scaling'] or 'no scaling'} but rope_parameters "
                         f"says {scalings['rope_parameters'] or 'no scaling'}; expected one RoPE description")
    return theta, next(iter(scalings.values()), None), partial


def _inner(sections: dict, key: str, path: Path) -> list[tuple[str, float]]:
    found = []
    for name, section in sections.items():
        if key in section:
            label = f"{name}.{key}" if name else key
            if not _is_number(section[key]) or section[key] <= 0:
                raise MergeError(f"{path}: {shown(label)} must be a positive number, found {shown(section[key])}")
            found.append((label, float(section[key])))
    return found


def _agreeing(path: Path, what: str, stated: list[tuple[str, float]]) -> float | None:
    values = {value for _, value in stated}
    if len(values) > 1:
        said = " but ".join(f"{label}={shown(value)}" for label, value in stated)
        raise MergeError(f"{path}: {said}; expected one {what} (transformers versions differ on which applies)")
    return stated[0][1] if stated else None


def _scaling(d: dict, name: str, path: Path, max_positions: int, notes: list[str],
             stated: bool = True) -> RopeScaling | None:
    """The scaling a rope dict describes; `stated`: as config.json states it (transformers 5 adds
    original_max_position_embeddings to the dict it applies, so only a stated one is checked against the
    factor)."""
    unread = sorted(str(key) for key in d if key not in _ROPE_KEYS)
    if unread:  # transformers' RoPE functions do not read them either
        notes.append(f"{path}: {name} keys that no RoPE of transformers reads, kept as published: {', '.join(unread)}")
    kind = _rope_type(d, name, path)
    if kind is None or kind == "default":
        return None
    if kind not in SUPPORTED_SCALINGS:
        raise MergeError(f"{path}: {name} has rope_type {shown(kind)}, which Megatron/MindSpeed cannot be shown to have "
                         "trained; expected llama3, yarn, linear or default")
    factor = _rope_number(d, "factor", name, path)
    if kind == "linear":
        return RopeScaling(kind, (("factor", factor),))
    original = _rope_number(d, "original_max_position_embeddings", name, path, default=max_positions)
    if kind == "llama3":
        params = {"factor": factor, "low_freq_factor": _rope_number(d, "low_freq_factor", name, path),
                  "high_freq_factor": _rope_number(d, "high_freq_factor", name, path),
                  "original_max_position_embeddings": original}
    else:
        params = _yarn_params(d, name, path, factor, original, max_positions, stated)
    return RopeScaling(kind, tuple(sorted(params.items())))


def _rope_type(d: dict, name: str, path: Path) -> str | None:
    stated = [d[k] for k in ("rope_type", "type") if k in d]
    if len(stated) == 2 and stated[0] != stated[1]:
        raise MergeError(f"{path}: {name} has rope_type {shown(d['rope_type'])} and type {shown(d['type'])}; expected one")
    if not stated:
        if set(d) - {"rope_theta", "partial_rotary_factor"}:
            raise MergeError(f"{path}: {name} has scaling parameters but no rope_type; expected e.g. "
                             "\"rope_type\": \"llama3\"")
        return None
    kind = stated[0]
    if not isinstance(kind, str):
        raise MergeError(f"{path}: {name}.rope_type must be a string, found {shown(kind)}")
    return kind


def _rope_number(d: dict, key: str, name: str, path: Path, default: float | None = None) -> float:
    if key not in d and default is not None:
        return float(default)
    value = d.get(key)
    if not _is_number(value) or value <= 0:
        raise MergeError(f"{path}: {name}.{key} must be a positive number, found "
                         f"{shown(value)}{'' if key in d else ' (missing)'}")
    return float(value)


def _yarn_params(d: dict, name: str, path: Path, factor: float, original: float, max_positions: int,
                 stated: bool) -> dict:
    if stated and "original_max_position_embeddings" in d and not math.isclose(max_positions / original, factor, rel_tol=1e-6):
        # transformers 4.4x-4.5x take the factor from this ratio, 5.x from "factor": the function would
        # depend on the version that loads the model.
        raise MergeError(f"{path}: {name} yarn factor={factor:g} but max_position_embeddings / "
                         f"original_max_position_embeddings = {max_positions}/{original:g}; transformers versions "
                         f"differ on which applies; expected max_position_embeddings = {factor * original:g}")
    if d.get("truncate", True) is not True:
        raise MergeError(f"{path}: {name}.truncate={shown(d['truncate'])}: MindSpeed's YaRN rounds the correction "
                         "range; expected true")
    # transformers: `beta_fast or 32`, so 0/null also mean the default
    beta_fast = _rope_number(d, "beta_fast", name, path) if d.get("beta_fast") else 32.0
    beta_slow = _rope_number(d, "beta_slow", name, path) if d.get("beta_slow") else 1.0
    if d.get("attention_factor") is not None:
        attention = _rope_number(d, "attention_factor", name, path)
    else:
        mscale, mscale_all = (_rope_number(d, k, name, path) if d.get(k) else None for k in ("mscale", "mscale_all_dim"))
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor, 1.0))
    # DeepSeek's attention (MLA) also multiplies its softmax scale by mscale(factor, mscale_all_dim)^2
    mscale_all_dim = _rope_number(d, "mscale_all_dim", name, path) if d.get("mscale_all_dim") else 0.0
    return {"factor": factor, "original_max_position_embeddings": original, "beta_fast": beta_fast,
            "beta_slow": beta_slow, "attention_factor": attention, "mscale_all_dim": mscale_all_dim}


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# --rope-scaling-original-max-position-embeddings, with hidden_size / num_attention_heads as the rotary dim.
# --dynamic-factor (InternLM3) rescales the base.
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}


def check_rope_scaling(shape: ModelShape, args, arg, where: str) -> None:
    trained = _trained_rope_scaling(shape, args, arg, where)
    hf = shape.rope_scaling
    if trained is None:
        if hf is not None:
            recorded = ("rotary_seq_len_interpolation_factor",) if hf.type == "linear" else (
                "use_rope_scaling", "rope_scaling_type")
            if not any(hasattr(args, name) for name in recorded):
                raise MergeError(f"{where}: the HF config has RoPE scaling {hf}, but the args record no "
                                 f"{' or '.join(recorded)}: cannot confirm the model was trained with it")
            raise MergeError(f"{where}: the HF config has RoPE scaling {hf}, but the args record none: the merged "
                             "model would not compute what was trained")
        return
    kind, params, label = trained
    if hf is None:
        raise MergeError(f"{where}: {label} but the HF config has no RoPE scaling: the merged model would not "
                         "compute what was trained")
    if hf.type != kind:
        raise MergeError(f"{where}: {label} but the HF config's RoPE scaling is {hf}: the merged model would not "
                         "compute what was trained")
    for param, (source, theirs) in params.items():
        ours = hf.get(param)
        if ours is None or not math.isclose(float(theirs), ours, rel_tol=1e-6):
            raise MergeError(f"{where}: RoPE scaling differs: {source} but the HF config's {kind} {param} is "
                             f"{'missing' if ours is None else f'{ours:g}'}: the merged model would not compute "
                             "what was trained")


def _trained_rope_scaling(shape: ModelShape, args, arg, where: str):
    """(type, {param: (where the value comes from, value)}, description) of the scaling the args say was
    trained, or None. Only parameters the args record are listed."""
    if _arg_number(args, "dynamic_factor", where, 1.0) > 1:
        raise MergeError(f"{where}: args.dynamic_factor={shown(arg('dynamic_factor'))} (dynamic RoPE base) is not "
                         "supported: no HF config of these architectures computes it")
    interpolation = arg("rotary_seq_len_interpolation_factor")
    kinds = [(name, value) for name, value in (("use_rope_scaling", arg("use_rope_scaling", False)),
                                               ("rope_scaling_type", arg("rope_scaling_type")),
                                               ("rotary_seq_len_interpolation_factor",
                                                interpolation if interpolation not in (None, 1) else None))
             if value]
    if shape.mla is not None and not arg("rope_scaling_type"):  # MindSpeed's own YaRN takes precedence
        mla_yarn = _megatron_mla_yarn(args, arg, where)
        if mla_yarn is not None:
            kinds.append(("rope_type", "yarn"))
    if len(kinds) > 1:
        both = " and ".join(f"args.{name}={shown(value)}" for name, value in kinds)
        raise MergeError(f"{where}: {both}: RoPE scalings applied on top of each other have no HF equivalent")
    if not kinds:
        return None
    name, value = kinds[0]
    if name == "rope_type":
        return mla_yarn
    if name == "use_rope_scaling":
        factor = _arg_number(args, "rope_scaling_factor", where, 8.0)
        params = {"factor": ("args.rope_scaling_factor" + ("" if hasattr(args, "rope_scaling_factor") else
                                                           " (Megatron default)") + f"={factor:g}", factor)}
        params |= {k: (f"args.use_rope_scaling=True fixes {k}={v:g}", v) for k, v in _MEGATRON_LLAMA3.items()}
        return "llama3", params, f"args.use_rope_scaling=True (llama3 RoPE scaling, factor {factor:g})"
    if name == "rotary_seq_len_interpolation_factor":
        factor = _arg_number(args, name, where)
        return "linear", {"factor": (f"args.{name}={shown(value)}", factor)}, f"args.{name}={shown(value)} (linear RoPE scaling)"
    if not isinstance(value, str):  # never str() of an input value: it may be a reference bomb
        raise MergeError(f"{where}: args.rope_scaling_type={shown(value)}; expected a scaling type name or None")
    return _mindspeed_rope_scaling(shape, args, value, where)


# Megatron-Core's MLA: --rope-type (None means yarn), --rotary-scaling-factor, --mscale, --mscale-all-dim;
# the original context (4096) and beta_fast/slow (32/1) are MLATransformerConfig defaults no argument sets.
# Its cos/sin are scaled by mscale(f, mscale) / mscale(f, mscale_all_dim), its softmax by
# mscale(f, mscale_all_dim)^2 (even with plain rope), and the correction range is floored/ceiled.
_MEGATRON_MLA_YARN = {"original_max_position_embeddings": 4096.0, "beta_fast": 32.0, "beta_slow": 1.0}


def _megatron_mla_yarn(args, arg, where: str):
    kind = arg("rope_type") or "yarn"
    factor = _arg_number(args, "rotary_scaling_factor", where, 1.0)
    mscale = _arg_number(args, "mscale", where, 1.0)
    mscale_all = _arg_number(args, "mscale_all_dim", where, 0.0)
    if kind == "rope":
        if factor > 1 and mscale_all:
            raise MergeError(f"{where}: args.rope_type='rope' with rotary_scaling_factor={factor:g} and "
                             f"mscale_all_dim={mscale_all:g}: Megatron's MLA then scales its softmax by "
                             f"{_yarn_mscale(factor, mscale_all) ** 2:g} without YaRN, which no HF config computes")
        return None
    if kind != "yarn":
        raise MergeError(f"{where}: args.rope_type={shown(kind)}; Megatron's MLA knows 'rope' and 'yarn'")
    if factor <= 1:  # YaRN at factor 1 is plain RoPE (every mscale is 1)
        return None
    label = f"args.rope_type={shown(arg('rope_type'))} (Megatron MLA YaRN, factor {factor:g})"
    params = {"factor": (f"args.rotary_scaling_factor={factor:g}", factor),
              "attention_factor": (f"args.mscale={mscale:g} and mscale_all_dim={mscale_all:g} give attention_factor="
                                   f"{_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all):g}",
                                   _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)),
              "mscale_all_dim": (f"args.mscale_all_dim={mscale_all:g}", mscale_all)}
    params |= {k: (f"Megatron's MLA fixes {k}={v:g}", v) for k, v in _MEGATRON_MLA_YARN.items()}
    return "yarn", params, label


def _mindspeed_rope_scaling(shape: ModelShape, args, kind: str, where: str):
    label = f"args.rope_scaling_type={shown(kind)}"
    if kind == "llama3":
        names = {"factor": ("rope_scaling_factor",), "low_freq_factor": ("low_freq_factor",),
                 "high_freq_factor": ("high_freq_factor",),
                 "original_max_position_embeddings": ("original_max_position_embeddings",)}
    elif kind == "yarn":
        # MLA rotates qk_rope_head_dim dims in both; otherwise MindSpeed takes hidden / heads as the rotary dim
        if shape.mla is None and shape.head_dim * shape.heads != shape.hidden:
            raise MergeError(f"{where}: {label} with head_dim={shape.head_dim} != hidden_size/num_attention_heads="
                             f"{shape.hidden // shape.heads}: MindSpeed's YaRN scales the latter, transformers the "
                             "former, so the merged model would not compute what was trained")
        names = {"factor": ("yarn_scaling_factor",) if _recorded(args, "yarn_scaling_factor") else
                 ("rope_scaling_factor",), "beta_fast": ("rope_scaling_beta_fast", "beta_fast"),
                 "beta_slow": ("rope_scaling_beta_slow", "beta_slow"),
                 "original_max_position_embeddings": ("rope_scaling_original_max_position_embeddings",)}
    else:
        raise UnsupportedInput(f"{where}: {label} is not supported: only llama3 and yarn scaling can be matched to a HF "
                         "config")
    params = {}
    for param, candidates in names.items():
        found = _recorded_value(args, candidates, where)
        if found is not None:
            params[param] = found
    if kind == "yarn" and "factor" in params:
        params["attention_factor"] = _mindspeed_yarn_mscale(args, params["factor"][1], where)
    if kind == "yarn" and shape.mla is not None:  # MindSpeed's MLA scales its softmax as DeepSeek's does
        mscale_all = _arg_number(args, "rope_scaling_mscale_all_dim", where, 0.0)
        params["mscale_all_dim"] = (f"args.rope_scaling_mscale_all_dim={mscale_all:g}", mscale_all)
    return kind, params, label


def _recorded(args, name: str) -> bool:
    return getattr(args, name, None) is not None


def _recorded_value(args, names: tuple[str, ...], where: str):
    """(description, value) of the arg among `names` that the run recorded; refuse when two disagree."""
    found = [(f"args.{n}={shown(getattr(args, n))}", _arg_number(args, n, where)) for n in names if _recorded(args, n)]
    if len({value for _, value in found}) > 1:
        raise MergeError(f"{where}: {' and '.join(d for d, _ in found)} disagree: cannot tell which one MindSpeed used")
    return found[0] if found else None


def _arg_number(args, name: str, where: str, default: float | None = None) -> float:
    value = getattr(args, name, None)
    if value is None:
        return default
    if not _is_number(value):
        raise MergeError(f"{where}: args.{name}={shown(value)}; expected a number")
    return float(value)


def _mindspeed_yarn_mscale(args, factor: float, where: str) -> tuple[str, float]:
    mscale = _arg_number(args, "rope_scaling_mscale", where, 1.0)
    mscale_all = _arg_number(args, "rope_scaling_mscale_all_dim", where, 0.0)
    value = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    source = (f"args.rope_scaling_mscale={mscale:g} and rope_scaling_mscale_all_dim={mscale_all:g} give "
              f"attention_factor={value:g}")
    return source, value


def megatron_rope_args(scaling) -> dict:
    """The args that record this HF RoPE scaling for Megatron/MindSpeed (what `check_rope_scaling` reads back)."""
    if scaling is None:
        return {}
    if scaling.type == "linear":
        return {"rotary_seq_len_interpolation_factor": scaling.get("factor")}
    if scaling.type == "llama3":
        return {"rope_scaling_type": "llama3", "rope_scaling_factor": scaling.get("factor"),
                "low_freq_factor": scaling.get("low_freq_factor"), "high_freq_factor": scaling.get("high_freq_factor"),
                "original_max_position_embeddings": scaling.get("original_max_position_embeddings")}
    if scaling.type == "yarn":
        factor, mscale_all = scaling.get("factor"), scaling.get("mscale_all_dim") or 0.0
        # MindSpeed scales cos/sin by yarn_mscale(f, mscale) / yarn_mscale(f, mscale_all_dim); transformers by
        # attention_factor: the mscale that gives it (yarn_mscale(f, m) = 0.1·m·ln f + 1 for f > 1)
        attention = scaling.get("attention_factor")
        mscale = 1.0
        if attention is not None and factor and factor > 1:
            mscale = (attention * _yarn_mscale(factor, mscale_all) - 1) / (0.1 * math.log(factor))
        return {"rope_scaling_type": "yarn", "rope_scaling_factor": factor,
                "rope_scaling_beta_fast": scaling.get("beta_fast"), "rope_scaling_beta_slow": scaling.get("beta_slow"),
                "rope_scaling_original_max_position_embeddings": scaling.get("original_max_position_embeddings"),
                "rope_scaling_mscale": mscale, "rope_scaling_mscale_all_dim": mscale_all}
    raise MergeError(f"the model's RoPE scaling {scaling} has no Megatron argument that records it")
