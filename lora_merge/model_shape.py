"""The architecture of the model being merged, read from the HF reference config and checked against
the Megatron args, so that a mismatch stops the merge instead of producing a wrong model.

Every top-level key of config.json is either read and checked here, or known not to change what the
model computes; anything else is refused, because a key transformers reads that we ignore could make the
published model compute something other than what was trained. A key that is absent takes the value
transformers' own config class would give it (the architecture module's `HfConfig.defaults`), so the
checks compare against what the HF model will actually use. What differs between model types (defaults,
their own keys, biases, q/k norms, experts) is declared by each architecture module.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_merge.architectures import ARCHITECTURES, HfConfig
from lora_merge.errors import MergeError
from lora_merge.layer_numbering import noop_layers
from lora_merge.mla_shape import MlaShape, check_mla_args
from lora_merge.moe_shape import MoeShape, check_moe_args

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

def _config_of(model_type: str) -> HfConfig | None:
    """The architecture module's HfConfig for a model type (None if unsupported)."""
    arch = ARCHITECTURES.get(model_type)
    return arch.config if arch is not None else None


def _supported_types() -> list[str]:
    return sorted(ARCHITECTURES)


# Keys read and checked below, for every supported model type.
_CHECKED = frozenset({
    "model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "hidden_act", "rms_norm_eps", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "dtype", "torch_dtype", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "max_position_embeddings", "quantization_config", "attn_logit_softcapping",
    "final_logit_softcapping", "pruned_heads",
})
# Keys checked where the model type's family has them (elsewhere they are unknown), besides its own.
_FAMILY_KEYS = {"qwen": {"sliding_window", "use_sliding_window", "layer_types"},
                "mistral": {"sliding_window", "layer_types"}, "llama": set()}
# What PretrainedConfig writes in transformers 5.x and 4.x (metadata, labels, token ids, output switches,
# the generation settings 4.x kept in config.json) and the model classes' training-only or numerically
# neutral keys: none of them changes the function the weights compute. max_window_layers only matters
# with sliding windows, which are refused; pretraining_tp splits a matmul without changing its result.
_HARMLESS = frozenset({
    "_name_or_path", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset", "transformers_version",
    "auto_map", "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "use_cache", "initializer_range",
    "attention_dropout", "max_window_layers", "pretraining_tp",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})

_BOOLEAN_SWITCHES = frozenset({"use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
                               "is_decoder", "is_encoder_decoder", "tie_encoder_decoder", "output_router_logits",
                               "use_bfloat16", "add_cross_attention"})

# Keys transformers reads from a rope_scaling / rope_parameters dict (4.x and 5.x).
_ROPE_KEYS = frozenset({
    "rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
    "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
    "truncate", "short_factor", "long_factor",
})
_ROPE_SECTIONS = ("rope_scaling", "rope_parameters")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as transformers applies it, defaults filled in: the type and its parameters
    (factor, original_max_position_embeddings, low/high_freq_factor, beta_fast/slow, attention_factor)."""
    type: str
    params: tuple[tuple[str, float], ...]

    def get(self, name: str) -> float | None:
        return dict(self.params).get(name)

    def __str__(self) -> str:
        return f"{self.type} ({', '.join(f'{k}={v:g}' for k, v in self.params)})"


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    num_layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads (Megatron's query groups)
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: torch.dtype | None  # the reference's dtype, if it names one
    rope_theta: float | None = None
    norm_eps: float | None = None
    rope_scaling: RopeScaling | None = None
    tokenizer_vocab: int | None = None  # ids tokenizer.json can produce, when the reference has one
    mtp_layers: int = 0  # multi-token-prediction layers after the decoder (DeepSeek's num_nextn_predict_layers)
    defaulted: frozenset[str] = frozenset()  # HF keys absent from config.json, so the config class's default
    moe: MoeShape | None = None  # routed experts, for a Mixture-of-Experts model
    mla: MlaShape | None = None  # multi-latent attention (DeepSeek) instead of grouped-query attention

    @property
    def mtp_prefixes(self) -> tuple[str, ...]:
        """HF name prefixes of the multi-token-prediction layers, which follow the decoder's."""
        return tuple(f"model.layers.{i}." for i in range(self.num_layers, self.num_layers + self.mtp_layers))

    @property
    def features(self) -> frozenset[str]:
        """Optional parts of the architecture that some rules depend on."""
        shared = self.moe is not None and self.moe.shared_ffn > 0
        return frozenset(name for name, on in (("qkv_bias", self.qkv_bias), ("qk_norm", self.qk_norm),
                                               ("untied", not self.tied), ("tied", self.tied),
                                               ("shared_expert", shared), ("mla", self.mla is not None),
                                               ("q_lora", self.mla is not None and bool(self.mla.q_lora)),
                                               ("no_q_lora", self.mla is not None and not self.mla.q_lora)) if on)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers


