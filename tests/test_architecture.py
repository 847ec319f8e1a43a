"""The shape of the code, measured: data flows one way, so no module imports (at the top or inside a function)
a module that imports it back, however long the way round; and the kind of an input is asked in one place."""

import ast
from pathlib import Path

import torch

PACKAGE = Path(__file__).parent.parent / "lora_merge"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports anywhere in its text. `from package import name` counts as importing
    the package (its __init__ runs) unless `name` is a submodule; a module's own parent packages count only
    when it imports a name from them (Python imports them anyway to reach the module)."""
    found = modules()
    graph = {}
    for module, path in found.items():
        is_package = path.name == "__init__.py"
        imported, explicit = set(), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = module.split(".") if is_package else module.split(".")[:-1]
                    base = ".".join(parent[:len(parent) - node.level + 1] + ([base] if base else []))
                if not base.startswith("lora_merge"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    imported.add(sub if sub in found else base)
                    if sub not in found:
                        explicit.add(base)
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.startswith("lora_merge")}
        with_parents = {".".join(name.split(".")[:i]) for name in imported for i in range(1, name.count(".") + 2)}
        graph[module] = {m for m in with_parents - {module} if m in found
                         and (not module.startswith(m + ".") or m in explicit)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert "lora_merge.runs.to_hf" in graph["lora_merge.api"] and "lora_merge.api" in graph["lora_merge"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the finder finds


def test_no_import_cycles():
    """Not even through a function-level import or the package face (`lora_merge/__init__` imports the API on
    first use: nothing below may import the face; the version has a module of its own)."""
    assert cycles(import_graph()) == []


def calls_outside_readers(name: str) -> set[str]:
    """The modules outside readers/ that call `name(...)`."""
    found = set()
    for module, path in modules().items():
        if module.startswith("lora_merge.readers"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                found.add(module)
    return found


def test_the_kind_of_an_input_is_asked_in_one_place():
    """readers/detect.py decides what a path is; outside readers/ only runs/inputs.py asks it, and nothing asks
    which class an opened input is (it answers the Source questions instead)."""
    assert calls_outside_readers("input_kind") == {"lora_merge.runs.inputs"}
    input_classes = {"HfModel", "PeftAdapter", "Checkpoint"}
    asking = set()
    for module, path in modules().items():
        if module.startswith("lora_merge.readers"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if named & input_classes:
                    asking.add(module)
    assert asking == set()


def test_every_reader_answers_the_source_questions(tmp_path):
    import lora_merge
    from lora_merge.readers.detect import open_checkpoint
    from lora_merge.readers.hf_model import read_hf_model
    from lora_merge.readers.peft import read_peft_adapter
    from lora_merge.readers.source import Source

    root = Path(__file__).parent / "fixtures/qwen3_tp2_fp32"
    lora_merge.merge(base=root / "base", hf_ref=root / "hf_ref", out=tmp_path / "hf", warn=lambda m: None)
    lora_merge.export_adapter(lora=root / "lora", hf_ref=root / "hf_ref", out=tmp_path / "adapter",
                              warn=lambda m: None)
    megatron, hf, peft = (open_checkpoint(root / "base"), read_hf_model(tmp_path / "hf"),
                          read_peft_adapter(tmp_path / "adapter"))
    for source in (megatron, hf, peft):
        assert isinstance(source, Source), type(source)
        for question in ("path", "format", "sources", "skipped", "hf_named", "megatron_args", "weights_dtype",
                         "experts", "fp8"):
            getattr(source, question)
        assert source.has("decoder.layers.0.self_attention.linear_qkv.weight") is (source is megatron)
    assert (megatron.hf_named, hf.hf_named, peft.hf_named) == (False, True, True)
    assert megatron.megatron_args is megatron.args and hf.megatron_args is None and peft.megatron_args is None
    assert (megatron.weights_dtype, hf.weights_dtype, peft.weights_dtype) == (torch.float32, torch.float32, None)


def test_every_tensor_writer_is_a_sink():
    """The runs drive every output through runs/stream.py: each writer answers the Sink interface."""
    from lora_merge.writers.megatron_dist import MegatronDistOutput
    from lora_merge.writers.megatron_legacy import MegatronLegacyWriter
    from lora_merge.writers.safetensors_stream import ShardedSafetensorsWriter
    from lora_merge.writers.sink import Sink

    wanted = {name for name in vars(Sink) if not name.startswith("_")}
    assert wanted == {"total_bytes", "start", "write", "finish", "abort"}
    for writer in (ShardedSafetensorsWriter, MegatronLegacyWriter, MegatronDistOutput):
        missing = {name for name in wanted - {"total_bytes"} if not callable(getattr(writer, name, None))}
        assert not missing, (writer.__name__, missing)
    assert calls_outside_readers("execute") == {"lora_merge.runs.stream"}  # one driver of the pipeline
