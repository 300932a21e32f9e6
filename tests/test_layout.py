"""The scripts teach their technique: each shows its own torch calls, neighbours in the grid
differ by the technique alone, and the shared helpers stay small and acyclic."""
from __future__ import annotations

import ast
import difflib
import re

import pytest

from conftest import AMP_DIR

GRID = [["train_without", "train_autocast", "train_GradScaler"],
        ["train_DP", "train_DP_autocast", "train_DP_GradScaler"],
        ["train_DDP", "train_DDP_autocast", "train_DDP_GradScaler"],
        ["train_FSDP", "train_FSDP_autocast", "train_FSDP_GradScaler"]]
SCRIPTS = [name for row in GRID for name in row] + ["train_FSDP_mixed", "eval_without", "eval_DP",
                                                    "eval_DDP"]


def _source(name: str) -> str:
    return (AMP_DIR / f"{name}.py").read_text()


def _code(name: str) -> list[str]:
    """The script's lines after its docstring, comments stripped."""
    src = _source(name)
    doc_end = ast.parse(src).body[0].end_lineno
    return [ln.split("#")[0].rstrip() for ln in src.splitlines()[doc_end:]]


def _technique(name: str) -> set[str]:
    """The torch calls a script must contain literally, from its name."""
    calls = set()
    if name.endswith(("autocast", "GradScaler")):
        calls.add("torch.autocast(")
    if name.endswith("GradScaler"):
        calls |= {"torch.amp.GradScaler(", "scaler.scale(loss).backward()",
                  "scaler.step(optimizer)", "scaler.update()"}
    if "_DP" in name and "_DDP" not in name:
        calls.add("nn.DataParallel(")
    if name.startswith("train_DDP"):
        calls.add("DistributedDataParallel(")
    if name.startswith("train_FSDP"):
        calls.add("fully_shard(")
    if name == "train_FSDP_mixed":
        calls |= {"MixedPrecisionPolicy(", "torch.amp.GradScaler("}
    if name == "eval_DDP":
        calls |= {"dist.all_reduce(", "range(rank, ev.test_size, world_size)"}
    return calls


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_contains_its_technique_literally(name):
    code, technique = "\n".join(_code(name)), _technique(name)
    for call in technique:
        assert call in code, f"{name}.py must show {call!r} itself, not behind a helper"
    for call in ("torch.autocast(", "GradScaler(", "nn.DataParallel(", "DistributedDataParallel(",
                 "fully_shard(", "MixedPrecisionPolicy("):
        if not any(call in c for c in technique):
            assert call not in code, f"{name}.py uses {call!r}, which is not its technique"
    if name.startswith("train_FSDP"):  # its optimizer is made over the shards, after sharding
        assert code.index("parts.optimizer") > code.rindex("fully_shard("), name
    if name.startswith("train"):
        assert "optimizer.zero_grad(set_to_none=True)" in code
        assert re.search(r"def train_step\(images, targets\):", code)
    assert len(_source(name).splitlines()) <= 90


def _pairs():
    for row in GRID:
        yield row[0], row[1]
        yield row[1], row[2]
    for col in zip(*GRID):
        yield col[0], col[1]
        yield col[1], col[2]
        yield col[0], col[2]
        yield col[2], col[3]  # DDP -> FSDP2
    yield "train_FSDP_GradScaler", "train_FSDP_mixed"  # another technique: a policy per block


@pytest.mark.parametrize("a,b", list(_pairs()))
def test_neighbours_differ_by_their_technique_only(a, b):
    """`diff` of two neighbouring scripts (docstrings and comments aside) is a handful of lines."""
    changed = [ln for ln in difflib.unified_diff(_code(a), _code(b), lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert len(changed) <= (22 if b == "train_FSDP_mixed" else 16), "\n".join(changed)


def _ampkit_modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in (AMP_DIR / "ampkit").rglob("*.py")}


def test_shared_helpers_have_no_import_cycle():
    modules = _ampkit_modules()
    edges = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in ast.walk(tree):  # function-level imports count too
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = [node.module] if node.module else [a.name for a in node.names]
                edges[name] |= {t.split(".")[0] for t in targets if t.split(".")[0] in modules}

    def visit(node, path):
        assert node not in path, "import cycle: " + " -> ".join(path[path.index(node):] + [node])
        for nxt in edges[node]:
            visit(nxt, path + [node])

    for name in modules:
        visit(name, [])


def test_no_long_functions_in_the_shared_helpers():
    too_long = [f"ampkit/{name}.py:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
                for name, tree in _ampkit_modules().items() for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno + 1 > 60]
    assert not too_long, too_long


def test_no_private_attribute_in_the_scripts():
    for name in SCRIPTS:
        assert not re.search(r"\.\s*_[a-z]", "\n".join(_code(name))), name
