"""Demo: merge a bundled tiny Megatron LoRA checkpoint (TP=2 x PP=2) and show the result is the model
that was trained: its logits under transformers match the real Megatron forward pass with LoRA, and it
answers a text prompt differently from the base model.

Everything is written under one temporary directory, removed when the demo ends, fails or is interrupted.
Nothing is downloaded: the toy tokenizer is trained here on a few sentences.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Before transformers is imported: its loading bars and advisory logs are not part of the demo.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tp2pp2_fp32_filtered"
PROMPT = "the merged model answers"
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # the fixture's ids 0-3, as in its config
# Qwen2's pre-tokenizer split (transformers 5 builds a qwen2 model's tokenizer as Qwen2Tokenizer, a byte-level
# BPE from tokenizer.json's vocab and merges, whatever tokenizer_class says): a tokenizer trained with the
# same split and byte-level mapping encodes and decodes the same under it.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
CORPUS = ["the merged model answers a text prompt", "the base model and the merged model differ",
          "a lora fine tune merged into the weights of the model", "hello world from a tiny model"]


def write_tokenizer(hf_dir: Path) -> None:
    """Replace the fixture's word-level tokenizer (which transformers 5 turns into a BPE that encodes nothing)
    with a byte-level BPE trained on CORPUS; its ids stay below the model's 250-row vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=250, special_tokens=SPECIALS, show_progress=False))
    tok.save(str(hf_dir / "tokenizer.json"))
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}, indent=2))


# A SIGINT is remembered as well as raised: a library that swallows the KeyboardInterrupt (the tokenizer trainer
# consumes a Python iterator in native code) must not make an interrupted demo run on to the end.
RECEIVED: list[int] = []


def _on_sigint(signum, frame):
    RECEIVED.append(signum)
    raise KeyboardInterrupt


def stop_if_interrupted() -> None:
    if RECEIVED:
        raise KeyboardInterrupt


def lora_merge(*args: str) -> None:
    stop_if_interrupted()
    print("$ lora-merge", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "lora_merge", *args], check=True)


def answer(model, tokenizer, unused_ids: list[int]) -> tuple[list[int], str]:
    import torch

    prompt = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**prompt, max_new_tokens=8, do_sample=False, suppress_tokens=unused_ids,
                             pad_token_id=tokenizer.pad_token_id)[0, prompt["input_ids"].shape[1]:].tolist()
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


def run(work: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_ref = work / "hf_ref"
    shutil.copytree(FIXTURE / "hf_ref", hf_ref)
    write_tokenizer(hf_ref)
    stop_if_interrupted()
    inputs = ["--base", str(FIXTURE / "base"), "--lora", str(FIXTURE / "lora"), "--hf-ref", str(hf_ref)]
    merged, base = work / "merged", work / "base"
    lora_merge(*inputs, "--out", str(merged))
    # The base model in HF form, for comparison: the same tool with the LoRA scaled to nothing (1e-30·B·A
    # rounds away in every weight), quietly.
    lora_merge(*inputs, "--out", str(base), "--lora-alpha", "1e-30", "-q")

    stop_if_interrupted()
    ref = torch.load(FIXTURE / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    with_lora = (logits - ref["logits_lora"]).abs().max().item()
    without = (logits - ref["logits_base"]).abs().max().item()
    print(f"\ntransformers loaded {merged.name}/")
    print(f"max |logits - Megatron forward with LoRA|    = {with_lora:.2e}   (should be ~1e-6)")
    print(f"max |logits - Megatron forward without LoRA| = {without:.2f}       (the LoRA changed the model)")

    stop_if_interrupted()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    unused = list(range(len(tokenizer), model.config.vocab_size))  # rows the toy tokenizer has no text for
    merged_ids, merged_text = answer(model, tokenizer, unused)
    base_ids, base_text = answer(AutoModelForCausalLM.from_pretrained(base).eval(), tokenizer, unused)
    stop_if_interrupted()
    print(f"\nprompt: {PROMPT!r} -> token ids {tokenizer(PROMPT)['input_ids']}")
    print(f"  base model:   {base_text!r}")
    print(f"  merged model: {merged_text!r}")
    ok = with_lora <= 1e-4 and without > 0.5 and bool(merged_text.strip()) and merged_ids != base_ids
    print("demo:", "OK, the merged model is the trained model" if ok else "MISMATCH")
    return 0 if ok else 1


def main() -> int:
    # SIGTERM unwinds like Ctrl-C, so the temporary directory is removed either way.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, _on_sigint)
    with tempfile.TemporaryDirectory(prefix="lora-merge-demo-") as work:
        # torch's compiler cache (which generate() may create) goes there too, for this process and lora-merge's
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(work) / "torch-cache")
        try:
            return run(Path(work))
        except subprocess.CalledProcessError as exc:
            print(f"demo: lora-merge failed (exit {exc.returncode})", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("demo: interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
