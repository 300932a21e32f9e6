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
SAMPLER_RECIPE = {"DistributedSampler(data.train_set", "with local_main_first("}
# Each train script's epoch, DeiT's shape, in this order: a new order for the sampler,
# train, validate, schedule on the accuracy, save, log.
EPOCH = ["sampler.set_epoch(epoch)", "train_one_epoch(", "count_correct(", "scheduler.step(",
         "saver.save(", "log.epoch("]


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
    if name.startswith(("train_DDP", "train_FSDP")):  # the ranks' counts, summed in view
        calls |= {"dist.all_reduce(counts)"}
    if name.startswith("train_DDP"):  # the unwrapped weights, saved by rank 0
        calls |= {"technique.model.module.state_dict()"}
    if name.startswith("train_FSDP"):  # the full state, gathered from the shards
        calls |= {"get_model_state_dict(model, options=full)",
                  "get_optimizer_state_dict(model, optimizer, options=full)"}
    if name.startswith("train_DDP"):  # with --accum_steps: no all-reduce but at a step's last
        calls |= {"DistributedDataParallel(", "with model.no_sync()"} | GROUP_RECIPE | SAMPLER_RECIPE
    if name.startswith("train_FSDP"):
        calls |= ({"fully_shard(", "model.set_requires_gradient_sync(last)",
                   "model.set_reshard_after_backward(last)",
                   ".full_tensor()"} | GROUP_RECIPE | SAMPLER_RECIPE)
    if name.endswith("GradScaler") or name == "train_FSDP_mixed":
        calls.add("scaler.unscale_(optimizer)")
    if name == "train_FSDP_mixed":
        calls |= {"MixedPrecisionPolicy(", "torch.amp.GradScaler("}
    if name == "eval_DDP":
        calls |= {"dist.all_reduce(", "range(rank, ev.test_size, world_size)"} | GROUP_RECIPE
    if name.startswith("train"):
        calls |= {"torch.optim.AdamW(model.parameters()", "optimizer.zero_grad(set_to_none=True)",
                  "torch.optim.lr_scheduler.ReduceLROnPlateau(technique.optimizer",
                  "build_loaders(", "technique = build(parts)", *EPOCH,
                  "torch.nn.utils.get_total_norm(",
                  "torch.nn.utils.clip_grads_with_norm_(model.parameters(), parts.clip_grad, norm)",
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
        last = "ev.report(" if name.startswith("eval") else "log.epoch("
        assert code.rindex("destroy_process_group()") > code.rindex(last), name
        if name.startswith("train"):  # a stop, too, leaves the group in the script's own call
            assert code.rindex("destroy_process_group()") < code.rindex("return run.status")
        # On every way out (an error too): the teardown is the finally of the run's try.
        assert re.search(r"^    finally:\n        dist\.destroy_process_group\(\)$", code, re.M), name
    if name.startswith("train"):
        # The set-up before the epochs (the network resumed before build() wraps it; the
        # states after), the epochs in their order, then the run's end.
        set_up = [code.index(c) for c in ("build_loaders(", "make_parts(", "resume(", "build(parts)",
                                          "restore(", "for epoch in ")]
        epoch = [code.index(c) for c in EPOCH] + [code.rindex("run.end(")]
        assert set_up == sorted(set_up) and epoch == sorted(epoch) and set_up[-1] < epoch[0], name
        assert re.search(r"def train_step\(micro_batches\):", code)
        # One zero_grad before the step's backward passes; one unscale_ before the clip,
        # the clip before the optimizer's step: once per optimizer step, after the loop.
        loop = re.search(r"^\s+for .* in (enumerate\(micro_batches\)|micro_batches):", code,
                         re.M).start()
        norm, clip = code.index("get_total_norm("), code.index("clip_grads_with_norm_(")
        order = [code.index("optimizer.zero_grad("), loop, norm, clip]
        assert order == sorted(order), name
        step = "scaler.step(optimizer)" if "scaler.step(" in code else "optimizer.step()"
        assert clip < code.index(step), name
        if "scaler.unscale_(" in code:
            assert loop < code.index("scaler.unscale_(") < norm, name
        # The epoch's options named at the call; the run's status returned after the teardown.
        assert "**" not in code, name
        assert code.rstrip().splitlines()[-3].strip() == "return run.status", name


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
    """`diff -w` of two neighbouring scripts (docstrings, comments and indentation aside: a
    process group's scripts hold their run in the ``try`` that leaves the group) is a handful
    of lines."""
    changed = [ln for ln in difflib.unified_diff([ln.strip() for ln in _code(a)],
                                                 [ln.strip() for ln in _code(b)], lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    if b.startswith("train_DDP") and not a.startswith("train_DDP"):
        # The whole of DDP's recipe: process group, wrapper, sampler, the counts' sum, the
        # unwrapped weights, the comm hook and its saved state, teardown (from
        # DataParallel: its own wrapping out, too).
        limit = 43 if a.startswith("train_DP") else 37
    elif b.startswith("train_FSDP") and a.startswith("train_DDP"):
        limit = 31  # another wrapper, its own skip of a micro-batch's reduction, its state
    else:
        limit = 28 if b == "train_FSDP_mixed" else 16  # mixed: a scaler for fp16 alone
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
    modules, graph = _graph()
    for name in modules:
        assert name not in _closure(name, graph), f"import cycle through {name}"


def _graph() -> tuple[dict, dict]:
    modules = _project_modules()
    return modules, {n: _imports(n, tree, modules) for n, tree in modules.items()}


def _layer(name: str) -> str:
    if name.startswith("ampkit.machinery"):
        return "machinery"
    if name.startswith("ampkit"):
        return "core"
    return "tools" if name.startswith("tools") else "scripts"


def test_imports_run_one_way_plumbing_beneath_tools_above():
    """The scripts and tools (benchmark, compare and tools/) above the training core
    (ampkit/), the core above its plumbing (ampkit/machinery/): the plumbing imports
    nothing of the core, the core nothing of the tools or the scripts (alexnet.py included)."""
    modules, graph = _graph()
    allowed = {"machinery": {"machinery"}, "core": {"core", "machinery"},
               "tools": {"tools", "core", "machinery"},
               "scripts": {"scripts", "tools", "core", "machinery"}}
    wrong = sorted(f"{name} -> {dep}" for name, deps in graph.items() for dep in deps
                   if _layer(dep) not in allowed[_layer(name)])
    assert not wrong, wrong
    assert {p.stem for p in (AMP_DIR / "ampkit").glob("*.py")} == {
        "__init__", "technique", "engine", "train", "evaluate", "precision", "distributed",
        "models", "comm_hooks"}
    assert {"measure_steps", "measure_input", "cifar_files", "tables", "report", "run_logs",
            "figure", "comparison", "compare_results", "runner",
            "variants", "bench_flags"} <= {p.stem for p in
                                                          (AMP_DIR / "tools").glob("*.py")}


# What talks to the process group: torch.distributed's collectives and the functions of
# ampkit/distributed.py that wrap them (each a call that every rank must make).
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_to_all", "barrier",
               "broadcast", "broadcast_object_list", "gather_object", "monitored_barrier",
               "gather", "new_group", "recv", "reduce", "reduce_scatter", "scatter", "send",
               "sum_over_ranks", "max_over_ranks", "gather_from_ranks", "any_rank",
               "local_main_first", "agreed_resume_path", "agree_on_resumed",
               "rank_random_states"}


def _calls(path) -> set[str]:
    """The names of the functions and methods ``path`` calls."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def test_the_plumbing_is_single_process_every_collective_in_view():
    """No module under ampkit/machinery/ talks to the process group: a reader knows which
    calls every rank must make from the scripts and ampkit/distributed.py alone (the core's
    train and evaluate call that module by name; the engine's epoch sums its figures
    through it)."""
    machinery = sorted((AMP_DIR / "ampkit" / "machinery").glob("*.py"))
    assert machinery
    for path in machinery:
        assert not _calls(path) & COLLECTIVES, (path.name, _calls(path) & COLLECTIVES)
        assert "torch.distributed" not in path.read_text(), path.name  # nor reached around
    for path in (AMP_DIR / "ampkit").glob("*.py"):
        if path.stem not in ("distributed", "comm_hooks"):
            assert "torch.distributed" not in path.read_text(), path.name
    # The DDP hooks hand each bucket to PyTorch's own, whose all-reduce DDP runs in every
    # rank's backward: no collective of their own.
    assert not _calls(AMP_DIR / "ampkit" / "comm_hooks.py") & COLLECTIVES


def test_no_function_imports_a_project_module():
    """Imports of the project's own modules stand at the top of their module: none hides in a
    function (where one would dodge a cycle)."""
    modules = _project_modules()
    hidden = []
    for name, tree in modules.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and \
                            _imports(name, ast.Module(body=[node], type_ignores=[]), modules):
                        hidden.append(f"{name}:{node.lineno}")
    assert not hidden, hidden


@pytest.mark.parametrize("name", [n for row in GRID for n in row] + ["train_FSDP_mixed"])
def test_train_scripts_import_the_core_and_its_plumbing_alone(name):
    """What a train script imports, all the way down, is the training core and the machinery
    it needs, and no more code than that (about 2,500 lines, docstrings, comments and blank
    lines left out: what a reader follows, not what explains it): not the benchmark's or
    compare's tools."""
    modules, graph = _graph()
    reached = _closure(name, graph)
    assert "ampkit.train" in reached and "ampkit.machinery.checkpoint_files" in reached, reached
    assert not {n for n in reached if _layer(n) in ("tools", "scripts")}, reached
    files = [AMP_DIR / (n.replace(".", "/") + ".py") for n in reached | {name}]
    lines = sum(_code_lines(f if f.exists() else f.with_suffix("") / "__init__.py")
                for f in files)
    assert lines <= 2750, lines  # 2,700 with DDP's comm hooks


def _code_lines(path) -> int:
    """A module's lines of code: not blank, not a comment, not in a docstring."""
    src = path.read_text()
    docs = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for number, line in enumerate(src.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and number not in docs)


def test_no_long_functions_or_classes():
    """A function fits a screen (60 lines), a class two; a train script's ``main()``, its
    whole run in view (set-up, epochs, teardown), at most 80."""
    def limit(name, node):
        return 80 if name.startswith("train_") and node.name == "main" else 60
    too_long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
                for name, tree in _project_modules().items() for node in ast.walk(tree)
                if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and node.end_lineno - node.lineno + 1 > limit(name, node))
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


def test_modules_end_at_their_seams():
    """Every module under AMP/ fits a few screens (at most 260 lines, docstrings included: a
    longer one holds two things); a train script, its whole run in view, at most 160."""
    sizes = {str(p.relative_to(AMP_DIR)): len(p.read_text().splitlines())
             for p in AMP_DIR.rglob("*.py")}
    assert len(sizes) > 40, sizes
    too_long = {f: n for f, n in sizes.items()
                if n > (160 if f.startswith("train_") else 260)}
    assert not too_long, too_long


def test_tests_start_processes_through_one_helper():
    """The tests start a process one way (tests/helpers/processes.py: its own session, the
    environment of a user's run, a timeout that kills the whole job and shows its output),
    and run a script in-process one way (tests/helpers/in_process.py). faulty_train.py, a
    job itself, sends its group a signal from another process, as a scheduler does."""
    tests_dir = AMP_DIR.parent / "tests"
    allowed = {"processes.py", "faulty_train.py"}
    direct = []
    for path in sorted(tests_dir.glob("*.py")) + sorted((tests_dir / "helpers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and path.name not in allowed:
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if "subprocess" in names:
                    direct.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.FunctionDef) and node.name == "run_main" \
                    and path.name != "in_process.py":
                direct.append(f"{path.name}:{node.lineno} defines run_main")
    assert not direct, direct
