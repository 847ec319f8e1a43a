"""Read the reference config.json as transformers reads it, and turn it into a `ModelShape`.

The config is read once from disk, then handed to the config class transformers would pick for it
(`from_dict`, as `AutoConfig.from_pretrained` does; no remote code is ever run), so every default, every
4.x/5.x spelling (`rope_scaling`/`rope_parameters`, `torch_dtype`/`dtype`, `layer_types` …) and every
validation is transformers' own: the shape we check against the Megatron args is the model that will load.

What is refused is a value that changes what the model computes and that Megatron cannot have trained or
this tool does not map, named with its key and value. Keys the config class does not read change nothing
transformers computes: they are kept as published and listed in one note. A key the class reads that we do
not examine is accepted at its default and refused otherwise, so a newer transformers cannot slip a new
switch past the merge.
"""

from __future__ import annotations

import copy
import functools
import dataclasses
import importlib.util
import inspect
import logging
import re
import warnings
from pathlib import Path

import torch

from lora_merge.model.architectures import ARCHITECTURES, HfConfig
from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.fp8 import read_fp8_config
from lora_merge.mxfp4 import is_mxfp4_config
from lora_merge.interrupts import raise_if_received
from lora_merge.model.model_shape import DTYPES, ModelShape, RopeScaling
from lora_merge.model.multimodal import MULTIMODAL
from lora_merge.model.rope import hf_rope, rotated_fraction
from lora_merge.shown import shown
from lora_merge.files.small_files import json_kind, read_json
from lora_merge.value_checks import is_int, is_number

# Keys every config class takes (PretrainedConfig: metadata, labels, token ids, output switches, the
# generation settings 4.x kept in config.json) and the decoder classes' training-only or numerically neutral
# keys: none of them changes the function the weights compute. max_window_layers only matters with
# sliding windows, which are refused (but for types on the HF routes only, whose config is kept as published);
# pretraining_tp splits a matmul without changing its result.
NEUTRAL_KEYS = frozenset({
    "_name_or_path", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset", "transformers_version",
    "auto_map", "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "use_cache", "initializer_range",
    "attention_dropout", "max_window_layers", "pretraining_tp", "architectures", "model_type",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # load-balancing loss and router noise act only in training
    "router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
})
# Keys read by `_shape`, the checks below or an architecture's own reader.
EXAMINED_KEYS = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "mlp_bias", "dtype", "torch_dtype", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "max_position_embeddings", "quantization_config", "pruned_heads", "layer_types", "num_nextn_predict_layers",
    # transformers 5 moves it into the scaled RoPE it applies, which must be the one stated (rope.hf_rope)
    "original_max_position_embeddings",
})
# Sliding-window keys, checked (and refused when on) for the families whose attention has them.
FAMILY_KEYS = {"qwen": frozenset({"sliding_window", "use_sliding_window"}), "mistral": frozenset({"sliding_window"}),
               "llama": frozenset()}
_BOOLEAN_SWITCHES = frozenset({"use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
                               "is_decoder", "is_encoder_decoder", "tie_encoder_decoder", "output_router_logits",
                               "use_bfloat16", "add_cross_attention"})
_NO_SWA = "sliding-window attention is not supported: Megatron trained full attention"


def read_hf_config(hf_dir: Path, notes: list[str] | None = None) -> tuple[ModelShape, dict]:
    """The model's shape and config.json as published; `notes` collects what was accepted but is worth
    saying (keys transformers does not read, a model type read as its architecture)."""
    notes = [] if notes is None else notes
    path = hf_dir / "config.json"
    raw = read_json(path, missing=f"{hf_dir}: no config.json (the --hf-ref directory must hold the HF model's config)")
    if not isinstance(raw, dict):
        raise MergeError(f"{path}: the top level is a JSON {json_kind(raw)}; expected an object of config fields")
    published, raw = raw, _language_model_config(raw, path)
    spec = _architecture(raw, path, notes)
    _check_plain_fields(raw, path)
    try:
        config = transformers_config(raw, spec, path)
    except MergeError:
        _explain_refusal(raw, path)  # our own line where we have a more precise one
        raise
    fields = ConfigFields(raw, config, path)
    _check_class_keys(fields, spec, notes)
    _refuse_unsupported_computation(fields, spec)
    tokenizer = tokenizer_vocab(hf_dir)
    shape = _shape(fields, spec, notes, tokenizer[0] if tokenizer else None)
    if shape.heads % shape.groups:
        raise MergeError(f"{path}: num_attention_heads={shape.heads} is not a multiple of "
                         f"num_key_value_heads={shape.groups}")
    if tokenizer is not None and shape.vocab < tokenizer[0]:
        raise MergeError(f"{path}: vocab_size={shape.vocab} is smaller than the tokenizer's {tokenizer[0]} "
                         f"token ids ({tokenizer[1]} names id {tokenizer[0] - 1}); expected vocab_size >= "
                         f"{tokenizer[0]} (rows are never cut silently)")
    if published is not raw:
        shape = dataclasses.replace(shape, multimodal=published["model_type"])
    return shape, published


