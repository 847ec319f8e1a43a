"""Every command with every kind of input: a base that is a legacy or torch_dist Megatron checkpoint or an HF
model dir, a LoRA that is a Megatron checkpoint or a PEFT adapter; dense and MoE. Nothing may assume the
base or the LoRA is Megatron's (an HF base has no expert layout, a PEFT adapter no Megatron module names)."""

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from helpers import FIXTURES
from lora_merge.cli import main
from test_peft_input import make_adapter

MOE = Path(__file__).parent / "fixtures_moe"
# (fixture, its base's format, MoE or not): one of each reader, dense and MoE.
ROOTS = {"legacy": FIXTURES / "tp2pp2_fp32_filtered", "torch_dist": FIXTURES / "dist_tp2pp2_fp32",
         "legacy-moe": MOE / "mixtral_ep2", "torch_dist-moe": MOE / "qwen3moe_dist_ep2"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, base_model):
    """For a fixture: its HF base (the base written in HF form) and a PEFT adapter trained on it."""
    @functools.cache
    def get(kind: str) -> dict:
        root, work = ROOTS[kind], tmp_path_factory.mktemp(kind)
        hf = base_model(root)
        make_adapter(hf, work / "peft", r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"])
        return {"root": root, "hf": hf, "peft": work / "peft", "work": work}
    return get


def _run(capsys, *args) -> tuple[int, list[str], list[str]]:
    capsys.readouterr()  # what came before (transformers' loading bars)
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), [line for line in captured.err.splitlines() if line.strip()]


@pytest.mark.parametrize("kind", ROOTS)
@pytest.mark.parametrize("base_kind", ["megatron", "hf"])
@pytest.mark.parametrize("lora_kind", ["megatron", "peft"])
def test_dry_run_merge_and_verify_with_every_input_kind(kind, base_kind, lora_kind, inputs, tmp_path, capsys):
    got = inputs(kind)
    root = got["root"]
    base = root / "base" if base_kind == "megatron" else got["hf"]
    lora = root / "lora" if lora_kind == "megatron" else got["peft"]
    given = ["--base", base, "--lora", lora, "--hf-ref", root / "hf_ref"]
    named = ["--base-model-id", "example-org/example-model"]  # else a warning says the card names no base model
    out, report = tmp_path / "out", tmp_path / "report.json"

    code, stdout, err = _run(capsys, *given, *named, "--out", out, "--dry-run")
    if base_kind == "megatron" and lora_kind == "peft":  # PEFT names HF tensors: it goes onto HF weights only
        assert code == 2 and len(err) == 1 and "a PEFT adapter is merged onto an HF model" in err[0], err
        assert str(base) in err[0]
        return
    assert code == 0 and not err, err
    (lora_line,) = [line for line in stdout if line.startswith("  LoRA:")]
    targets = "o_proj, q_proj" if lora_kind == "peft" else "linear_fc1, linear_fc2, linear_proj, linear_qkv"
    assert re.search(rf" on {targets}: \d+ modules$", lora_line), lora_line
    if kind.endswith("moe"):
        (experts,) = [line for line in stdout if line.startswith("  experts:")]
        assert ("base: HF per-expert tensors" if base_kind == "hf" else "base checkpoint: ") in experts, experts
        assert ("LoRA checkpoint: " in experts) == (lora_kind == "megatron"), experts

    code, stdout, err = _run(capsys, *given, *named, "--out", out, "--no-progress", "--verify", "--report", report)
    assert code == 0 and not err and stdout[-1].endswith("(verified)"), (stdout, err)
    described = json.loads(report.read_text())["inputs"]
    assert described["base"]["format"] == ("HF" if base_kind == "hf" else "torch_dist" if kind.startswith("torch_dist")
                                           else "legacy")
    assert described["lora"]["format"] == ("PEFT" if lora_kind == "peft" else "legacy")

    code, stdout, err = _run(capsys, "verify", out, *given)
    assert code == 0 and not err and stdout[-1].startswith("verify: OK"), (stdout, err)
    if base_kind == "hf":
        assert stdout[0] == f"baseline: reference weights in {got['hf']}", stdout[0]


