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
    """The script's code lines after its docstring: comments and blank lines stripped."""
    src = _source(name)
    doc_end = ast.parse(src).body[0].end_lineno
    lines = (ln.split("#")[0].rstrip() for ln in src.splitlines()[doc_end:])
    return [ln for ln in lines if ln.strip()]


# DDP's recipe (and FSDP2's, on the same process group), in the script's own code.
GROUP_RECIPE = {"torchrun_env(args.cuda)", "torch.cuda.set_device(device)",
                "init_process_group(", "destroy_process_group()"}
SAMPLER_RECIPE = {"DistributedSampler(trainer.train_set", "sampler.set_epoch(epoch)",
                  "trainer.start(build, sampler)"}


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
    if name.startswith("train_DDP"):  # with --accum_steps: no all-reduce but at a step's last
        calls |= {"DistributedDataParallel(", "with model.no_sync()"} | GROUP_RECIPE | SAMPLER_RECIPE
    if name.startswith("train_FSDP"):
        calls |= ({"fully_shard(", "model.set_requires_gradient_sync(last)",
                   "model.set_reshard_after_backward(last)",
                   "norm.full_tensor()"} | GROUP_RECIPE | SAMPLER_RECIPE)
    if name.endswith("GradScaler") or name == "train_FSDP_mixed":
        calls.add("scaler.unscale_(optimizer)")
    if name == "train_FSDP_mixed":
        calls |= {"MixedPrecisionPolicy(", "torch.amp.GradScaler("}
    if name == "eval_DDP":
        calls |= {"dist.all_reduce(", "range(rank, ev.test_size, world_size)"} | GROUP_RECIPE
    if name.startswith("train"):
        calls |= {"torch.optim.AdamW(model.parameters()", "optimizer.zero_grad(set_to_none=True)",
                  "for epoch in trainer.epochs():", "trainer.train_epoch(technique, epoch)",
                  "torch.nn.utils.clip_grad_norm_(model.parameters(), parts.clip_grad)",
                  "forward_backward(x, y, len(y) / n)"}
    return calls


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_contains_its_technique_literally(name):
    code, technique = "\n".join(_code(name)), _technique(name)
    for call in technique:
        assert call in code, f"{name}.py must show {call!r} itself, not behind a helper"
    for call in ("torch.autocast(", "GradScaler(", "nn.DataParallel(", "DistributedDataParallel(",
                 "fully_shard(", "MixedPrecisionPolicy(", "init_process_group(",
                 "DistributedSampler(", "no_sync(", "set_requires_gradient_sync("):
        if not any(call in c for c in technique):
            assert call not in code, f"{name}.py uses {call!r}, which is not its technique"
    if name.startswith("train_FSDP"):  # its optimizer is made over the shards, after sharding
        assert code.index("torch.optim.AdamW(") > code.rindex("fully_shard("), name
    if "init_process_group(" in code:  # the device is bound before the group is made
        assert code.index("torch.cuda.set_device(") < code.index("init_process_group("), name
        last = "ev.report(" if name.startswith("eval") else "train_epoch("
        assert code.rindex("destroy_process_group()") > code.rindex(last), name
    if name.startswith("train"):
        assert re.search(r"def train_step\(window\):", code)
        # One zero_grad before the window's backward passes; one unscale_ before the clip,
        # the clip before the optimizer's step: once per optimizer step, after the loop.
        loop = re.search(r"^\s+for .* in (enumerate\(window\)|window):", code, re.M).start()
        order = [code.index("optimizer.zero_grad("), loop, code.index("clip_grad_norm_(")]
        assert order == sorted(order), name
        step = "scaler.step(optimizer)" if "scaler.step(" in code else "optimizer.step()"
        assert code.index("clip_grad_norm_(") < code.index(step), name
        if "scaler.unscale_(" in code:
            assert loop < code.index("scaler.unscale_(") < code.index("clip_grad_norm_("), name
    assert len(_source(name).splitlines()) <= 112  # about 110


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
    if b.startswith("train_DDP") and not a.startswith("train_DDP"):
        limit = 30  # the whole of DDP's recipe: process group, wrapper, sampler, teardown
    elif b.startswith("train_FSDP") and a.startswith("train_DDP"):
        limit = 20  # another wrapper, its own way to skip a micro-batch's reduction and gather
    else:
        limit = 22 if b == "train_FSDP_mixed" else 16
    assert len(changed) <= limit, "\n".join(changed)


def _project_modules() -> dict[str, ast.Module]:
    """Every module of AMP/ by its dotted name: the scripts, alexnet, ampkit and its packages."""
    return {".".join(p.relative_to(AMP_DIR).with_suffix("").parts).removesuffix(".__init__"):
            ast.parse(p.read_text()) for p in AMP_DIR.rglob("*.py")}


def _imports(name: str, tree: ast.Module, modules: dict) -> set[str]:
    """The project modules ``name`` imports, anywhere in it (function-level imports too)."""
    package = name if (AMP_DIR / name.replace(".", "/") / "__init__.py").exists() \
        else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _closure(name: str, graph: dict) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_shared_helpers_have_no_import_cycle():
    modules = _project_modules()
    graph = {name: _imports(name, tree, modules) for name, tree in modules.items()}
    for name in modules:
        assert name not in _closure(name, graph), f"import cycle through {name}"


@pytest.mark.parametrize("name", [n for row in GRID for n in row] + ["train_FSDP_mixed"])
def test_train_scripts_import_no_measuring_or_report_code(name):
    """What a train script imports, all the way down, is the training core and the machinery
    it needs: not the benchmark harness, compare's reports or its child-process runner."""
    modules = _project_modules()
    graph = {n: _imports(n, tree, modules) for n, tree in modules.items()}
    reached = _closure(name, graph)
    assert "ampkit.train" in reached and "ampkit.machinery.checkpoint" in reached, reached
    for tool in ("ampkit.machinery.measure", "ampkit.machinery.report",
                 "ampkit.machinery.runner", "benchmark", "compare"):
        assert tool not in reached, f"{name} imports {tool}"


def test_the_layout_shows_the_core_apart_from_the_machinery():
    """ampkit/ holds the training core (the loop, the driver, precision, distributed set-up,
    models); ampkit/machinery/ the rest."""
    core = {p.stem for p in (AMP_DIR / "ampkit").glob("*.py")}
    assert core == {"__init__", "engine", "train", "evaluate", "precision", "distributed",
                    "models"}, core
    machinery = {p.stem for p in (AMP_DIR / "ampkit" / "machinery").glob("*.py")}
    assert {"checkpoint", "measure", "report", "runner", "saving", "resume"} <= machinery


def test_no_long_functions_or_classes():
    too_long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
                for name, tree in _project_modules().items() for node in ast.walk(tree)
                if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and node.end_lineno - node.lineno + 1 > 60)
                or (isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 150)]
    assert not too_long, too_long


def test_no_private_attribute_in_the_scripts():
    for name in SCRIPTS:
        assert not re.search(r"\.\s*_[a-z]", "\n".join(_code(name))), name


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_describes_the_script_by_its_docstrings_first_line(name, capsys):
    import importlib

    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    first = module.__doc__.strip().splitlines()[0]
    assert " ".join(first.split()) in " ".join(capsys.readouterr().out.split())