# ---------------------------------------------------------------------------------------------------------
# Reading config.json


def read_hf_config(hf_dir: Path) -> tuple[ModelShape, dict]:
    path = hf_dir / "config.json"
    cfg = _read_json(path, missing=f"{hf_dir}: no config.json (the --hf-ref directory must hold the HF model's config)")
    if not isinstance(cfg, dict):
        raise MergeError(f"{path}: the top level is a JSON {_json_kind(cfg)}; expected an object of config fields")
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        raise MergeError(f"{path}: multimodal configs are not supported")
    model_type = _model_type(cfg, path)
    spec = _config_of(model_type)
    _check_known_fields(cfg, spec, path)
    fields = _Fields(cfg, path, spec.all_defaults)
    _refuse_unsupported_computation(fields, spec)
    shape = _shape(fields, spec)
    if shape.heads % shape.groups:
        raise MergeError(f"{path}: num_attention_heads={shape.heads} is not a multiple of "
                         f"num_key_value_heads={shape.groups}")
    if shape.tokenizer_vocab is not None and shape.vocab < shape.tokenizer_vocab:
        raise MergeError(f"{path}: vocab_size={shape.vocab} is smaller than the tokenizer's {shape.tokenizer_vocab} "
                         f"token ids ({hf_dir / 'tokenizer.json'}); expected vocab_size >= {shape.tokenizer_vocab} "
                         "(rows are never cut silently)")
    return shape, cfg


def _shape(fields: _Fields, spec: HfConfig) -> ModelShape:
    heads = fields.positive_int("num_attention_heads")
    hidden = fields.positive_int("hidden_size")
    groups = fields.positive_int("num_key_value_heads", nullable=True)
    head_dim = fields.positive_int("head_dim", nullable=not spec.head_dim_required)
    max_positions = fields.positive_int("max_position_embeddings")
    rope_theta, rope_scaling = _rope(fields.cfg, fields.path, max_positions)
    num_layers = fields.positive_int("num_hidden_layers")
    return ModelShape(
        model_type=spec.model_type,
        num_layers=num_layers,
        hidden=hidden,
        heads=heads,
        # multi-latent attention gives every head its own key and value; its head sizes are in `mla`
        groups=heads if spec.read_mla else groups or heads,
        head_dim=head_dim or hidden // heads,
        ffn=fields.positive_int("intermediate_size"),
        vocab=fields.positive_int("vocab_size"),
        tied=fields.flag("tie_word_embeddings"),
        qkv_bias=spec.qkv_bias if isinstance(spec.qkv_bias, bool) else fields.flag(spec.qkv_bias),
        qk_norm=spec.qk_norm,
        moe=spec.read_moe(fields, num_layers) if spec.read_moe else None,
        mla=spec.read_mla(fields) if spec.read_mla else None,
        dtype=_dtype(fields),
        rope_theta=fields.default("rope_theta") if rope_theta is None else rope_theta,
        norm_eps=fields.number("rms_norm_eps"),
        rope_scaling=rope_scaling,
        tokenizer_vocab=tokenizer_vocab_size(fields.path.parent / "tokenizer.json"),
        mtp_layers=_count(fields, "num_nextn_predict_layers"),
        defaulted=frozenset(fields.defaulted),
    )


def _count(fields: _Fields, key: str) -> int:
    value = fields.cfg.get(key) or 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MergeError(f"{fields.path}: '{key}' must be a count, found {value!r}")
    return value