@pytest.mark.parametrize("kind", ["legacy", "legacy-moe"])
def test_inspect_describes_an_hf_model_dir(kind, inputs, capsys):
    got = inputs(kind)
    config = json.loads((got["hf"] / "config.json").read_text())
    tensors = load_file(got["hf"] / "model.safetensors")
    code, stdout, err = _run(capsys, "inspect", got["hf"])
    assert code == 0 and not err, err
    assert stdout[0] == f"{got['hf']}: HF model dir, model_type {config['model_type']!r} ({config['architectures'][0]})"
    text = "\n".join(stdout)
    assert f"num_hidden_layers={config['num_hidden_layers']}, hidden_size={config['hidden_size']}" in text
    assert f"  tensors: {len(tensors)} ({len(tensors)} float32), in layers 4 (0-3)" in stdout
    assert f"    model.safetensors: {len(tensors)} tensors, " in text
    if kind.endswith("moe"):
        assert f"num_local_experts={config['num_local_experts']}" in text

    code, verbose, _ = _run(capsys, "inspect", "-v", got["hf"])
    listed = [line.split()[0] for line in verbose if line.startswith("      ")]
    assert code == 0 and sorted(listed) == sorted(tensors)


def test_inspect_describes_a_peft_adapter(inputs, capsys):
    got = inputs("legacy")
    code, stdout, err = _run(capsys, "inspect", got["peft"])
    assert code == 0 and not err, err
    assert stdout[0].startswith(f"{got['peft']}: PEFT LORA adapter (PEFT ") and str(got["hf"]) in stdout[0]
    assert stdout[1] == "  LoRA: r=2 lora_alpha=4, target_modules=['o_proj', 'q_proj']"
    assert stdout[2] == "  adapted modules: 8 (o_proj x4, q_proj x4) in layers 4 (0-3); rank [2], scale 2"
    assert "  tensors: 16 (16 float32)" in stdout

    code, verbose, _ = _run(capsys, "inspect", "--verbose", got["peft"])
    assert code == 0 and "    model.layers.3.self_attn.o_proj.weight: r=2, scale 2" in verbose

    import lora_merge  # the Python API describes the same way
    assert lora_merge.inspect(got["peft"]).splitlines() == stdout
    assert lora_merge.inspect(got["hf"]).startswith(f"{got['hf']}: HF model dir, model_type 'qwen2'")


def test_inspect_refuses_what_is_no_input_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    code, _, err = _run(capsys, "inspect", tmp_path)
    assert code == 2 and len(err) == 1 and "config.json but no *.safetensors" in err[0], err
    code, _, err = _run(capsys, "inspect", tmp_path / "nothing")
    assert code == 2 and err == [f"lora-merge: error: {tmp_path / 'nothing'}: does not exist"]


def test_verify_of_a_peft_merge_without_base_checks_against_the_reference_weights(inputs, tmp_path, capsys):
    """A PEFT adapter given without --base goes onto --hf-ref's weights; --verify and verify compare with them."""
    got = inputs("legacy")
    given = ["--lora", got["peft"], "--hf-ref", got["hf"]]
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, *given, "--out", out, "-q", "--verify")
    assert code == 0 and stdout == [] and err == [], (stdout, err)
    code, stdout, _ = _run(capsys, "verify", out, *given)
    assert code == 0 and stdout[0] == f"baseline: reference weights in {got['hf']}"
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.2.mlp.down_proj.weight"] += 1e-3  # a tensor the adapter does not touch
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    code, stdout, err = _run(capsys, "verify", out, *given)
    assert code == 1 and any("model.layers.2.mlp.down_proj.weight" in line for line in stdout), stdout


