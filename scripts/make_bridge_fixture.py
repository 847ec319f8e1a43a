"""Make tests/fixtures/bridge_tp2_fp32: a Megatron-Bridge-layout base and LoRA checkpoint of the dense Qwen2-like
fixture model, saved by the REAL megatron-core 0.16.1 on CPU (gloo, TP=2).

Megatron-Bridge itself does not install here (0.6.2 needs Python 3.12 and imports TransformerEngine, which does not
build without CUDA), so its LoRA module is rebuilt from its documented structure (Megatron-Bridge 067f987d,
`peft/lora.py`, `peft/utils.py` ParallelLinearAdapter, `peft/adapter_wrapper.py`), with megatron-core's own parallel
linears inside:
* every targeted linear becomes a wrapper holding the original module and an adapter; the wrapper's
  sharded_state_dict is the original module's (same keys) plus the adapter's under `<linear>.adapter.`;
* the adapter has `linear_in` (A, [r, in]): a ColumnParallelLinear(in, r, gather_output=True) on a column-parallel
  base (linear_qkv, linear_fc1), a RowParallelLinear(in, r, input_is_parallel=True) on a row-parallel one
  (linear_proj, linear_fc2); and `linear_out` (B, [out, r]): a ColumnParallelLinear(r, out), gathered on a
  row-parallel base; linear_fc1's linear_out goes through megatron-core's apply_swiglu_sharded_factory, as Bridge
  does for a gated MLP;
* the adapter adds (alpha / dim) · linear_out(linear_in(x)) to the wrapped linear's output.
The values are the committed fixture's canonical base and LoRA (the same seeds), so the forward pass through this
structure must give the fixture's own Megatron logits (checked here, on every rank that holds them).

Saved as Bridge's `save_checkpoint` writes (its generate_state_dict and apply_peft_adapter_filter_to_state_dict):
`{"checkpoint_version": 3.0, "iteration": N, "model": <sharded state dict>, "rng_state": ShardedObject}` through
megatron-core's dist_checkpointing.save, without Megatron args; run_config.yaml (ConfigContainer: `model:` every
TransformerConfig field plus the GPT provider's, callables and dtypes as `{_target_, _call_: false}`; `peft:` the
LoRA config), train_state.pt and the tracker latest_checkpointed_iteration.txt beside it.
* base/: the whole model (as Bridge's import from HF saves it), iteration 1, run_config.yaml without `peft`;
* lora/: adapter tensors only, iteration 10 (`_extra_state` dropped), and a stale iteration 5 with other values;
* lora_normalized/ (MoE): `normalize_moe_lora`, the routed experts' adapters at rank dim / topk (their factors the
  first rows of the LoRA's), scaled by alpha over that rank; logits_normalized.pt holds its forward pass;
* lora_canonical/: Bridge's CanonicalLoRA (LoRALinearSplitQKV / LoRALinearSplitFC1UpGate: one adapter per HF
  projection, their outputs interleaved per query group, gate and up side by side) on linear_q, linear_v (no k),
  linear_fc1_gate, linear_fc1_up, linear_proj and linear_fc2, its own seeded values; the gate and up adapters' B go
  through the swiglu factory as Bridge saves them, so at TP=2 their rows are stored in the factory's order.
  logits_canonical.pt holds its forward pass.

    python scripts/make_bridge_fixture.py [--out tests/fixtures]
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixturegen import dense, library as lib, moe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# name: (family, the spec of the model and LoRA, the committed fixture of the same model (same seeds), its folder,
#        the provider class run_config.yaml names, whether to add a CanonicalLoRA, the targets of a DoRA)
CASES = {
    "bridge_tp2_fp32": ("dense", dict(dense.QWEN2, tp=2, gen=2), "tp2_fp32_filtered", "tests/fixtures",
                        "megatron.bridge.models.qwen.qwen_provider.Qwen2ModelProvider", True,
                        # qkv has a bias here (Bridge scales it with the magnitude: not read), proj and fc2 are
                        # row-parallel at TP=2 (Bridge's norm is over each rank's columns: no one model)
                        ["linear_fc1"]),
    # SequentialMLP experts at EP=2: every routed expert its own adapter, saved with the experts' global axis
    "bridge_qwen3moe_ep2": ("moe", dict(moe.QWEN3MOE, targets=lib.GQA_TARGETS), "qwen3moe_ep2", "tests/fixtures_moe",
                            "megatron.bridge.models.qwen.qwen_provider.Qwen3MoEModelProvider", False, lib.GQA_TARGETS),
}
LORA_ITERS = (5, 10)  # stale, latest
ROW_PARALLEL = ("linear_proj", "linear_fc2")
CANONICAL_SEED = 9000


def yaml_value(v):
    """A config value as Bridge's safe YAML representers write it, or None where it has none (process groups)."""
    import torch

    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, enum.Enum):
        return v.value if isinstance(v.value, (int, str)) else v.name
    if isinstance(v, torch.dtype):
        return {"_target_": str(v), "_call_": False}
    if callable(v) and hasattr(v, "__qualname__"):
        return {"_target_": f"{v.__module__}.{v.__qualname__}", "_call_": False}
    if isinstance(v, (list, tuple)):
        items = [yaml_value(x) for x in v]
        return items if all(x is not None or y is None for x, y in zip(items, v)) else None
    return None


