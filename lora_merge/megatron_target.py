"""What a `--to megatron` run is asked to write: the parallel layout, the checkpoint format, the expert layout,
the vocabulary padding, the MLA naming and the module names (local or TransformerEngine spec) — checked for type and range before any input is opened, and
against the model once it is known (`runs/to_megatron.py` writes it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lora_merge.errors import MergeError
from lora_merge.model.megatron_args import check_has_megatron_form
from lora_merge.model.te_spec import IMPLS, LOCAL
from lora_merge.model.parallel_layout import ParallelLayout
from lora_merge.value_checks import shown_value
from lora_merge.writers.megatron_args import vocab_padding

CKPT_FORMATS = ("torch", "torch_dist")
EXPERT_LAYOUTS = ("sequential", "grouped")
MLA_NAMINGS = ("megatron-core", "mindspeed")


@dataclass
class MegatronTarget:
    """What the user asked the checkpoint to be."""

    layout: ParallelLayout = field(default_factory=ParallelLayout)
    ckpt_format: str = "torch"
    expert_layout: str = "sequential"
    make_vocab_size_divisible_by: int | None = None  # None: Megatron's 128, or --padded-vocab-size's own
    padded_vocab_size: int | None = None
    mla_naming: str = "megatron-core"  # or "mindspeed": MLA's down-projections fused into linear_qkv
    transformer_impl: str = LOCAL  # or "transformer_engine": the TE spec's names and _extra_state (model/te_spec.py)

    def check_values(self) -> None:
        """Every choice of the right type and range, whatever the model: before any input is opened. One rule
        for the command line and the API (the command line passes what was typed, defaults left None)."""
        for option, value, choices in (("--ckpt-format", self.ckpt_format, CKPT_FORMATS),
                                       ("--expert-layout", self.expert_layout, EXPERT_LAYOUTS),
                                       ("--mla-naming", self.mla_naming, MLA_NAMINGS),
                                       ("--transformer-impl", self.transformer_impl, IMPLS)):
            if not isinstance(value, str) or value not in choices:
                raise MergeError(f"{option} {shown_value(value)}: expected one of {', '.join(choices)}")
        self.layout.check_values()
        vocab_padding(1, 1, self.make_vocab_size_divisible_by, None)  # the divisor's type and range
        if self.padded_vocab_size is not None:
            vocab_padding(1, 1, None, self.padded_vocab_size)  # the size's type and range

    def check_model(self, shape) -> int:
        """The layout against the model; returns the padded vocabulary."""
        check_has_megatron_form(shape, "--to megatron")  # first: no layout of such a model is worth checking
        self.layout.check(shape)
        if self.mla_naming == "mindspeed" and (shape.mla is None or self.ckpt_format != "torch"):
            raise MergeError("--mla-naming mindspeed: MindSpeed-LLM's fused MLA naming is written for multi-latent "
                             "attention models in --ckpt-format torch only")
        if self.mla_naming == "mindspeed" and shape.mtp_in_source:
            raise MergeError("--mla-naming mindspeed with multi-token-prediction layers: MindSpeed-LLM's MTP layout "
                             "differs from Megatron-Core's and is not written; use --mla-naming megatron-core")
        if self.mla_naming == "mindspeed" and self.transformer_impl != LOCAL:
            raise MergeError("--mla-naming mindspeed with --transformer-impl transformer_engine: MindSpeed-LLM's fused "
                             "MLA is a local-spec layout; use --mla-naming megatron-core")
        if self.expert_layout == "grouped" and shape.moe is None:
            raise MergeError("--expert-layout grouped: the model has no routed experts")
        if shape.own_mechanics is not None:  # what the family's Megatron model can be built at
            shape.own_mechanics.check_target(self)
        return vocab_padding(shape.vocab, self.layout.tp, self.make_vocab_size_divisible_by, self.padded_vocab_size)
