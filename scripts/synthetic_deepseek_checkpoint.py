"""Write a synthetic DeepSeek-V3 Megatron-Core checkpoint for benchmarks: the BASE as a torch_dist
(distributed) checkpoint, the LoRA as MindSpeed's legacy filtered LoRA with one file per EP rank, and an
hf_ref config.json (transformers' deepseek_v3).

Shapes (default: DeepSeek-V3's; `--small` for quick checks, `--shape KEY=VALUE` to override any):
hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head_dim 128,
dense ffn 18432, 256 routed experts with ffn 2048, 1 shared expert (ffn 2048), top-8, 8 groups / 4 per
token, sigmoid routing with an fp32 router expert_bias, routed_scaling_factor 2.5, vocab 129280 (padded
to a multiple of 128), untied embeddings, bf16. Layers below first_k_dense_replace (1) are dense MLPs,
the others MoE (SequentialMLP experts + a shared expert). Expert parallelism EP (8), TP = PP = 1.
LoRA r=8, alpha=16 on every MLA linear, the dense MLP, every expert and the shared expert.

The base reproduces what Megatron-LM (megatron-core 0.16.1, local spec, `--ckpt-format torch_dist`,
`--ckpt-fully-parallel-save`, the default) writes for such a model trained with --bf16:
* heterogeneous layers (moe_layer_freq a list) are saved with per-layer keys `decoder.layers.{i}.…`
  (TransformerBlock.sharded_state_dict: non_homogeneous_layers), not stacked [L, …];
* experts as global `decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight` [E, 2F, H] (rows
  [gate; up] per expert) and `linear_fc2.weight` [E, H, F]; every swiglu fc1 (dense, expert, shared) is
  saved as two chunks, its gate half and its up half (apply_swiglu_sharded_factory); `_extra_state`
  entries as bytes items named `…/shard_{offset}_{shape}`; rng_state as one bytes item on rank 0;
* which rank saves which chunk: experts on their EP rank; every replicated chunk is spread over the
  data-parallel group (= all EP ranks) by Megatron's distribute_shards_to_ranks (coverage, then size,
  then shard id, greedily to the least loaded rank) — `--no-fully-parallel` keeps them all on rank 0;
* per rank, FileSystemWriterAsync's split into thread_count=2 files `__{rank}_{i}.distcp` (bytes items
  round-robin, tensors by chunk size to the lighter file), bytes items first, each chunk written by
  torch's own `_write_item` (a torch.save archive at an offset);
* `.metadata`: torch.distributed.checkpoint's Metadata built by torch's create_default_global_save_plan
  from the per-rank plans (in rank order), with storage_data, storage_meta, version and Megatron's extra
  `all_local_plans`; `common.pt` (args, checkpoint_version, iteration, …, content_metadata) and
  `metadata.json`.
Checked against a real megatron-core 0.16.1 dist_checkpointing.save at small shapes with EP=8 (same
keys, global shapes, dtypes, chunk lists in the same order, same file, offset and length of every record).

Memory: chunks are generated one at a time (the largest is the embedding or output layer, 1.85 GB at
full shapes), written and freed; the whole model is never in memory.

    python scripts/synthetic_deepseek_checkpoint.py OUT [--small] [--ep 8] [--shape experts=32 ...]
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import random
import time
import uuid
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

try:
    from synthetic_values import normal_like
except ImportError:  # imported as scripts.<module>
    from scripts.synthetic_values import normal_like
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import (
    _StorageWriterTransforms,
    _write_item,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

FULL = {"hidden": 7168, "heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope": 128, "qk_rope": 64,
        "v_head_dim": 128, "ffn": 18432, "experts": 256, "moe_ffn": 2048, "shared_experts": 1, "topk": 8,
        "n_group": 8, "topk_group": 4, "scaling": 2.5, "vocab": 129280, "layers": 2, "first_k_dense": 1,
        "max_pos": 4096, "rope_theta": 10000}
SMALL = dict(FULL, hidden=64, heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head_dim=12,
             ffn=96, experts=16, moe_ffn=16, topk=4, n_group=4, topk_group=2, vocab=250, max_pos=32)
LORA_TARGETS = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
                "linear_fc1", "linear_fc2"]
BASE_ITER, LORA_ITER = 1, 10
THREAD_COUNT = 2  # TorchDistSaveShardedStrategy's default: two files per rank
BF16 = torch.bfloat16
METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}


def padded_vocab(d: dict) -> int:
    return -(-d["vocab"] // 128) * 128  # --make-vocab-size-divisible-by 128, TP 1


def moe_layer_freq(d: dict) -> list:
    return [0 if i < d["first_k_dense"] else 1 for i in range(d["layers"])]


# --- values -------------------------------------------------------------------------------------------

def _gen(seed: int, *parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr((seed, *parts)).encode()))


def _value(seed: int, key: str, offsets, sizes, dtype, kind: str) -> torch.Tensor:
    std, mean = {"norm": (0.05, 1.0), "bias": (0.05, 0.0)}.get(kind, (0.02, 0.0))
    return normal_like(sizes, dtype, std, mean, key=(seed, key, tuple(offsets)))


# --- the model's sharded state dict, in Megatron's order ------------------------------------------------

class Shard(SimpleNamespace):
    """One chunk of a global tensor (a ShardedTensor) or one bytes item (a ShardedObject)."""


def _tensor(entries, key, shape, dtype=BF16, kind="weight", holders=None, chunks=None, expert=None):
    """A tensor saved as `chunks` [(offsets, sizes)] (default: whole). holders None = every rank."""
    for offsets, sizes in chunks or [((0,) * len(shape), tuple(shape))]:
        entries.append(Shard(key=key, bytes=False, shape=tuple(shape), offsets=tuple(offsets), sizes=tuple(sizes),
                             dtype=dtype, kind=kind, holders=holders, expert=expert))


def _object(entries, key, obj, holders):
    entries.append(Shard(key=key, bytes=True, obj=obj, holders=holders))


def _glu_chunks(f: int, h: int, lead: tuple = ()):
    """apply_swiglu_sharded_factory at TP 1: the gate half and the up half of fc1 [2F, H]."""
    return [(lead + (0, 0), (1,) * len(lead) + (f, h)), (lead + (f, 0), (1,) * len(lead) + (f, h))]


def sharded_entries(d: dict, ep: int) -> list:
    """Every shard of the model in the order of GPTModel.sharded_state_dict (megatron-core 0.16.1, local
    MLA spec, heterogeneous layers), as a rank iterates them. Expert shards name their EP rank."""
    H, E, F = d["hidden"], d["experts"], d["moe_ffn"]
    E_loc = E // ep
    Fs = d["shared_experts"] * F
    out = []
    _tensor(out, "embedding.word_embeddings.weight", (padded_vocab(d), H))
    for i, moe in enumerate(moe_layer_freq(d)):
        p = f"decoder.layers.{i}."
        a = p + "self_attention."
        _tensor(out, p + "input_layernorm.weight", (H,), kind="norm")
        for name, shape in mla_linears(d).items():
            _tensor(out, a + name + ".weight", shape)
            _object(out, a + name + "._extra_state/shard_0_1", None, holders=[0])
        _tensor(out, a + "q_layernorm.weight", (d["q_lora_rank"],), kind="norm")
        _tensor(out, a + "kv_layernorm.weight", (d["kv_lora_rank"],), kind="norm")
        _tensor(out, p + "pre_mlp_layernorm.weight", (H,), kind="norm")
        if not moe:
            Fd = d["ffn"]
            _tensor(out, p + "mlp.linear_fc1.weight", (2 * Fd, H), chunks=_glu_chunks(Fd, H))
            _object(out, p + "mlp.linear_fc1._extra_state/shard_0_1", None, holders=[0])
            _tensor(out, p + "mlp.linear_fc2.weight", (H, Fd))
            _object(out, p + "mlp.linear_fc2._extra_state/shard_0_1", None, holders=[0])
            continue
        _tensor(out, p + "mlp.router.weight", (E, H))
        _tensor(out, p + "mlp.router.expert_bias", (E,), dtype=torch.float32, kind="bias")
        x = p + "mlp.experts.experts."
        for r in range(ep):
            for k in range(E_loc):
                e = r * E_loc + k
                _tensor(out, x + "linear_fc1.weight", (E, 2 * F, H), holders=[r], expert=e,
                        chunks=_glu_chunks(F, H, (e,)))
                _object(out, x + f"linear_fc1._extra_state/shard_{e}_{E}", None, holders=[r])
                _tensor(out, x + "linear_fc2.weight", (E, H, F), holders=[r], expert=e,
                        chunks=[((e, 0, 0), (1, H, F))])
                _object(out, x + f"linear_fc2._extra_state/shard_{e}_{E}", None, holders=[r])
        s = p + "mlp.shared_experts."
        _tensor(out, s + "linear_fc1.weight", (2 * Fs, H), chunks=_glu_chunks(Fs, H))
        _object(out, s + "linear_fc1._extra_state/shard_0_1", None, holders=[0])
        _tensor(out, s + "linear_fc2.weight", (H, Fs))
        _object(out, s + "linear_fc2._extra_state/shard_0_1", None, holders=[0])
    _tensor(out, "decoder.final_layernorm.weight", (H,), kind="norm")
    _tensor(out, "output_layer.weight", (padded_vocab(d), H))
    _object(out, "rng_state/shard_0.0_1.1", "rng", holders=[0])
    return out


def mla_linears(d: dict) -> dict:
    """{MLA linear: [out, in]} in MLASelfAttention's module order."""
    H, NH = d["hidden"], d["heads"]
    return {"linear_proj": (H, NH * d["v_head_dim"]),
            "linear_q_down_proj": (d["q_lora_rank"], H),
            "linear_q_up_proj": (NH * (d["qk_nope"] + d["qk_rope"]), d["q_lora_rank"]),
            "linear_kv_down_proj": (d["kv_lora_rank"] + d["qk_rope"], H),
            "linear_kv_up_proj": (NH * (d["qk_nope"] + d["v_head_dim"]), d["kv_lora_rank"])}


