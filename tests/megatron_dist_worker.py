"""Real megatron-core 0.16.1 on gloo/CPU for tests/test_megatron_dist_writer.py (not collected by pytest).

Small GPTModels of every kind the torch_dist writer handles (dense with a qkv bias and untied output, dense
tied with q/k norms, MoE with a dense first layer, a shared expert and its gate, MoE with stacked layers,
MLA with a dense first layer, routed experts, an expert bias and shared experts, dense MLA without a q LoRA
rank), built with the local spec as Megatron-LM's --transformer-impl local does.

Run as `python megatron_dist_worker.py JOB.json` (the test does): two gloo ranks are spawned, and for each
parallel layout in the job each rank builds every model, then
- "save": writes it with `dist_checkpointing.save` (the values of values.pt), as Megatron-LM's training loop
  does, so that the test can hold our writer's layout against Megatron's own;
- "load": fills every parameter with junk, `dist_checkpointing.load(model.sharded_state_dict(), dir)`,
  `load_state_dict(strict=True)`, and compares every parameter with its slice of the value written, found
  by its canonical name (the name the writer was given), not through the writer's key naming.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

H = 32  # hidden size of every model
VOCAB = 128  # padded vocabulary (a multiple of 64 * TP for TP <= 2)

MODELS = {
    "dense_bias": dict(layers=2, heads=4, groups=2, kv=8, ffn=48, qkv_bias=True, tied=False),
    "dense_tied_qknorm": dict(layers=2, heads=4, groups=4, kv=8, ffn=40, qk_norm=True, tied=True),
    # Qwen2-MoE-like: a dense first layer (moe_layer_freq as a list: per-layer keys), a gated shared expert
    "moe_first_dense": dict(layers=3, heads=4, groups=2, kv=8, ffn=48, qkv_bias=True, tied=False,
                            moe=dict(freq=[0, 1, 1], experts=4, ffn=16, topk=2, shared=24, shared_gate=True)),
    # Qwen3-MoE-like: every layer MoE (moe_layer_freq 1: stacked keys, experts [L, E, ...])
    "moe_stacked": dict(layers=2, heads=4, groups=2, kv=8, ffn=48, qk_norm=True, tied=False,
                        moe=dict(freq=1, experts=4, ffn=16, topk=2, shared=0)),
    # DeepSeek-V3-like: MLA, a dense first layer, experts with an expert bias and shared experts
    "mla_moe": dict(layers=2, heads=4, ffn=48, tied=False,
                    mla=dict(q_lora=24, kv_lora=16, qk_head=8, rope=4, v_head=8),
                    moe=dict(freq=[0, 1], experts=4, ffn=16, topk=2, shared=32, expert_bias=True)),
    # DeepSeek-V2-Lite-like attention (no q LoRA rank: linear_q_proj), dense: stacked keys with MLA's norm names
    "mla_dense_no_q_lora": dict(layers=2, heads=4, ffn=48, tied=False,
                                mla=dict(q_lora=None, kv_lora=16, qk_head=8, rope=4, v_head=8)),
}


def moe_layers(spec: dict) -> list[int]:
    moe = spec.get("moe")
    if not moe:
        return []
    freq = moe["freq"]
    if isinstance(freq, int):
        return [i for i in range(spec["layers"]) if i % freq == 0]
    return [i for i, f in enumerate(freq) if f]


def canonical_tensors(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """The model's tensors as the writer's caller names them: global Megatron names, TP=1 shapes."""
    s = MODELS[name]
    out = [("embedding.word_embeddings.weight", (VOCAB, H))]
    for i in range(s["layers"]):
        p = f"decoder.layers.{i}."
        out.append((p + "input_layernorm.weight", (H,)))
        if "mla" in s:
            m, nh = s["mla"], s["heads"]
            q = nh * (m["qk_head"] + m["rope"])
            if m["q_lora"]:
                out += [(p + "self_attention.linear_q_down_proj.weight", (m["q_lora"], H)),
                        (p + "self_attention.q_layernorm.weight", (m["q_lora"],)),
                        (p + "self_attention.linear_q_up_proj.weight", (q, m["q_lora"]))]
            else:
                out.append((p + "self_attention.linear_q_proj.weight", (q, H)))
            out += [(p + "self_attention.linear_kv_down_proj.weight", (m["kv_lora"] + m["rope"], H)),
                    (p + "self_attention.kv_layernorm.weight", (m["kv_lora"],)),
                    (p + "self_attention.linear_kv_up_proj.weight", (nh * (m["qk_head"] + m["v_head"]), m["kv_lora"])),
                    (p + "self_attention.linear_proj.weight", (H, nh * m["v_head"]))]
        else:
            qkv = (s["heads"] + 2 * s["groups"]) * s["kv"]
            out.append((p + "self_attention.linear_qkv.weight", (qkv, H)))
            if s.get("qkv_bias"):
                out.append((p + "self_attention.linear_qkv.bias", (qkv,)))
            if s.get("qk_norm"):
                out += [(p + "self_attention.q_layernorm.weight", (s["kv"],)),
                        (p + "self_attention.k_layernorm.weight", (s["kv"],))]
            out.append((p + "self_attention.linear_proj.weight", (H, s["heads"] * s["kv"])))
        out.append((p + "pre_mlp_layernorm.weight", (H,)))
        if i in moe_layers(s):
            moe = s["moe"]
            E, F = moe["experts"], moe["ffn"]
            out.append((p + "mlp.router.weight", (E, H)))
            if moe.get("expert_bias"):
                out.append((p + "mlp.router.expert_bias", (E,)))
            for e in range(E):
                out += [(p + f"mlp.experts.{e}.linear_fc1.weight", (2 * F, H)),
                        (p + f"mlp.experts.{e}.linear_fc2.weight", (H, F))]
            if moe["shared"]:
                out += [(p + "mlp.shared_experts.linear_fc1.weight", (2 * moe["shared"], H)),
                        (p + "mlp.shared_experts.linear_fc2.weight", (H, moe["shared"]))]
                if moe.get("shared_gate"):
                    out.append((p + "mlp.shared_experts.gate_weight", (1, H)))
        else:
            out += [(p + "mlp.linear_fc1.weight", (2 * s["ffn"], H)), (p + "mlp.linear_fc2.weight", (H, s["ffn"]))]
    out.append(("decoder.final_layernorm.weight", (H,)))
    if not s["tied"]:
        out.append(("output_layer.weight", (VOCAB, H)))
    return out


# --- Megatron side ------------------------------------------------------------------------------------

def _patch_cpu(torch):
    """What megatron-core 0.16.1 needs to build (not run) these models on a CPU (as scripts/make_*fixtures.py)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None

    class _Stream:
        def wait_stream(self, *a, **k):
            pass

        def record_event(self, *a, **k):
            return None

    stream = _Stream()
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False  # TE placeholders would make MLA think TransformerEngine is there


