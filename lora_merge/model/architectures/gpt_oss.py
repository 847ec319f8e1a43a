"""gpt-oss (`gpt_oss`: gpt-oss-20b, -120b): GQA with biases on q/k/v/o and a learned attention sink per head
(`self_attn.sinks`), alternating sliding-window layers, and in every layer a router with a bias and experts stored
stacked as transformers holds them: `mlp.experts.gate_up_proj` [E, hidden, 2·ffn] (in → out; gate and up columns
interleaved), `down_proj` [E, ffn, hidden], and their biases. PEFT adapts the stacked parameters through
target_parameters, each expert by its own factors (lora.StackedExpertsDelta). The MXFP4 release
(`_blocks`/`_scales`) is read dequantized expert by expert (lora_merge/mxfp4.py).

Megatron-Core (local spec) holds each expert's parameters apart, `mlp.experts.{e}.linear_fc1.weight` [gate; up]
[2·ffn, hidden] and so on: each is one row of the stacked HF tensor (layout.ExpertSlab), so the experts are read
and written at expert TP = 1 only (the local SequentialMLP's expert biases need it too). Its mechanics, each an
argument of the run (`GptOssMechanics` checks them against the config and writes them):
- sinks: softmax_type "learnable", the parameter `self_attention.core_attention.softmax_offset` [heads] (split
  over TP by heads), HF's `sinks` unscaled;
- sliding windows: window_size (W-1, 0) attends W tokens, as HF's sliding_window W; window_attn_skip_freq 2
  windows Megatron's layers 1, 3, … (1-indexed), HF's `sliding_attention` layers 0, 2, …;
- the MLP: quick_geglu (x·σ(1.702x) gated), glu_linear_offset 1 (HF's `up + 1`), activation_func_clamp_value = HF's
  swiglu_limit; biases on every linear (add_bias_linear);
- RoPE: YaRN (position_embedding_type "yarn", its factor, original context, betas, and no rounding of the
  correction range: HF's truncate false).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.model.architectures.base import Architecture, HfConfig, PeftQuirks
from lora_merge.model.architectures.dense import EMBEDDING, FINAL, INPUT_NORM, O_PROJ, PRE_MLP_NORM, QKV
from lora_merge.model.layout import ColumnParallel, ExpertSlab, Replicated
from lora_merge.model.moe_shape import MoeShape
from lora_merge.shown import shown
from lora_merge.value_checks import is_int, is_number

QUICK_GELU_ALPHA = 1.702  # Megatron's quick_gelu: x * sigmoid(1.702 x)


def read_moe(fields, num_layers: int) -> MoeShape:
    return MoeShape(fields.positive_int("num_local_experts"), fields.positive_int("num_experts_per_tok"),
                    fields.positive_int("intermediate_size"), 0, False, True, frozenset(range(num_layers)))


@dataclass(frozen=True)
class GptOssMechanics:
    """What gpt-oss's config says it computes that a Megatron run records in its args (see the module's doc)."""

    sliding_window: int | None
    windowed: tuple[int, ...]  # the layers with sliding-window attention (HF layer numbers)
    clamp: float  # swiglu_limit
    alpha: float  # swiglu_alpha
    rope_theta: float
    rope_type: str  # "yarn" (the releases) or "default"
    yarn: tuple[tuple[str, float], ...]  # factor, original_max_position_embeddings, beta_fast, beta_slow
    truncate: bool
    rope_extra: tuple[str, ...]  # RoPE parameters beyond those (an attention_factor, mscale …)
    # the generic argument checks this family answers itself (model/megatron_args.py)
    handles = frozenset({"add_bias_linear", "position_embedding_type", "swiglu", "window", "rope", "glu_linear_offset",
                         "activation_func_clamp_value", "softmax_type"})

    def mechanics(self) -> list[str]:
        window = f"a {self.sliding_window}-token window in {len(self.windowed)} layers, " if self.windowed else ""
        rope = f"YaRN RoPE (factor {dict(self.yarn)['factor']:g})" if self.yarn else f"RoPE ({self.rope_type})"
        return [f"attention sinks, {window}clamped quick-GeGLU (limit {self.clamp:g}), {rope}"]

    def megatron_args(self, num_layers: int) -> dict:
        """The args a Megatron-LM run of this model records."""
        yarn = dict(self.yarn)
        rope = dict(  # Megatron-LM's argument names (--rotary-scaling-factor, --mscale: shared with MLA's YaRN)
            # (use_rotary_position_embeddings would turn Megatron-LM's position_embedding_type back to "rope")
            position_embedding_type="yarn", use_rotary_position_embeddings=False,
            rotary_base=self.rope_theta, rotary_scaling_factor=yarn["factor"],
            yarn_original_max_position_embeddings=int(yarn["original_max_position_embeddings"]),
            yarn_beta_fast=yarn["beta_fast"], yarn_beta_slow=yarn["beta_slow"], mscale=1.0, mscale_all_dim=0.0,
            yarn_correction_range_round_to_int=self.truncate,
        ) if self.yarn else dict(position_embedding_type="rope", rotary_base=self.rope_theta)
        return dict(**rope,
            add_bias_linear=True, swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
            activation_func_clamp_value=self.clamp, bias_gelu_fusion=False, bias_swiglu_fusion=False,
            softmax_type="learnable", window_size=(self.sliding_window - 1, 0) if self.windowed else None,
            window_attn_skip_freq=self._skip_freq(num_layers) if self.windowed else None,
            moe_router_score_function="softmax", moe_router_pre_softmax=False,
        )

    @staticmethod
    def check_target(target) -> None:
        """What a `--to megatron` layout of it may be (megatron_target.MegatronTarget)."""
        layout = target.layout
        if layout.etp > 1:
            given = f"--etp {layout.etp}" + (f" (as --tp {layout.tp}: expert TP is TP unless --etp says otherwise)"
                                              if layout.etp == layout.tp else "")
            raise UnsupportedInput(f"{given}: megatron-core builds gpt-oss's experts (biases on every linear) at expert "
                                   "TP 1 only ('Bias in Moe is only supported when ETP==1'); give --etp 1")
        if target.expert_layout == "grouped":
            raise UnsupportedInput("--expert-layout grouped: gpt-oss's experts have biases, which Megatron-Core's local "
                                   "GroupedMLP has not; write --expert-layout sequential")
        if target.transformer_impl != "local":
            raise UnsupportedInput(f"--transformer-impl {target.transformer_impl}: gpt-oss's sinks in TransformerEngine "
                                   "(its learnable-softmax attention) are not proven here; write --transformer-impl local")

    def _skip_freq(self, num_layers: int):
        """Megatron's window_attn_skip_freq for these windowed layers: 2 when they are 0, 2, 4, … (HF's alternating
        pattern), else the per-layer list (1: windowed)."""
        if self.windowed == tuple(range(0, num_layers, 2)):
            return 2
        return [int(i in self.windowed) for i in range(num_layers)]

    def check_args(self, shape, arg, where: str) -> list[str]:
        """The args against the config; returns notes for what differs by design (the window's one token)."""
        notes = []
        if not shape.qkv_bias:
            raise UnsupportedInput(f"{where}: the HF config's attention_bias=false; Megatron's gpt-oss (add_bias_linear) "
                                   "has q/k/v and output biases (expected attention_bias true)")
        if not math.isclose(self.alpha, QUICK_GELU_ALPHA, rel_tol=1e-9):
            raise UnsupportedInput(f"{where}: the HF config's swiglu_alpha={self.alpha:g}; Megatron's quick_geglu "
                                   f"computes x·sigmoid({QUICK_GELU_ALPHA}·x) (expected swiglu_alpha {QUICK_GELU_ALPHA})")
        expected = {"add_bias_linear": True, "softmax_type": "learnable"}
        for name, value in expected.items():
            if arg(name) is not None and arg(name) != value:
                raise MergeError(f"{where}: args.{name}={shown(arg(name))}; a gpt-oss model is trained with "
                                 f"{name}={shown(value)}")
        gated = bool(arg("quick_geglu")) or (arg("gated_linear_unit") and arg("activation_func") == "quick_gelu")
        if arg("swiglu") or (arg("quick_geglu") is not None and not gated):
            raise MergeError(f"{where}: args.swiglu={shown(arg('swiglu'))}, args.quick_geglu={shown(arg('quick_geglu'))}; "
                             "gpt-oss's MLP is the clamped quick-GeGLU (expected quick_geglu=True)")
        self._check_number(arg, "glu_linear_offset", 1.0, "HF adds 1 to the up projection", where)
        self._check_number(arg, "activation_func_clamp_value", self.clamp, "the HF config's swiglu_limit", where)
        if arg("bias_gelu_fusion") and arg("quick_geglu"):
            notes.append(f"{where}: args.bias_gelu_fusion=True: Megatron's fused quick-GeGLU clamps before adding the "
                         "fc1 bias, HF's gpt-oss after; the weights are merged exactly, but the run computed its MLP "
                         "that way")
        notes += self._check_window(shape, arg, where)
        self._check_rope(arg, where)
        return notes

    @staticmethod
    def _check_number(arg, name: str, expected: float, what: str, where: str) -> None:
        value = arg(name)
        if value is None or not is_number(value) or not math.isclose(float(value), expected, rel_tol=1e-9):
            recorded = f"args.{name}={shown(value)}" if value is not None else f"the args record no {name}"
            raise MergeError(f"{where}: {recorded}; expected {expected:g} ({what})")

    def _check_window(self, shape, arg, where: str) -> list[str]:
        window, freq = arg("window_size"), arg("window_attn_skip_freq")
        if self.windowed and self.sliding_window is None:
            raise MergeError(f"{where}: the HF config's layer_types have sliding_attention layers but no "
                             "sliding_window size")
        if not self.windowed:
            if window:
                raise MergeError(f"{where}: args.window_size={shown(window)}, but the HF config has no sliding-window "
                                 "layers")
            return []
        if window is None:
            raise MergeError(f"{where}: the args record no window_size, but the HF config's layers "
                             f"{', '.join(map(str, self.windowed[:4]))}… attend a {self.sliding_window}-token window")
        if not (isinstance(window, (list, tuple)) and len(window) == 2 and all(is_int(w) for w in window)
                and window[1] == 0 and window[0] in (self.sliding_window - 1, self.sliding_window)):
            raise MergeError(f"{where}: args.window_size={shown(window)}; the HF config's sliding_window "
                             f"{self.sliding_window} is Megatron's ({self.sliding_window - 1}, 0)")
        layers = tuple(i for i in range(shape.num_layers)
                       if (freq is None) or (is_int(freq) and freq > 0 and (i + 1) % freq != 0)
                       or (isinstance(freq, list) and i < len(freq) and freq[i]))
        if freq is not None and not (is_int(freq) and freq > 0) and not (
                isinstance(freq, list) and len(freq) == shape.num_layers and all(v in (0, 1) for v in freq)):
            raise MergeError(f"{where}: args.window_attn_skip_freq={shown(freq)}; expected a positive integer or a "
                             "list of 0/1 per layer")
        if layers != self.windowed:
            raise MergeError(f"{where}: args.window_attn_skip_freq={shown(freq)} windows layers "
                             f"{', '.join(map(str, layers[:6]))}…, the HF config's layer_types window layers "
                             f"{', '.join(map(str, self.windowed[:6]))}…")
        if window[0] == self.sliding_window:
            return [f"{where}: args.window_size={shown(window)} attended {self.sliding_window + 1} tokens in the "
                    f"windowed layers; HF's gpt-oss attends {self.sliding_window} (sliding_window): the weights are "
                    "merged exactly, the window is one token narrower than in training"]
        return []

    def _check_rope(self, arg, where: str) -> None:
        if self.rope_type == "yarn" and not self.yarn or self.rope_extra:
            raise UnsupportedInput(f"{where}: the HF config's RoPE parameters "
                                   f"{', '.join(self.rope_extra) or '(a YaRN without its factor, context and betas)'}: "
                                   "no Megatron YaRN argument matches them")
        if self.rope_type not in ("yarn", "default"):
            raise UnsupportedInput(f"{where}: the HF config's RoPE is {shown(self.rope_type)}; a gpt-oss Megatron run's "
                                   "is YaRN (or plain RoPE)")
        kind, expected = arg("position_embedding_type") or "rope", "yarn" if self.yarn else "rope"
        if arg("use_rotary_position_embeddings") and kind != "rope":  # Megatron-LM then builds "rope"
            kind = "rope"
        if kind != expected:
            raise MergeError(f"{where}: args.position_embedding_type={shown(kind)}, but the HF config's RoPE is "
                             f"{'YaRN' if self.yarn else 'plain'} (expected {expected!r}"
                             f"{', with its yarn_* arguments' if self.yarn else ''}): the merged model would not "
                             "compute what was trained")
        for flag in ("use_rope_scaling", "rope_scaling_type"):
            if arg(flag):
                raise MergeError(f"{where}: args.{flag}={shown(arg(flag))}: RoPE scaling on top of the config's "
                                 f"{'YaRN' if self.yarn else 'plain RoPE'}; the merged model would not compute what "
                                 "was trained")
        if not self.yarn:
            self._check_number(arg, "rotary_base", self.rope_theta, "the HF config's rope_theta", where)
            return
        # Megatron-LM records the factor and mscales under the names MLA's YaRN shares (--rotary-scaling-factor,
        # --mscale, --mscale-all-dim); Megatron-Core's config, and so some tools' args, under yarn_*
        for names, theirs in ((("rotary_base",), self.rope_theta),
                              (("rotary_scaling_factor", "yarn_rotary_scaling_factor"), dict(self.yarn)["factor"]),
                              *(((f"yarn_{k}",), v) for k, v in self.yarn if k != "factor"),
                              (("mscale", "yarn_mscale"), 1.0), (("mscale_all_dim", "yarn_mscale_all_dim"), 0.0)):
            recorded = [(name, arg(name)) for name in names if arg(name) is not None]
            if not recorded and names[0].startswith("mscale"):
                continue  # Megatron's defaults: 1 and 0
            if not recorded:
                raise MergeError(f"{where}: the args record no {' or '.join(names)}, but the HF config's YaRN has "
                                 f"{theirs:g}: cannot confirm the model was trained with it")
            for name, value in recorded:
                if not is_number(value) or not math.isclose(float(value), theirs, rel_tol=1e-6, abs_tol=1e-12):
                    raise MergeError(f"{where}: args.{name}={shown(value)}, but the HF config's YaRN has {theirs:g}"
                                     + (" (HF's attention factor is Megatron's with mscale 1 and mscale_all_dim 0)"
                                        if "mscale" in name else "") + ": the merged model would not compute what "
                                     "was trained")
        rounded = arg("yarn_correction_range_round_to_int")
        if rounded is not None and bool(rounded) != self.truncate:
            raise MergeError(f"{where}: args.yarn_correction_range_round_to_int={shown(rounded)}, but the HF config's "
                             f"YaRN truncate is {str(self.truncate).lower()}")


def read_mechanics(fields) -> GptOssMechanics:
    config = fields.config
    types = list(getattr(config, "layer_types", None) or [])
    kinds = set(types) - {"sliding_attention", "full_attention"}
    if kinds:
        raise MergeError(f"{fields.path}: layer_types has {shown(sorted(kinds)[0])}; gpt-oss's layers are "
                         "'sliding_attention' or 'full_attention'")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    yarn = tuple((k, float(rope[k])) for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
                 if is_number(rope.get(k)))
    window = getattr(config, "sliding_window", None)
    return GptOssMechanics(
        sliding_window=window if is_int(window) and window > 0 else None,
        windowed=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        clamp=float(config.swiglu_limit), alpha=float(getattr(config, "swiglu_alpha", QUICK_GELU_ALPHA)),
        rope_theta=float(rope.get("rope_theta", 0.0)) if is_number(rope.get("rope_theta")) else 0.0,
        rope_type=str(rope.get("rope_type", "default")),
        yarn=yarn if rope.get("rope_type") == "yarn" and len(yarn) == 4 else (),
        truncate=bool(rope.get("truncate", True)),
        rope_extra=tuple(sorted(set(rope) - {"rope_type", "rope_theta", "factor", "original_max_position_embeddings",
                                             "beta_fast", "beta_slow", "truncate"})),
    )


CONFIG = HfConfig(
    "gpt_oss", causal_lm="GptOssForCausalLM", family="mistral", qkv_bias="attention_bias",
    examined_keys=frozenset({"num_local_experts", "num_experts_per_tok", "attention_bias", "swiglu_limit",
                             "swiglu_alpha", "layer_types", "sliding_window", "router_aux_loss_coef"}),
    read_moe=read_moe, fused_experts="mlp.experts", peft=PeftQuirks(stacked_in_out=True),
    read_mechanics=read_mechanics,
)


def expert(megatron: str, dims, hf: str, hf_dims, form: str, split: str) -> ExpertSlab:
    return ExpertSlab(f"mlp.experts.{{expert}}.{megatron}", dims, hf=f"mlp.experts.{hf}", hf_dims=hf_dims, form=form,
                      split=split, layers="moe")


ARCHITECTURE = Architecture(
    name="gpt_oss", before_layers=EMBEDDING, after_layers=FINAL, config=CONFIG,
    layer_rules=(
        INPUT_NORM,
        *QKV,
        O_PROJ,
        Replicated("self_attention.linear_proj.bias", ("hidden",), hf="self_attn.o_proj.bias", requires="qkv_bias"),
        ColumnParallel("self_attention.core_attention.softmax_offset", ("heads",), hf="self_attn.sinks"),
        PRE_MLP_NORM,
        Replicated("mlp.router.weight", ("experts", "hidden"), hf="mlp.router.weight", layers="moe"),
        Replicated("mlp.router.bias", ("experts",), hf="mlp.router.bias", layers="moe"),
        expert("linear_fc1.weight", ("gated_moe_ffn", "hidden"), "gate_up_proj", ("experts", "hidden", "gated_moe_ffn"),
               "transposed_interleaved", "column"),
        expert("linear_fc1.bias", ("gated_moe_ffn",), "gate_up_proj_bias", ("experts", "gated_moe_ffn"), "interleaved",
               "column"),
        expert("linear_fc2.weight", ("hidden", "moe_ffn"), "down_proj", ("experts", "moe_ffn", "hidden"), "transposed",
               "row"),
        expert("linear_fc2.bias", ("hidden",), "down_proj_bias", ("experts", "hidden"), "as_is", "replicated"),
    ),
)
