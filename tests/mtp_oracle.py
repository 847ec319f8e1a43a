"""transformers' own multi-token-prediction forward (`MtpModel`, transformers 5), as an oracle for MTP layers.

An HF release keeps MTP layer k as `model.layers.{L+k}.*` beside the main model and lists that prefix in the
model class's `_keys_to_ignore_on_load_unexpected` (DeepSeek-V3's layer 61, GLM-4.5's 92); `MtpModel.from_pretrained`
loads the layers that list names, with transformers' own renaming and expert conversion. A small model's
MTP layer sits at another index, so `expecting_mtp_at` lists it the same way while a model loads."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def expecting_mtp_at(model_class, num_layers: int):
    """`model_class` treats `model.layers.{num_layers}…` as its MTP layers while the block runs."""
    saved = model_class.__dict__.get("_keys_to_ignore_on_load_unexpected")
    model_class._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{num_layers}\..*"]
    try:
        yield
    finally:
        if saved is None:
            del model_class._keys_to_ignore_on_load_unexpected
        else:
            model_class._keys_to_ignore_on_load_unexpected = saved


def rolled(ids):
    """The next tokens, as Megatron's MTP takes them: shifted left by one, the last position 0."""
    import torch

    out = torch.roll(ids, -1, dims=-1)
    out[..., -1] = 0
    return out


def mtp_logits(model, input_ids):
    """[MTP layers, batch, seq, vocab]: each MTP layer's logits for every position, chained as Megatron-Core's
    MultiTokenPredictionBlock chains them (layer k sees layer k-1's output and the tokens k+1 ahead).
    `model` was loaded by from_pretrained (inside `expecting_mtp_at`) from a folder holding its MTP layers."""
    import torch
    from transformers.modeling_layers import MtpModel

    with expecting_mtp_at(type(model), model.config.num_hidden_layers):
        mtp = MtpModel.from_pretrained(model)
    mtp.eval()
    S = input_ids.shape[-1]
    positions = torch.arange(S).unsqueeze(0).expand_as(input_ids)
    with torch.no_grad():
        hidden = model.model(input_ids).last_hidden_state
        ids, out = input_ids, []
        for k in range(len(mtp.layers)):
            ids = rolled(ids)
            hidden = mtp.forward_layer(k, hidden, positions, None, input_ids=ids)
            out.append(mtp._project_to_logits(hidden).float())
    return torch.stack(out)


def from_pretrained(path, **kwargs):
    """AutoModelForCausalLM.from_pretrained(path, output_loading_info=True), with the model's MTP layers (if its
    config has them) expected beside it as a release's are: (model, loading info)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
    with (expecting_mtp_at(cls, config.num_hidden_layers) if mtp else contextlib.nullcontext()):
        return AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
