"""Every non-weight file of the reference comes along (Kimi-style tiktoken.model and tokenizer code, named
chat templates, LICENSE ...); weights, their indexes, hidden entries and subdirectories are left out and
listed with the reason; verify catches a copied file that was replaced, removed or added afterwards.

The output is checked with transformers itself: the tokenizer of the merged model loads (remote code and
all) and tokenizes as the reference's does."""

import base64
import hashlib
import json
import os
import shutil
import socket
import stat
from pathlib import Path

import pytest

from helpers import FIXTURES, assert_nothing_written, copied_args, copy_fixture
from lora_merge.cli import main

NAME = "tp2_fp32_filtered"
LORA = FIXTURES / NAME / "lora"

# A tokenizer in the style of Kimi-K2's: its vocabulary in tiktoken.model (base64 token, rank per line), read
# by the repository's own tokenization code named in tokenizer_config.json's auto_map.
TOKENIZER_CODE = '''
import base64
from transformers import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}

    def __init__(self, vocab_file, **kwargs):
        with open(vocab_file, "rb") as f:
            lines = [line.split() for line in f.read().splitlines() if line.strip()]
        self.encoder = {base64.b64decode(t).decode(): int(r) for t, r in lines}
        self.decoder = {v: k for k, v in self.encoder.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.encoder)

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, 0)

    def _convert_id_to_token(self, index):
        return self.decoder[index]

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def kimi_style_reference(hf_ref: Path) -> None:
    """Turn the fixture's reference into a Kimi-like one, with the files a real HF repository also holds."""
    (hf_ref / "tokenizer.json").unlink()
    letters = "abcdefghijklmnopqrstuvwxyz "
    (hf_ref / "tiktoken.model").write_bytes(b"".join(base64.b64encode(c.encode()) + f" {i + 3}\n".encode()
                                                     for i, c in enumerate(letters)))
    (hf_ref / "tokenization_kimi.py").write_text(TOKENIZER_CODE)
    (hf_ref / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1024}))
    templates = hf_ref / "additional_chat_templates"
    templates.mkdir()
    (templates / "tool_use.jinja").write_text("{% for m in messages %}<tool>{{ m['content'] }}{% endfor %}")
    (hf_ref / "LICENSE").write_text("modified MIT\n")
    (hf_ref / "NOTICE").write_bytes(b"\x00\xff binary is fine too\n")
    (hf_ref / "special_tokens_map.json").write_text("{}")
    # Left out: the original repository's card, git metadata, other formats of the weights, pictures.
    (hf_ref / "README.md").write_text("# Kimi\n![](figures/logo.png)\n")
    (hf_ref / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (hf_ref / ".cache" / "huggingface").mkdir(parents=True)
    (hf_ref / ".cache" / "huggingface" / "download.lock").write_text("")
    (hf_ref / "figures").mkdir()
    (hf_ref / "figures" / "logo.png").write_bytes(b"\x89PNG")
    (hf_ref / "original").mkdir()
    (hf_ref / "original" / "consolidated.00.pth").write_bytes(b"weights")
    (hf_ref / "original" / "tokenizer.model").write_bytes(b"sentencepiece")


COPIED = ["LICENSE", "NOTICE", "additional_chat_templates/tool_use.jinja", "chat_template.jinja",
          "generation_config.json", "special_tokens_map.json", "tiktoken.model", "tokenization_kimi.py",
          "tokenizer_config.json"]


def merge(root: Path, out: Path, *extra: str) -> int:
    return main(copied_args(root, out) + ["--no-progress", *extra])


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(fixture copy with a Kimi-style reference, its merged output)."""
    tmp = tmp_path_factory.mktemp("kimi")
    root = copy_fixture(NAME, tmp)
    kimi_style_reference(root / "hf_ref")
    out = tmp / "out"
    assert merge(root, out, "--report", str(tmp / "report.json")) == 0
    return root, out


def test_every_non_weight_file_of_a_kimi_style_reference_is_copied(kimi, tmp_path):
    root, out = kimi
    ref = root / "hf_ref"
    for name in COPIED:
        assert (out / name).is_file() and not (out / name).is_symlink(), name
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    report = json.loads((out.parent / "report.json").read_text())["reference_files"]
    assert report["copied"] == COPIED
    assert set(report["left_out"]) == {"README.md", ".gitattributes", ".cache/", "figures/", "original/",
                                       "config.json"}
    for name in ("README.md", "config.json"):
        assert "the output's own" in report["left_out"][name]
    assert not (out / "original").exists() and not (out / "figures").exists() and not (out / ".cache").exists()
    assert (out / "README.md").read_text() != (ref / "README.md").read_text()


def test_transformers_loads_the_copied_tokenizer_with_its_remote_code(kimi, monkeypatch):
    from transformers import AutoTokenizer

    root, out = kimi
    ours = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    theirs = AutoTokenizer.from_pretrained(root / "hf_ref", trust_remote_code=True)
    assert type(ours).__name__ == "TikTokenTokenizer"
    text = "hello world"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"] == [ord(c) - ord("a") + 3 if c != " " else 29
                                                                  for c in text]
    # The named template from additional_chat_templates/ and the default one from chat_template.jinja.
    assert set(ours.chat_template) == {"default", "tool_use"} and ours.chat_template == theirs.chat_template


def test_a_note_names_what_was_left_out_unexpectedly(tmp_path, capsys):
    root = copy_fixture(NAME, tmp_path)
    kimi_style_reference(root / "hf_ref")
    (root / "hf_ref" / "adapter_config.json").write_text("{}")
    assert merge(root, tmp_path / "out") == 0
    notes = sorted(line for line in capsys.readouterr().err.splitlines() if "not copied to the output" in line)
    prefix = f"lora-merge: warning: {root / 'hf_ref'}: not copied to the output: "
    assert len(notes) == 2, notes
    assert notes[0].startswith(prefix + "adapter_config.json (a PEFT adapter's config"), notes
    assert notes[1].startswith(prefix + "figures/, original/ (a subdirectory"), notes
    assert not (tmp_path / "out" / "adapter_config.json").exists()


def test_weights_and_their_indexes_are_left_out_and_listed(tmp_path):
    root = copy_fixture(NAME, tmp_path)
    ref = root / "hf_ref"
    weights = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.safetensors", "tf_model.h5",
               "flax_model.msgpack", "model.gguf", "model.onnx", "training_args.bin", "optimizer.pt"]
    for name in weights:
        (ref / name).write_bytes(b"not copied")
    (ref / "model-00003-of-00003.safetensors").symlink_to("../../blobs/never-downloaded")  # never read
    report = tmp_path / "report.json"
    assert merge(root, tmp_path / "out", "--report", str(report)) == 0
    left_out = json.loads(report.read_text())["reference_files"]["left_out"]
    for name in weights + ["model-00003-of-00003.safetensors"]:
        assert name in left_out and ("weights" in left_out[name] or "index" in left_out[name]), name
    assert left_out["model.safetensors.index.json"] == "index of the reference's weights"
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["README.md", "chat_template.jinja", "config.json", "generation_config.json",
                       "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() != b"not copied"


@pytest.mark.parametrize("kind", ["fifo", "link to a fifo", "socket", "broken symlink"])
def test_a_special_file_in_the_reference_stops_the_run_in_one_line(tmp_path, capsys, kind):
    from test_damaged_inputs import fails

    root = copy_fixture(NAME, tmp_path)
    victim = root / "hf_ref" / "tiktoken.model"
    if kind == "fifo":
        os.mkfifo(victim)  # opening it to read would wait for a writer forever
        expected = "a FIFO, not a regular file"
    elif kind == "link to a fifo":
        os.mkfifo(root / "pipe")
        victim.symlink_to(root / "pipe")
        expected = "a FIFO, not a regular file"
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(victim))
        expected = "a socket, not a regular file"
    else:
        victim.symlink_to("../../blobs/gone")
        expected = "broken symlink (to ../../blobs/gone)"
    before, out = regular_files_state(root), tmp_path / "out"
    line = fails(copied_args(root, out) + ["--no-progress"], capsys, str(victim), expected)
    assert "remove" in line
    assert_nothing_written(out)
    assert regular_files_state(root) == before


def regular_files_state(root: Path) -> dict:
    """Like tree_state, without reading special files (reading a FIFO waits for a writer)."""
    state = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            state[path] = ("link", os.readlink(path))
        elif path.is_file():
            state[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            state[path] = stat.S_IFMT(path.lstat().st_mode)
    return state


def test_copied_files_count_in_the_free_space_check(tmp_path, capsys, monkeypatch):
    from test_damaged_inputs import fails

    root = copy_fixture(NAME, tmp_path)
    big = root / "hf_ref" / "generation_config.json"
    with big.open("r+b") as f:
        f.truncate(3 * 10**9)  # sparse: 3 GB to copy, no disk used here
    monkeypatch.setattr(shutil, "disk_usage", lambda path: type("Usage", (), {"free": 2 * 10**9})())
    out = tmp_path / "out"
    line = fails(copied_args(root, out) + ["--no-progress"], capsys, "not enough disk space", "2.00 GB are free")
    needed = float(line.split("the output needs ")[1].split(" GB")[0])
    assert 3.0 < needed < 3.1, line
    assert_nothing_written(out)


def verify(out: Path, capsys, *extra: str) -> tuple[int, list[str]]:
    code = main(["verify", str(out), "--lora", str(LORA), *extra])
    captured = capsys.readouterr()
    return code, [line for line in captured.out.splitlines() if line.startswith("  problem: ")]


@pytest.mark.parametrize("change", ["replaced", "removed", "added", "replaced in a subdirectory"])
def test_verify_fails_on_a_copied_file_changed_after_the_merge(kimi, tmp_path, capsys, change):
    root, good = kimi
    ref = root / "hf_ref"
    code, problems = verify(good, capsys, "--hf-ref", str(ref), "--base", str(root / "base"))
    assert code == 0 and problems == []

    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    if change == "replaced":
        victim = bad / "tokenizer_config.json"
        victim.write_text(victim.read_text().replace("1024", "2048"))
        expected = {f"{victim}: differs from the reference's {ref / 'tokenizer_config.json'} (from byte",
                    f"{victim}: sha256 "}
    elif change == "removed":
        victim = bad / "tiktoken.model"
        victim.unlink()
        expected = {f"{victim}: missing; the reference has {ref / 'tiktoken.model'}",
                    f"{victim}: missing; the model card lists it"}
    elif change == "added":  # another tokenizer beside the copied one changes what loads
        victim = bad / "tokenizer.json"
        shutil.copyfile(FIXTURES / NAME / "hf_ref" / "tokenizer.json", victim)
        expected = {f"{victim}: not in the model card's file list"}
    else:
        victim = bad / "additional_chat_templates" / "tool_use.jinja"
        victim.write_text("{{ 'other' }}")
        expected = {f"{victim}: differs from the reference's", f"{victim}: sha256 "}

    code, problems = verify(bad, capsys, "--hf-ref", str(ref))
    assert code == 1 and len(problems) == len(expected), problems
    for text in expected:
        assert any(p.startswith(f"  problem: {text}") for p in problems), (text, problems)
    # Without --hf-ref the model card alone catches every change.
    code, problems = verify(bad, capsys)
    card_only = {text for text in expected if "reference" not in text}
    assert code == 1 and len(problems) == len(card_only), problems


def test_force_replaces_an_earlier_output_holding_reference_files(kimi, tmp_path, capsys):
    root, good = kimi
    out = tmp_path / "out"
    shutil.copytree(good, out)
    assert merge(root, out, "--force") == 0
    assert (out / "tiktoken.model").is_file()
    (out / "thesis.tex").write_text("weeks of work")  # not listed by the card: not an output's file
    assert merge(root, out, "--force") == 2
    assert "is not an earlier merged model written by lora-merge (it also holds thesis.tex)" in capsys.readouterr().err
    assert (out / "thesis.tex").read_text() == "weeks of work"


def test_a_report_inside_the_output_named_like_a_reference_file_is_refused(tmp_path, capsys):
    from test_damaged_inputs import fails

    root = copy_fixture(NAME, tmp_path)
    (root / "hf_ref" / "LICENSE").write_text("license")
    out = tmp_path / "out"
    out.mkdir()
    fails(copied_args(root, out) + ["--no-progress", "--force", "--report", str(out / "LICENSE")], capsys,
          "the output holds the reference's LICENSE under that name")


def test_the_report_of_an_earlier_run_in_the_reference_is_not_copied(tmp_path, capsys):
    """An output of lora-merge used as a reference: its card names its --report, which describes another run."""
    first = tmp_path / "first"
    assert main(copied_args(FIXTURES / NAME, first) + ["--no-progress", "--report", str(first / "run.json")]) == 0
    root = copy_fixture(NAME, tmp_path)
    args = copied_args(root, tmp_path / "second") + ["--no-progress", "--report", str(tmp_path / "r.json")]
    args[args.index("--hf-ref") + 1] = str(first)
    assert main(args) == 0
    assert "run.json (the --report of the lora-merge run that wrote the reference" in capsys.readouterr().err
    assert not (tmp_path / "second" / "run.json").exists()
    left_out = json.loads((tmp_path / "r.json").read_text())["reference_files"]["left_out"]
    assert set(left_out) == {"run.json", "README.md", "config.json", "model.safetensors"}


def test_a_file_name_that_is_not_text_is_refused_unless_left_out(tmp_path, capsys):
    from test_damaged_inputs import fails

    root = copy_fixture(NAME, tmp_path)
    ref = os.fsencode(root / "hf_ref")
    with open(os.path.join(ref, b".cache-\xff"), "wb"):  # hidden: left out, whatever its name
        pass
    assert merge(root, tmp_path / "first") == 0
    with open(os.path.join(ref, b"vocab-\xff.txt"), "wb") as f:
        f.write(b"x")
    out = tmp_path / "out"
    fails(copied_args(root, out) + ["--no-progress"], capsys, "holds a file whose name is not printable text",
          "'vocab-\\udcff.txt'")
    assert_nothing_written(out)
