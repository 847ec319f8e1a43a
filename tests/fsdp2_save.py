"""Save a transformers model as FSDP2 training does (a test helper, run as a script): 2 gloo ranks on CPU, each layer
and the model wrapped by torch's own `fully_shard` (every parameter sharded along dim 0), the sharded state dict
written with torch.distributed.checkpoint as `{"model": state_dict}` (accelerate's and MindSpeed-LLM's app-state
key).

    python tests/fsdp2_save.py HF_MODEL_DIR OUT_DIR [--no-prefix]
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, model_dir: str, out: str, prefixed: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = get_model_state_dict(model)
    dcp.save({"model": state} if prefixed else state, checkpoint_id=out)
    dist.destroy_process_group()


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, model_dir, out, "--no-prefix" not in sys.argv), nprocs=2)


if __name__ == "__main__":
    main()
