"""Damaged files: a broken input is one line and exit 2; a damaged output under `verify` is one problem per
damaged file and exit 1, with every other tensor still checked. Never a traceback; no input is changed."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import BASE_ONLY, FIXTURES, assert_nothing_written, copied_args, copy_fixture, merge_args
from lora_merge import options
from lora_merge.runs import to_hf
from lora_merge.cli import main

NAME = "tp2_fp32_filtered"
LORA = FIXTURES / NAME / "lora"
TENSORS = 51  # in a merged NAME
SMALL_SHARDS = ["--max-shard-size", "100KB"]
INDEX = "model.safetensors.index.json"
TRACKER = "latest_checkpointed_iteration.txt"


def tree_state(*roots: Path) -> dict:
    """sha256 of every file under `roots` (size and mtime for huge sparse ones), link targets, dirs."""
    state = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                if path.is_symlink():
                    state[path] = ("link", os.readlink(path))
                elif path.is_dir():
                    state[path] = "dir"
                elif path.stat().st_size > 64 << 20:
                    state[path] = (path.stat().st_size, path.stat().st_mtime_ns)
                else:
                    state[path] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def fails(args: list[str], capsys, *expected: str) -> str:
    """Run the CLI on bad input: exit 2, exactly one stderr line holding every `expected` text."""
    code = main(args)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if not line.startswith("lora-merge: warning: ")]
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("lora-merge: error: "), captured.err
    assert "Traceback" not in captured.out + captured.err
    for text in expected:
        assert text in lines[0], lines[0]
    print(f"\n[{code}] {lines[0]}")  # `pytest -s` lists every message
    return lines[0]


def deny_open(monkeypatch, victim: Path) -> None:
    """Opening `victim` fails as with mode 000 (chmod alone does not stop root, which runs CI here)."""
    real_open = Path.open

    real_os_open = os.open

    def open_(self, *args, **kwargs):
        if self == victim:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    def os_open(path, *args, **kwargs):
        if Path(path) == victim:
            raise PermissionError(13, "Permission denied", str(path))
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    monkeypatch.setattr(os, "open", os_open)


# --- the tracker file and iteration dirs -------------------------------------------------------------

@pytest.mark.parametrize("content, expected", [
    (b"\xff\xfe1\n", "not text (not UTF-8"),
    (b"", "empty"),
    (b" \n\t\r\n", "empty"),
    (b"-5\n", "found '-5'"),
    (b"+5", "found '+5'"),
    (b" 1 2\n", "found '1 2'"),
    ("10²".encode(), "found '10²'"),  # str.isdigit() is True
    ("١٠".encode(), "found '١٠'"),  # Arabic-Indic 10: int() accepts it
    (b"10\x00", r"found '10\x00'"),
    (b"1e3", "found '1e3'"),
    (b"9" * 40, "found '99999"),
])
def test_malformed_tracker(tmp_path, capsys, content, expected):
    root = copy_fixture(NAME, tmp_path)
    tracker = root / "lora" / TRACKER
    tracker.write_bytes(content)
    before, out = tree_state(root), tmp_path / "out"
    fails(copied_args(root, out), capsys, str(tracker), "expected an iteration number or 'release'", expected)
    assert_nothing_written(out)
    assert tree_state(root) == before


def test_huge_tracker_is_not_read_whole(tmp_path, capsys):
    root = copy_fixture(NAME, tmp_path)
    tracker = root / "base" / TRACKER
    os.truncate(tracker, 2 << 30)  # sparse: 2 GB that cost no disk
    before, out = tree_state(root), tmp_path / "out"
    fails(copied_args(root, out), capsys, str(tracker), "over 4096 bytes", "expected an iteration number")
    assert_nothing_written(out)
    assert tree_state(root) == before


@pytest.mark.parametrize("damage, expected", [
    ("directory", "a directory"),
    ("broken symlink", "broken symlink"),
    ("unreadable", "cannot be read (Permission denied)"),
])
def test_tracker_that_cannot_be_read(tmp_path, capsys, monkeypatch, damage, expected):
    root = copy_fixture(NAME, tmp_path)
    tracker = root / "lora" / TRACKER
    if damage == "directory":
        tracker.unlink()
        tracker.mkdir()
    elif damage == "broken symlink":
        tracker.unlink()
        tracker.symlink_to("tracker-moved-away.txt")
    before, out = tree_state(root), tmp_path / "out"
    with monkeypatch.context() as m:
        if damage == "unreadable":
            deny_open(m, tracker)
        fails(copied_args(root, out), capsys, str(tracker), expected, "expected an iteration number")
    assert_nothing_written(out)
    assert tree_state(root) == before


@pytest.mark.parametrize("content", [b"10", b"\n10\r\n", b"0000010\n"])
def test_tracker_with_odd_but_valid_spacing(tmp_path, capsys, content):
    root = copy_fixture(NAME, tmp_path)
    (root / "lora" / TRACKER).write_bytes(content)
    assert main(copied_args(root, tmp_path / "out") + ["--no-progress"]) == 0
    assert "(iteration 10," in capsys.readouterr().out


@pytest.mark.parametrize("name", ["iter_٠٠٠٠٠٠١", "iter_²"])
def test_iteration_dir_named_with_non_ascii_digits(tmp_path, capsys, name):
    root = copy_fixture(NAME, tmp_path)
    it_dir = root / "base" / name
    (root / "base" / "iter_0000001").rename(it_dir)
    args = copied_args(root, tmp_path / "out")
    args[args.index("--base") + 1] = str(it_dir)
    before = tree_state(root)
    fails(args, capsys, str(it_dir), "ASCII digits", "iter_0000010")
    assert_nothing_written(tmp_path / "out")
    assert tree_state(root) == before


# --- reference files copied into the output ---------------------------------------------------------

@pytest.mark.parametrize("name, damage, expected", [
    ("tokenizer_config.json", "broken symlink", "broken symlink"),
    ("modeling_custom.py", "broken symlink", "broken symlink"),
    ("tokenizer_config.json", "unreadable", "cannot be read (Permission denied)"),
])
def test_reference_file_that_cannot_be_copied(tmp_path, capsys, monkeypatch, name, damage, expected):
    root = copy_fixture(NAME, tmp_path)
    src = root / "hf_ref" / name
    if damage == "broken symlink":
        src.unlink(missing_ok=True)
        src.symlink_to("../../blobs/gone")
    elif damage == "directory":
        src.unlink(missing_ok=True)
        src.mkdir()
    before, out = tree_state(root), tmp_path / "out"
    with monkeypatch.context() as m:
        if damage == "unreadable":
            deny_open(m, src)
        fails(copied_args(root, out) + ["--no-progress"], capsys, str(src), expected)
    assert_nothing_written(out)
    assert tree_state(root) == before


@pytest.mark.parametrize("name", ["chat_template.jinja", "special_tokens_map.json"])
def test_a_directory_in_the_reference_is_left_out_with_a_note(tmp_path, capsys, name):
    """Subdirectories are never copied (transformers reads a model from the top level), whatever their name;
    one line says so, naming it, and the output has no such entry, as the reference has no such file."""
    root = copy_fixture(NAME, tmp_path)
    src = root / "hf_ref" / name
    src.unlink(missing_ok=True)
    src.mkdir()
    (src / "inside.txt").write_text("x")
    out = tmp_path / "out"
    assert main(copied_args(root, out) + ["--no-progress"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "not copied to the output" in line]
    assert len(notes) == 1 and f"{root / 'hf_ref'}: not copied to the output: {name}/ (a subdirectory" in notes[0]
    assert not os.path.lexists(out / name)


def test_tokenizer_json_that_is_a_directory(tmp_path, capsys):
    root = copy_fixture(NAME, tmp_path)
    src = root / "hf_ref" / "tokenizer.json"
    src.unlink()
    src.mkdir()
    out = tmp_path / "out"
    fails(copied_args(root, out) + ["--no-progress"], capsys, str(src))
    assert_nothing_written(out)


def test_reference_in_the_hf_cache_layout_is_copied_as_content(tmp_path):
    """huggingface_hub's cache: snapshots/REV/NAME -> ../../blobs/SHA. The output holds regular files."""
    root = copy_fixture(NAME, tmp_path)
    repo = tmp_path / "models--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for src in (root / "hf_ref").iterdir():
        blob = hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, repo / "blobs" / blob)
        (snapshot / src.name).symlink_to(f"../../blobs/{blob}")
    (snapshot / "modeling_tiny.py").symlink_to(os.readlink(snapshot / "chat_template.jinja"))  # copied, never run
    before, out = tree_state(repo), tmp_path / "out"
    args = copied_args(root, out) + ["--no-progress"]
    args[args.index("--hf-ref") + 1] = str(snapshot)
    assert main(args) == 0
    assert tree_state(repo) == before
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                 "modeling_tiny.py"):
        copied = out / name
        assert copied.is_file() and not copied.is_symlink(), name
        assert copied.read_bytes() == (snapshot / name).read_bytes(), name