def _read_json(path: Path, missing: str):
    """A JSON file's content, or one line saying why it cannot be read."""
    if path.is_symlink() and not path.exists():
        raise MergeError(f"{path}: broken symlink (points to {path.readlink()}, which does not exist)")
    if path.is_dir():
        raise MergeError(f"{path}: is a directory; expected a JSON file")
    if not path.exists():
        raise MergeError(missing)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MergeError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                         "expected a UTF-8 JSON file") from None
    except OSError as exc:
        raise MergeError(f"{path}: cannot be read ({exc.strerror or exc}); expected a readable JSON file") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise MergeError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, and integers too long to convert
        raise MergeError(f"{path}: not valid JSON ({str(exc).splitlines()[0]})") from None


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {list: "array", str: "string", int: "number", float: "number", dict: "object"}.get(type(value), "null")


def _model_type(cfg: dict, path: Path) -> str:
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or _config_of(model_type) is None:
        what = f"model_type {model_type!r} is not supported" if "model_type" in cfg else "no model_type"
        raise MergeError(f"{path}: {what} (expected one of {', '.join(_supported_types())})")
    return model_type


def _check_known_fields(cfg: dict, spec: HfConfig, path: Path) -> None:
    known = _CHECKED | _FAMILY_KEYS[spec.family] | spec.own_keys | _HARMLESS
    for key in cfg:
        if key not in known:
            raise MergeError(f"{path}: unknown field {key!r} for {spec.model_type}; it may change what the model computes "
                             "(remove it if it does not)")
    # Harmless to the weights, but transformers 5 refuses a config whose switches are not booleans, and a
    # special token outside the vocabulary names no token.
    for key in _BOOLEAN_SWITCHES & cfg.keys():
        if not isinstance(cfg[key], bool):
            raise MergeError(f"{path}: {key!r} must be true or false, found {cfg[key]!r}")
    vocab = cfg.get("vocab_size")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id") & cfg.keys():
        ids = cfg[key] if isinstance(cfg[key], list) else [cfg[key]]
        for token in ids:
            if token is None and not isinstance(cfg[key], list):
                continue
            if not (isinstance(token, int) and not isinstance(token, bool) and token >= 0) or \
                    (isinstance(vocab, int) and token >= vocab):
                raise MergeError(f"{path}: {key}={cfg[key]!r}; expected token ids in 0..{vocab if isinstance(vocab, int) else '?'}"
                                 f"{'' if not isinstance(vocab, int) else ' (vocab_size)'} or null")


class _Fields:
    """Typed access to config.json: a present key must have the type transformers expects; an absent one
    takes the value the model type's config class gives it."""

    def __init__(self, cfg: dict, path: Path, defaults: dict):
        self.cfg, self.path, self.defaults = cfg, path, defaults
        self.defaulted: set[str] = set()

    def default(self, key: str):
        if key in self.defaults:
            self.defaulted.add(key)
        return self.defaults.get(key)

    def _bad(self, key: str, expected: str):
        return MergeError(f"{self.path}: {key!r} must be {expected}, found {self.cfg[key]!r}")

    def positive_int(self, key: str, nullable: bool = False) -> int | None:
        if key not in self.cfg:
            if key not in self.defaults and not nullable:
                raise MergeError(f"{self.path}: {key!r} must be a positive integer, found None (the key is missing)")
            return self.default(key)
        value = self.cfg[key]
        if value is None and nullable:
            return None
        if not _is_int(value) or value <= 0:
            raise self._bad(key, "a positive integer" + (" or null" if nullable else ""))
        return value

    def number(self, key: str) -> float:
        if key not in self.cfg:
            return self.default(key)
        value = self.cfg[key]
        if not _is_number(value) or value <= 0:
            raise self._bad(key, "a positive number")
        return float(value)

    def flag(self, key: str) -> bool:
        if key not in self.cfg:
            return bool(self.default(key))
        if not isinstance(self.cfg[key], bool):
            raise self._bad(key, "true or false")
        return self.cfg[key]

    def text(self, key: str, nullable: bool = False) -> str | None:
        if key not in self.cfg:
            return self.default(key)
        value = self.cfg[key]
        if not (isinstance(value, str) or (value is None and nullable)):
            raise self._bad(key, "a string" + (" or null" if nullable else ""))
        return value

    def null_or(self, key: str):
        return self.cfg[key] if key in self.cfg else self.default(key)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond float range
        return False


