"""Which HuggingFace layer a (pipeline stage, virtual chunk, local layer) of a Megatron checkpoint is.

Megatron numbers layers locally inside each pipeline stage and virtual-pipeline chunk. Global numbers
run chunk by chunk: for v in chunks: for p in stages. MindSpeed's noop layers count in `num_layers`
but hold no parameters, so the HF index is the global index minus the noop layers before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lora_merge.errors import MergeError
from lora_merge.value_checks import MAX_SIZE, is_int, non_negative_int, positive_int, shown_value


@dataclass(frozen=True)
class LayerNumbering:
    counts: tuple[tuple[int, ...], ...]  # counts[chunk][stage]: layers held by that chunk of that stage
    noop: frozenset[int] = frozenset()
    mtp_at: tuple[int, int] | None = None  # (stage, chunk) of the multi-token-prediction layers; None: the last

    def mtp_place(self) -> tuple[int, int]:
        return self.mtp_at or (len(self.counts[0]) - 1, len(self.counts) - 1)

    @property
    def hf_layers(self) -> int:
        """The decoder layers that hold parameters (the HF model's num_hidden_layers)."""
        return sum(sum(row) for row in self.counts) - len(self.noop)

    def global_index(self, stage: int, chunk: int, local: int, where: str) -> int:
        if local >= self.counts[chunk][stage]:
            raise MergeError(
                f"{where}: local layer {local} but the args give chunk {chunk} of stage {stage} only "
                f"{self.counts[chunk][stage]} layers"
            )
        offset = 0
        for v, row in enumerate(self.counts):
            for p, count in enumerate(row):
                if (v, p) == (chunk, stage):
                    return offset + local
                offset += count
        raise MergeError(f"{where}: pipeline stage {stage} / chunk {chunk} is outside the layout from the args")

    def hf_index(self, stage: int, chunk: int, local: int, where: str) -> int:
        index = self.global_index(stage, chunk, local, where)
        if index in self.noop:
            raise MergeError(f"{where}: layer {index} holds parameters but the args list it in noop_layers")
        return index - sum(1 for n in self.noop if n < index)


def _int_or_none(value, name: str):
    if value is None or value == "" or (is_int(value) and value == 0):
        return None
    return non_negative_int(int(value) if isinstance(value, str) and value.isdigit() else value, f"args.{name}", "args")


def noop_layers(args) -> frozenset[int]:
    """MindSpeed's noop_layers: a set, list or comma-separated string of global layer indices."""
    value = getattr(args, "noop_layers", None) or ()
    if isinstance(value, str):
        value = [int(v) if v.isdigit() else v for v in value.replace(" ", "").split(",") if v]
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(is_int(v) and 0 <= v <= MAX_SIZE for v in value):
        raise MergeError(f"args: noop_layers {shown_value(value)} is not a list of layer numbers")
    return frozenset(value)


# megatron-core's PipelineParallelLayerLayout (--pipeline-model-parallel-layout): one string of layer characters
# per virtual stage, "|" between them, in the order (chunk 0: stage 0, 1, …), (chunk 1: …); "x*n" and "(…)*n"
# repeat, commas are cosmetic. E: the embedding, t: a decoder layer, m: a multi-token-prediction layer, L: the loss.
LAYER_TYPES = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}  # a list layout names LayerTypes
MAX_LAYOUT = 1 << 20  # characters once unrolled: far above any real model (DeepSeek-V3's is ~70)


def layout_stages(value, where: str = "args") -> list[str]:
    """The virtual stages of a pipeline_model_parallel_layout (a string, or megatron-core's list of lists), each
    as a string of layer characters."""
    field = f"{where}: pipeline_model_parallel_layout {shown_value(value)}"
    if isinstance(value, (list, tuple)):
        def layer_type(x) -> str:  # megatron-core: a LayerType, or its name in any case around spaces
            return (getattr(x, "name", None) or (x.strip().lower() if isinstance(x, str) else "")).lower()

        if not all(isinstance(row, (list, tuple)) and all(layer_type(x) in LAYER_TYPES for x in row) for row in value):
            raise MergeError(f"{field}: expected a list of virtual stages, each a list of layer types (embedding, "
                             "decoder, mtp, loss)")
        return ["".join(LAYER_TYPES[layer_type(x)] for x in row) for row in value]
    if not isinstance(value, str):
        raise MergeError(f"{field}: expected a layout string such as \"Et*3|(tt|)*29,m|L\"")
    text = value.replace(",", "")

    def unrolled(m: re.Match) -> str:
        if len(m.group(1)) * int(m.group(2)) > MAX_LAYOUT:
            raise MergeError(f"{field}: unrolls to more than {MAX_LAYOUT} characters")
        return m.group(1) * int(m.group(2))

    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):  # as megatron-core unrolls: parentheses first, once each
        text = re.sub(pattern, unrolled, text)
        if len(text) > MAX_LAYOUT:
            raise MergeError(f"{field}: unrolls to more than {MAX_LAYOUT} characters")
    stages = text.split("|")
    bad = sorted({c for stage in stages for c in stage} - set("EtmL"))
    if bad:
        raise MergeError(f"{field}: {''.join(bad)!r} is no layer character; expected E, t, m, L, |, (…)*n, x*n")
    return stages