# --- verify on a damaged output and a damaged reference ----------------------------------------------

@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """(reference HF dir with the base weights, good merged output), both in several shards."""
    root = tmp_path_factory.mktemp("damaged")
    reference, good = root / "reference", root / "good"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(options, "MIN_SHARD_BYTES", 1)  # a fixture model is 0.6 MB; several shards need small ones
        assert main(merge_args(NAME, reference) + BASE_ONLY + SMALL_SHARDS) == 0
        assert main(merge_args(NAME, good) + SMALL_SHARDS) == 0
    assert len(list(good.glob("model-*.safetensors"))) >= 4
    return reference, good


def verify(out: Path, reference: Path, capsys):
    """(exit code, problem lines, stderr lines, stdout); the inputs, out included, must be left as they were."""
    before = tree_state(out, reference, LORA)
    code = main(["verify", str(out), "--lora", str(LORA), "--hf-ref", str(reference)])
    captured = capsys.readouterr()
    assert tree_state(out, reference, LORA) == before
    assert "Traceback" not in captured.out + captured.err
    problems = [line.removeprefix("  problem: ") for line in captured.out.splitlines()
                if line.startswith("  problem: ")]
    print("".join(f"\n[{code}] problem: {p}" for p in problems))  # `pytest -s` lists every problem
    return code, problems, captured.err.splitlines(), captured.out