def _language_model_config(raw: dict, path: Path) -> dict:
    """The config of the model the merge is about: a multimodal release's language model (its text_config, as
    published: transformers fills in the rest), else the file itself."""
    if "text_config" not in raw or "num_hidden_layers" in raw:
        return raw
    kind = MULTIMODAL.get(raw.get("model_type"))
    if kind is None:
        raise UnsupportedInput(f"{path}: multimodal model type {shown(raw.get('model_type'))} is not supported (of "
                               f"the multimodal ones, {', '.join(sorted(MULTIMODAL))} are: their language model is "
                               "merged, their towers carried)")
    text = raw[kind.text_key]
    if not isinstance(text, dict):
        raise MergeError(f"{path}: {kind.text_key} is a JSON {json_kind(text)}; expected the language model's config")
    text = dict(text)
    if text.setdefault("model_type", kind.text_model_type) != kind.text_model_type:
        raise MergeError(f"{path}: {kind.text_key}.model_type is {shown(text['model_type'])}; a {kind.model_type} "
                         f"model's language model is {kind.text_model_type}")
    # transformers ties the output layer by the top level's value (its default where absent), not the text's, and
    # loads in the top level's dtype
    text["tie_word_embeddings"] = bool(transformers_config(raw, kind, path).tie_word_embeddings)
    stated = [raw[k] for k in ("dtype", "torch_dtype") if raw.get(k) is not None]
    if stated:
        text.pop("torch_dtype", None)
        text["dtype"] = stated[0]
    return text


# The ModelShape fields that define the function a model computes (its dtype, the tokenizer beside it and
# which keys were defaulted do not).
FUNCTION_FIELDS = ("model_type", "multimodal", "num_layers", "hidden", "heads", "groups", "head_dim", "ffn", "vocab", "tied",
                   "qkv_bias", "qk_norm", "rope_theta", "rope_scaling", "rotary_percent", "norm_eps", "moe", "mla")


def check_same_model(reference: ModelShape, hf_ref: Path, base_dir: Path) -> None:
    """An HF --base must be the model --hf-ref describes: its own config.json is read as the reference's is,
    and every field that defines the function must agree (the output gets --hf-ref's config, so a base
    with another layer count, RoPE base or model type would be merged into a model that is not its own)."""
    if Path(base_dir).resolve() == Path(hf_ref).resolve():
        return
    base, _ = read_hf_config(Path(base_dir), notes=[])  # its notes are about a config the output does not get
    for name in FUNCTION_FIELDS:
        differing = _first_difference(name, getattr(base, name), getattr(reference, name))
        if differing is not None:
            field, theirs, ours = differing
            raise MergeError(f"{Path(base_dir) / 'config.json'}: the HF base's {field} is {theirs} but --hf-ref's "
                             f"({Path(hf_ref) / 'config.json'}) is {ours}; expected the base to be the model --hf-ref "
                             "describes")


def _first_difference(name: str, theirs, ours) -> tuple[str, str, str] | None:
    """(field, their value, ours) for the first differing field, descending into the MoE, MLA and RoPE
    scaling descriptions so the line names e.g. moe.experts rather than two long descriptions."""
    if theirs == ours:
        return None
    if dataclasses.is_dataclass(theirs) and type(theirs) is type(ours):
        for f in dataclasses.fields(theirs):
            inner = _first_difference(f"{name}.{f.name}", getattr(theirs, f.name), getattr(ours, f.name))
            if inner is not None:
                return inner
    return name, _described(theirs), _described(ours)


def _described(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, RopeScaling):
        return str(value)
    return f"{type(value).__name__}(...)" if dataclasses.is_dataclass(value) else shown(value)