def _dtype(fields: _Fields) -> torch.dtype | None:
    names = [fields.text(key, nullable=True) for key in ("dtype", "torch_dtype")]
    name = names[0] or names[1]
    return DTYPES.get(name) if name else None


# ---------------------------------------------------------------------------------------------------------
# Config fields that change the function and that Megatron cannot have trained: refused outright


def _refuse_unsupported_computation(fields: _Fields, spec: HfConfig) -> None:
    for check in (_check_activation, _check_biases, _check_sliding_window, _check_layer_types, _check_extras,
                  _check_architectures):
        check(fields, spec, fields.path)


def _check_activation(fields: _Fields, spec: HfConfig, path: Path) -> None:
    act = fields.text("hidden_act")
    if act != "silu":
        raise MergeError(f"{path}: hidden_act={act!r}, but the {spec.model_type} MLP Megatron trains is swiglu "
                         "(args.swiglu: silu-gated); expected 'silu'")


def _check_biases(fields: _Fields, spec: HfConfig, path: Path) -> None:
    if spec.qkv_bias is False and fields.flag("attention_bias"):
        # In HF Llama/Mistral/Qwen3 attention_bias also gives o_proj a bias, which Megatron's
        # add_qkv_bias does not have: writing one would be inventing weights.
        raise MergeError(f"{path}: attention_bias=true for {spec.model_type} (q/k/v *and* o_proj biases) is not supported")
    if fields.flag("mlp_bias"):
        raise MergeError(f"{path}: mlp_bias=true is not supported")


_NO_SWA = "sliding-window attention is not supported: Megatron trained full attention"


def _check_sliding_window(fields: _Fields, spec: HfConfig, path: Path) -> None:
    if spec.family == "qwen":
        # Qwen's sliding_window is only used when use_sliding_window is on (Qwen2-MoE writes 0 for none).
        if fields.cfg.get("sliding_window") != 0:
            fields.positive_int("sliding_window", nullable=True)
        if fields.flag("use_sliding_window"):
            raise MergeError(f"{path}: use_sliding_window=true: {_NO_SWA} (expected false)")
    elif spec.family == "mistral":
        window = fields.positive_int("sliding_window", nullable=True)
        if window is not None:
            absent = "" if "sliding_window" in fields.cfg else " (MistralConfig's default when the key is absent)"
            raise MergeError(f"{path}: sliding_window={window}{absent}: {_NO_SWA} (expected \"sliding_window\": null)")


def _check_layer_types(fields: _Fields, spec: HfConfig, path: Path) -> None:
    types = fields.null_or("layer_types")
    if types is None:
        return
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise fields._bad("layer_types", "a list of strings or null")
    layers = fields.cfg.get("num_hidden_layers")
    if isinstance(layers, int) and len(types) != layers:
        raise MergeError(f"{path}: layer_types has {len(types)} entries for num_hidden_layers={layers}; transformers "
                         "refuses such a config")
    for i, kind in enumerate(types):
        if kind != "full_attention":
            raise MergeError(f"{path}: layer_types[{i}]={kind!r}: {_NO_SWA} (expected only 'full_attention')")


def _check_extras(fields: _Fields, spec: HfConfig, path: Path) -> None:
    if "quantization_config" in fields.cfg:
        kind = fields.cfg["quantization_config"].get("quant_method") if isinstance(fields.cfg["quantization_config"],
                                                                                 dict) else None
        fix = (" (FP8 weights with weight_scale_inv, as DeepSeek-V3 is released): give the bf16 copy the Megatron base "
               "was converted from (e.g. made with DeepSeek's fp8_cast_bf16.py), whose config has no "
               "quantization_config" if kind == "fp8" else "; expected the unquantized HF model the Megatron base "
               "was converted from")
        raise MergeError(f"{path}: has a quantization_config ({kind or 'unknown method'}): the reference is a "
                         f"quantized model{fix}")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if fields.cfg.get(key) is not None:
            raise MergeError(f"{path}: {key}={fields.cfg[key]!r}: logit soft-capping is not supported (Megatron "
                             "trained without it); expected null")
    if fields.cfg.get("pruned_heads"):
        raise MergeError(f"{path}: pruned_heads={fields.cfg['pruned_heads']!r}: pruned attention heads are not "
                         "supported; expected none")