def shards(out: Path) -> list[Path]:
    return sorted(out.glob("model-*.safetensors"))


def header_of(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return length, json.loads(data[8: 8 + length])


def cut(path: Path, size: int) -> None:
    os.truncate(path, size)


def patch(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)


def replace_by_link(path: Path) -> None:
    path.unlink()
    path.symlink_to("elsewhere.safetensors")


def replace_by_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def shrink_a_shape(path: Path) -> None:
    """A valid-looking header whose first tensor's shape no longer matches its data_offsets."""
    length, header = header_of(path)
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"][0] -= 1
    text = json.dumps(header, separators=(",", ":")).encode()
    patch(path, 8, text.ljust(length))


SHARD_DAMAGE = {
    "missing": (Path.unlink, "missing (listed in the index)"),
    "cut to half": (lambda p: cut(p, p.stat().st_size // 2), "truncated"),
    "cut to 5 bytes": (lambda p: cut(p, 5), "truncated: 5 bytes, less than the 8-byte header length"),
    "data short by 4 bytes": (lambda p: cut(p, p.stat().st_size - 4), "truncated: its header needs"),
    "bytes appended": (lambda p: p.open("ab").write(b"\0" * 8), "8 bytes after the last tensor's data"),
    "garbage header length": (lambda p: patch(p, 0, b"\xff" * 8), "above safetensors' limit"),
    "header length beyond the file": (lambda p: patch(p, 0, (p.stat().st_size).to_bytes(8, "little")),
                                      "truncated: the header alone should be"),
    "garbage header": (lambda p: patch(p, 8, b"#garbage#" * 4), "header: not JSON"),
    "header not UTF-8": (lambda p: patch(p, 8, b"\xff" * 16), "header: not UTF-8 text"),
    "shape not matching offsets": (shrink_a_shape, "but its data_offsets span"),
    "broken symlink": (replace_by_link, "broken symlink"),
    "directory": (replace_by_dir, "a directory"),
}


@pytest.mark.parametrize("damage", SHARD_DAMAGE)
def test_damaged_shard_is_one_problem_and_the_rest_is_still_checked(sharded, tmp_path, capsys, damage):
    reference, good = sharded
    out = tmp_path / "out"
    shutil.copytree(good, out)
    victim = shards(out)[1]
    in_victim = len(header_of(victim)[1]) - 1
    edit, expected = SHARD_DAMAGE[damage]
    edit(victim)
    code, problems, errors, text = verify(out, reference, capsys)
    assert code == 1, text
    assert len(problems) == 1 and problems[0].startswith(f"{victim}: ") and expected in problems[0], problems
    assert errors == [f"lora-merge: error: {out}: verification failed (1 problem(s))"]
    # Every tensor outside the damaged shard was compared with the baseline.
    assert f"{in_victim:5d} not checked: its file is missing or damaged" in text, text
    checked = sum(int(line.split()[0]) for line in text.splitlines()
                  if line.strip().split(" ", 1)[-1].startswith(("identical to baseline", "merged:")))
    assert checked == TENSORS - in_victim, text


def test_unreadable_shard(sharded, tmp_path, capsys, monkeypatch):
    reference, good = sharded
    out = tmp_path / "out"
    shutil.copytree(good, out)
    victim = shards(out)[0]
    before = tree_state(out, reference)
    with monkeypatch.context() as m:
        deny_open(m, victim)
        code = main(["verify", str(out), "--lora", str(LORA), "--hf-ref", str(reference)])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert f"  problem: {victim}: cannot be read (Permission denied)\n" in captured.out, captured.out
    assert tree_state(out, reference) == before


def test_extra_shard_not_in_the_index(sharded, tmp_path, capsys):
    reference, good = sharded
    out = tmp_path / "out"
    shutil.copytree(good, out)
    shutil.copyfile(shards(out)[0], out / "model-extra.safetensors")
    code, problems, _, text = verify(out, reference, capsys)
    assert code == 1 and problems == [f"{out / 'model-extra.safetensors'}: not listed in the index"], text
    assert "verify: OK" not in text and f"{TENSORS - 23:5d} merged" in text


def test_index_putting_a_tensor_in_the_wrong_shard(sharded, tmp_path, capsys):
    reference, good = sharded
    out = tmp_path / "out"
    shutil.copytree(good, out)
    index = json.loads((out / INDEX).read_text())
    tensor, right = next(iter(index["weight_map"].items()))
    wrong = next(f for f in index["weight_map"].values() if f != right)
    index["weight_map"][tensor] = wrong
    (out / INDEX).write_text(json.dumps(index))
    code, problems, _, text = verify(out, reference, capsys)
    assert code == 1, text
    assert f"{tensor}: the index puts it in {wrong}, which does not hold it" in problems, problems
    assert f"{out / right}: holds 1 tensor(s) the index does not put there ({tensor})" in problems, problems


INDEX_DAMAGE = {
    "not UTF-8": (b'{"weight_map": {"a": "\xff"}}', "not UTF-8 text"),
    "not JSON": (b'{"weight_map": ', "not JSON ("),
    "deeply nested": (b"[" * 100_000, "not JSON ("),
    "a list": (b"[]", "not a JSON object"),
    "no weight_map": (b'{"metadata": {}}', "no weight_map; expected an object"),
    "weight_map a list": (b'{"weight_map": []}', "weight_map is a list"),
    "file not a string": (b'{"weight_map": {"lm_head.weight": 3}}', "weight_map puts lm_head.weight in 3"),
    "parent dir": (b'{"weight_map": {"lm_head.weight": "../good/model-00001-of-00007.safetensors"}}',
                   "expected the name of a file in this directory"),
    "absolute": (b'{"weight_map": {"lm_head.weight": "/etc/passwd"}}', "in '/etc/passwd'"),
    "subdir": (b'{"weight_map": {"lm_head.weight": "sub/model.safetensors"}}', "in 'sub/model.safetensors'"),
    "dot dot": (b'{"weight_map": {"lm_head.weight": ".."}}', "in '..'"),
}


@pytest.mark.parametrize("damage", INDEX_DAMAGE)
def test_malformed_index_in_the_output_is_a_problem(sharded, tmp_path, capsys, damage):
    reference, good = sharded
    out = tmp_path / "out"
    shutil.copytree(good, out)
    content, expected = INDEX_DAMAGE[damage]
    (out / INDEX).write_bytes(content)
    code, problems, errors, text = verify(out, reference, capsys)
    assert code == 1, text
    # The shards are still read without the index: the index is the only problem.
    assert len(problems) == 1 and problems[0].startswith(f"{out / INDEX}: ") and expected in problems[0], problems
    assert errors == [f"lora-merge: error: {out}: verification failed (1 problem(s))"]


@pytest.mark.parametrize("damage", ["not JSON", "no weight_map", "parent dir", "absolute"])
def test_malformed_index_in_the_reference_is_an_error(sharded, tmp_path, capsys, damage):
    reference, good = sharded
    ref = tmp_path / "reference"
    shutil.copytree(reference, ref)
    content, expected = INDEX_DAMAGE[damage]
    (ref / INDEX).write_bytes(content)
    before = tree_state(ref, good)
    fails(["verify", str(good), "--lora", str(LORA), "--hf-ref", str(ref)], capsys, f"{ref / INDEX}: ", expected,
          "baseline")
    assert tree_state(ref, good) == before


@pytest.mark.parametrize("damage", ["missing", "cut to half", "garbage header length"])
def test_damaged_reference_shard_is_an_error(sharded, tmp_path, capsys, damage):
    reference, good = sharded
    ref = tmp_path / "reference"
    shutil.copytree(reference, ref)
    victim = shards(ref)[-1]
    edit, expected = SHARD_DAMAGE[damage]
    edit(victim)
    fails(["verify", str(good), "--lora", str(LORA), "--hf-ref", str(ref)], capsys, f"{victim}: ", expected,
          "baseline")


def test_merge_with_verify_catches_a_truncated_shard_and_publishes_nothing(tmp_path, capsys, monkeypatch):
    real_copy = to_hf.copy_reference_files

    def copy_then_damage(hf_dir, staging, config, dtype):
        victim = shards(staging)[2]
        cut(victim, victim.stat().st_size // 2)  # as a full disk or a killed copy would leave it
        return real_copy(hf_dir, staging, config, dtype)

    monkeypatch.setattr(to_hf, "copy_reference_files", copy_then_damage)
    monkeypatch.setattr(options, "MIN_SHARD_BYTES", 1)
    out = tmp_path / "out"
    code = main(merge_args(NAME, out) + SMALL_SHARDS + ["--verify"])
    captured = capsys.readouterr()
    problems = [line for line in captured.out.splitlines() if line.startswith("  problem: ")]
    assert code == 1, captured.err
    assert len(problems) == 1 and "model-00003-of-00007.safetensors: truncated" in problems[0], captured.out
    failed = f"lora-merge: error: {out}: verification failed (1 problem(s)), nothing published"
    assert captured.err.splitlines() == [failed]
    assert_nothing_written(out)