# ---------------------------------------------------------------------------------------------------------
# Which architecture, and transformers' reading of the file


def _architecture(raw: dict, path: Path, notes: list[str]) -> HfConfig:
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type].config
    # A model published under its own model_type with remote code but a supported class in `architectures`
    # (Kimi-K2: kimi_k2, DeepseekV3ForCausalLM) is that class's model to every loader that picks by it.
    by_class = {arch.config.causal_lm: arch.config for arch in ARCHITECTURES.values()}
    names = raw.get("architectures")
    if isinstance(model_type, str) and isinstance(names, list) and len(names) == 1 and names[0] in by_class:
        spec = by_class[names[0]]
        notes.append(f"{path}: model_type {shown(model_type)} with architectures [{shown(names[0])}]: read and merged as "
                     f"{spec.model_type}; its config.json and code files are kept as published")
        return spec
    what = f"model_type {shown(model_type)} is not supported" if "model_type" in raw else "no model_type"
    raise MergeError(f"{path}: {what} (expected one of {', '.join(sorted(ARCHITECTURES))}, or a config whose "
                     f"architectures names one of {', '.join(sorted(by_class))})")


def transformers_config(raw: dict, spec: HfConfig, path: Path):
    """The config object transformers builds from this file for the model type (never remote code)."""
    import transformers

    raise_if_received()  # importing transformers may have swallowed a signal

    try:
        config_class = transformers.CONFIG_MAPPING[spec.model_type]
    except KeyError:
        raise MergeError(f"{path}: transformers {transformers.__version__} does not know model type "
                         f"{shown(spec.model_type)}, so it could not load the merged model; install a transformers that "
                         "does") from None
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)  # deprecation chatter about 4.x keys is not the user's concern here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return config_class.from_dict(copy.deepcopy(raw))
    except (RecursionError, MemoryError):
        raise
    except Exception as exc:  # its own validation of a value: the model would not load
        first = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:2])[:300] if first else type(exc).__name__
        raise MergeError(f"{path}: transformers {transformers.__version__} refuses it: {detail}") from None
    finally:
        logger.setLevel(level)


