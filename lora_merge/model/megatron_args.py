"""The HF model's shape checked against the args the Megatron run recorded: every architecture fact both
state must agree, or the merged model is not the one that was trained."""

from __future__ import annotations

import math

from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.model.layer_numbering import noop_layers
from lora_merge.model.mla_shape import check_mla_args
from lora_merge.model.model_shape import ModelShape
from lora_merge.model.moe_shape import check_moe_args
from lora_merge.model.rope import check_rope_scaling
from lora_merge.value_checks import finite_number, is_int, positive_int
from lora_merge.shown import shown


# TransformerConfig mechanics (Megatron-LM records them as args by the same names) at the values that leave the
# attention and MLP as the HF families here compute them; a family that has one says so (`own_mechanics.handles`)
UNMODELED = {"qk_l2_norm": False, "softmax_scale": None, "attention_output_gate": False, "glu_linear_offset": 0.0,
             "activation_func_clamp_value": None, "softmax_type": "vanilla",
             # (1 + w) norms: Megatron-LM up to 0.15 records --apply-layernorm-1p by that name, 0.16 by the field's
             "apply_layernorm_1p": False, "layernorm_zero_centered_gamma": False}


def check_against_args(shape: ModelShape, args, where: str) -> list[str]:
    """Every architecture fact that the Megatron args also record must agree with the HF config. Returns notes on
    what differs by design (a family's own mechanics may have some)."""
    check_has_megatron_form(shape, where)  # first: nothing else is worth comparing then
    own = shape.own_mechanics
    handled = own.handles if own is not None else frozenset()
    def arg(name, default=None):
        value = getattr(args, name, default)
        return default if value is None else value

    def size(name, default=None):
        """A size the args record, checked to be one (hidden_size="64" is not: the args are not Megatron's)."""
        value = arg(name, default)
        return None if value is None else positive_int(value, f"args.{name}", where)

    gqa = bool(arg("group_query_attention", False))
    groups = size("num_query_groups", shape.heads) if gqa else size("num_attention_heads", shape.heads)
    heads = size("num_attention_heads", shape.heads)
    checks = [
        ("num_layers", size("num_layers"), shape.num_layers + _noop_count(args), "num_hidden_layers"),
        ("hidden_size", size("hidden_size"), shape.hidden, "hidden_size"),
        ("num_attention_heads", heads, shape.heads, "num_attention_heads"),
    ]
    if shape.mla is None:  # multi-latent attention has its own head sizes (check_mla_args)
        checks += [("num_query_groups", groups, shape.groups, "num_key_value_heads"),
                   ("kv_channels", size("kv_channels", shape.hidden // heads if heads else None), shape.head_dim,
                    "head_dim")]
    if shape.moe is None or len(shape.moe.layers) < shape.num_layers:  # only dense layers use it
        checks.append(("ffn_hidden_size", size("ffn_hidden_size"), shape.ffn, "intermediate_size"))
    for arg_name, theirs, ours, hf_name in checks:
        if theirs is not None and theirs != ours:
            raise MergeError(f"{where}: args.{arg_name}={theirs} but the HF config's {hf_name} implies {ours}"
                             f"{_defaulted(shape, hf_name)}")
    untie = arg("untie_embeddings_and_output_weights")
    if untie is not None and bool(untie) == shape.tied:
        raise MergeError(f"{where}: args.untie_embeddings_and_output_weights={shown(untie)} but the HF config has "
                         f"tie_word_embeddings={shape.tied}{_defaulted(shape, 'tie_word_embeddings')}")
    qkv_bias = arg("add_qkv_bias")
    if qkv_bias is None and arg("add_bias_linear") is not None and "add_bias_linear" not in handled:
        qkv_bias = arg("add_bias_linear")
    if qkv_bias is not None and bool(qkv_bias) != shape.qkv_bias:
        raise MergeError(f"{where}: args.add_qkv_bias={shown(qkv_bias)} but the HF config ({shape.model_type}) "
                         f"{'has' if shape.qkv_bias else 'has no'} q/k/v biases")
    qk_norm = arg("qk_layernorm")  # with MLA: the norms of the compressed q and kv, which DeepSeek always has
    if qk_norm is not None and bool(qk_norm) != (shape.qk_norm or shape.mla is not None):
        raise MergeError(f"{where}: args.qk_layernorm={shown(qk_norm)} but the HF config ({shape.model_type}) "
                         f"{'has' if shape.qk_norm else 'has no'} q/k norms")
    _check_function_args(shape, arg, where, handled)
    check_moe_args(shape.moe, args, shape.num_layers, where)
    check_mla_args(shape.mla, args, where)
    if "rope" not in handled:
        check_rope_scaling(shape, args, arg, where)
    _check_vocab_args(shape, size, arg, where)
    mtp = arg("mtp_num_layers")
    if mtp and (not is_int(mtp) or mtp != shape.mtp_layers):
        raise MergeError(f"{where}: args.mtp_num_layers={shown(mtp)} but the HF config's {shape.mtp_key} is "
                         f"{shape.mtp_layers}{_defaulted(shape, shape.mtp_key)}: the multi-token-prediction "
                         "layers would not map one to one")
    for name, default in UNMODELED.items():
        value = arg(name)
        if value is not None and value != default and name not in handled:
            raise UnsupportedInput(f"{where}: args.{name}={shown(value)}: a mechanic the {shape.model_type} model "
                                   f"does not have (expected {shown(default)}); the merged model would not be the one "
                                   "trained")
    if arg("swiglu") is False and "swiglu" not in handled:
        raise MergeError(f"{where}: args.swiglu=False, but the {shape.model_type} MLP is gated (swiglu)")
    return own.check_args(shape, arg, where) if own is not None else []


def check_has_megatron_form(shape: ModelShape, where: str) -> None:
    """Model types whose Megatron form no Megatron run here could prove (their architecture says why) are
    merged on the HF routes only: their Megatron checkpoints are neither read nor written."""
    if shape.hf_only:
        raise UnsupportedInput(f"{where}: {shape.model_type} is merged from HF bases (with PEFT adapters) only: "
                               f"{shape.hf_only}, so its Megatron checkpoints are not read or written")


def _check_function_args(shape: ModelShape, arg, where: str, handled: frozenset = frozenset()) -> None:
    """Args that change what the trained model computes without changing any tensor shape: the HF config
    must describe the same function, or the merged model is not the trained one."""
    fixed = [("rotary_interleaved", False), ("apply_layernorm_1p", False), ("add_bias_linear", False),
             ("position_embedding_type", "rope"), ("normalization", "RMSNorm")]
    for name, expected in fixed:
        if name in handled:
            continue
        value = arg(name)
        if value is not None and value != expected:
            raise MergeError(f"{where}: args.{name}={shown(value)}; only {shown(expected)} maps onto a HF {shape.model_type} model")
    # (Megatron-LM 0.16 records --norm-epsilon as layernorm_epsilon, earlier releases as norm_epsilon)
    for name, theirs, ours, hf_name in (("rotary_base", arg("rotary_base"), shape.rope_theta, "rope_theta"),
                                        ("norm_epsilon", arg("norm_epsilon"), shape.norm_eps, "rms_norm_eps"),
                                        ("layernorm_epsilon", arg("layernorm_epsilon"), shape.norm_eps, "rms_norm_eps")):
        if theirs is not None and ours is not None and not math.isclose(
                finite_number(theirs, f"args.{name}", where, 0, low_open=True), ours, rel_tol=1e-6):
            raise MergeError(f"{where}: args.{name}={theirs} but the HF config's {hf_name} is {ours}"
                             f"{_defaulted(shape, hf_name)}: the merged model would not compute what was trained")
    # Megatron rotates the first int(kv_channels * rotary_percent) dims of each head, as transformers does with
    # partial_rotary_factor. MindSpeed's --use-glm-rope (ModelLink's --use-partial-rope) is ChatGLM's rotary,
    # which turns interleaved pairs of dims: another function.
    for flag in ("use_glm_rope", "use_partial_rope"):
        if arg(flag):
            raise UnsupportedInput(f"{where}: args.{flag}={shown(arg(flag))}: MindSpeed's GLM rotary (ChatGLM's, "
                                   "interleaved pairs) is not what the HF class computes; expected none")
    recorded = arg("rotary_percent")
    percent = 1.0 if recorded is None else finite_number(recorded, "args.rotary_percent", where, 0, 1, low_open=True)
    if not math.isclose(percent, shape.rotary_percent, rel_tol=1e-9):
        said = f"args.rotary_percent={shown(recorded)}" if recorded is not None else \
            "the args record no rotary_percent (Megatron's default 1.0)"
        raise MergeError(f"{where}: {said} but the HF config's partial_rotary_factor is {shape.rotary_percent:g}"
                         f"{_defaulted(shape, 'partial_rotary_factor')}: the merged model would not compute what was "
                         "trained")
    # MindSpeed --sliding-window, Megatron --window-size: attention limited to a window in training.
    for name in ("sliding_window", "window_size"):
        if arg(name) is not None and not (name == "window_size" and "window" in handled):
            raise MergeError(f"{where}: args.{name}={shown(arg(name))}: the model was trained with sliding-window "
                             "attention, which the HF config does not describe; expected none")


# Megatron-LM's --make-vocab-size-divisible-by default (MindSpeed keeps it): the rule's divisor when the
# args do not record one.
DEFAULT_VOCAB_DIVISOR = 128


def _check_vocab_args(shape: ModelShape, size, arg, where: str) -> None:
    padded = size("padded_vocab_size")
    if padded is not None and padded < shape.vocab:
        raise MergeError(f"{where}: args.padded_vocab_size={padded} is smaller than the HF vocab_size={shape.vocab}")
    if padded is not None and padded > shape.vocab:
        _check_padding_rule(shape.vocab, padded, arg, where)
    # The unpadded vocabulary some Megatron/MindSpeed args record: its rows were trained, none may be cut.
    unpadded = size("vocab_size")
    if unpadded is not None and unpadded > shape.vocab:
        raise MergeError(f"{where}: args.vocab_size={unpadded} is larger than the HF config's vocab_size={shape.vocab}; "
                         f"trained rows would be cut (expected vocab_size >= {unpadded})")


def _check_padding_rule(vocab: int, padded: int, arg, where: str) -> None:
    """The merge keeps the first `vocab` of the `padded` embedding rows; the rest may only be Megatron's own
    padding. Megatron (and MindSpeed, for a padded_vocab_size it computes) pads the tokenizer's vocabulary
    up to a multiple of make_vocab_size_divisible_by × TP (training/tokenizer _vocab_size_with_padding), so
    the vocabulary trained had more than padded − multiple ids. An HF vocab_size at or below that would
    cut trained rows: it is refused (a --padded-vocab-size given to MindSpeed by hand is usually the HF
    vocab_size itself; any other is refused too, as nothing then tells padding from trained rows)."""
    divisor = arg("make_vocab_size_divisible_by")
    tp = arg("tensor_model_parallel_size", 1)
    recorded = divisor is not None
    divisor = divisor if recorded else DEFAULT_VOCAB_DIVISOR
    if not (isinstance(divisor, int) and not isinstance(divisor, bool) and divisor > 0
            and isinstance(tp, int) and not isinstance(tp, bool) and tp > 0):
        raise MergeError(f"{where}: args.make_vocab_size_divisible_by={shown(divisor)} and "
                         f"args.tensor_model_parallel_size={shown(tp)}; expected positive integers (they decide "
                         "Megatron's vocabulary padding)")
    multiple = divisor * tp
    expected = -(-vocab // multiple) * multiple
    if padded % multiple:  # not computed by the rule: a --padded-vocab-size given by hand (MindSpeed)
        raise MergeError(f"{where}: args.padded_vocab_size={padded} is not a multiple of make_vocab_size_divisible_by x "
                         f"tensor_model_parallel_size = {divisor} x {tp}, so it was set by hand and nothing tells "
                         f"padding from trained rows; the HF config's vocab_size={vocab} would cut rows "
                         f"{vocab}..{padded - 1}; expected vocab_size={padded}")
    if expected != padded:
        source = (f"args.make_vocab_size_divisible_by={divisor}" if recorded
                  else f"Megatron's default make_vocab_size_divisible_by={divisor} (the args record none)")
        raise MergeError(f"{where}: args.padded_vocab_size={padded} but the HF config's vocab_size={vocab} pads to "
                         f"{expected} under Megatron's rule (round up to a multiple of {source} x "
                         f"tensor_model_parallel_size={tp} = {multiple}): the checkpoint's vocabulary had more than "
                         f"{padded - multiple} ids, and rows {vocab}..{padded - 1} would be cut; expected an HF "
                         f"vocab_size of {padded - multiple + 1}..{padded} (the reference of the tokenizer trained "
                         "with)")


# Megatron-LM: --use-rope-scaling applies the llama3 rule with low/high_freq_factor 1/4 and an original
# context of 8192 fixed in RotaryEmbedding._apply_scaling, and --rope-scaling-factor (default 8.0);
# --rotary-seq-len-interpolation-factor is linear position interpolation (positions / factor).
# MindSpeed-LLM: --rope-scaling-type {llama3, yarn, longrope, plm}. llama3 reads --rope-scaling-factor,
# --low-freq-factor, --high-freq-factor, --original-max-position-embeddings. yarn reads --rope-scaling-factor
# (older releases --yarn-scaling-factor), --rope-scaling-beta-fast/-slow (newer --beta-fast/--beta-slow),
# --rope-scaling-mscale, --rope-scaling-mscale-all-dim (cos/sin scaled by their mscale ratio) and


def _defaulted(shape: ModelShape, hf_name: str) -> str:
    if hf_name in shape.defaulted:
        return f" (absent from config.json, so transformers' {shape.model_type} default)"
    return ""


def _noop_count(args) -> int:
    return len(noop_layers(args))