def _nbytes(s: Shard) -> int:
    return int(np.prod(s.sizes)) * torch._utils._element_size(s.dtype)


def distribute(entries: list, ep: int, fully_parallel: bool) -> None:
    """Set each shard's saving rank. Tensors: megatron.core.dist_checkpointing.exchange_utils.
    distribute_shards_to_ranks (least covered first, then largest, then by shard id (key, offset), each to
    the least loaded rank holding it). Bytes items (ShardedObjects) keep their main replica."""
    tensors = [s for s in entries if not s.bytes]
    for s in entries:
        if s.bytes:
            s.rank = s.holders[0]
        elif not fully_parallel:
            s.rank = s.holders[0] if s.holders else 0
    if not fully_parallel:
        return
    load = [0] * ep
    order = sorted(tensors, key=lambda s: (len(s.holders or range(ep)), -_nbytes(s), (s.key, s.offsets, None)))
    for s in order:
        _, rank = min((load[r], r) for r in (s.holders or range(ep)))
        s.rank = rank
        load[rank] += _nbytes(s)


def write_item(s: Shard) -> WriteItem:
    if s.bytes:
        return WriteItem(index=MetadataIndex(s.key), type=WriteItemType.BYTE_IO)
    return WriteItem(index=MetadataIndex(s.key, torch.Size(s.offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.sizes)),
                                                 properties=TensorProperties(dtype=s.dtype), size=torch.Size(s.shape)))


