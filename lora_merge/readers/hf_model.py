"""An HF model directory as the base of a merge (`--base HF_DIR`): its safetensors tensors by HF name, each
a view of the mapped file, so a Megatron LoRA merges straight onto the original HF weights.

Headers and the index are checked as `verify` checks them (sizes, offsets, no gaps, files inside the
directory); symlinks into an HF cache are followed. Tensors no rule writes are an error, as for a
Megatron base, except the rotary tables some exporters save (recomputed from the config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.fp8 import SCALE_SUFFIX, Fp8Format, Fp8Weight, check_scales, read_fp8_config, scale_shape
from lora_merge.files.pages import release_pages
from lora_merge.readers.checkpoint import TensorRef
from lora_merge.readers.safetensors_file import tensor_refs
from lora_merge.files.small_files import read_json
from lora_merge.model.multimodal import MULTIMODAL, Renamed, rename
from lora_merge.mxfp4 import (BLOCKS_SUFFIX, SCALES_SUFFIX, Mxfp4Weight, check_pair, check_scales as check_mxfp4_scales,
                              is_mxfp4_config)
INDEX = "model.safetensors.index.json"
DERIVED = (".rotary_emb.inv_freq",)  # buffers computed from the config, not weights


def is_hf_model_dir(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and (
        (path / INDEX).exists() or any(path.glob("*.safetensors")))


@dataclass
class HfModel:
    """What the merge needs of a base: tensors by (HF) name, what was skipped, what was read."""

    path: Path
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    sources: list = field(default_factory=list)
    format: str = "HF"

    fp8: Fp8Format | None = None  # a block-FP8 release: its quantized weights read dequantized
    mxfp4: bool = False  # an MXFP4 release (gpt-oss): its stacked experts read dequantized
    names: Renamed | None = None  # a multimodal release: its language model's tensors under our names

    @property
    def dtype(self) -> torch.dtype:
        """The dtype most of its bytes have (of an FP8 release: that of the tensors it left unquantized)."""
        weight: dict[torch.dtype, int] = {}
        for ref in self.tensors.values():
            if not isinstance(ref, (Fp8Ref, Mxfp4Ref)):
                weight[ref.dtype] = weight.get(ref.dtype, 0) + ref.nbytes
        return max(weight, key=weight.get) if weight else torch.bfloat16

    # the Source interface (readers/source.py)
    hf_named = True
    megatron_args = None
    experts = None
    replicas = ()

    @property
    def weights_dtype(self) -> torch.dtype:
        return self.dtype

    def has(self, megatron_name: str) -> bool:
        """Whether it holds a parameter by that Megatron name (which of two namings a checkpoint uses): never,
        its tensors are named as HF names them."""
        return False

    def describe(self) -> str:
        return (f"HF model {self.path} ({len(self.tensors)} tensors in {len(self.sources) - 1} file(s)"
                + (", MXFP4 experts read dequantized" if self.mxfp4 else "")
                + (f", a {self.names.kind.model_type} release: {len(self.names.carried)} tower tensors carried"
                   if self.names is not None else "") + ")")


def read_hf_model(path: Path) -> HfModel:
    from lora_merge.readers.safetensors_dir import SafetensorsDir

    path = Path(path)
    found = SafetensorsDir(path)
    if found.problems:
        raise MergeError(f"{found.problems[0]}; the HF base's weights must be intact")
    if not found:
        raise MergeError(f"{path}: no safetensors weights (an HF base needs model.safetensors or an index)")
    config = read_json(path / "config.json")
    config = config if isinstance(config, dict) else {}  # (read_hf_config says what is wrong with it)
    q = config.get("quantization_config")
    mxfp4 = is_mxfp4_config(q)
    model = HfModel(path=path, sources=[path / "config.json"], fp8=None if mxfp4 else _fp8_format(path), mxfp4=mxfp4)
    for file in sorted(set(found.file_of.values())):
        model.sources.append(path / file)
        for name, ref in tensor_refs(path / file, "the HF base's weights", fp8=model.fp8 is not None,
                                     mxfp4=mxfp4).items():
            if name.endswith(DERIVED):
                model.skipped["rotary tables (recomputed from the config)"] = \
                    model.skipped.get("rotary tables (recomputed from the config)", 0) + 1
            else:
                model.tensors[name] = ref
    if (path / INDEX).exists():
        model.sources.append(path / INDEX)
    if config.get("model_type") in MULTIMODAL and "text_config" in config:
        model.tensors, model.names = rename(model.tensors, MULTIMODAL[config["model_type"]], str(path))
    if model.fp8 is not None:
        _pair_fp8_weights(model)
    if model.mxfp4:
        _pair_mxfp4_weights(model)
    return model


@dataclass(frozen=True)
class Mxfp4Ref(TensorRef):
    """A stacked experts parameter [E, in, out] stored as MXFP4 blocks and scales; load() gives an Mxfp4Weight,
    read dequantized expert by expert."""

    blocks: TensorRef | None = None
    scales: TensorRef | None = None

    @property
    def nbytes(self) -> int:  # as stored
        return self.blocks.nbytes + self.scales.nbytes

    def load(self) -> Mxfp4Weight:
        return Mxfp4Weight(self.blocks.load(), self.scales.load())

    def release(self) -> None:
        self.blocks.release()
        self.scales.release()


def _pair_mxfp4_weights(model: HfModel) -> None:
    """Each `X_blocks` with its `X_scales` (the shapes agreeing, no scale E8M0's NaN) as the parameter X; either
    one alone is refused."""
    for name in [n for n in model.tensors if n.endswith(BLOCKS_SUFFIX)]:
        base = name.removesuffix(BLOCKS_SUFFIX)
        blocks, scales = model.tensors.pop(name), model.tensors.pop(base + SCALES_SUFFIX, None)
        if scales is None:
            raise MergeError(f"{blocks.where}: MXFP4 blocks without their {base + SCALES_SUFFIX}; the release is "
                             "incomplete")
        shape = check_pair(blocks, scales, base, blocks.where)
        check_mxfp4_scales(scales.load(), scales.where)
        scales.release()
        model.tensors[base] = Mxfp4Ref(blocks.where, shape, torch.float32, blocks.loader, blocks.mapped, blocks=blocks,
                                       scales=scales, spans=lambda b=blocks, s=scales: b.byte_spans() + s.byte_spans())
    strays = [n for n, r in model.tensors.items() if r.dtype == torch.uint8]
    if strays:
        raise MergeError(f"{model.tensors[strays[0]].where}: MXFP4 {strays[0]} without its blocks")


@dataclass(frozen=True)
class Fp8Ref(TensorRef):
    """A block-FP8 weight and its scales (possibly in two shards); load() gives an Fp8Weight, read dequantized."""

    scale: TensorRef | None = None
    block: tuple[int, int] = (128, 128)

    @property
    def nbytes(self) -> int:  # as stored: one byte per element, and the scales
        return math.prod(self.shape) + self.scale.nbytes

    def load(self) -> Fp8Weight:
        return Fp8Weight(self.loader(), self.scale.load(), self.block)

    def release(self) -> None:  # (the views, not fetched again where the input is at a URL)
        if self.mapped:
            release_pages(self.unread())
        self.scale.release()


def _fp8_format(path: Path) -> Fp8Format | None:
    raw = read_json(path / "config.json")
    q = raw.get("quantization_config") if isinstance(raw, dict) else None
    return None if q is None else read_fp8_config(q, path / "config.json")


def _pair_fp8_weights(model: HfModel) -> None:
    """Each float8 weight with its weight_scale_inv (which may sit in another shard), of the shape the block
    size gives, every scale finite and within the range a quantizer writes for trained weights (read here,
    before anything is written: scales are 1/16384 of the weights); a scale without its weight, or the other
    way round, is refused."""
    block = model.fp8.block
    for name in [n for n, r in model.tensors.items() if r.dtype == torch.float8_e4m3fn]:
        ref = model.tensors[name]
        scale = model.tensors.pop(name + SCALE_SUFFIX, None)
        if scale is None:
            raise MergeError(f"{ref.where}: an FP8 weight without its {name + SCALE_SUFFIX} (the scales of its "
                             f"{block[0]}x{block[1]} blocks); the release is incomplete")
        if len(ref.shape) != 2 or scale.dtype != torch.float32 or tuple(scale.shape) != scale_shape(ref.shape, block):
            expected = list(scale_shape(ref.shape, block)) if len(ref.shape) == 2 else "a 2-D weight"
            raise MergeError(f"{scale.where}: scales of shape {list(scale.shape)} ({str(scale.dtype).removeprefix('torch.')}) "
                             f"for the FP8 weight {list(ref.shape)} in {block[0]}x{block[1]} blocks (the config's "
                             f"weight_block_size); expected float32 {expected}")
        check_scales(scale.load(), scale.where, pow2=model.fp8.pow2)
        scale.release()
        model.tensors[name] = Fp8Ref(ref.where, ref.shape, torch.float32, ref.loader, ref.mapped, scale=scale,
                                     block=block, spans=lambda r=ref, s=scale: r.byte_spans() + s.byte_spans(),
                                     view=ref.view)
    strays = [n for n in model.tensors if n.endswith(SCALE_SUFFIX)]
    if strays:
        raise MergeError(f"{model.tensors[strays[0]].where}: FP8 scales without an FP8 weight {strays[0].removesuffix(SCALE_SUFFIX)}")