def _check_architectures(fields: _Fields, spec: HfConfig, path: Path) -> None:
    names = fields.null_or("architectures")
    if names is None:
        return
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise fields._bad("architectures", "a list of class names or null")
    # Loaders such as vLLM pick the model class from here; the merged weights are a causal LM's.
    expected = spec.causal_lm
    for name in names:
        if name != expected:
            raise MergeError(f"{path}: architectures names {name!r}; a {spec.model_type} causal LM is {expected!r} "
                             "(loaders such as vLLM pick the model class from this field)")


# ---------------------------------------------------------------------------------------------------------
# RoPE: rope_theta, rope_scaling (transformers 4.x), rope_parameters (5.x)


def _rope(cfg: dict, path: Path, max_positions: int) -> tuple[float | None, RopeScaling | None]:
    """rope_theta (None where the config states none) and the scaling transformers will use. Where the config states a value twice (top-level and
    inside a rope dict, or in both dicts), the statements must agree: transformers versions differ on which
    one wins, so a disagreement means the merged model's function depends on who loads it."""
    sections = {}
    for name in _ROPE_SECTIONS:
        value = cfg.get(name)
        if value is not None and not isinstance(value, dict):
            raise MergeError(f"{path}: {name!r} must be an object or null, found {value!r}")
        if value:
            sections[name] = value
    theta = _agreeing(path, "rope_theta", _inner({"": cfg, **sections}, "rope_theta", path))
    partial = _agreeing(path, "partial_rotary_factor", _inner({"": cfg, **sections}, "partial_rotary_factor", path))
    if partial is not None and partial != 1.0:
        raise MergeError(f"{path}: partial_rotary_factor={partial:g}: partial RoPE is not supported (Megatron "
                         "args.rotary_percent must be 1.0); expected 1.0")
    scalings = {name: _scaling(d, name, path, max_positions) for name, d in sections.items()}
    if len(set(scalings.values())) > 1:
        raise MergeError(f"{path}: rope_scaling says {scalings['rope_scaling'] or 'no scaling'} but rope_parameters "
                         f"says {scalings['rope_parameters'] or 'no scaling'}; expected one RoPE description")
    return theta, next(iter(scalings.values()), None)


def _inner(sections: dict, key: str, path: Path) -> list[tuple[str, float]]:
    found = []
    for name, section in sections.items():
        if key in section:
            label = f"{name}.{key}" if name else key
            if not _is_number(section[key]) or section[key] <= 0:
                raise MergeError(f"{path}: {label!r} must be a positive number, found {section[key]!r}")
            found.append((label, float(section[key])))
    return found


def _agreeing(path: Path, what: str, stated: list[tuple[str, float]]) -> float | None:
    values = {value for _, value in stated}
    if len(values) > 1:
        said = " but ".join(f"{label}={value!r}" for label, value in stated)
        raise MergeError(f"{path}: {said}; expected one {what} (transformers versions differ on which applies)")
    return stated[0][1] if stated else None