def test_quiet_prints_only_errors_and_verbose_more(inputs, tmp_path, capsys):
    root = ROOTS["legacy"]
    given = ["--base", root / "base", "--lora", root / "lora", "--hf-ref", root / "hf_ref"]
    named = ["--base-model-id", "example-org/example-model"]  # else a warning says the card names no base model
    # --lora-alpha differing from the checkpoint's is a warning: shown normally, not with -q
    code, stdout, err = _run(capsys, *given, *named, "--out", tmp_path / "a", "--lora-alpha", "16", "-q")
    assert code == 0 and stdout == [] and err == [], (stdout, err)
    code, stdout, err = _run(capsys, *given, *named, "--out", tmp_path / "b", "--lora-alpha", "16", "--no-progress")
    assert code == 0 and len(err) == 1 and err[0].startswith("lora-merge: warning: --lora-alpha 16.0 overrides")
    assert stdout[-1].startswith("wrote 51 tensors")
    # errors still speak under -q
    code, stdout, err = _run(capsys, *given, "--out", tmp_path / "a", "-q")
    assert code == 2 and stdout == [] and len(err) == 1 and "exists" in err[0], err
    for args in (["inspect", "-q", root / "base"], ["verify", "-q", tmp_path / "b", *given, "--lora-alpha", "16"]):
        code, stdout, err = _run(capsys, *args)
        assert code == 0 and stdout == [] and err == [], (args, stdout, err)
    # a failed verification shows its problems even under -q: they are the error
    tensors = load_file(tmp_path / "b" / "model.safetensors")
    tensors["model.norm.weight"] += 1e-3
    save_file(tensors, tmp_path / "b" / "model.safetensors", metadata={"format": "pt"})
    code, stdout, err = _run(capsys, "verify", "-q", tmp_path / "b", *given, "--lora-alpha", "16")
    assert code == 1 and any("model.norm.weight" in line for line in stdout) and len(err) == 1, (stdout, err)

    code, stdout, _ = _run(capsys, *given, "--out", tmp_path / "c", "--dry-run", "-v")
    planned = [line for line in stdout if line.startswith("    ") and " <- " in line]
    assert code == 0 and len(planned) == 51 and any(line.endswith("+ LoRA") for line in planned)
    assert "    model.layers.0.self_attn.q_proj.weight [64, 64] float32 <- decoder.layers.0.self_attention." \
           "linear_qkv.weight + LoRA" in planned
    with pytest.raises(SystemExit) as usage_error:
        main(["-q", "-v", *map(str, given), "--out", str(tmp_path / "c")])
    assert usage_error.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


COMMANDS = [["--help"], ["--version"], ["inspect", "--help"], ["verify", "--help"], ["export-adapter", "--help"],
            ["--lora", "x"]]  # the last: a usage error (no --hf-ref, --out)


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_help_version_and_usage_errors_answer_without_importing_torch(argv):
    """The installed command's path (`python -m lora_merge` runs entry.main): torch, transformers and safetensors
    take seconds to import, and none is needed to print help or refuse a command line."""
    probe = ("import runpy, sys\n"
             f"sys.argv = ['lora-merge', *{argv!r}]\n"
             "try:\n"
             "    runpy.run_module('lora_merge', run_name='__main__')\n"
             "except SystemExit as exc:\n"
             "    code = exc.code\n"
             "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors', 'numpy') if m in sys.modules)\n"
             "print('exit', code, 'heavy', heavy, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    last = done.stderr.strip().splitlines()[-1]
    expected_code = 2 if argv == ["--lora", "x"] else 0
    assert last == f"exit {expected_code} heavy []", done.stderr
    if argv == ["--help"]:
        assert "an HF model dir" in done.stdout and "a PEFT adapter dir" in done.stdout


def test_light_option_values_agree_with_the_modules_that_use_them():
    from lora_merge import options
    from lora_merge.model.model_shape import DTYPES
    from lora_merge.peft_adapter import EXPERT_FORMATS, VLLM_DEFAULT_MAX_LORA_RANK

    assert options.DTYPE_NAMES == tuple(DTYPES)
    assert options.EXPERT_FORMATS == EXPERT_FORMATS
    assert options.VLLM_DEFAULT_MAX_LORA_RANK == VLLM_DEFAULT_MAX_LORA_RANK


def test_the_version_is_written_once():
    import lora_merge

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lora_merge.version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", lora_merge.__version__)
