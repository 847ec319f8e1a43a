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
from lora_merge.layer_numbering import numbering_from_args
from lora_merge.readers.checkpoint import Checkpoint, LoraCollector, TensorRef, all_ranks
from lora_merge.readers.iteration import TRACKER, resolve_iteration_dir
from lora_merge.torch_archive import MappedFile, TorchArchive
from lora_merge.safe_load import load_archive

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


def _expected_dirs(tp: int, pp: int) -> dict[tuple[int, ...], str]:
    if pp == 1:
        return {(t,): f"mp_rank_{t:02d}" for t in range(tp)}
    return {(t, p): f"mp_rank_{t:02d}_{p:03d}" for t in range(tp) for p in range(pp)}


def _load_rank(rank_dir: Path) -> tuple[dict, TorchArchive]:
    path = rank_dir / RANK_FILE
    if not path.is_file():
        raise MergeError(f"{rank_dir}: missing {RANK_FILE}")
    archive = TorchArchive(MappedFile(path))
    state = load_archive(archive)  # memory-mapped: only the pickle is read now
    if not isinstance(state, dict):
        raise MergeError(f"{path}: expected a dict with 'model' and 'args', found {type(state).__name__}")
    return state, archive


def _model_chunks(state: dict, path: Path) -> dict[int, dict]:
    chunks = {}
    for key, value in state.items():
        m = MODEL_CHUNK_KEY.match(str(key))
        if m:
            if not isinstance(value, dict):
                raise MergeError(f"{path}: entry {key!r} is a {type(value).__name__}, expected a state dict")
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
    if _arg_int(args, "expert_model_parallel_size") > 1:
        raise MergeError(f"{first / RANK_FILE}: expert parallelism (MoE) checkpoints are not supported")

    expected = _expected_dirs(tp, pp)
    missing = [name for key, name in expected.items() if key not in dirs]
    extra = [p.name for key, p in dirs.items() if key not in expected]
    if missing or extra:
        detail = (f"missing {', '.join(missing)}" if missing else "") + ("; " if missing and extra else "") + (
            f"unexpected {', '.join(extra)}" if extra else "")
        raise MergeError(f"{it_dir}: rank directories do not match TP={tp} PP={pp} from the args ({detail})")

    vpp = None
    numbering = None
    ckpt = Checkpoint(path=path, format="legacy", iteration=iteration, args=args, tp=tp, pp=pp, vpp=1)
    ckpt.sources = [path / TRACKER, it_dir, *dirs.values(), *(d / RANK_FILE for d in dirs.values())]
    seen_ranks: dict[str, dict[int, TensorRef]] = defaultdict(dict)
    lora = LoraCollector(str(it_dir))

    for key, rank_dir in sorted(dirs.items(), key=lambda kv: (kv[0][1:] or (0,), kv[0][0])):
        t, p = key[0], (key[1] if pp > 1 else 0)
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
        for chunk, sd in chunks.items():
            for raw_key, value in sd.items():
                where = f"{file}:{'model' if vpp == 1 else f'model{chunk}'}[{raw_key}]"
                name = raw_key[len("module."):] if raw_key.startswith("module.") else raw_key
                if name.endswith("_extra_state"):
                    ckpt.skipped["_extra_state"] += 1
                    continue
                if not isinstance(value, torch.Tensor):
                    raise MergeError(f"{where}: expected a tensor, found {type(value).__name__}")
                m = LAYER_KEY.match(name)
                if m:
                    index = numbering.hf_index(p, chunk, int(m.group(1)), where)
                    name = f"decoder.layers.{index}.{m.group(2)}"
                ref = TensorRef.of(where, value, mapped=True, record=archive.record_of(value))
                if lora.add(name, t, ref):
                    continue
                slot = seen_ranks[name.replace(".base_layer.", ".")]
                if t in slot:
                    raise MergeError(f"{where}: tensor appears twice for TP rank {t} ({slot[t].where})")
                slot[t] = ref

    ckpt.vpp = vpp
    ckpt.params = {name: all_ranks(name, by_rank, tp, it_dir) for name, by_rank in seen_ranks.items()}
    lora.finish(ckpt, tp)
    ckpt.numbering = numbering
    return ckpt


def _check_same_layout(state: dict, file: Path, tp: int, pp: int, iteration: str) -> None:
    args = state.get("args")
    if args is not None:
        their = (_arg_int(args, "tensor_model_parallel_size"), _arg_int(args, "pipeline_model_parallel_size"))
        if their != (tp, pp):
            raise MergeError(f"{file}: args say TP={their[0]} PP={their[1]}, other ranks say TP={tp} PP={pp}")
    it = state.get("iteration")
    if iteration.isdigit() and it is not None and str(it) != iteration:
        raise MergeError(f"{file}: holds iteration {it}, but its directory is iteration {iteration}")