def _scaling(d: dict, name: str, path: Path, max_positions: int) -> RopeScaling | None:
    for key in d:
        if key not in _ROPE_KEYS:
            raise MergeError(f"{path}: unknown key {key!r} in {name}; it may change what the model computes "
                             "(remove it if it does not)")
    kind = _rope_type(d, name, path)
    if kind is None or kind == "default":
        return None
    if kind not in ("llama3", "yarn", "linear"):
        raise MergeError(f"{path}: {name} has rope_type {kind!r}, which Megatron/MindSpeed cannot be shown to have "
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
        params = _yarn_params(d, name, path, factor, original, max_positions)
    return RopeScaling(kind, tuple(sorted(params.items())))


def _rope_type(d: dict, name: str, path: Path) -> str | None:
    stated = [d[k] for k in ("rope_type", "type") if k in d]
    if len(stated) == 2 and stated[0] != stated[1]:
        raise MergeError(f"{path}: {name} has rope_type {d['rope_type']!r} and type {d['type']!r}; expected one")
    if not stated:
        if set(d) - {"rope_theta", "partial_rotary_factor"}:
            raise MergeError(f"{path}: {name} has scaling parameters but no rope_type; expected e.g. "
                             "\"rope_type\": \"llama3\"")
        return None
    kind = stated[0]
    if not isinstance(kind, str):
        raise MergeError(f"{path}: {name}.rope_type must be a string, found {kind!r}")
    return kind


def _rope_number(d: dict, key: str, name: str, path: Path, default: float | None = None) -> float:
    if key not in d and default is not None:
        return float(default)
    value = d.get(key)
    if not _is_number(value) or value <= 0:
        raise MergeError(f"{path}: {name}.{key} must be a positive number, found "
                         f"{value!r}{'' if key in d else ' (missing)'}")
    return float(value)


def _yarn_params(d: dict, name: str, path: Path, factor: float, original: float, max_positions: int) -> dict:
    if "original_max_position_embeddings" in d and not math.isclose(max_positions / original, factor, rel_tol=1e-6):
        # transformers 4.4x-4.5x take the factor from this ratio, 5.x from "factor": the function would
        # depend on the version that loads the model.
        raise MergeError(f"{path}: {name} yarn factor={factor:g} but max_position_embeddings / "
                         f"original_max_position_embeddings = {max_positions}/{original:g}; transformers versions "
                         f"differ on which applies; expected max_position_embeddings = {factor * original:g}")
    if d.get("truncate", True) is not True:
        raise MergeError(f"{path}: {name}.truncate={d['truncate']!r}: MindSpeed's YaRN rounds the correction "
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


# ---------------------------------------------------------------------------------------------------------
# tokenizer.json


def tokenizer_vocab_size(path: Path) -> int | None:
    """How many token ids tokenizer.json can produce (its largest id + 1), or None without a tokenizer.json."""
    if not path.exists() and not path.is_symlink():
        return None
    tok = _read_json(path, missing=f"{path}: missing")

    def bad(what: str):
        return MergeError(f"{path}: malformed tokenizer.json: {what}")

    if not isinstance(tok, dict):
        raise bad(f"the top level is a JSON {_json_kind(tok)}; expected an object")
    model = tok.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        ids = list(vocab.values())
    elif isinstance(vocab, list):  # Unigram: [token, score] pairs, the id is the position
        ids = [len(vocab) - 1] if vocab else []
    else:
        raise bad(f"model.vocab is {_json_kind(vocab)}; expected an object (token -> id) or a list (Unigram)")
    added = tok.get("added_tokens", [])
    if not isinstance(added, list) or not all(isinstance(t, dict) for t in added):
        raise bad("added_tokens is not a list of objects")
    ids += [t.get("id") for t in added]
    for i in ids:
        if not _is_int(i) or i < 0:
            raise bad(f"token id {i!r}; expected non-negative integers")
    return max(ids) + 1 if ids else None


# ---------------------------------------------------------------------------------------------------------
# Cross-checks against the Megatron args


def check_against_args(shape: ModelShape, args, where: str) -> None:
    """Every architecture fact that the Megatron args also record must agree with the HF config."""
    def arg(name, default=None):
        value = getattr(args, name, default)
        return default if value is None else value

    gqa = bool(arg("group_query_attention", False))
    groups = int(arg("num_query_groups", shape.heads)) if gqa else int(arg("num_attention_heads", shape.heads))
    heads = int(arg("num_attention_heads", shape.heads))
    checks = [
        ("num_layers", arg("num_layers"), shape.num_layers + _noop_count(args), "num_hidden_layers"),
        ("hidden_size", arg("hidden_size"), shape.hidden, "hidden_size"),
        ("num_attention_heads", heads, shape.heads, "num_attention_heads"),
    ]
    if shape.mla is None:  # multi-latent attention has its own head sizes (check_mla_args)
        checks += [("num_query_groups", groups, shape.groups, "num_key_value_heads"),
                   ("kv_channels", arg("kv_channels", shape.hidden // heads if heads else None), shape.head_dim,
                    "head_dim")]
    if shape.moe is None or len(shape.moe.layers) < shape.num_layers:  # only dense layers use it
        checks.append(("ffn_hidden_size", arg("ffn_hidden_size"), shape.ffn, "intermediate_size"))
    for arg_name, theirs, ours, hf_name in checks:
        if theirs is not None and int(theirs) != ours:
            raise MergeError(f"{where}: args.{arg_name}={theirs} but the HF config's {hf_name} implies {ours}"
                             f"{_defaulted(shape, hf_name)}")
    untie = arg("untie_embeddings_and_output_weights")
    if untie is not None and bool(untie) == shape.tied:
        raise MergeError(f"{where}: args.untie_embeddings_and_output_weights={untie} but the HF config has "
                         f"tie_word_embeddings={shape.tied}{_defaulted(shape, 'tie_word_embeddings')}")
    qkv_bias = arg("add_qkv_bias")
    if qkv_bias is None and arg("add_bias_linear") is not None:
        qkv_bias = arg("add_bias_linear")
    if qkv_bias is not None and bool(qkv_bias) != shape.qkv_bias:
        raise MergeError(f"{where}: args.add_qkv_bias={qkv_bias} but the HF config ({shape.model_type}) "
                         f"{'has' if shape.qkv_bias else 'has no'} q/k/v biases")
    qk_norm = arg("qk_layernorm")  # with MLA: the norms of the compressed q and kv, which DeepSeek always has
    if qk_norm is not None and bool(qk_norm) != (shape.qk_norm or shape.mla is not None):
        raise MergeError(f"{where}: args.qk_layernorm={qk_norm} but the HF config ({shape.model_type}) "
                         f"{'has' if shape.qk_norm else 'has no'} q/k norms")
    _check_function_args(shape, arg, where)
    check_moe_args(shape.moe, args, shape.num_layers, where)
    check_mla_args(shape.mla, args, where)
    _check_rope_scaling(shape, args, arg, where)
    _check_vocab_args(shape, arg, where)
    if arg("mtp_num_layers"):
        raise MergeError(f"{where}: args.mtp_num_layers={arg('mtp_num_layers')}: the checkpoint has multi-token-"
                         "prediction layers (mtp.*), which this tool cannot map yet and will not drop; merge a "
                         "checkpoint trained without MTP")
    if arg("swiglu") is False:
        raise MergeError(f"{where}: args.swiglu=False, but the {shape.model_type} MLP is gated (swiglu)")


def _check_function_args(shape: ModelShape, arg, where: str) -> None:
    """Args that change what the trained model computes without changing any tensor shape: the HF config
    must describe the same function, or the merged model is not the trained one."""
    fixed = [("rotary_interleaved", False), ("apply_layernorm_1p", False), ("add_bias_linear", False),
             ("position_embedding_type", "rope"), ("normalization", "RMSNorm"), ("rotary_percent", 1.0)]
    for name, expected in fixed:
        value = arg(name)
        if value is not None and value != expected:
            raise MergeError(f"{where}: args.{name}={value!r}; only {expected!r} maps onto a HF {shape.model_type} model")
    for name, theirs, ours, hf_name in (("rotary_base", arg("rotary_base"), shape.rope_theta, "rope_theta"),
                                        ("norm_epsilon", arg("norm_epsilon"), shape.norm_eps, "rms_norm_eps")):
        if theirs is not None and ours is not None and not math.isclose(float(theirs), ours, rel_tol=1e-6):
            raise MergeError(f"{where}: args.{name}={theirs} but the HF config's {hf_name} is {ours}"
                             f"{_defaulted(shape, hf_name)}: the merged model would not compute what was trained")
    # MindSpeed --sliding-window, Megatron --window-size: attention limited to a window in training.
    for name in ("sliding_window", "window_size"):
        if arg(name) is not None:
            raise MergeError(f"{where}: args.{name}={arg(name)!r}: the model was trained with sliding-window "
                             "attention, which the HF config does not describe; expected none")


def _check_vocab_args(shape: ModelShape, arg, where: str) -> None:
    padded = arg("padded_vocab_size")
    if padded is not None and int(padded) < shape.vocab:
        raise MergeError(f"{where}: args.padded_vocab_size={padded} is smaller than the HF vocab_size={shape.vocab}")
    # The unpadded vocabulary some Megatron/MindSpeed args record: its rows were trained, none may be cut.
    unpadded = arg("vocab_size")
    if unpadded is not None and int(unpadded) > shape.vocab:
        raise MergeError(f"{where}: args.vocab_size={unpadded} is larger than the HF config's vocab_size={shape.vocab}; "
                         f"trained rows would be cut (expected vocab_size >= {unpadded})")


# Megatron-LM: --use-rope-scaling applies the llama3 rule with low/high_freq_factor 1/4 and an original
# context of 8192 fixed in RotaryEmbedding._apply_scaling, and --rope-scaling-factor (default 8.0);
# --rotary-seq-len-interpolation-factor is linear position interpolation (positions / factor).
# MindSpeed-LLM: --rope-scaling-type {llama3, yarn, longrope, plm}. llama3 reads --rope-scaling-factor,
# --low-freq-factor, --high-freq-factor, --original-max-position-embeddings. yarn reads --rope-scaling-factor
# (older releases --yarn-scaling-factor), --rope-scaling-beta-fast/-slow (newer --beta-fast/--beta-slow),
# --rope-scaling-mscale, --rope-scaling-mscale-all-dim (cos/sin scaled by their mscale ratio) and
# --rope-scaling-original-max-position-embeddings, with hidden_size / num_attention_heads as the rotary dim.
# --dynamic-factor (InternLM3) rescales the base.
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}


def _check_rope_scaling(shape: ModelShape, args, arg, where: str) -> None:
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
        raise MergeError(f"{where}: args.dynamic_factor={arg('dynamic_factor')} (dynamic RoPE base) is not "
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
        both = " and ".join(f"args.{name}={value!r}" for name, value in kinds)
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
        return "linear", {"factor": (f"args.{name}={value}", factor)}, f"args.{name}={value} (linear RoPE scaling)"
    return _mindspeed_rope_scaling(shape, args, str(value), where)


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
        raise MergeError(f"{where}: args.rope_type={kind!r}; Megatron's MLA knows 'rope' and 'yarn'")
    if factor <= 1:  # YaRN at factor 1 is plain RoPE (every mscale is 1)
        return None
    label = f"args.rope_type={arg('rope_type')!r} (Megatron MLA YaRN, factor {factor:g})"
    params = {"factor": (f"args.rotary_scaling_factor={factor:g}", factor),
              "attention_factor": (f"args.mscale={mscale:g} and mscale_all_dim={mscale_all:g} give attention_factor="
                                   f"{_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all):g}",
                                   _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)),
              "mscale_all_dim": (f"args.mscale_all_dim={mscale_all:g}", mscale_all)}
    params |= {k: (f"Megatron's MLA fixes {k}={v:g}", v) for k, v in _MEGATRON_MLA_YARN.items()}
    return "yarn", params, label


def _mindspeed_rope_scaling(shape: ModelShape, args, kind: str, where: str):
    label = f"args.rope_scaling_type={kind!r}"
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
        raise MergeError(f"{where}: {label} is not supported: only llama3 and yarn scaling can be matched to a HF "
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
    found = [(f"args.{n}={getattr(args, n)!r}", _arg_number(args, n, where)) for n in names if _recorded(args, n)]
    if len({value for _, value in found}) > 1:
        raise MergeError(f"{where}: {' and '.join(d for d, _ in found)} disagree: cannot tell which one MindSpeed used")
    return found[0] if found else None


def _arg_number(args, name: str, where: str, default: float | None = None) -> float:
    value = getattr(args, name, None)
    if value is None:
        return default
    if not _is_number(value):
        raise MergeError(f"{where}: args.{name}={value!r}; expected a number")
    return float(value)


def _mindspeed_yarn_mscale(args, factor: float, where: str) -> tuple[str, float]:
    mscale = _arg_number(args, "rope_scaling_mscale", where, 1.0)
    mscale_all = _arg_number(args, "rope_scaling_mscale_all_dim", where, 0.0)
    value = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    source = (f"args.rope_scaling_mscale={mscale:g} and rope_scaling_mscale_all_dim={mscale_all:g} give "
              f"attention_factor={value:g}")
    return source, value


def _defaulted(shape: ModelShape, hf_name: str) -> str:
    if hf_name in shape.defaulted:
        return f" (absent from config.json, so transformers' {shape.model_type} default)"
    return ""


def _noop_count(args) -> int:
    return len(noop_layers(args))