def local_plan(entries: list, rank: int) -> list:
    """A rank's items in the order of its flattened state dict: one entry per key at the key's first
    local occurrence, holding all of its local chunks."""
    by_key: dict[str, list] = {}
    for s in entries:
        if s.rank == rank:
            by_key.setdefault(s.key, []).append(s)
    return [s for shards in by_key.values() for s in shards]


def _item_size(s: Shard) -> int:
    return _nbytes(s)  # FileSystemWriterAsync's _item_size: the chunk's size (torch's uses the global size)


def split_files(items: list) -> list:
    """megatron.core FileSystemWriterAsync: _split_by_size_and_type(thread_count, items)."""
    bins = [[] for _ in range(THREAD_COUNT)]
    sizes = [0] * THREAD_COUNT
    byte_items = [s for s in items if s.bytes]
    tensor_items = sorted((s for s in items if not s.bytes), key=_item_size, reverse=True)
    for i, s in enumerate(byte_items):
        bins[i % THREAD_COUNT].append(s)
    for s in tensor_items:
        idx = min(range(THREAD_COUNT), key=lambda j: (sizes[j], j))
        bins[idx].append(s)
        sizes[idx] += _item_size(s)
    return [b for b in bins if b]


def _rng_state(seed: int):
    """What Megatron-LM's get_rng_state saves (one dp rank, no data_parallel_random_init); on a GPU the CUDA
    and tracker states are 16-byte Philox states."""
    rs = random.Random(seed)
    np_state = np.random.RandomState(seed).get_state()
    g = torch.Generator().manual_seed(seed)
    return [{"random_rng_state": rs.getstate(), "np_rng_state": np_state, "torch_rng_state": g.get_state(),
             "cuda_rng_state": torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8),
             "rng_tracker_states": {"model-parallel-rng": torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8)}}]


