"""Multi-latent attention (DeepSeek-V2/V3): its sizes, read from the HF config by the architecture module,
and their check against the Megatron args."""

from __future__ import annotations

from dataclasses import dataclass

from lora_merge.errors import MergeError
from lora_merge.shown import shown


@dataclass(frozen=True)
class MlaShape:
    q_lora: int | None  # q_lora_rank; None: q is projected from the hidden state directly (V2-Lite)
    kv_lora: int
    nope: int  # per-head q/k dims without rotary embedding (qk_nope_head_dim)
    rope: int  # per-head q/k dims with it (qk_rope_head_dim), one shared rotary key for all heads
    v: int  # per-head value dims (v_head_dim)
    # DeepSeek-V3.2's sparse-attention indexer (DSA): its heads and head size, None without one
    index_heads: int | None = None
    index_head_dim: int | None = None
    indexer_layers: frozenset[int] | None = None  # the layers with their own indexer (None: every layer; GLM-5)

    def __str__(self) -> str:
        indexer = f", DSA indexer {self.index_heads}x{self.index_head_dim}" if self.index_heads else ""
        return (f"MLA q_lora {self.q_lora}, kv_lora {self.kv_lora}, qk {self.nope}+{self.rope} (rope), v {self.v}"
                + indexer)

    def dims(self, heads: int) -> dict[str, int]:
        q_rows = self.q_lora or heads * (self.nope + self.rope)  # what MindSpeed fuses with the kv down-projection
        dims = {"kv_lora": self.kv_lora, "kv_down": self.kv_lora + self.rope,
                "q_kv_down": q_rows + self.kv_lora + self.rope, "q_heads": heads * (self.nope + self.rope),
                "kv_heads": heads * (self.nope + self.v), "v_heads": heads * self.v}
        if self.q_lora:
            dims["q_lora"] = self.q_lora
        if self.index_heads:
            dims.update(index_q=self.index_heads * self.index_head_dim, index_head=self.index_head_dim,
                        index_heads=self.index_heads)
        return dims


# Megatron-LM's argument names, and MindSpeed-LLM's where they differ
_ARGS = (("q_lora_rank", ("q_lora_rank",)), ("kv_lora_rank", ("kv_lora_rank",)),
         ("qk_nope_head_dim", ("qk_head_dim", "qk_nope_head_dim")),
         ("qk_rope_head_dim", ("qk_pos_emb_head_dim", "qk_rope_head_dim")), ("v_head_dim", ("v_head_dim",)))


def check_mla_args(mla: MlaShape | None, args, where: str) -> None:
    trained = bool(getattr(args, "multi_latent_attention", False) or getattr(args, "multi_head_latent_attention", False))
    if mla is None:
        if trained:
            raise MergeError(f"{where}: args.multi_latent_attention=True, but the HF config describes ordinary "
                             "attention")
        return
    if not trained:
        raise MergeError(f"{where}: the HF config describes multi-latent attention (DeepSeek), but the args do not "
                         "enable it (multi_latent_attention)")
    ours = {"q_lora_rank": mla.q_lora, "kv_lora_rank": mla.kv_lora, "qk_nope_head_dim": mla.nope,
            "qk_rope_head_dim": mla.rope, "v_head_dim": mla.v}
    for hf_name, names in _ARGS:
        for name in names:
            if hasattr(args, name) and getattr(args, name) != ours[hf_name] and not (
                    hf_name == "q_lora_rank" and not getattr(args, name) and not ours[hf_name]):
                raise MergeError(f"{where}: args.{name}={shown(getattr(args, name))} but the HF config's {hf_name} is "
                                 f"{ours[hf_name]}")
    if getattr(args, "mla_mm_split", False):
        raise MergeError(f"{where}: args.mla_mm_split=True splits the up-projections into per-part matrices "
                         "whose layout is not documented; convert the checkpoint without it")


def megatron_mla_args(mla: MlaShape) -> dict:
    """The args that record these MLA sizes (Megatron-LM's names, and MindSpeed-LLM's switch), as
    `check_mla_args` reads them back."""
    return dict(multi_latent_attention=True, multi_head_latent_attention=True, q_lora_rank=mla.q_lora,
                kv_lora_rank=mla.kv_lora, qk_head_dim=mla.nope, qk_pos_emb_head_dim=mla.rope, v_head_dim=mla.v,
                kv_channels=None, num_query_groups=None, group_query_attention=False)
