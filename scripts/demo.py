"""Demo: merge a bundled tiny Megatron LoRA checkpoint (TP=2 x PP=2) and show the result is the model
that was trained: its logits under transformers match the real Megatron forward pass with LoRA."""

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tp2pp2_fp32_filtered"


def main() -> int:
    out = Path(tempfile.mkdtemp(prefix="lora-merge-demo-")) / "merged"
    cmd = ["lora-merge", "--base", str(FIXTURE / "base"), "--lora", str(FIXTURE / "lora"),
           "--hf-ref", str(FIXTURE / "hf_ref"), "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run([str(Path(sys.executable).parent / "lora-merge"), *cmd[1:]], check=True)

    ref = torch.load(FIXTURE / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    with_lora = (logits - ref["logits_lora"]).abs().max().item()
    without = (logits - ref["logits_base"]).abs().max().item()
    print(f"\ntransformers loaded {out}")
    print(f"max |logits - Megatron forward with LoRA|    = {with_lora:.2e}   (should be ~1e-6)")
    print(f"max |logits - Megatron forward without LoRA| = {without:.2f}       (the LoRA changed the model)")
    ok = with_lora <= 1e-4 and without > 0.5
    print("demo:", "OK, the merged model is the trained model" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