def _bytes_data(s: Shard, seed: int) -> io.BytesIO:
    """As Megatron's planner resolves a ShardedObject: torch.save of its data into a BytesIO. Megatron
    wraps each object in a list (TorchDistSaveShardedStrategy / sharded_objects_to_pyt)."""
    buf = io.BytesIO()
    torch.save([_rng_state(seed) if s.obj == "rng" else s.obj], buf)
    buf.seek(0)
    return buf


# --- args and config ------------------------------------------------------------------------------------

def make_args(d: dict, ep: int, *, lora: bool, save: str, load: str, r: int = 8, alpha: int = 16):
    """Megatron-LM 0.16.1 args of a DeepSeek-V3 run (MLA + MoE, local spec) as saved in its checkpoints;
    the same fields as tests/fixtures_deepseek (scripts/fixturegen/deepseek.py, make_ds_args)."""
    dist = not lora
    return argparse.Namespace(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, expert_model_parallel_size=ep, context_parallel_size=1,
        sequence_parallel=False, world_size=ep, data_parallel_size=ep, rank=0, num_layers=d["layers"],
        hidden_size=d["hidden"], ffn_hidden_size=d["ffn"], num_attention_heads=d["heads"],
        group_query_attention=False, num_query_groups=d["heads"], kv_channels=d["v_head_dim"],
        padded_vocab_size=padded_vocab(d), make_vocab_size_divisible_by=128, add_qkv_bias=False,
        add_bias_linear=False, add_dense_bias=False, swiglu=True, untie_embeddings_and_output_weights=True,
        normalization="RMSNorm", norm_epsilon=1e-6, position_embedding_type="rope",
        use_rotary_position_embeddings=True, rotary_base=d["rope_theta"], rotary_percent=1.0,
        rotary_interleaved=False, rope_scaling_type=None, seq_length=d["max_pos"],
        max_position_embeddings=d["max_pos"], qk_layernorm=True, num_experts=d["experts"], hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=BF16, bf16=True, fp16=False, transformer_impl="local",
        use_mcore_models=True, use_legacy_models=False, spec=None, noop_layers=None, num_layer_list=None,
        ckpt_format="torch_dist" if dist else "torch", use_dist_ckpt=dist, load=load, save=save,
        finetune=lora, no_load_optim=True, no_load_rng=True, no_save_optim=True,
        tokenizer_type="PretrainedFromHF", tokenizer_name_or_path="/data/models/DeepSeek-V3", micro_batch_size=1,
        global_batch_size=ep, train_iters=LORA_ITER if lora else BASE_ITER, lr=1e-4, min_lr=1e-6,
        iteration=LORA_ITER if lora else BASE_ITER,
        lora_r=r if lora else 16, lora_alpha=alpha if lora else 32,
        lora_target_modules=list(LORA_TARGETS) if lora else [], lora_ckpt_filter=lora, lora_load=None,
        lora_fusion=False, lora_register_forward_hook=["word_embeddings", "input_layernorm"],
        num_virtual_stages_per_pipeline_rank=None, decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None, pipeline_model_parallel_layout=None,
        account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
        overlap_p2p_comm=False, use_distributed_optimizer=False, auto_detect_ckpt_format=False,
        ckpt_fully_parallel_save=True, ckpt_assume_constant_structure=False, async_save=False, no_save_rng=False,
        expert_tensor_parallel_size=1, moe_ffn_hidden_size=d["moe_ffn"], moe_router_topk=d["topk"],
        moe_router_pre_softmax=False, moe_router_score_function="sigmoid",
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, moe_z_loss_coeff=None,
        moe_router_topk_scaling_factor=d["scaling"], moe_router_num_groups=d["n_group"],
        moe_router_group_topk=d["topk_group"], moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_input_jitter_eps=None, moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_use_legacy_grouped_gemm=False,
        moe_permute_fusion=False, moe_layer_freq=moe_layer_freq(d),
        moe_shared_expert_intermediate_size=d["shared_experts"] * d["moe_ffn"], moe_shared_expert_gate=False,
        moe_shared_expert_overlap=False, moe_tp_extend_ep=False, multi_latent_attention=True,
        q_lora_rank=d["q_lora_rank"], kv_lora_rank=d["kv_lora_rank"], qk_head_dim=d["qk_nope"],
        qk_pos_emb_head_dim=d["qk_rope"], v_head_dim=d["v_head_dim"], rope_type="rope", rotary_scaling_factor=1.0,
        mscale=1.0, mscale_all_dim=0.0, moe_router_bias_update_rate=1e-3,
        model_type=_megatron_enum("megatron.core.enums", "ModelType", encoder_or_decoder=1),
        attention_backend=_megatron_enum("megatron.core.transformer.enums", "AttnBackend", auto=5),
    )


