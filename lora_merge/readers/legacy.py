"""Reader for Megatron-Core's legacy per-rank checkpoint (`iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`).

Each rank file is unpickled once with tensors memory-mapped, so opening even a large checkpoint reads
only the pickles; tensor bytes are paged in when a rule asks for them.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.model.layer_numbering import numbering_from_args
from lora_merge.model.mtp import args_mtp_layers, canonical as mtp_canonical, is_mtp
from lora_merge.readers.checkpoint import LORA_KEY, Checkpoint, LoraCollector, TensorRef, all_ranks
from lora_merge.readers.experts import ExpertLayout, expert_layout, expert_params
from lora_merge.readers.iteration import TRACKER, resolve_iteration_dir
from lora_merge.files.torch_archive import MappedFile, TorchArchive
from lora_merge.files.safe_load import load_archive
from lora_merge.shown import shown

RANK_FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
MODEL_CHUNK_KEY = re.compile(r"^model(\d*)$")
# Top-level entries of a rank file that are not model weights and are never needed for a merge.
NON_MODEL_ENTRIES = {"args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler", "rng_state",
                     "rerun_state_machine", "num_floating_point_operations_so_far", "tokens_so_far"}


def is_legacy_iteration(path: Path) -> bool:
    return path.is_dir() and any(RANK_DIR.match(p.name) for p in path.iterdir())


def _rank_dirs(it_dir: Path) -> dict[tuple[int, ...], Path]:
    found = {}
    for p in sorted(it_dir.iterdir()):
        m = RANK_DIR.match(p.name)
        if m and p.is_dir():
            found[tuple(int(g) for g in m.groups() if g is not None)] = p
    if not found:
        raise MergeError(f"{it_dir}: no mp_rank_* directories")
    return found


def _rank_of(key: tuple[int, ...], pp: int, ep: int) -> tuple[int, int, int] | None:
    """(tp, pp, ep) ranks of a dir name's numbers: `mp_rank_TT[_PPP][_EEE]` has the PP part only when
    PP > 1 and the EP part only when EP > 1, so `mp_rank_00_003` means what the args say."""
    expected_parts = 1 + (pp > 1) + (ep > 1)
    if len(key) != expected_parts:
        return None
    t = key[0]
    p = key[1] if pp > 1 else 0
    e = key[-1] if ep > 1 else 0
    return t, p, e


def _dir_name(t: int, p: int, e: int, pp: int, ep: int) -> str:
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")


def _check_rank_grid(it_dir: Path, dirs: dict, tp: int, pp: int, experts: ExpertLayout | None) -> dict:
    """The dirs by (tp, pp, ep) rank. Every (tp, pp) needs a file for the dense part and every (pp, ep,
    expert-TP rank) one for the experts; with ETP=1 only some (tp, ep) dirs exist, so the grid is not
    assumed, only covered."""
    ep = experts.ep if experts else 1
    ranks, extra = {}, []
    for key, d in dirs.items():
        rank = _rank_of(key, pp, ep)
        if rank is None or rank[0] >= tp or rank[1] >= pp or rank[2] >= ep:
            extra.append(d.name)
        else:
            ranks[rank] = d
    missing = [_dir_name(t, p, 0, pp, ep) if ep == 1 else f"a {_dir_name(t, p, 0, pp, 1)}_EEE dir"
               for t in range(tp) for p in range(pp) if not any(r[:2] == (t, p) for r in ranks)]
    if experts and experts.tp_extend:  # every (TP, EP) rank holds experts of its own
        missing += [_dir_name(t, p, e, pp, ep) for t in range(tp) for p in range(pp) for e in range(ep)
                    if (t, p, e) not in ranks]
    elif experts:
        # with ETP=1 any TP rank's file may hold an EP rank's experts
        missing += [_dir_name(t, p, e, pp, ep) if experts.etp == experts.tp else
                    f"an {_dir_name(0, p, e, pp, ep).replace('mp_rank_00', 'mp_rank_TT')} dir (experts of EP rank {e})"
                    for p in range(pp) for e in range(ep) for t in range(experts.etp)
                    if not any(r[1:] == (p, e) and experts.etp_rank(r[0]) == t for r in ranks)]
    if missing or extra:
        detail = (f"missing {', '.join(dict.fromkeys(missing))}" if missing else "") + \
            ("; " if missing and extra else "") + (f"unexpected {', '.join(extra)}" if extra else "")
        layout = f"TP={tp} PP={pp}" + (f" EP={ep} ETP={experts.etp}" if experts else "")
        raise MergeError(f"{it_dir}: rank directories do not match {layout} from the args ({detail})")
    return ranks


def _load_rank(rank_dir: Path) -> tuple[dict, TorchArchive]:
    path = rank_dir / RANK_FILE
    if not path.is_file():
        raise MergeError(f"{rank_dir}: missing {RANK_FILE}")
    # memory-mapped: only the pickle is read now; each tensor's member is fetched (at a URL) when its ref loads it
    archive = TorchArchive(MappedFile(path), fetch_members=False)
    state = load_archive(archive)
    if not isinstance(state, dict):
        raise MergeError(f"{path}: expected a dict with 'model' and 'args', found {type(state).__name__}")
    return state, archive


def _model_chunks(state: dict, path: Path) -> dict[int, dict]:
    chunks = {}
    for key, value in state.items():
        m = MODEL_CHUNK_KEY.match(str(key))
        if m:
            if not isinstance(value, dict):
                raise MergeError(f"{path}: entry {shown(key)} is a {type(value).__name__}, expected a state dict")
            chunks[int(m.group(1) or 0)] = value
    if not chunks:
        raise MergeError(f"{path}: no 'model' entry (keys: {', '.join(map(str, state))})")
    if sorted(chunks) != list(range(len(chunks))):
        raise MergeError(f"{path}: model chunks {sorted(chunks)} are not numbered 0..{len(chunks) - 1}")
    return chunks


def _arg_int(args, name: str, default: int = 1) -> int:
    value = getattr(args, name, None)
    return default if value is None else int(value)


def read_legacy(path: Path) -> Checkpoint:
    it_dir, iteration = resolve_iteration_dir(path, is_legacy_iteration)
    dirs = _rank_dirs(it_dir)
    first = dirs[min(dirs)]
    first_state, first_archive = _load_rank(first)
    args = first_state.get("args")
    if args is None:
        raise MergeError(f"{first / RANK_FILE}: no 'args' entry; cannot tell the parallel layout")
    tp = _arg_int(args, "tensor_model_parallel_size")
    pp = _arg_int(args, "pipeline_model_parallel_size")
    experts = expert_layout(args, tp, str(first / RANK_FILE))
    ranks = _check_rank_grid(it_dir, dirs, tp, pp, experts)

    vpp = None
    numbering = None
    ckpt = Checkpoint(path=path, format="legacy", iteration=iteration, args=args, tp=tp, pp=pp, vpp=1)
    ckpt.experts = experts
    ckpt.sources = [path / TRACKER, it_dir, *dirs.values(), *(d / RANK_FILE for d in dirs.values())]
    slots: dict[str, dict[int, tuple[TensorRef, int]]] = defaultdict(dict)
    lora = LoraCollector(str(it_dir))
    adapter = "default"

    for (t, p, e), rank_dir in sorted(ranks.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        file = rank_dir / RANK_FILE
        state, archive = (first_state, first_archive) if rank_dir == first else _load_rank(rank_dir)
        _check_same_layout(state, file, tp, pp, iteration)
        chunks = _model_chunks(state, file)
        if vpp is None:
            vpp = len(chunks)
            arg_vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
            if int(arg_vpp) != vpp:
                raise MergeError(f"{file}: {vpp} model chunks but args say virtual_pipeline_model_parallel_size={arg_vpp}")
            numbering = numbering_from_args(args, pp, vpp)
        elif len(chunks) != vpp:
            raise MergeError(f"{file}: {len(chunks)} model chunks, expected {vpp} as in the other ranks")
        for entry in state:
            if str(entry) not in NON_MODEL_ENTRIES and not MODEL_CHUNK_KEY.match(str(entry)):
                ckpt.skipped[f"top-level entry '{entry}'"] += 1
        ckpt.files.append((str(file), sum(isinstance(v, torch.Tensor) for sd in chunks.values() for v in sd.values()),
                           sum(v.nbytes for sd in chunks.values() for v in sd.values() if isinstance(v, torch.Tensor))))
        adapter = next((m.group(3) for sd in chunks.values() for k in sd if (m := LORA_KEY.match(str(k)))), adapter)
        for chunk, sd in chunks.items():
            for raw_key, value in sd.items():
                where = f"{file}:{'model' if vpp == 1 else f'model{chunk}'}[{raw_key}]"
                name = raw_key[len("module."):] if raw_key.startswith("module.") else raw_key
                if name.endswith("_extra_state"):
                    ckpt.skipped["_extra_state"] += 1
                    continue
                if not isinstance(value, torch.Tensor):
                    raise MergeError(f"{where}: expected a tensor, found {type(value).__name__}")
                mtp_param = is_mtp(name)
                if mtp_param:  # on the last stage's last chunk, or where pipeline_model_parallel_layout puts them
                    if (p, chunk) != numbering.mtp_place():
                        stage, last = numbering.mtp_place()
                        raise MergeError(f"{where}: multi-token-prediction parameter on pipeline stage {p}, chunk "
                                         f"{chunk}; the args put them on stage {stage}, chunk {last}")
                    name = mtp_canonical(name, numbering.hf_layers, args_mtp_layers(args), where)
                m = LAYER_KEY.match(name)
                if m and not mtp_param:
                    index = numbering.hf_index(p, chunk, int(m.group(1)), where)
                    name = f"decoder.layers.{index}.{m.group(2)}"
                record = archive.record_of(value)
                per_expert = expert_params(name, value, e, experts, adapter, where, t) if experts else None
                # Expert tensors are split over expert-TP ranks; every other tensor is repeated in each
                # EP rank's file (copy `e`), and those copies must agree, as must the embedding the MTP layers'
                # stage keeps beside the first stage's (copy `p`).
                shard, copy = (experts.etp_rank(t), t) if per_expert is not None else (t, (e, p))
                for name, tensor in per_expert or [(name, value)]:
                    ref = TensorRef.of(where, tensor, mapped=True, record=record)
                    if lora.add(name, shard, ref, copy=copy):
                        continue
                    _place(ckpt, slots[name.replace(".base_layer.", ".")], shard, copy, ref)

    ckpt.vpp = vpp
    ckpt.params = {name: all_ranks(name, {r: ref for r, (ref, _) in by_rank.items()}, ckpt.rank_group(name), it_dir)
                   for name, by_rank in slots.items()}
    lora.finish(ckpt, ckpt.rank_group)
    if experts is not None and experts.tp_extend and ckpt.lora:
        raise MergeError(f"{it_dir}: LoRA weights in a checkpoint saved with --moe-tp-extend-ep: MindSpeed-LLM refuses "
                         "LoRA with it, so no LoRA layout is known for it")
    ckpt.numbering = numbering
    return ckpt


def _place(ckpt: Checkpoint, slot: dict, shard: int, copy: int, ref: TensorRef) -> None:
    if shard in slot:
        first, first_copy = slot[shard]
        if first_copy == copy:
            raise MergeError(f"{ref.where}: tensor appears twice for TP rank {shard} ({first.where})")
        ckpt.replicas.append((first, ref))
        return
    slot[shard] = (ref, copy)


def _check_same_layout(state: dict, file: Path, tp: int, pp: int, iteration: str) -> None:
    args = state.get("args")
    if args is not None:
        their = (_arg_int(args, "tensor_model_parallel_size"), _arg_int(args, "pipeline_model_parallel_size"))
        if their != (tp, pp):
            raise MergeError(f"{file}: args say TP={their[0]} PP={their[1]}, other ranks say TP={tp} PP={pp}")
    it = state.get("iteration")
    if iteration.isdigit() and it is not None and str(it) != iteration:
        raise MergeError(f"{file}: holds iteration {it}, but its directory is iteration {iteration}")
