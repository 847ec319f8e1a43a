"""Which HuggingFace layer a (pipeline stage, virtual chunk, local layer) of a Megatron checkpoint is.

Megatron numbers layers locally inside each pipeline stage and virtual-pipeline chunk. Global numbers
run chunk by chunk: for v in chunks: for p in stages. MindSpeed's noop layers count in `num_layers`
but hold no parameters, so the HF index is the global index minus the noop layers before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lora_merge.errors import MergeError
from lora_merge.value_checks import MAX_SIZE, is_int, non_negative_int, positive_int, shown_value


@dataclass(frozen=True)
class LayerNumbering:
    counts: tuple[tuple[int, ...], ...]  # counts[chunk][stage]: layers held by that chunk of that stage
    noop: frozenset[int] = frozenset()

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


def numbering_from_args(args, pp: int, vpp: int) -> LayerNumbering:
    num_layers = positive_int(getattr(args, "num_layers", None), "args.num_layers", "args")
    noop = noop_layers(args)
    layer_list = getattr(args, "num_layer_list", None)
    first = _int_or_none(getattr(args, "decoder_first_pipeline_num_layers", None)
                         or getattr(args, "num_layers_in_first_pipeline_stage", None), "decoder_first_pipeline_num_layers")
    last = _int_or_none(getattr(args, "decoder_last_pipeline_num_layers", None)
                        or getattr(args, "num_layers_in_last_pipeline_stage", None), "decoder_last_pipeline_num_layers")

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
