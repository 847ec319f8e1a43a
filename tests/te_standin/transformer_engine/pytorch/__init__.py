"""The leaf modules megatron-core's TE spec builds on: TransformerEngine's parameter names and extra state, its
arithmetic in fp32 (see ../../README.md)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from transformer_engine import __getattr__  # noqa: F401
from . import distributed, fp8  # noqa: F401
from .fp8 import fp8_autocast  # noqa: F401


class _Module(nn.Module):
    def __init__(self):
        super().__init__()
        # what TransformerEngineBaseModule sets when built (megatron-core's TEGroupedLinear reads them to shard
        # its extra state)
        self.fp8 = self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)  # TE >= 2.4 without FP8

    def init_fp8_metadata(self, num_gemms=1):  # (FP8 metadata: none here)
        pass

    def set_extra_state(self, state):
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        raise RuntimeError("Unsupported checkpoint format.")


def _param(*shape, dtype=None):
    return nn.Parameter(torch.empty(*shape, dtype=dtype or torch.float32))


def _split(out_features, in_features, parallel_mode, tp_size):
    tp = tp_size or 1
    if parallel_mode == "column":
        return out_features // tp, in_features
    if parallel_mode == "row":
        return out_features, in_features // tp
    return out_features, in_features


class _Linear(_Module):
    def _linear_init(self, in_features, out_features, bias, return_bias, parallel_mode, tp_size, tp_group,
                     params_dtype):
        out, inp = _split(out_features, in_features, parallel_mode, tp_size)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.return_bias, self.parallel_mode = return_bias, parallel_mode
        self.tp_size, self.tp_group = tp_size or 1, tp_group
        self.weight = _param(out, inp, dtype=params_dtype)
        if bias:
            self.bias = _param(out, dtype=params_dtype)
        else:
            self.bias = torch.Tensor()

    def _apply_linear(self, x):
        out = x @ self.weight.t()
        if self.parallel_mode == "row" and self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        if self.use_bias and self.return_bias:
            return out, self.bias
        return out + self.bias if self.use_bias else out


class Linear(_Linear):
    def __init__(self, in_features, out_features, *, bias=True, return_bias=False, parallel_mode=None, tp_size=1,
                 tp_group=None, params_dtype=None, **kwargs):
        super().__init__()
        self._linear_init(in_features, out_features, bias, return_bias, parallel_mode, tp_size, tp_group, params_dtype)

    def forward(self, x, is_first_microbatch=None, **kwargs):
        return self._apply_linear(x)


def _norm(x, weight, bias, eps, zero_centered_gamma):
    w = weight + 1 if zero_centered_gamma else weight
    xf = x.float()
    if bias is None:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * w).to(x.dtype)
    return F.layer_norm(xf, (xf.shape[-1],), w, bias, eps).to(x.dtype)


class LayerNormLinear(_Linear):
    def __init__(self, in_features, out_features, *, eps=1e-5, bias=True, return_bias=False, parallel_mode=None,
                 tp_size=1, tp_group=None, params_dtype=None, normalization="LayerNorm", zero_centered_gamma=False,
                 return_layernorm_output=False, **kwargs):
        super().__init__()
        assert not return_layernorm_output
        self.layer_norm_weight = _param(in_features, dtype=params_dtype)
        if normalization != "RMSNorm":
            self.layer_norm_bias = _param(in_features, dtype=params_dtype)
        else:
            self.layer_norm_bias = None
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self._linear_init(in_features, out_features, bias, return_bias, parallel_mode, tp_size, tp_group, params_dtype)

    def forward(self, x, is_first_microbatch=None, **kwargs):
        return self._apply_linear(_norm(x, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                                        self.zero_centered_gamma))


class RMSNorm(_Module):
    def __init__(self, hidden_size, eps=1e-5, zero_centered_gamma=False, params_dtype=None, **kwargs):
        super().__init__()
        self.weight = _param(hidden_size, dtype=params_dtype)
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma

    def forward(self, x):
        return _norm(x, self.weight, None, self.eps, self.zero_centered_gamma)


class LayerNorm(_Module):
    def __init__(self, hidden_size, eps=1e-5, zero_centered_gamma=False, params_dtype=None, **kwargs):
        super().__init__()
        self.weight = _param(hidden_size, dtype=params_dtype)
        self.bias = _param(hidden_size, dtype=params_dtype)
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma

    def forward(self, x):
        return _norm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class DotProductAttention(_Module):
    def __init__(self, num_attention_heads, kv_channels, *, softmax_scale=None, attn_mask_type="causal",
                 **kwargs):
        super().__init__()
        k = kv_channels[0] if isinstance(kv_channels, (tuple, list)) else kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else k ** -0.5
        assert attn_mask_type == "causal", attn_mask_type

    def forward(self, query, key, value, attention_mask=None, attn_mask_type="causal", **kwargs):
        assert attn_mask_type == "causal", attn_mask_type
        s, b, h, _ = query.shape
        groups = key.shape[2]
        q = query.permute(1, 2, 0, 3).float()  # [b, h, s, d]
        k = key.permute(1, 2, 0, 3).float().repeat_interleave(h // groups, dim=1)
        v = value.permute(1, 2, 0, 3).float().repeat_interleave(h // groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.softmax_scale
        causal = torch.ones(s, key.shape[0], dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        out = (probs @ v).permute(2, 0, 1, 3)  # [s, b, h, dv]
        return out.reshape(s, b, -1).to(query.dtype)


class GroupedLinear(_Module):
    def __init__(self, num_gemms, in_features, out_features, *, bias=True, return_bias=False, parallel_mode=None,
                 tp_size=1, tp_group=None, params_dtype=None, **kwargs):
        super().__init__()
        out, inp = _split(out_features, in_features, parallel_mode, tp_size)
        self.num_gemms, self.use_bias, self.return_bias = num_gemms, bias, return_bias
        for i in range(num_gemms):
            setattr(self, f"weight{i}", _param(out, inp, dtype=params_dtype))
            if bias:
                setattr(self, f"bias{i}", _param(out, dtype=params_dtype))

    def forward(self, x, m_splits, is_first_microbatch=None, **kwargs):
        outs = []
        for i, part in enumerate(torch.split(x, list(m_splits))):
            y = part @ getattr(self, f"weight{i}").t()
            if self.use_bias and not self.return_bias:
                y = y + getattr(self, f"bias{i}")
            outs.append(y)
        out = torch.cat(outs) if outs else x.new_zeros(0, self.weight0.shape[0])
        if self.use_bias and self.return_bias:
            return out, torch.cat([getattr(self, f"bias{i}").expand(n, -1) for i, n in enumerate(m_splits)])
        return out