def _layout_numbering(args, value, num_layers: int, pp: int, vpp: int, noop) -> LayerNumbering:
    """The numbering a layout gives, checked as megatron-core checks it: per-stage layer counts (chunk-major:
    chunk 0's stages, then chunk 1's), and where the multi-token-prediction layers are (one virtual stage, after
    every decoder layer: DeepSeek-V3's recipes put them on the second-to-last stage's last chunk)."""
    for other in ("num_layer_list", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                  "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        if getattr(args, other, None):
            raise MergeError(f"args: pipeline_model_parallel_layout and {other} both given; Megatron takes one")
    stages = layout_stages(value)
    field = f"args: pipeline_model_parallel_layout {shown_value(value)}"
    if len(stages) != pp * vpp:
        raise MergeError(f"{field}: {len(stages)} virtual stages, but the checkpoint has PP={pp} x {vpp} model "
                         f"chunk(s) = {pp * vpp}")
    flat = "".join(stages)
    if not flat.startswith("E") or flat.count("E") != 1 or not flat.endswith("L") or flat.count("L") != 1:
        raise MergeError(f"{field}: expected the embedding (E) first and the loss (L) last, once each")
    if flat.count("t") != num_layers:
        raise MergeError(f"{field}: {flat.count('t')} decoder layers (t), but args.num_layers={num_layers}")
    holding = [i for i, s in enumerate(stages) if "m" in s]
    if len(holding) > 1 or (holding and flat.index("m") < flat.rindex("t")):
        raise MergeError(f"{field}: multi-token-prediction layers (m) must come after every decoder layer, in one "
                         "virtual stage")
    if holding and holding[0] // pp != vpp - 1:
        raise MergeError(f"{field}: multi-token-prediction layers in chunk {holding[0] // pp}; megatron-core keeps "
                         "them in a stage's last chunk")
    counts = [stage.count("t") for stage in stages]
    if any(n < 0 or n >= num_layers for n in noop):
        raise MergeError(f"args: noop_layers {sorted(noop)} outside 0..{num_layers - 1}")
    return LayerNumbering(counts=tuple(tuple(counts[v * pp:(v + 1) * pp]) for v in range(vpp)), noop=noop,
                          mtp_at=(holding[0] % pp, holding[0] // pp) if holding else None)


def numbering_from_args(args, pp: int, vpp: int) -> LayerNumbering:
    num_layers = positive_int(getattr(args, "num_layers", None), "args.num_layers", "args")
    noop = noop_layers(args)
    layer_list = getattr(args, "num_layer_list", None)
    first = _int_or_none(getattr(args, "decoder_first_pipeline_num_layers", None)
                         or getattr(args, "num_layers_in_first_pipeline_stage", None), "decoder_first_pipeline_num_layers")
    last = _int_or_none(getattr(args, "decoder_last_pipeline_num_layers", None)
                        or getattr(args, "num_layers_in_last_pipeline_stage", None), "decoder_last_pipeline_num_layers")
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout is not None and layout != "" and not (hasattr(layout, "input_data") and layout.input_data is None):
        return _layout_numbering(args, getattr(layout, "input_data", layout), num_layers, pp, vpp, noop)

    if layer_list:
        per_stage = ([int(x) if x.strip().isdigit() else x for x in layer_list.split(",")]
                     if isinstance(layer_list, str) else layer_list)
        if not isinstance(per_stage, (list, tuple)) or not all(is_int(n) and 0 <= n <= MAX_SIZE for n in per_stage):
            raise MergeError(f"args: num_layer_list {shown_value(layer_list)} is not a list of layer counts")
        per_stage = list(per_stage)
        if len(per_stage) != pp or sum(per_stage) != num_layers:
            raise MergeError(f"args: num_layer_list {shown_value(layer_list)} does not split {num_layers} layers over "
                             f"PP={pp}")
    elif first is not None or last is not None:
        # megatron-core's TransformerConfig: the stages between (or after) the uneven ones exist exactly when
        # layers are left for them, and split those layers evenly
        middle_stages = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if middle_stages < 0 or rest < 0 or (middle_stages == 0) != (rest == 0) or (middle_stages and rest % middle_stages):
            left = (f"{rest} layer(s) left for {middle_stages} other stage(s)" if rest >= 0 and middle_stages >= 0
                    else "more layers than the model has")
            raise MergeError(f"args: first/last stage layer counts ({first}/{last}) do not fit {num_layers} layers over "
                             f"PP={pp}: {left}; every stage needs at least one layer, the others an even share")
        per_middle = rest // middle_stages if middle_stages else 0
        per_stage = [per_middle] * pp
        if first is not None:
            per_stage[0] = first
        if last is not None:
            per_stage[-1] = last
    else:
        if num_layers % pp:
            raise MergeError(f"args: num_layers={num_layers} is not divisible by PP={pp} and no uneven split is given")
        per_stage = [num_layers // pp] * pp

    if any(count % vpp for count in per_stage):
        raise MergeError(f"args: stage layer counts {per_stage} do not divide into {vpp} virtual-pipeline chunks")
    counts = tuple(tuple(count // vpp for count in per_stage) for _ in range(vpp))
    if any(n < 0 or n >= num_layers for n in noop):
        raise MergeError(f"args: noop_layers {sorted(noop)} outside 0..{num_layers - 1}")
    return LayerNumbering(counts=counts, noop=noop)