def run_config(config, peft: dict | None, iteration: int, provider: str, tp: int) -> dict:
    model = {"_target_": provider}
    for f in dataclasses.fields(config):
        if f.name.startswith("_"):
            continue
        value = yaml_value(getattr(config, f.name))
        if value is not None or getattr(config, f.name) is None:
            model[f.name] = value
    dm = dense.MODEL
    model.update(  # GPTModelProvider's own fields
        share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=dm["make_vocab_size_divisible_by"],
        position_embedding_type="rope", rotary_base=dm["rotary_base"], rotary_percent=1.0,
        seq_length=dm["seq_length"], vocab_size=lib.padded_vocab(tp), should_pad_vocab=False,
        hf_model_id="Qwen/Qwen2-tiny-fixture", parallel_output=True,
        transformer_layer_spec={"_target_": "megatron.bridge.models.gpt_provider.local_layer_spec", "_call_": False})
    out = {"_target_": "megatron.bridge.training.config.ConfigContainer", "model": model,
           "checkpoint": {"_target_": "megatron.bridge.training.config.CheckpointConfig", "ckpt_format": "torch_dist",
                          "save": "/checkpoints/bridge_run", "save_optim": False, "save_rng": True,
                          "pretrained_checkpoint": "/checkpoints/qwen2_tiny_imported" if peft else None},
           "train": {"_target_": "megatron.bridge.training.config.TrainingConfig", "train_iters": iteration}}
    if peft is not None:
        out["peft"] = peft
    return out


def worker(rank: int, world: int, name: str, out_dir: str, port: int):
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    family, spec = CASES[name][:2]
    fam = lib.family(family)
    lib.patch_cuda(torch)
    fam.patch_cpu(torch)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    BridgeRank(fam, rank, world, name, spec, out_dir).make()