_ENUMS: dict = {}


def _megatron_enum(module: str, name: str, **members):
    """A member of a Megatron enum (args.model_type, args.attention_backend) that pickles exactly as the real
    one (GLOBAL 'module name' + its value), without importing Megatron: an Enum class under the real
    module path, registered in sys.modules only while a checkpoint is being saved (see _megatron_modules)."""
    import enum

    if (module, name) not in _ENUMS:
        cls = enum.Enum(name, members, module=module)
        _ENUMS[(module, name)] = cls
    return next(iter(_ENUMS[(module, name)]))


class _megatron_modules:
    """Make the enum stand-ins importable by pickle (it checks that a class is found under its module and
    name) while saving; restores sys.modules afterwards. A real, already imported Megatron is left alone."""

    def __enter__(self):
        import sys
        import types

        self.added = []
        for (module, name), cls in _ENUMS.items():
            parts = module.split(".")
            for i in range(1, len(parts) + 1):
                m = ".".join(parts[:i])
                if m not in sys.modules:
                    sys.modules[m] = types.ModuleType(m)
                    self.added.append(m)
            setattr(sys.modules[module], name, getattr(sys.modules[module], name, cls))
        return self

    def __exit__(self, *exc):
        import sys

        for m in reversed(self.added):
            del sys.modules[m]