def _config(torch, name: str, tp: int, ep: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    s = MODELS[name]
    kw = dict(num_layers=s["layers"], hidden_size=H, num_attention_heads=s["heads"], ffn_hidden_size=s["ffn"],
              add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
              hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
              use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
              bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
              persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    if s.get("moe"):
        moe = s["moe"]
        kw.update(num_moe_experts=moe["experts"], moe_ffn_hidden_size=moe["ffn"], moe_router_topk=moe["topk"],
                  moe_layer_freq=moe["freq"], moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall",
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep,
                  moe_router_dtype="fp32")
        if moe["shared"]:
            kw.update(moe_shared_expert_intermediate_size=moe["shared"],
                      moe_shared_expert_gate=moe.get("shared_gate", False))
        if moe.get("expert_bias"):
            kw.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    if "mla" in s:
        m = s["mla"]
        return MLATransformerConfig(q_lora_rank=m["q_lora"], kv_lora_rank=m["kv_lora"], qk_head_dim=m["qk_head"],
                                    qk_pos_emb_head_dim=m["rope"], v_head_dim=m["v_head"], kv_channels=m["v_head"],
                                    qk_layernorm=True, rope_type="rope", rotary_scaling_factor=1.0, **kw)
    return TransformerConfig(num_query_groups=s["groups"], kv_channels=s["kv"], add_qkv_bias=s.get("qkv_bias", False),
                             qk_layernorm=s.get("qk_norm", False), **kw)


def build(torch, name: str, tp: int, ep: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = _config(torch, name, tp, ep)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if "mla" in MODELS[name]:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class MLADotProductAttention(DotProductAttention):  # the local one does not take MLA's k/v channels
            def __init__(self, config, *a, k_channels=None, v_channels=None, **k):
                super().__init__(config, *a, **k)

        for ls in block.layer_specs:
            ls.submodules.self_attention.submodules.core_attention = MLADotProductAttention
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=VOCAB, max_sequence_length=64,
                    pre_process=True, post_process=True, parallel_output=True,
                    share_embeddings_and_output_weights=MODELS[name]["tied"], position_embedding_type="rope")


COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_q_proj.weight", "linear_q_down_proj.weight",
          "linear_q_up_proj.weight", "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "word_embeddings.weight",
          "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")
GATED = ("linear_fc1.weight",)


def canonical(key: str, ep_rank: int, experts_per_rank: int) -> str:
    """A GPTModel state_dict key (PP=1: layer numbers are global) -> the canonical global name."""
    key = key.replace(".mlp.experts.local_experts.", ".mlp.experts.")
    parts = key.split(".")
    if ".mlp.experts." in key:
        i = parts.index("experts") + 1
        parts[i] = str(ep_rank * experts_per_rank + int(parts[i]))
    return ".".join(parts)


def local_slice(torch, key: str, full, rank: int, size: int):
    """The TP (or expert-TP) shard of a global value that the parameter `key` holds."""
    if size == 1:
        return full
    if key.endswith(GATED):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    if key.endswith(COLUMN) or key.endswith("linear_fc1.weight"):
        return full.chunk(size, dim=0)[rank]
    if key.endswith(ROW):
        return full.chunk(size, dim=1)[rank]
    return full  # norms, router, expert bias, shared expert gate: replicated


def _ranks(ps, key: str):
    if ".mlp.experts." in key:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def worker(rank: int, world: int, job: dict):
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    _patch_cpu(torch)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(job["port"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    report = {}
    for step in job["steps"]:
        tp, ep = step["tp"], step["ep"]
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        for name, d in step["models"].items():
            torch.manual_seed(0)
            model = build(torch, name, tp, ep)
            values = torch.load(Path(job["values"][name]))
            moe = MODELS[name].get("moe")
            per_rank = moe["experts"] // ep if moe else 0
            ep_rank = ps.get_expert_model_parallel_rank()
            metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
            if step["mode"] == "load":  # as Megatron-LM's load_checkpoint: the flags the checkpoint was saved with
                common = dist_checkpointing.load_common_state_dict(d)
                assert common["checkpoint_version"] == 3.0 and common["iteration"] == 7, common
                assert common["args"].num_layers == MODELS[name]["layers"], common["args"]
                metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
                assert metadata == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}, metadata
            metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
            sd = model.state_dict()
            if step["mode"] == "save":
                new = {}
                for key, x in sd.items():
                    if key.endswith("_extra_state"):
                        new[key] = x
                        continue
                    cname = canonical(key, ep_rank, per_rank)
                    if cname not in values and key.endswith("local_tokens_per_expert"):
                        new[key] = x
                        continue
                    r, size = _ranks(ps, key)
                    new[key] = local_slice(torch, key, values[cname], r, size)
                model.load_state_dict(new, strict=True)
                from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
                from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

                state = {"model": model.sharded_state_dict(metadata=metadata), "checkpoint_version": 3.0,
                         "iteration": 1}
                dist_checkpointing.save(state, d, get_default_save_sharded_strategy("torch_dist"),
                                        content_metadata=_clean_metadata_for_serialization(metadata))
                continue
            # load: junk first, so that every value compared below came from the checkpoint
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(-1234.5)
                for b_name, b in model.named_buffers():
                    if b_name.endswith("expert_bias"):
                        b.fill_(-1234.5)
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, d)
            model.load_state_dict(loaded["model"], strict=True)
            checked = []
            for key, x in model.state_dict().items():
                if key.endswith("_extra_state"):
                    continue
                cname = canonical(key, ep_rank, per_rank)
                if cname not in values:
                    if key.endswith("local_tokens_per_expert"):
                        continue
                    raise AssertionError(f"{name}: model key {key} ({cname}) was not written")
                r, size = _ranks(ps, key)
                want = local_slice(torch, key, values[cname], r, size).to(x.dtype)  # bf16 -> fp32 is exact
                if x.shape != want.shape or not torch.equal(x, want):
                    raise AssertionError(f"{name} TP={tp} EP={ep} rank {rank}: {key} differs from {cname} written")
                checked.append(cname)
            report.setdefault(f"{name} tp{tp} ep{ep}", []).extend(checked)
        ps.destroy_model_parallel()
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def main():
    job = json.loads(Path(sys.argv[1]).read_text())
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(2, job), nprocs=2, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
