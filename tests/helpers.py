"""What the test modules share: where the fixtures are, the arguments that merge one, and the helpers that copy
a fixture, rewrite its rank files and check a refused run. The fixtures that merge a fixture once per session
are in conftest.py."""

import json
import shutil
from pathlib import Path

import torch

from lora_merge.cli import main
from lora_merge.files.safe_load import StandIn, load_pt

TESTS = Path(__file__).parent
FIXTURES = TESTS / "fixtures"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "fixture.json").is_file())
FIXTURE_DIRS = (FIXTURES, TESTS / "fixtures_moe", TESTS / "fixtures_deepseek")

# Options that write the base model in HF form: alpha 0 is refused (a likely mistake), and 1e-30·B·A is far
# below the rounding step of every weight, so W + 1e-30·B·A rounds back to W bit for bit.
BASE_ONLY = ["--lora-alpha", "1e-30"]


def fixture_root(fixture: str | Path) -> Path:
    """A fixture's folder: a path as given, or a name looked up in tests/fixtures, fixtures_moe, fixtures_deepseek."""
    if isinstance(fixture, Path):
        return fixture
    for d in FIXTURE_DIRS:
        if (d / fixture / "fixture.json").is_file():
            return d / fixture
    raise KeyError(f"no fixture {fixture!r} in {', '.join(d.name for d in FIXTURE_DIRS)}")


def fixture_info(fixture: str | Path) -> dict:
    return json.loads((fixture_root(fixture) / "fixture.json").read_text())


