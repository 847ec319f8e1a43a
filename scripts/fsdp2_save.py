"""Save a transformers model as FSDP2 training does (for tests/test_dcp_hf_base.py and bench.py --dcp): gloo ranks on CPU, each layer
and the model wrapped by torch's own `fully_shard` (every parameter sharded along dim 0), the sharded state dict
written with torch.distributed.checkpoint as `{"model": state_dict}` (accelerate's and MindSpeed-LLM's app-state
key).

    python scripts/fsdp2_save.py HF_MODEL_DIR OUT_DIR [--no-prefix] [--ranks N] [--peft ADAPTER_DIR]

(N: 2 by default.) With --peft, the model is PEFT's model of that adapter (PeftModel.from_pretrained, float32), and
its state dict (the base's weights and the adapter's factors, under PEFT's in-memory names) is what is saved; the
adapter's adapter_config.json is copied beside it, as a training run's checkpoint directory holds it.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, model_dir: str, out: str, prefixed: bool, peft: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32 if peft else torch.bfloat16)
    layers = model.model.layers
    if peft:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, peft)
    for layer in layers:
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
    ranks = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else 2
    peft = sys.argv[sys.argv.index("--peft") + 1] if "--peft" in sys.argv else None
    mp.spawn(worker, args=(ranks, port, model_dir, out, "--no-prefix" not in sys.argv, peft), nprocs=ranks)
    if peft:
        import shutil

        shutil.copy(os.path.join(peft, "adapter_config.json"), out)


if __name__ == "__main__":
    main()