def hf_config(d: dict) -> dict:
    """transformers' deepseek_v3 config.json (the keys of tests/fixtures_deepseek/deepseek_v3_ep2), plain rope."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "dtype": "bfloat16", "eos_token_id": 1, "first_k_dense_replace": d["first_k_dense"],
        "head_dim": d["qk_rope"], "hidden_act": "silu", "hidden_size": d["hidden"], "initializer_range": 0.02,
        "intermediate_size": d["ffn"], "kv_lora_rank": d["kv_lora_rank"], "max_position_embeddings": d["max_pos"],
        "model_type": "deepseek_v3", "moe_intermediate_size": d["moe_ffn"], "moe_layer_freq": 1,
        "n_group": d["n_group"], "n_routed_experts": d["experts"], "n_shared_experts": d["shared_experts"],
        "norm_topk_prob": True, "num_attention_heads": d["heads"], "num_experts_per_tok": d["topk"],
        "num_hidden_layers": d["layers"], "num_key_value_heads": d["heads"], "num_nextn_predict_layers": 0,
        "output_router_logits": False, "pad_token_id": None, "pretraining_tp": 1, "q_lora_rank": d["q_lora_rank"],
        "qk_head_dim": d["qk_nope"] + d["qk_rope"], "qk_nope_head_dim": d["qk_nope"], "qk_rope_head_dim": d["qk_rope"],
        "rms_norm_eps": 1e-06, "rope_interleave": True,
        "rope_parameters": {"rope_theta": float(d["rope_theta"]), "rope_type": "default"},
        "routed_scaling_factor": d["scaling"], "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": d["topk_group"], "topk_method": "noaux_tc", "transformers_version": "5.24.0",
        "use_cache": True, "v_head_dim": d["v_head_dim"], "vocab_size": d["vocab"],
    }


# --- writers --------------------------------------------------------------------------------------------

def write_base(out: Path, d: dict, ep: int, seed: int = 0, fully_parallel: bool = True,
               save_dir: str = "/data/ckpt/deepseek_v3/base", log=print) -> Path:
    it = out / f"iter_{BASE_ITER:07d}"
    it.mkdir(parents=True, exist_ok=True)
    entries = sharded_entries(d, ep)
    distribute(entries, ep, fully_parallel)
    plans = [local_plan(entries, r) for r in range(ep)]
    all_local_plans = [SavePlan([write_item(s) for s in items], planner_data={}) for items in plans]
    _, metadata = create_default_global_save_plan(all_local_plans, rewrite_index_hints=False)
    transforms = _StorageWriterTransforms()
    fmt = {}
    try:
        from torch.distributed.checkpoint.filesystem import SerializationFormat
        fmt["serialization_format"] = SerializationFormat.TORCH_SAVE
    except ImportError:  # older torch: torch.save always
        pass
    results, written = {}, 0
    for rank, items in enumerate(plans):
        for i, bucket in enumerate(split_files(items)):
            name = f"__{rank}_{i}.distcp"
            with open(it / name, "wb") as f:
                for s in [s for s in bucket if s.bytes] + [s for s in bucket if not s.bytes]:
                    data = (_bytes_data(s, seed) if s.bytes
                            else _value(seed, s.key, s.offsets, s.sizes, s.dtype, s.kind))
                    wr = _write_item(transforms, f, data, write_item(s), name, **fmt)
                    results[wr.index] = wr.storage_data
                    written += wr.size_in_bytes
                    del data
            log(f"  {name}: {(it / name).stat().st_size / 1e9:.2f} GB")
    metadata.storage_data = results
    metadata.storage_meta = StorageMeta(checkpoint_id=f"{save_dir}/iter_{BASE_ITER:07d}",
                                        save_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"lora-merge-bench:{seed}")))
    metadata.version = "1.0.0"
    metadata.all_local_plans = all_local_plans  # Megatron's save_state_dict_async_plan keeps them
    with open(it / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    common = {"args": make_args(d, ep, lora=False, save=save_dir, load="/data/ckpt/deepseek_v3/hf-converted"),
              "checkpoint_version": 3.0, "iteration": BASE_ITER, "num_floating_point_operations_so_far": 0,
              "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}}
    with _megatron_modules():
        torch.save(common, it / "common.pt")
    (it / "metadata.json").write_text(json.dumps(METADATA_JSON))
    (out / "latest_checkpointed_iteration.txt").write_text(str(BASE_ITER))
    return it


def lora_modules(d: dict, ep: int, rank: int) -> dict:
    """{module name in EP rank `rank`'s LoRA file: (in, out)}, in PEFT's order."""
    H, F, E_loc = d["hidden"], d["moe_ffn"], d["experts"] // ep
    Fs = d["shared_experts"] * F
    out = {}
    for i, moe in enumerate(moe_layer_freq(d)):
        p = f"decoder.layers.{i}."
        for name, (o, n) in mla_linears(d).items():
            out[p + "self_attention." + name] = (n, o)
        if not moe:
            out[p + "mlp.linear_fc1"] = (H, 2 * d["ffn"])
            out[p + "mlp.linear_fc2"] = (d["ffn"], H)
            continue
        for k in range(E_loc):
            out[f"{p}mlp.experts.local_experts.{k}.linear_fc1"] = (H, 2 * F)
            out[f"{p}mlp.experts.local_experts.{k}.linear_fc2"] = (F, H)
        out[p + "mlp.shared_experts.linear_fc1"] = (H, 2 * Fs)
        out[p + "mlp.shared_experts.linear_fc2"] = (Fs, H)
    return out


ROW_PARALLEL = ("linear_proj", "linear_fc2")  # their lora_A is a RowParallelLinear (has _extra_state)


def lora_value(seed: int, name: str, shape) -> torch.Tensor:
    """Factor values depend only on the GLOBAL module (dense LoRA repeated identically in every EP file)."""
    return normal_like(shape, BF16, key=(seed, "lora", name))


def global_module(d: dict, ep: int, rank: int, name: str) -> str:
    if ".local_experts." not in name:
        return name
    head, rest = name.split(".local_experts.")
    k, tail = rest.split(".", 1)
    return f"{head}.{rank * (d['experts'] // ep) + int(k)}.{tail}"


def write_lora(out: Path, d: dict, ep: int, r: int = 8, alpha: int = 16, seed: int = 1) -> None:
    """MindSpeed's filtered LoRA (--lora-ckpt-filter), legacy format, one file per EP rank: the dense
    LoRA repeated in every file, each rank's experts numbered locally (`local_experts.{k}`), `_extra_state`
    None entries where PEFT's LoRA linears have them (lora_B of column-parallel, lora_A of row-parallel
    layers), as in tests/fixtures_deepseek. Factors in bf16, the training dtype (Float16Module casts the
    PEFT-wrapped model)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest_checkpointed_iteration.txt").write_text(str(LORA_ITER))
    args = make_args(d, ep, lora=True, save="/data/ckpt/deepseek_v3/lora", load="/data/ckpt/deepseek_v3/base",
                     r=r, alpha=alpha)
    for rank in range(ep):
        model = {}
        for name, (n_in, n_out) in lora_modules(d, ep, rank).items():
            g = global_module(d, ep, rank, name)
            row = name.endswith(ROW_PARALLEL)
            model[name + ".lora_A.default.weight"] = lora_value(seed, g + ".A", (r, n_in))
            if row:
                model[name + ".lora_A.default._extra_state"] = None
            model[name + ".lora_B.default.weight"] = lora_value(seed, g + ".B", (n_out, r))
            if not row:
                model[name + ".lora_B.default._extra_state"] = None
        rank_dir = out / f"iter_{LORA_ITER:07d}" / f"mp_rank_00_{rank:03d}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        with _megatron_modules():
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": LORA_ITER, "model": model,
                        "rng_state": _rng_state(seed + rank), "num_floating_point_operations_so_far": 0},
                       rank_dir / "model_optim_rng.pt")