def merge_args(fixture: str | Path, out: Path, with_base: bool | None = None) -> list[str]:
    """CLI arguments merging a fixture; unfiltered LoRA fixtures run without --base by default."""
    root = fixture_root(fixture)
    if with_base is None:
        with_base = fixture_info(root)["lora"] == "filtered"
    args = ["--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(out), "--no-progress"]
    return (["--base", str(root / "base")] if with_base else []) + args


def peft_model_loading_every_key(base_dir: Path, adapter: Path):
    """PEFT's model of `adapter` on the HF model in `base_dir`, after checking that PEFT loads every key of
    the adapter (none unexpected) and finds every factor it expects (none missing)."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()

    probe = PeftModel(base(), PeftConfig.from_pretrained(adapter))
    loaded = probe.load_adapter(adapter, adapter_name="probe")
    assert not loaded.unexpected_keys, loaded.unexpected_keys[:4]
    assert not [k for k in loaded.missing_keys if ".probe." in k or k.endswith(".probe")], loaded.missing_keys[:4]
    return PeftModel.from_pretrained(base(), adapter).eval()


def copy_fixture(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def rank_files(ckpt_dir: Path) -> list[Path]:
    it = (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip()
    return sorted((ckpt_dir / f"iter_{int(it):07d}").glob("mp_rank_*/model_optim_rng.pt"))


def copied_args(root: Path, out: Path) -> list[str]:
    """CLI arguments merging a copied fixture with its base."""
    return ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(out)]


def rewrite(path: Path, edit) -> None:
    """Load a rank file safely, let `edit` change it, save it back (stand-ins saved as plain strings)."""
    state = load_pt(path, mmap=False)
    state.pop("rng_state", None)  # holds numpy stand-ins; not needed by the tool
    args = state.get("args")
    if args is not None:
        for key, value in vars(args).items():
            if isinstance(value, StandIn):
                setattr(args, key, repr(value))
    edit(state)
    torch.save(state, path)


def set_value(path: Path, key: str, index, value) -> None:
    """Rewrite one rank file with model[key][index] = value (the tensor copied first: it may be a view)."""
    def edit(state):
        state["model"][key] = state["model"][key].clone()
        state["model"][key][index] = value

    rewrite(path, edit)


def quiet(message: str) -> None:
    """A `warn` for runs whose warnings the test does not look at."""


def run_failing(args: list[str], capsys, *expected: str) -> str:
    code = main(args)
    err = capsys.readouterr().err
    assert code != 0, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("lora-merge: warning: ")]
    assert len(lines) == 1 and lines[0].startswith("lora-merge: error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    print(f"\n[{code}] {lines[0]}")  # `pytest -s tests/test_errors.py` lists every message
    return lines[0]


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*"))


def reference_beside(files_of: Path, dest: Path, config, **changes) -> Path:
    """An HF reference dir at `dest`: the files of the reference `files_of` (tokenizer, …) beside `config` (a
    transformers config object) saved as its config.json, with `changes` applied to that file."""
    dest.mkdir(parents=True)
    for f in files_of.iterdir():
        if f.name != "config.json":
            shutil.copy(f, dest / f.name)
    config.save_pretrained(dest)
    if changes:
        path = dest / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return dest


def trained_peft_adapter(model, lora_config, seed: int, out: Path, **save):
    """`model` wrapped by PEFT with `lora_config`, every lora_B given random values (PEFT starts B at zero, a
    trained adapter does not), saved to `out` (`save`: save_pretrained's options); returns the PEFT model."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, lora_config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "lora_magnitude_vector" in name:  # DoRA's magnitudes start as the base's row norms; trained, not
                p.mul_(1 + torch.randn_like(p) * 0.1)
    peft_model.save_pretrained(out, **save)
    return peft_model


def with_mtp_layer(hf_dir: Path, num_layers: int, seed: int = 0) -> dict:
    """Give the HF model in `hf_dir` one multi-token-prediction layer as releases store it (model.layers.{L}:
    a decoder layer shaped as the last one, with values of its own, enorm, hnorm, eh_proj [H, 2H],
    shared_head.norm, and copies of embed_tokens and lm_head), and say so in its config; returns the new tensors."""
    from safetensors.torch import load_file, save_file

    (shard,) = hf_dir.glob("*.safetensors")
    tensors = load_file(shard)
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."

    def like(t):
        return (torch.randn(t.shape, generator=g) * 0.1).to(t.dtype)

    new = {mtp + k[len(last):]: like(t) for k, t in tensors.items() if k.startswith(last)}
    embed, head = tensors["model.embed_tokens.weight"], tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    hidden = embed.shape[1]
    for name, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)), ("eh_proj.weight", (hidden, 2 * hidden)),
                        ("shared_head.norm.weight", (hidden,))):
        new[mtp + name] = like(torch.empty(shape, dtype=embed.dtype))
    new[mtp + "embed_tokens.weight"], new[mtp + "shared_head.head.weight"] = embed.clone(), head.clone()
    save_file({**tensors, **new}, shard, metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return new


def random_hf_model(config, out: Path, adjust=None, auto=None) -> Path:
    """A tiny model of transformers' own class for `config` (`auto`: the Auto class that picks it, by default
    AutoModelForCausalLM), saved to `out` in bf16 with random values in every parameter (norms, biases and routers
    too; 1-D ones around 1); `adjust(model)` may change it before saving."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = (auto or AutoModelForCausalLM).from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.05 if p.dim() > 1 else 0.1) + (p.dim() == 1))
        if adjust is not None:
            adjust(model)
    model.save_pretrained(out)
    return out


def assert_merges_as_peft(hf_base: Path, lora_config, seed: int, tmp_path: Path, auto=None, **merge):
    """A PEFT adapter trained on `hf_base` with `lora_config`, merged by lora_merge (float32, `merge`: more of the
    API's options) and by PEFT's merge_and_unload: transformers loads ours whole (with `auto`, by default
    AutoModelForCausalLM), every tensor within 1e-6 of PEFT's, the logits within 1e-4. Returns (our state dict, the
    base's) for the caller's own checks."""
    import lora_merge
    from transformers import AutoModelForCausalLM

    loader = auto or AutoModelForCausalLM
    model = loader.from_pretrained(hf_base, dtype=torch.float32)
    vocab = model.config.get_text_config().vocab_size
    expected = trained_peft_adapter(model, lora_config, seed, tmp_path / "adapter").merge_and_unload()
    out = tmp_path / "out"
    lora_merge.merge(base=hf_base, lora=tmp_path / "adapter", hf_ref=hf_base, out=out, dtype="float32",
                     warn=lambda message: None, **merge)
    merged, info = loader.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ours, theirs = merged.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (merged.eval()(ids).logits - expected.eval()(ids).logits).abs().max() <= 1e-4
    return ours, loader.from_pretrained(hf_base, dtype=torch.float32).state_dict()


# Object storage (the `s3` fixture in conftest.py: a bucket `models` on a local S3 server)

def upload(fs, local: Path, key: str) -> str:
    fs.put(str(local), f"models/{key}", recursive=True)
    return f"s3://models/{key}"


def out_dir(tmp_path: Path, where: str, name: str) -> Path:
    """`tmp_path/where/name`: an output named like the URL's last component, so the cards agree."""
    (tmp_path / where).mkdir()
    return tmp_path / where / name


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def downloaded(fs, url: str, into: Path) -> dict[str, bytes]:
    fs.get(url.removeprefix("s3://"), str(into), recursive=True)
    return files(into)