class BridgeRank(lib.Rank):
    def make(self):
        import torch
        import yaml
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        fam, spec = self.family, self.spec
        _, _, same_as, folder, provider, with_canonical, dora_targets = CASES[self.name]
        self.chunks, self.chunk_first, self.chunk_last = self.build(fam.make_config(self))
        self.model = self.chunks[0]
        self.base_global = fam.canonical_base(torch, spec, self.vpad)
        S, B = self.dm["seq_length"], lib.BATCH
        g = torch.Generator().manual_seed(lib.INPUT_SEED)
        self.input_ids = torch.randint(0, self.dm["vocab_size"], (B, S), generator=g, dtype=torch.int64)
        self.position_ids = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
        self.mask = torch.triu(torch.ones(S, S), diagonal=1).bool().view(1, 1, S, S)
        self.fill(self.localize(self.base_global))
        reference = torch.load(ROOT / folder / same_as / "logits.pt")
        logits_base = self.forward()
        torch.testing.assert_close(logits_base, reference["logits_base"], rtol=0, atol=1e-5)
        rng = lib.make_rng_state(torch, 2)

        def save(root: Path, iteration: int, model_sd: dict, peft):
            d = root / f"iter_{iteration:07d}"
            if self.rank == 0:
                d.mkdir(parents=True, exist_ok=True)
            self.dist.barrier()
            metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
            state = {"checkpoint_version": 3.0, "iteration": iteration, "model": model_sd(metadata),
                     "rng_state": ShardedObject("rng_state", rng, (1, self.TP), (0, self.tp_rank),
                                                replica_id=ps.get_data_parallel_rank())}
            lib.pinned_dist_save(state, d, f"/checkpoints/{root.name}/iter_{iteration:07d}", metadata)
            if self.rank == 0:
                config = run_config(self.config, peft, iteration, provider, self.TP)
                (d / "run_config.yaml").write_text(yaml.safe_dump(config))
                train_state = {"step": torch.tensor(iteration), "consumed_train_samples": torch.tensor(iteration * 8),
                               "floating_point_operations_so_far": torch.tensor(0.0)}
                torch.save(train_state, d / "train_state.pt")
                torch.save(train_state, root / "latest_train_state.pt")
                (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
            self.dist.barrier()

        self.config = fam.make_config(self)
        out = self.out
        save(out / "base", lib.BASE_ITER, lambda md: self.model.sharded_state_dict(metadata=md), None)

        peft = {"_target_": "megatron.bridge.peft.lora.LoRA", "target_modules": list(spec["targets"]),
                "exclude_modules": [], "dim": lib.LORA_R, "alpha": lib.LORA_ALPHA, "dropout": 0.0,
                "dropout_position": "pre", "lora_A_init_method": "xavier", "lora_B_init_method": "zero",
                "a2a_experimental": False, "lora_dtype": None, "normalize_moe_lora": False,
                "share_expert_adapters": True, "experts_shared_outer_loras": False,
                "sequence_parallel_input_regather": False}
        originals = {(layer.layer_number, name): getattr(parent, name) for layer in self.model.decoder.layers
                     for parent, names in ((layer.self_attention, ("linear_qkv", "linear_proj")),
                                           (layer.mlp, ("linear_fc1", "linear_fc2"))) for name in names
                     if hasattr(parent, name)}
        io = moe.lora_modules(spec) if "num_experts" in spec else {
            f"decoder.layers.{i}.{dense.module_path(m)}": dense.lora_io(m) for i in range(self.dm["num_layers"])
            for m in spec["targets"]}
        adapters = wrap_targets(self.model, self.config, spec["targets"], lib.LORA_R, lib.LORA_ALPHA,
                                self.ep_rank, spec.get("num_experts", 0) // self.EP, io)

        def adapter_sd(md):  # Bridge's PEFT save: adapter tensors only, no _extra_state
            return {k: v for k, v in self.model.sharded_state_dict(metadata=md).items()
                    if ".adapter." in k and "_extra_state" not in k}

        for iteration in LORA_ITERS:
            seed = spec["lora_seed"] + (lib.STALE_SEED_OFFSET if iteration != LORA_ITERS[-1] else 0)
            fill_adapters(torch, adapters, fam.canonical_lora(torch, spec, seed), self.tp_rank, self.TP,
                          self.etp_rank, self.ETP or 1)
            logits = self.forward()
            save(out / "lora", iteration, adapter_sd, peft)
        torch.testing.assert_close(logits, reference["logits_lora"], rtol=0, atol=1e-5)
        if self.writer:
            torch.save({"input_ids": self.input_ids.clone(), "logits_lora": logits.clone(),
                        "logits_base": logits_base.clone()}, out / "logits.pt")

        def unwrap():
            for layer in self.model.decoder.layers:
                for parent, names in ((layer.self_attention, ("linear_qkv", "linear_proj")),
                                      (layer.mlp, ("linear_fc1", "linear_fc2"))):
                    for name in names:
                        if hasattr(parent, name):
                            setattr(parent, name, originals[(layer.layer_number, name)])
                if hasattr(layer.mlp, "experts"):
                    for expert in layer.mlp.experts.local_experts:
                        for name in ("linear_fc1", "linear_fc2"):
                            wrapped = getattr(expert, name)
                            setattr(expert, name, getattr(wrapped, "to_wrap", wrapped))
            torch.testing.assert_close(self.forward(), logits_base, rtol=0, atol=0)  # unwrapped: the base again

        # ---- DoRA: the LoRA's factors, and magnitudes of their own ----
        unwrap()
        factors = fam.canonical_lora(torch, spec, spec["lora_seed"])
        dora = wrap_targets(self.model, self.config, dora_targets, lib.LORA_R, lib.LORA_ALPHA, self.ep_rank,
                            spec.get("num_experts", 0) // self.EP, io, dora=True)
        fill_adapters(torch, dora, factors, self.tp_rank, self.TP, self.etp_rank, self.ETP or 1)
        fill_magnitudes(torch, dora, factors, self.base_global, self.tp_rank, self.TP, self.etp_rank, self.ETP or 1)
        logits = self.forward()
        assert (logits - logits_base).abs().max() > 0.5
        peft_dora = {"_target_": "megatron.bridge.peft.dora.DoRA", "target_modules": list(dora_targets),
                     "dim": lib.LORA_R, "alpha": lib.LORA_ALPHA, "dropout": 0.0, "dropout_position": "pre",
                     "lora_A_init_method": "xavier", "lora_B_init_method": "zero"}
        save(out / "lora_dora", LORA_ITERS[-1], adapter_sd, peft_dora)
        if self.writer:
            torch.save({"input_ids": self.input_ids.clone(), "logits_lora": logits.clone(),
                        "logits_base": logits_base.clone()}, out / "logits_dora.pt")
        unwrap()

        if "num_experts" in spec:  # ---- normalize_moe_lora: the experts' adapters at rank dim / topk ----
            expert_dim = lib.LORA_R // moe.TOPK
            factors = {k: (v[:expert_dim] if k.endswith("lora_A.weight") else v[:, :expert_dim])
                       if ".mlp.experts." in k else v for k, v in fam.canonical_lora(torch, spec, spec["lora_seed"]).items()}
            normalized = wrap_targets(self.model, self.config, spec["targets"], lib.LORA_R, lib.LORA_ALPHA,
                                      self.ep_rank, spec["num_experts"] // self.EP, io, expert_dim=expert_dim)
            fill_adapters(torch, normalized, factors, self.tp_rank, self.TP, self.etp_rank, self.ETP or 1)
            logits = self.forward()
            save(out / "lora_normalized", LORA_ITERS[-1], adapter_sd, dict(peft, normalize_moe_lora=True))
            if self.writer:
                torch.save({"input_ids": self.input_ids.clone(), "logits_lora": logits.clone(),
                            "logits_base": logits_base.clone()}, out / "logits_normalized.pt")
            unwrap()
        if not with_canonical:
            self.dist.barrier()
            self.dist.destroy_process_group()
            return

        # ---- CanonicalLoRA on the same base: q and v (no k), gate and up, proj and fc2 ----
        canonical = wrap_canonical(self.model, self.config, CANONICAL_TARGETS, lib.LORA_R, lib.LORA_ALPHA, self.TP)
        fill_canonical(torch, canonical, canonical_factors(torch, CANONICAL_SEED, CANONICAL_TARGETS), self.tp_rank,
                       self.TP)
        logits = self.forward()
        assert (logits - logits_base).abs().max() > 0.5
        peft_canonical = dict(peft, _target_="megatron.bridge.peft.canonical_lora.CanonicalLoRA",
                              target_modules=CANONICAL_TARGETS)
        for key in ("a2a_experimental", "lora_dtype", "experts_shared_outer_loras", "sequence_parallel_input_regather"):
            peft_canonical.pop(key)
        save(out / "lora_canonical", LORA_ITERS[-1], adapter_sd, peft_canonical)
        if self.writer:
            torch.save({"input_ids": self.input_ids.clone(), "logits_lora": logits.clone(),
                        "logits_base": logits_base.clone()}, out / "logits_canonical.pt")
        self.dist.barrier()
        self.dist.destroy_process_group()


def make_adapter_classes():
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    class Adapter(torch.nn.Module):
        def __init__(self, in_features, out_features, dim, alpha, row_parallel_base, swiglu, config, is_expert=False):
            super().__init__()
            init = torch.nn.init.zeros_
            if row_parallel_base:
                self.linear_in = RowParallelLinear(in_features, dim, config=config, input_is_parallel=True,
                                                   skip_bias_add=True, bias=False, init_method=init,
                                                   is_expert=is_expert)
            else:
                self.linear_in = ColumnParallelLinear(in_features, dim, config=config, bias=False, gather_output=True,
                                                      init_method=init, is_expert=is_expert)
            self.linear_out = ColumnParallelLinear(dim, out_features, config=config, bias=False,
                                                   gather_output=row_parallel_base, init_method=init,
                                                   is_expert=is_expert)
            self.scale, self.swiglu = alpha / dim, swiglu

        def forward(self, x):
            h, _ = self.linear_in(x)
            y, _ = self.linear_out(h)
            return y * self.scale

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            sd = self.linear_in.sharded_state_dict(f"{prefix}linear_in.", sharded_offsets, metadata)
            out = self.linear_out.sharded_state_dict(f"{prefix}linear_out.", sharded_offsets, metadata)
            if self.swiglu:
                key = f"{prefix}linear_out.weight"
                out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets)
            return {**sd, **out}

    class Wrapped(torch.nn.Module):
        def __init__(self, to_wrap, adapter):
            super().__init__()
            self.to_wrap, self.adapter = to_wrap, adapter

        def forward(self, x, *args, **kwargs):
            out, bias = self.to_wrap(x, *args, **kwargs)
            return out + self.adapter(x).reshape(out.shape), bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return {**self.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata),
                    **self.adapter.sharded_state_dict(f"{prefix}adapter.", sharded_offsets, metadata)}

    class CanonicalQkv(torch.nn.Module):
        """Bridge's LoRALinearSplitQKV: q, k and v adapters (any may be absent), their outputs interleaved per query
        group of this rank as Megatron packs linear_qkv's output."""

        def __init__(self, to_wrap, adapters: dict, heads: int, groups: int, head_dim: int):
            super().__init__()
            self.to_wrap, self.adapter = to_wrap, torch.nn.ModuleDict(adapters)
            self.heads, self.groups, self.head_dim = heads, groups, head_dim

        def forward(self, x, *args, **kwargs):
            out, bias = self.to_wrap(x, *args, **kwargs)
            lead, d, per = x.shape[:-1], self.head_dim, self.heads // self.groups

            def part(name, n):
                a = self.adapter[name] if name in self.adapter else None
                return a(x).reshape(*lead, n, d) if a is not None else x.new_zeros(*lead, n, d)
            q, k, v = part("adapter_q", self.heads), part("adapter_k", self.groups), part("adapter_v", self.groups)
            chunks = []
            for g in range(self.groups):
                chunks += [q[..., g * per:(g + 1) * per, :], k[..., g:g + 1, :], v[..., g:g + 1, :]]
            return out + torch.cat(chunks, dim=-2).reshape(out.shape), bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            sd = self.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata)
            for name, adapter in self.adapter.items():
                sd.update(adapter.sharded_state_dict(f"{prefix}adapter.{name}.", sharded_offsets, metadata))
            return sd

    class CanonicalFc1(CanonicalQkv):
        """Bridge's LoRALinearSplitFC1UpGate: gate and up adapters, this rank's [gate; up] output."""

        def __init__(self, to_wrap, adapters: dict):
            torch.nn.Module.__init__(self)
            self.to_wrap, self.adapter = to_wrap, torch.nn.ModuleDict(adapters)

        def forward(self, x, *args, **kwargs):
            out, bias = self.to_wrap(x, *args, **kwargs)
            half = out.shape[-1] // 2
            parts = [self.adapter[n](x) if n in self.adapter else x.new_zeros(*x.shape[:-1], half)
                     for n in ("adapter_gate", "adapter_up")]
            return out + torch.cat(parts, dim=-1), bias

    return Adapter, Wrapped, CanonicalQkv, CanonicalFc1


def make_dora_classes(Adapter, Wrapped):
    """Bridge's ParallelLinearDoRAAdapter (the adapter plus `weight_magnitude` [out], saved TP-sharded on a
    column-parallel base, replicated on a row-parallel one) and DoRALinear: m / ‖W + s·B·A‖ · (W x + s·B·A x), the
    norm per output row of this rank's weight (on a row-parallel base at TP > 1: its columns only)."""
    import torch
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    class DoraAdapter(Adapter):
        def __init__(self, in_features, out_features, *args, **kwargs):
            super().__init__(in_features, out_features, *args, **kwargs)
            self.row_parallel = args[2]
            rows = self.linear_out.weight.shape[0] if not self.row_parallel else out_features
            self.weight_magnitude = torch.nn.Parameter(torch.zeros(rows))
            self.register_buffer("a_whole", None, persistent=False)  # A gathered, for the norm

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            key = f"{prefix}weight_magnitude"
            sd[key] = (make_sharded_tensor_for_checkpoint(self.weight_magnitude, key, prepend_offsets=sharded_offsets)
                       if self.row_parallel else
                       make_tp_sharded_tensor_for_checkpoint(self.weight_magnitude, key, 0,
                                                             prepend_offsets=sharded_offsets))
            return sd

    class DoraWrapped(Wrapped):
        def forward(self, x, *args, **kwargs):
            out, bias = self.to_wrap(x, *args, **kwargs)
            adapter = self.adapter
            y = out + adapter(x).reshape(out.shape)
            b = adapter.linear_out.weight  # [out rows of this rank (all of them on a row-parallel base), r]
            if adapter.row_parallel:
                a = adapter.linear_in.weight  # [r, this rank's columns]
            else:
                a = adapter.a_whole
            norm = torch.linalg.norm(self.to_wrap.weight + adapter.scale * b @ a, dim=1)
            return (adapter.weight_magnitude / norm) * y, bias

    return DoraAdapter, DoraWrapped


def fill_magnitudes(torch, adapters: dict, factors: dict, base: dict, tp_rank: int, tp: int, etp_rank: int, etp: int):
    """Each DoRA adapter's magnitude: the norm of the trained row W + s·B·A (over the global weight) times a seeded
    factor in [0.8, 1.2], in this rank's rows (fc1's: its gate rows then its up rows); A whole for the norm."""
    with torch.no_grad():
        for path, adapter in adapters.items():
            rank, size = (etp_rank, etp) if ".mlp.experts." in path else (tp_rank, tp)
            a, b = factors[path + ".lora_A.weight"], factors[path + ".lora_B.weight"]
            w = base[path + ".weight"]
            m = torch.linalg.norm(w + adapter.scale * b @ a, dim=1)
            m = m * (1 + 0.2 * (torch.rand(m.shape, generator=torch.Generator().manual_seed(len(path) * 7919)) - 0.5))
            module = path.rsplit(".", 1)[1]
            if module in ROW_PARALLEL:
                local = m
            elif module == "linear_fc1":
                gate, up = m.chunk(2)
                local = torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
            else:
                local = m.chunk(size)[rank]
            adapter.weight_magnitude.copy_(local)
            adapter.a_whole = a.clone()


CANONICAL_TARGETS = ["linear_q", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2"]
CANONICAL_PARTS = {"linear_q": ("linear_qkv", "adapter_q"), "linear_k": ("linear_qkv", "adapter_k"),
                   "linear_v": ("linear_qkv", "adapter_v"), "linear_fc1_gate": ("linear_fc1", "adapter_gate"),
                   "linear_fc1_up": ("linear_fc1", "adapter_up")}


def canonical_factors(torch, seed: int, targets) -> dict:
    """A [r, in] and B [rows, r] of every canonical adapter, B's rows in HF order (q: heads in order; gate: the
    ffn rows), by (global layer, target)."""
    dm = dense.MODEL
    H, F, NH, NG, D = dm["hidden_size"], dm["ffn_hidden_size"], dm["num_attention_heads"], dm["num_query_groups"], \
        dm["kv_channels"]
    rows = {"linear_q": (H, NH * D), "linear_k": (H, NG * D), "linear_v": (H, NG * D), "linear_fc1_gate": (H, F),
            "linear_fc1_up": (H, F), "linear_proj": (NH * D, H), "linear_fc2": (F, H)}
    out = {}
    for i in range(dm["num_layers"]):
        for t in targets:
            fin, fout = rows[t]
            name = f"canonical.layers.{i}.{t}"
            out[(i, t)] = (lib.randn(torch, seed, name + ".A", (lib.LORA_R, fin), 0.1),
                           lib.randn(torch, seed, name + ".B", (fout, lib.LORA_R), 0.1))
    return out


def wrap_canonical(model, config, targets, dim, alpha, tp: int) -> dict:
    """CanonicalLoRA's wrappers on every layer; {(global layer, target): adapter}."""
    Adapter, Wrapped, CanonicalQkv, CanonicalFc1 = make_adapter_classes()
    dm, adapters = dense.MODEL, {}
    H, F, NH, NG, D = dm["hidden_size"], dm["ffn_hidden_size"], dm["num_attention_heads"], dm["num_query_groups"], \
        dm["kv_channels"]
    out_of = {"adapter_q": NH * D, "adapter_k": NG * D, "adapter_v": NG * D, "adapter_gate": F, "adapter_up": F}
    for layer in model.decoder.layers:
        i = layer.layer_number - 1
        for fused, parent in (("linear_qkv", layer.self_attention), ("linear_fc1", layer.mlp)):
            parts = {part: t for t, (f, part) in CANONICAL_PARTS.items() if f == fused and t in targets}
            if not parts:
                continue
            made = {part: Adapter(H, out_of[part], dim, alpha, False, fused == "linear_fc1", config)
                    for part in parts}
            original = getattr(parent, fused)
            wrapper = CanonicalQkv(original, made, NH // tp, NG // tp, D) if fused == "linear_qkv" else \
                CanonicalFc1(original, made)
            setattr(parent, fused, wrapper)
            adapters.update({(i, t): made[part] for part, t in parts.items()})
        for t in ("linear_proj", "linear_fc2"):
            if t in targets:
                parent = layer.self_attention if t == "linear_proj" else layer.mlp
                fin, fout = dense.lora_io(t)
                adapter = Adapter(fin, fout, dim, alpha, True, False, config)
                setattr(parent, t, Wrapped(getattr(parent, t), adapter))
                adapters[(i, t)] = adapter
    return adapters


def fill_canonical(torch, adapters: dict, factors: dict, tp_rank: int, tp: int):
    with torch.no_grad():
        for key, adapter in adapters.items():
            a, b = factors[key]
            row_parallel = key[1] in ROW_PARALLEL
            adapter.linear_in.weight.copy_(a.chunk(tp, dim=1 if row_parallel else 0)[tp_rank])
            adapter.linear_out.weight.copy_(b.chunk(tp, dim=0)[tp_rank])


def wrap_targets(model, config, targets, dim, alpha, ep_rank: int, local_experts: int, io: dict,
                 dora: bool = False, expert_dim: int | None = None) -> dict:
    """Every targeted linear of every layer wrapped (each routed expert's of a SequentialMLP too, as Bridge adapts
    `local_experts.{k}.linear_fc1`: an is_expert adapter of its own); {global module path: adapter}."""
    Adapter, Wrapped, _, _ = make_adapter_classes()
    DoraAdapter, DoraWrapped = make_dora_classes(Adapter, Wrapped)
    if dora:
        Adapter, Wrapped = DoraAdapter, DoraWrapped
    adapters = {}
    for layer in model.decoder.layers:
        i = layer.layer_number - 1
        linears = [(f"decoder.layers.{i}.self_attention.{m}", layer.self_attention, m, False)
                   for m in ("linear_qkv", "linear_proj")]
        if hasattr(layer.mlp, "experts"):
            linears += [(f"decoder.layers.{i}.mlp.experts.{ep_rank * local_experts + k}.{m}", expert, m, True)
                        for k, expert in enumerate(layer.mlp.experts.local_experts) for m in ("linear_fc1", "linear_fc2")]
        else:
            linears += [(f"decoder.layers.{i}.mlp.{m}", layer.mlp, m, False) for m in ("linear_fc1", "linear_fc2")]
        for path, parent, module, is_expert in linears:
            if module not in targets:
                continue
            linear = getattr(parent, module)
            fin, fout = io[path]
            # Bridge's DoRA adapter is not an is_expert one, even on an expert (its linears use the TP group)
            adapter = Adapter(fin, fout, expert_dim if is_expert and expert_dim else dim, alpha, module in ROW_PARALLEL,
                              module == "linear_fc1", config, is_expert and not dora)
            setattr(parent, module, Wrapped(linear, adapter))
            adapters[path] = adapter
    return adapters


def fill_adapters(torch, adapters: dict, factors: dict, tp_rank: int, tp: int, etp_rank: int, etp: int):
    """The canonical global A [r, in] and B [out, r] (B's rows in the TP=1 order: fc1 [all gate; all up]) as
    this rank's shards of linear_in and linear_out (a routed expert's over the expert TP group)."""
    with torch.no_grad():
        for path, adapter in adapters.items():
            rank, size = (etp_rank, etp) if ".mlp.experts." in path else (tp_rank, tp)
            a, b = factors[path + ".lora_A.weight"], factors[path + ".lora_B.weight"]
            module = path.rsplit(".", 1)[1]
            if module in ROW_PARALLEL:
                a_local = a.chunk(size, dim=1)[rank]
            else:
                a_local = a.chunk(size, dim=0)[rank]
            if module == "linear_fc1":
                gate, up = b.chunk(2, dim=0)
                b_local = torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
            else:
                b_local = b.chunk(size, dim=0)[rank]
            adapter.linear_in.weight.copy_(a_local)
            adapter.linear_out.weight.copy_(b_local)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(CASES), help="the fixtures to make (default: all)")
    ap.add_argument("--out", help="write the fixtures under this folder instead of their tests/ folders")
    opts = ap.parse_args()
    import torch.multiprocessing as mp

    for name in opts.only or sorted(CASES):
        family, spec, same_as, folder, _, with_canonical, dora_targets = CASES[name]
        out = Path(opts.out) if opts.out else ROOT / folder
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        world = spec["tp"] * spec.get("ep", 1)
        mp.spawn(worker, args=(world, name, str(out), lib.free_port()), nprocs=world, join=True)
        shutil.copytree(ROOT / folder / same_as / "hf_ref", d / "hf_ref")
        same = json.loads((ROOT / folder / same_as / "fixture.json").read_text())
        info = {k: same[k] for k in same if k in (
            "model_type", "tp", "pp", "ep", "etp", "dtype", "r", "alpha", "targets", "vocab_size", "padded_vocab_size",
            "num_layers", "kv_channels", "num_experts", "qkv_bias", "qk_layernorm", "tied_embeddings")}
        info.update({
            "base_iteration": lib.BASE_ITER, "lora_iteration": LORA_ITERS[-1], "stale_lora_iteration": LORA_ITERS[0],
            "same_model_as": same_as, "lora": "filtered", "base_format": "torch_dist", "lora_format": "torch_dist",
            "megatron_bridge": True, "singleton_local_shards": False, "vpp": None, "logits_computed_in": "float32",
            "canonical_lora": with_canonical, "dora_targets": dora_targets,
            "description": __doc__.split("\n\n", 1)[1].split("\n\n    python")[0],
        })
        info.setdefault("tied_embeddings", False)
        (d / "fixture.json").write_text(json.dumps(info, indent=2) + "\n")
        print(f"wrote {d}")


if __name__ == "__main__":
    main()