def write_checkpoint(out: Path, d: dict, ep: int = 8, fully_parallel: bool = True, log=print) -> dict:
    if d["experts"] % ep:
        raise SystemExit(f"{d['experts']} experts do not split over EP={ep}")
    start = time.monotonic()
    write_base(out / "base", d, ep, fully_parallel=fully_parallel, log=log)
    write_lora(out / "lora", d, ep)
    hf = out / "hf_ref"
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(hf_config(d), indent=2))
    return {"seconds": time.monotonic() - start}


def parse_shape(small: bool, overrides: list) -> dict:
    d = dict(SMALL if small else FULL)
    for kv in overrides:
        k, _, v = kv.partition("=")
        if k not in d:
            raise SystemExit(f"unknown shape key {k!r}; known: {', '.join(d)}")
        d[k] = type(d[k])(float(v)) if isinstance(d[k], (int, float)) else v
    return d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--small", action="store_true", help="tiny shapes (hidden 64, 16 experts, vocab 250)")
    p.add_argument("--shape", nargs="*", default=[], metavar="KEY=VALUE", help=f"override a shape: {', '.join(FULL)}")
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--no-fully-parallel", action="store_true",
                   help="every replicated chunk saved by rank 0 (--no-ckpt-fully-parallel-save)")
    args = p.parse_args()
    d = parse_shape(args.small, args.shape)
    res = write_checkpoint(args.out, d, args.ep, not args.no_fully_parallel)
    print(f"wrote {args.out} in {res['seconds']:.1f} s")


if __name__ == "__main__":
    main()