@functools.lru_cache(maxsize=None)
def _class_parameters(config_class) -> dict:
    """The keys the config class takes, with their defaults (inspect.Parameter.empty where none)."""
    params = inspect.signature(config_class.__init__).parameters
    return {name: p.default for name, p in params.items()
            if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


@functools.lru_cache(maxsize=None)
def _class_keys(config_class) -> dict:
    """The class's parameters (`_class_parameters`) and the attributes its model's code reads from a config
    (`config.X`, `getattr(config, "X"`), which need not be parameters of the class: transformers' Qwen2 reads
    `config.head_dim` that Qwen2Config does not define. Read once per class (a source file per model type)."""
    keys = dict(_class_parameters(config_class))
    modeling = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        spec = importlib.util.find_spec(modeling)
        source = Path(spec.origin).read_text(encoding="utf-8") if spec and spec.origin else ""
    except (ImportError, OSError, ValueError):
        source = ""  # then only the class's parameters count as read
    for name in re.findall(r"""\bconfig\.(\w+)|getattr\(\s*config\s*,\s*["'](\w+)""", source):
        keys.setdefault(name[0] or name[1], inspect.Parameter.empty)
    return keys


def _check_class_keys(fields: ConfigFields, spec: HfConfig, notes: list[str]) -> None:
    """Keys the class does not read: a note. Keys it reads that nothing here examines: their default only."""
    config_class = type(fields.config)
    taken = _class_keys(config_class)
    aliases = dict(getattr(config_class, "attribute_map", {}) or {})
    known = NEUTRAL_KEYS | EXAMINED_KEYS | FAMILY_KEYS[spec.family] | spec.examined_keys
    unread = []
    for key, value in fields.raw.items():
        if key in known or key in aliases and aliases[key] in known:
            continue
        if key not in taken and key not in aliases:
            unread.append(key)
            continue
        default = taken.get(key, taken.get(aliases.get(key), inspect.Parameter.empty))
        if default is inspect.Parameter.empty or value != default:
            raise MergeError(f"{fields.path}: {key}={shown(value)}: transformers' {config_class.__name__} reads it "
                             f"and lora-merge does not know what it changes; expected "
                             f"{'it absent' if default is inspect.Parameter.empty else f'{key}={shown(default)}'}")
    if unread:
        notes.append(f"{fields.path}: keys transformers' {config_class.__name__} does not read (kept as published): "
                     f"{', '.join(sorted(unread))}")


class ConfigFields:
    """Typed access to transformers' reading of config.json (its defaults for absent keys); `raw` is the
    file as published, for what it states itself."""

    def __init__(self, raw: dict, config, path: Path):
        self.raw, self.config, self.path = raw, config, path
        self.defaulted: set[str] = set()
        self._aliases = dict(getattr(type(config), "attribute_map", {}) or {})

    def stated(self, key: str) -> bool:
        """Whether config.json states the key itself (under its own name or transformers' alias for it)."""
        return key in self.raw or any(self._aliases.get(k) == key or self._aliases.get(key) == k for k in self.raw)

    def get(self, key: str, default=None):
        if not self.stated(key):
            self.defaulted.add(key)
        value = getattr(self.config, key, default)
        return default if value is None and default is not None else value

    def _bad(self, key: str, value, expected: str):
        absent = "" if self.stated(key) else " (the key is missing)"
        return MergeError(f"{self.path}: {shown(key)} must be {expected}, found {shown(value)}{absent}")

    def positive_int(self, key: str, nullable: bool = False) -> int | None:
        value = self.get(key)
        if value is None and nullable:
            return None
        if not is_int(value) or value <= 0:
            raise self._bad(key, value, "a positive integer" + (" or null" if nullable else ""))
        return value

    def count(self, key: str) -> int:
        value = self.get(key) or 0
        if not is_int(value) or value < 0:
            raise self._bad(key, value, "a count (0 or more)")
        return value

    def number(self, key: str) -> float:
        value = self.get(key)
        if not is_number(value) or value <= 0:
            raise self._bad(key, value, "a positive number")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.get(key, False)
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def text(self, key: str, nullable: bool = False) -> str | None:
        value = self.get(key)
        if not (isinstance(value, str) or (value is None and nullable)):
            raise self._bad(key, value, "a string" + (" or null" if nullable else ""))
        return value


# ---------------------------------------------------------------------------------------------------------
# The shape


def _shape(fields: ConfigFields, spec: HfConfig, notes: list[str], tokenizer_ids: int | None) -> ModelShape:
    heads = fields.positive_int("num_attention_heads")
    hidden = fields.positive_int("hidden_size")
    groups = fields.positive_int("num_key_value_heads", nullable=True)
    # null is the class's own "hidden / heads" where the class defines head_dim; where it does not (Qwen2 in
    # transformers 5), a stated null reaches the model code as None
    head_dim = fields.positive_int("head_dim", nullable=not fields.stated("head_dim")
                                   or "head_dim" in _class_parameters(type(fields.config)))
    max_positions = fields.positive_int("max_position_embeddings")
    if spec.hf_only or spec.read_mechanics:
        # RoPE acts in the forward only, and with no Megatron form there is nothing to check it against (a YaRN
        # variant, one RoPE per layer type): the config keeps it as published; the rotated fraction is shown. A
        # family with mechanics of its own checks its RoPE against the args itself.
        rope_theta, rope_scaling, rotary_percent = None, None, rotated_fraction(fields.config)
    else:
        rope_theta, rope_scaling, rotary_percent = hf_rope(fields.raw, fields.config, fields.path, max_positions, notes)
    _check_partial_rope(fields, spec, rotary_percent, head_dim or hidden // heads, rope_scaling)
    if not any("partial_rotary_factor" in d for d in (fields.raw, fields.raw.get("rope_scaling") or {},
                                                      fields.raw.get("rope_parameters") or {}) if isinstance(d, dict)):
        fields.defaulted.add("partial_rotary_factor")  # e.g. glm4_moe's class default, 0.5
    if not any("rope_theta" in d for d in (fields.raw, fields.raw.get("rope_scaling") or {},
                                            fields.raw.get("rope_parameters") or {}) if isinstance(d, dict)):
        fields.defaulted.add("rope_theta")
    num_layers = fields.positive_int("num_hidden_layers")
    return ModelShape(
        model_type=spec.model_type,
        num_layers=num_layers,
        hidden=hidden,
        heads=heads,
        # multi-latent attention gives every head its own key and value; its head sizes are in `mla`
        groups=heads if spec.read_mla else groups or heads,
        head_dim=head_dim or hidden // heads,
        ffn=fields.positive_int(spec.dense_ffn_key),
        vocab=fields.positive_int("vocab_size"),
        tied=fields.flag("tie_word_embeddings"),
        qkv_bias=spec.qkv_bias if isinstance(spec.qkv_bias, bool) else fields.flag(spec.qkv_bias),
        qk_norm=spec.qk_norm if isinstance(spec.qk_norm, bool) else fields.flag(spec.qk_norm),
        moe=spec.read_moe(fields, num_layers) if spec.read_moe else None,
        mla=spec.read_mla(fields) if spec.read_mla else None,
        linear_attention=spec.read_linear_attention(fields, num_layers) if spec.read_linear_attention else None,
        dtype=_dtype(fields),
        rope_theta=rope_theta,
        norm_eps=fields.number("rms_norm_eps"),
        rope_scaling=rope_scaling,
        tokenizer_vocab=tokenizer_ids,
        rotary_percent=rotary_percent,
        hf_only=spec.hf_only,
        mtp_layers=fields.count(spec.mtp_key) if spec.mtp_key in spec.examined_keys else 0,
        mtp_prefix=spec.mtp_prefix,
        mtp_key=spec.mtp_key,
        config_features=frozenset(flag for flag in spec.flags if fields.flag(flag)),
        defaulted=frozenset(fields.defaulted),
        own_mechanics=spec.read_mechanics(fields) if spec.read_mechanics else None,
    )


def _check_partial_rope(fields: ConfigFields, spec: HfConfig, fraction: float, head_dim: int, scaling) -> None:
    """Partial RoPE (the first int(head_dim * fraction) dims of each head rotated, their halves paired, the
    rest passed through) is what Megatron's rotary_percent computes: where the HF class computes it too."""
    if fraction == 1.0:
        return
    path = fields.path
    if not spec.partial_rope:
        raise UnsupportedInput(f"{path}: partial_rotary_factor={fraction:g}: partial RoPE is not supported for "
                               f"{spec.model_type}, whose HF class rotates every dim of a head (Megatron "
                               "args.rotary_percent must then be 1.0); expected 1.0")
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        # 4.x classes differ on partial RoPE (some ignore the factor, 4.x never reads rope_parameters): proven
        # against transformers 5 only
        raise UnsupportedInput(f"{path}: partial_rotary_factor={fraction:g} is read only with transformers 5 or "
                               f"later (installed: {transformers.__version__})")
    rotated = int(head_dim * fraction)
    if rotated < 2 or rotated % 2:
        raise MergeError(f"{path}: partial_rotary_factor={fraction:g} of head_dim={head_dim} rotates {rotated} dims; "
                         "expected an even number of at least 2 (RoPE turns dims in pairs)")
    if scaling is not None:
        raise UnsupportedInput(f"{path}: partial_rotary_factor={fraction:g} with RoPE scaling {scaling}: whether "
                               "Megatron scales the rotated dims as transformers does is not established; expected "
                               "one of the two")


def _dtype(fields: ConfigFields) -> torch.dtype | None:
    value = getattr(fields.config, "dtype", None) or getattr(fields.config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value if value in DTYPES.values() else None
    return DTYPES.get(value) if isinstance(value, str) else None


# ---------------------------------------------------------------------------------------------------------
# What the file states itself, before transformers reads it


def _check_plain_fields(raw: dict, path: Path) -> None:
    # Harmless to the weights, but transformers 5 refuses a config whose switches are not booleans, and a
    # special token outside the vocabulary names no token.
    for key in _BOOLEAN_SWITCHES & raw.keys():
        if not isinstance(raw[key], bool):
            raise MergeError(f"{path}: {shown(key)} must be true or false, found {shown(raw[key])}")
    vocab = raw.get("vocab_size")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id") & raw.keys():
        ids = raw[key] if isinstance(raw[key], list) else [raw[key]]
        for token in ids:
            if token is None and not isinstance(raw[key], list):
                continue
            if not (is_int(token) and token >= 0) or (is_int(vocab) and token >= vocab):
                raise MergeError(f"{path}: {key}={shown(raw[key])}; expected token ids in "
                                 f"0..{vocab if is_int(vocab) else '?'}{' (vocab_size)' if is_int(vocab) else ''} "
                                 "or null")
    for key in ("dtype", "torch_dtype"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise MergeError(f"{path}: {shown(key)} must be a dtype name or null, found {shown(raw[key])}")
    q = raw.get("quantization_config")
    if q is not None and not (is_mxfp4_config(q) and raw.get("model_type") == "gpt_oss"):
        read_fp8_config(q, path)  # block-FP8 releases are read (dequantized), gpt-oss's MXFP4 experts too; others refused


_TYPED_KEYS = {
    "positive integer": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                         "max_position_embeddings"),
    "positive integer or null": ("num_key_value_heads", "head_dim", "sliding_window"),
    "true or false": ("tie_word_embeddings", "use_sliding_window", "attention_bias", "mlp_bias"),
    "a string": ("hidden_act",),
}


def _explain_refusal(raw: dict, path: Path) -> None:
    """Where transformers refused the file, say which value is wrong in our words when we can tell."""
    for expected, keys in _TYPED_KEYS.items():
        for key in keys:
            if key not in raw:
                continue
            value = raw[key]
            if expected.startswith("positive integer") and value is None and expected.endswith("null"):
                continue
            ok = {"true or false": isinstance(value, bool), "a string": isinstance(value, str)}.get(
                expected, is_int(value) and value > 0)
            if not ok:
                raise MergeError(f"{path}: {shown(key)} must be {'a ' if expected.startswith('positive') else ''}{expected}, "
                                 f"found {shown(value)}")
    types, layers = raw.get("layer_types"), raw.get("num_hidden_layers")
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
        raise MergeError(f"{path}: 'layer_types' must be a list of strings or null, found {shown(types)}")
    if isinstance(types, list) and is_int(layers) and len(types) != layers:
        raise MergeError(f"{path}: layer_types has {len(types)} entries for num_hidden_layers={layers}; transformers "
                         "refuses such a config")
    positions = raw.get("max_position_embeddings")
    hf_rope(raw, None, path, positions if is_int(positions) else 2048, [], stated_only=True)


# ---------------------------------------------------------------------------------------------------------
# Values that change the function and that Megatron cannot have trained: refused


def _refuse_unsupported_computation(fields: ConfigFields, spec: HfConfig) -> None:
    path = fields.path
    if not spec.hf_only:  # what a Megatron run can have trained; an HF-only type's config is kept as published
        _refuse_untrainable(fields, spec)
    if spec.qkv_bias is False and fields.get("attention_bias", False):
        # In HF Llama/Mistral/Qwen3 attention_bias also gives o_proj a bias, which Megatron's
        # add_qkv_bias does not have: writing one would be inventing weights.
        raise UnsupportedInput(f"{path}: attention_bias=true for {spec.model_type} (q/k/v *and* o_proj biases) is not supported")
    if fields.get("mlp_bias", False):
        raise UnsupportedInput(f"{path}: mlp_bias=true is not supported")
    for key in spec.must_be_false:
        if fields.flag(key):
            raise UnsupportedInput(f"{path}: {key}=true is not supported for {spec.model_type}: the Megatron model has "
                                   "no such weights; expected false")
    if getattr(fields.config, "pruned_heads", None):
        raise MergeError(f"{path}: pruned_heads={shown(fields.config.pruned_heads)}: pruned attention heads are not "
                         "supported; expected none")
    names = fields.raw.get("architectures")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise fields._bad("architectures", names, "a list of class names or null")
        # Loaders such as vLLM pick the model class from here; the merged weights are a causal LM's.
        for name in names:
            if name != spec.causal_lm:
                raise MergeError(f"{path}: architectures names {shown(name)}; a {spec.model_type} causal LM is "
                                 f"{shown(spec.causal_lm)} (loaders such as vLLM pick the model class from this field)")


def _refuse_untrainable(fields: ConfigFields, spec: HfConfig) -> None:
    """What the HF config computes that the Megatron model cannot have: another activation, sliding windows."""
    path = fields.path
    if spec.read_mechanics is not None:  # the family's windows and activation are its own (own_mechanics)
        return
    act = fields.text("hidden_act")
    if act != "silu":
        raise MergeError(f"{path}: hidden_act={shown(act)}, but the {spec.model_type} MLP Megatron trains is swiglu "
                         "(args.swiglu: silu-gated); expected 'silu'")
    window = fields.raw.get("sliding_window")  # as stated: transformers 4.x does not check its type
    if spec.family == "qwen" and window not in (None, 0) and not (is_int(window) and window > 0):
        raise MergeError(f"{path}: 'sliding_window' must be a positive integer or null, found {shown(window)}")
    if spec.family == "qwen" and fields.flag("use_sliding_window"):
        raise MergeError(f"{path}: use_sliding_window=true: {_NO_SWA} (expected false)")
    if spec.family == "mistral" and fields.get("sliding_window") is not None:
        absent = "" if fields.stated("sliding_window") else \
            f" (transformers' {spec.model_type} default when the key is absent)"
        raise MergeError(f"{path}: sliding_window={shown(fields.get('sliding_window'))}{absent}: {_NO_SWA} "
                         "(expected \"sliding_window\": null)")
    types = fields.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise fields._bad("layer_types", types, "a list of strings or null")
        for i, kind in enumerate(types):
            if kind != "full_attention":
                raise MergeError(f"{path}: layer_types[{i}]={shown(kind)}: {_NO_SWA} (expected only 'full_attention')")


# ---------------------------------------------------------------------------------------------------------
# The tokenizer's ids


def tokenizer_vocab(hf_dir: Path) -> tuple[int, Path] | None:
    """How many token ids the tokenizer files of `hf_dir` can produce (the largest id + 1) and the file
    that names the largest, or None when it has none of them. transformers' tokenizer assigns ids from
    tokenizer.json, from tokenizer_config.json's added_tokens_decoder and from added_tokens.json (slow
    tokenizers): an id in any of them is a token the model must have a row for."""
    found: list[tuple[int, Path]] = []
    for name, reader in (("tokenizer.json", tokenizer_vocab_size), ("tokenizer_config.json", _added_tokens_decoder),
                         ("added_tokens.json", _added_tokens_json)):
        path = hf_dir / name
        if path.exists() or path.is_symlink():
            count = reader(path)
            if count is not None:
                found.append((count, path))
    return max(found, key=lambda item: item[0]) if found else None


def _checked_ids(ids, path: Path, what: str) -> int | None:
    for i in ids:
        if not is_int(i) or i < 0:
            raise MergeError(f"{path}: malformed {path.name}: {what} {shown(i)}; expected non-negative integers")
    return max(ids) + 1 if ids else None


def tokenizer_vocab_size(path: Path) -> int | None:
    """How many token ids tokenizer.json can produce (its largest id + 1), or None without a tokenizer.json."""
    if not path.exists() and not path.is_symlink():
        return None
    tok = read_json(path, missing=f"{path}: missing")

    def bad(what: str):
        return MergeError(f"{path}: malformed tokenizer.json: {what}")

    if not isinstance(tok, dict):
        raise bad(f"the top level is a JSON {json_kind(tok)}; expected an object")
    model = tok.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        ids = list(vocab.values())
    elif isinstance(vocab, list):  # Unigram: [token, score] pairs, the id is the position
        ids = [len(vocab) - 1] if vocab else []
    else:
        raise bad(f"model.vocab is {json_kind(vocab)}; expected an object (token -> id) or a list (Unigram)")
    added = tok.get("added_tokens", [])
    if not isinstance(added, list) or not all(isinstance(t, dict) for t in added):
        raise bad("added_tokens is not a list of objects")
    ids += [t.get("id") for t in added]
    return _checked_ids(ids, path, "token id")


def _added_tokens_decoder(path: Path) -> int | None:
    """tokenizer_config.json's added_tokens_decoder: {"151643": {"content": "<|endoftext|>", ...}, ...}."""
    config = read_json(path)
    if not isinstance(config, dict):
        raise MergeError(f"{path}: the top level is a JSON {json_kind(config)}; expected an object")
    decoder = config.get("added_tokens_decoder")
    if decoder is None:
        return None
    if not isinstance(decoder, dict):
        raise MergeError(f"{path}: added_tokens_decoder is a JSON {json_kind(decoder)}; expected an object "
                         "(token id -> token)")
    ids = []
    for key in decoder:
        if not (key.isascii() and key.isdigit()):
            raise MergeError(f"{path}: added_tokens_decoder has the key {shown(key)}; expected token ids "
                             "(non-negative integers written as strings)")
        ids.append(int(key))
    return _checked_ids(ids, path, "token id")


def _added_tokens_json(path: Path) -> int | None:
    """added_tokens.json (slow tokenizers): {"<token>": id, ...}."""
    added = read_json(path)
    if not isinstance(added, dict):
        raise MergeError(f"{path}: the top level is a JSON {json_kind(added)}; expected an object (token -> id)")
    return _checked_ids(list(added.values()), path, "token id")
