"""The scripts teach their technique and their run: each makes its technique's torch calls
itself, runs its epoch in DeiT's shape with the bookkeeping left to its owners, and differs
from its neighbours in the grid by the technique alone; the shared code imports one way,
stays shallow and acyclic, and talks to the process group from one module only. These are
checks of structure, read from the code's syntax tree and import graph, not of spelling."""
from __future__ import annotations

import ast
import difflib
import io
import re
import tokenize
from collections import defaultdict

import pytest

from conftest import AMP_DIR

GRID = [["train_without", "train_autocast", "train_GradScaler"],
        ["train_DP", "train_DP_autocast", "train_DP_GradScaler"],
        ["train_DDP", "train_DDP_autocast", "train_DDP_GradScaler"],
        ["train_FSDP", "train_FSDP_autocast", "train_FSDP_GradScaler"]]
TRAIN = [name for row in GRID for name in row] + ["train_FSDP_mixed"]
SCRIPTS = TRAIN + ["eval_without", "eval_DP", "eval_DDP"]


def _source(name: str) -> str:
    return (AMP_DIR / f"{name}.py").read_text()


def _tree(name: str) -> ast.Module:
    return ast.parse(_source(name))


def _function(name: str, function: str) -> ast.FunctionDef:
    return next(n for n in _tree(name).body
                if isinstance(n, ast.FunctionDef) and n.name == function)


def _dotted(node: ast.AST) -> str:
    """``torch.amp.GradScaler`` for the expression that names it ("" for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    return ""


def _calls(tree: ast.AST) -> list[ast.Call]:
    """The calls under ``tree``, in source order."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _called(tree: ast.AST) -> list[str]:
    """The dotted names of what ``tree`` calls, in source order."""
    return [_dotted(c.func) for c in _calls(tree)]


def _first(names: list[str], suffix: str) -> int:
    """Where ``suffix`` (a dotted name's end) is first called."""
    return next(i for i, n in enumerate(names) if n == suffix or n.endswith("." + suffix))


def _has(names: list[str], suffix: str) -> bool:
    return any(n == suffix or n.endswith("." + suffix) for n in names)


# ------------------------------------------------------------------------ a technique's calls
# What a technique calls, by the dotted name's end, whichever spelling a script imports it by.
TECHNIQUE_CALLS = {
    "autocast": ["torch.autocast", "resolve_amp_dtype"],
    "scaler": ["torch.amp.GradScaler", "scale", "unscale_", "update", "refuse_unsupported"],
    "dp": ["DataParallel", "refuse_unsupported"],
    "ddp": ["DistributedDataParallel", "no_sync", "register_comm_hook"],
    # The full state of the shards is gathered by the checkpoint manager's state_dicts()
    # (distributed.py), and sharded again as it loads: the script names the network.
    "fsdp": ["fully_shard", "set_requires_gradient_sync", "set_reshard_after_backward",
             "full_tensor"],
    "group": ["torchrun_ranks", "refuse_unsupported", "set_device_index",
              "get_default_backend_for_device", "init_process_group", "DistributedSampler",
              "local_main_first", "dist.all_reduce", "destroy_process_group"],
    "mixed": ["MixedPrecisionPolicy", "resolve_amp_dtype", "torch.amp.GradScaler", "scale",
              "unscale_", "update"],
}
ALWAYS = ["choose_device", "torch.optim.AdamW", "zero_grad", "get_total_norm",
          "clip_grads_with_norm_", "ReduceLROnPlateau", "build_loaders", "make_network",
          "build", "Progress", "CheckpointManager", "checkpoint.load", "set_epoch",
          "train_one_epoch", "count_correct", "scheduler.step", "checkpoint.save",
          "checkpoint.save_stop", "log.epoch", "run.end"]


def _techniques(name: str) -> set[str]:
    kinds = set()
    if name.endswith(("autocast", "GradScaler")):
        kinds.add("autocast")
    if name.endswith("GradScaler"):
        kinds.add("scaler")
    if name.startswith("train_DP") and not name.startswith("train_DDP"):
        kinds.add("dp")
    if name.startswith("train_DDP"):
        kinds |= {"ddp", "group"}
    if name.startswith("train_FSDP"):
        kinds |= {"fsdp", "group"}
    if name == "train_FSDP_mixed":
        kinds.add("mixed")
    return kinds


@pytest.mark.parametrize("name", TRAIN)
def test_a_train_script_makes_its_techniques_calls_itself(name):
    """The wrapper, the precision objects and the process group's recipe are called in the
    script, not behind a helper; a technique that is not the script's is not called."""
    called = _called(_tree(name))
    mine = {call for kind in _techniques(name) for call in TECHNIQUE_CALLS[kind]} | set(ALWAYS)
    for call in mine:
        assert _has(called, call), f"{name}.py must call {call} itself"
    theirs = {call for kind, calls in TECHNIQUE_CALLS.items() if kind not in _techniques(name)
              for call in calls} - mine
    assert not [c for c in theirs if _has(called, c)], name


@pytest.mark.parametrize("name", TRAIN)
def test_the_step_reads_straight_down(name):
    """One zero_grad, the micro-batches' backward passes, then once per optimizer step:
    unscale_ (under a scaler), the norm, the clip, the optimizer's step."""
    step = next(n for n in ast.walk(_function(name, "build"))
                if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    called = _called(step)
    loop = next(n for n in ast.walk(step) if isinstance(n, ast.For))
    in_loop = set(_called(loop))
    assert _has(list(in_loop), "forward_backward")
    order = [_first(called, "zero_grad"), _first(called, "forward_backward"),
             _first(called, "get_total_norm"), _first(called, "clip_grads_with_norm_")]
    order.append(_first(called, "scaler.step") if _has(called, "scaler.step")
                 else _first(called, "optimizer.step"))
    if _has(called, "unscale_"):
        assert not _has(list(in_loop), "unscale_"), "unscale_ once a step, not per micro-batch"
        order.insert(2, _first(called, "unscale_"))
    assert order == sorted(order), (name, order)


@pytest.mark.parametrize("name", TRAIN)
def test_the_run_is_set_up_then_its_epochs_run_in_deits_shape(name):
    """main(): the flags, the device, then the precision decided in view and the device's
    refusals, before anything runs; then train(), the run: the data, the network from the
    seed, build() taking its values by name, the state it checkpoints with where the run
    stands, the checkpoint loaded after build() (torchtitan's order), then the epochs from
    where the run stands -- set_epoch, train from where the epoch starts, validate, schedule,
    save, log -- and the run's end. The rest of the epoch's bookkeeping is its owners' (the
    meters, the checkpoint manager): the loop sets no sampler index, resets no clock, passes
    no profiler, skipped counter or resumed figures, and a stop is one branch with one save."""
    main, run = _function(name, "main"), _function(name, "train")
    called, running = _called(main), _called(run)
    assert _has(called, "train") and not _has(called, "RunFolder"), name
    set_up = [_first(running, c) for c in ("RunFolder", "build_loaders", "make_network",
                                            "build", "Progress", "CheckpointManager",
                                            "checkpoint.load")]
    assert set_up == sorted(set_up), (name, set_up)
    build = next(c for c in _calls(run) if _dotted(c.func) == "build")
    # The bare network and the criterion by position; every value by its name.
    assert len(build.args) == 2 and all(k.arg is not None for k in build.keywords), name
    if _techniques(name) & {"autocast", "mixed"}:  # the precision, decided in main()
        assert _has(called, "resolve_amp_dtype"), name
        assert "amp_dtype" in {k.arg for k in build.keywords}, name
    if "mixed" in _techniques(name):  # whether a GradScaler runs: decided once, in main()
        assert "loss_scaling" in {k.arg for k in build.keywords}, name
    loops = [n for n in ast.walk(run) if isinstance(n, ast.For)]
    assert len(loops) == 1 and ast.unparse(loops[0].iter) == \
        "range(progress.epoch, args.epochs)", name
    epoch = _called(loops[0])
    order = [_first(epoch, c) for c in ("set_epoch", "train_one_epoch", "count_correct",
                                        "scheduler.step", "checkpoint.save", "log.epoch")]
    assert order == sorted(order), (name, order)
    assert _first(running, "run.end") > _first(running, "log.epoch")
    train = next(c for c in _calls(loops[0]) if _dotted(c.func).endswith("train_one_epoch"))
    kw = {k.arg: k.value for k in train.keywords}
    assert not set(kw) & {"profiler", "skipped", "before", "input_format", "epoch"}, name
    assert ast.unparse(kw["start"]) == "progress.step", name
    assert all(k.arg is not None for k in train.keywords), "options named, no ** dict"
    source = ast.unparse(run)
    assert "start_index" not in source and "begin_epoch" not in source, name
    assert "resumed" not in source, name
    assert sum(_dotted(c.func).endswith("save_stop") for c in _calls(run)) == 1, name
    assert sum(isinstance(n, ast.Break) for n in ast.walk(loops[0])) == 1, name


def _imported_helpers(name: str) -> set[str]:
    return {n.module for n in ast.walk(_tree(name)) if isinstance(n, ast.ImportFrom)
            and (n.module or "").startswith("ampkit")}


@pytest.mark.parametrize("name", TRAIN)
def test_a_train_script_imports_from_nine_helper_modules_at_most(name):
    """A reader follows a script's helpers into a few modules, each a concept: the flags,
    the device, the data, the networks, the engine, the meters, the checkpoint, the run,
    and a group's process group; DDP's scripts, its comm hooks too."""
    most = 10 if name.startswith("train_DDP") else 9
    assert len(_imported_helpers(name)) <= most, sorted(_imported_helpers(name))


@pytest.mark.parametrize("name", TRAIN)
def test_what_a_checkpoint_holds_is_named_once_after_build(name):
    """One mapping, name -> object, declared right after build() and its LR schedule, is what
    the checkpoint manager saves and loads: the same name, in view in the script, and no
    other list of the entries. The weights are the bare network's, spelled so in every
    script; where the run stands is one more entry."""
    run = _function(name, "train")
    assigns = [n for n in ast.walk(run) if isinstance(n, ast.Assign)
               and isinstance(n.value, ast.Dict) and _dotted(n.targets[0]) == "state"]
    assert len(assigns) == 1, name
    entries = {k.value: ast.unparse(v) for k, v in zip(assigns[0].value.keys,
                                                        assigns[0].value.values)}
    assert entries["model"] == "network" and entries["progress"] == "progress", entries
    assert {"optimizer", "scheduler"} <= set(entries), (name, entries)
    assert ("scaler" in entries) == ("GradScaler" in name or name == "train_FSDP_mixed"), name
    manager = next(c for c in _calls(run) if _dotted(c.func) == "CheckpointManager")
    assert _dotted(manager.args[1]) == "state", name
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "training_state"
                   for n in ast.walk(run)), name


@pytest.mark.parametrize("name", [n for n in SCRIPTS if "DDP" in n or "FSDP" in n])
def test_a_process_groups_script_leaves_it_on_every_way_out(name):
    """The device is bound before the group is made; the group is left in the ``finally`` of
    the ``try`` that holds the whole run, so an error and a stop leave it too."""
    main = _function(name, "main")
    called = _called(main)
    assert _first(called, "set_device_index") < _first(called, "init_process_group"), name
    tries = [n for n in main.body if isinstance(n, ast.Try)]
    assert len(tries) == 1 and _has(_called(ast.Module(tries[0].finalbody, [])),
                                    "destroy_process_group"), name
    assert _has(_called(ast.Module(tries[0].body, [])), "train" if name.startswith(
        "train") else "report"), name


# ------------------------------------------------------------------------ neighbour diffs
def _code(name: str) -> list[str]:
    """The script's code after its docstring, comments and blank lines out, each line stripped
    (``diff -w``: a process group's scripts hold their run one ``try`` deeper)."""
    src = _source(name)
    doc_end = ast.parse(src).body[0].end_lineno
    lines = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            lines.append((row, tok.start[1]))
    cut = dict(lines)
    out = []
    for number, line in enumerate(src.splitlines(), 1):
        if number <= doc_end:
            continue
        line = line[:cut[number]] if number in cut else line
        if line.strip():
            out.append(line.strip())
    return out


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
    """`diff -w` of two neighbouring scripts, docstrings and comments aside, is a handful of
    lines: the technique's."""
    changed = [ln for ln in difflib.unified_diff(_code(a), _code(b), lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    # Each count includes the precision decided in main() and handed to build() by name,
    # and what restore() loads by name: the technique's too.
    if b.startswith("train_DDP") and not a.startswith("train_DDP"):
        # DDP's recipe: the process group and its teardown, the wrapper and its comm hook,
        # the sampler, the counts' sum, the unwrapped weights (from DP: its wrapping, on CUDA
        # alone, out; its header's data_parallel, which says where no DataParallel is built).
        limit = 62 if a.startswith("train_DP") else 50
    elif b.startswith("train_FSDP") and a.startswith("train_DDP"):
        limit = 39  # another wrapper, its own skip of a micro-batch's reduction, its state
    elif b.startswith("train_DP") and not a.startswith("train_DP"):
        # DataParallel's wrapping, on CUDA alone; its precision asked of every GPU it uses.
        limit = 25
    else:
        # mixed: a scaler for fp16 alone; its policy, kept in the Technique for the header
        limit = 37 if b == "train_FSDP_mixed" else 23
    assert len(changed) <= limit, "\n".join(changed)


# ------------------------------------------------------------------------ comments
def _comments(name: str) -> list[tuple[int, str, bool]]:
    """(line, text, trailing: after code on its line) of each comment after the docstring."""
    src = _source(name)
    doc_end = ast.parse(src).body[0].end_lineno
    lines = src.splitlines()
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT and tok.start[0] > doc_end:
            row, col = tok.start
            found.append((row, tok.string.lstrip("#").strip(), bool(lines[row - 1][:col].strip())))
    return found


@pytest.mark.parametrize("name", TRAIN)
def test_comments_stand_above_their_lines(name):
    """Why-comments are block comments above the lines they explain (nanoGPT, imagenet):
    at most 15 % of a train script's code lines carry a trailing one."""
    trailing = sum(1 for _, _, after_code in _comments(name) if after_code)
    assert trailing <= 0.15 * len(_code(name)), (name, trailing, len(_code(name)))


@pytest.mark.parametrize("name", TRAIN)
def test_a_train_script_fits_170_lines_and_25_comments(name):
    """A script is read whole: at most 170 lines, docstring and comments included, and at
    most 25 comments, each a why said once above its line (a pitfall of the script's
    technique, not a restatement of the code or of a helper's docstring)."""
    src = _source(name)
    comments = sum(tok.type == tokenize.COMMENT
                   for tok in tokenize.generate_tokens(io.StringIO(src).readline))
    assert len(src.splitlines()) <= 170, (name, len(src.splitlines()))
    assert comments <= 25, (name, comments)


# Scripts that share a technique, whose comment may stand in each of them.
GROUPS = [set(n for n in TRAIN if n.startswith(("train_DDP", "train_FSDP"))),  # the group
          set(n for n in TRAIN if n.endswith(("GradScaler", "mixed"))),  # loss scaling
          set(n for n in TRAIN if n.endswith(("autocast", "GradScaler"))),
          set(n for n in TRAIN if n.endswith(("autocast", "GradScaler", "mixed"))),  # low precision
          set(n for n in TRAIN if n.startswith("train_DP") and not n.startswith("train_DDP"))]


def test_each_comment_is_said_once_where_it_teaches():
    """A comment stands in one script, or in the scripts of the technique it explains -- the
    combined scripts a copier takes carry their techniques' pitfalls (DDP's checklist, the
    scaler's): no comment text stands verbatim in more than 4 train scripts unless all of
    them share that technique. A comment about the run's plumbing is its helper's
    docstring, said once; the baseline's about the loop stand in train_without.py."""
    where = defaultdict(set)
    for name in TRAIN:
        for _, text, _ in _comments(name):
            where[text].add(name)
    spread = {text: names for text, names in where.items()
              if len(names) > 4 and not any(names <= group for group in GROUPS)}
    assert not spread, spread


# ------------------------------------------------------------------------ the import graph
def _project_modules() -> dict[str, ast.Module]:
    """Every module of AMP/ by its dotted name: the scripts, alexnet, ampkit and its packages."""
    return {".".join(p.relative_to(AMP_DIR).with_suffix("").parts).removesuffix(".__init__"):
            ast.parse(p.read_text()) for p in AMP_DIR.rglob("*.py")}


def _is_package(name: str) -> bool:
    return (AMP_DIR / name.replace(".", "/") / "__init__.py").exists()


def _imports(name: str, tree: ast.Module, modules: dict) -> set[str]:
    """The project modules ``name`` imports, anywhere in it (function-level imports too)."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # ``from PKG import MODULE`` imports the module; ``from MODULE import NAME`` MODULE
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _is_face(tree: ast.Module) -> bool:
    """A package's ``__init__`` that defines nothing: it hands on names it imports."""
    return all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr, ast.Assign)) and
               not (isinstance(n, ast.Assign) and any(getattr(t, "id", "") != "__all__"
                                                      for t in n.targets))
               for n in tree.body)


def _graph() -> tuple[dict, dict]:
    """The modules and their imports, an import of a package's face standing for the modules
    it hands on."""
    modules = _project_modules()
    raw = {n: _imports(n, tree, modules) for n, tree in modules.items()}
    faces = {n for n in modules if _is_package(n) and _is_face(modules[n])}

    def through(dep: str) -> set[str]:
        return set().union(*(through(d) for d in raw[dep])) if dep in faces else {dep}

    return modules, {n: set().union(*(through(d) for d in deps)) if deps else set()
                     for n, deps in raw.items() if n not in faces}


def _closure(name: str, graph: dict) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_cycle():
    _, graph = _graph()
    for name in graph:
        assert name not in _closure(name, graph), f"import cycle through {name}"


def test_the_shared_code_is_shallow():
    """ampkit's imports stand at most 5 floors deep: a module is one floor above the highest
    it imports, the ones that import nothing of the project on the ground floor."""
    _, graph = _graph()
    ampkit = {n: {d for d in deps if d.startswith("ampkit")} for n, deps in graph.items()
              if n.startswith("ampkit")}
    floors: dict[str, int] = {}

    def floor(name: str) -> int:
        if name not in floors:
            floors[name] = 1 + max((floor(d) for d in ampkit[name]), default=0)
        return floors[name]

    deepest = max(ampkit, key=floor)
    assert floor(deepest) <= 5, (deepest, floors)


def _layer(name: str) -> str:
    if name.startswith("ampkit"):
        return "ampkit"
    return "tools" if name.startswith("tools") else "scripts"


def test_imports_run_one_way_shared_code_beneath_tools_above():
    """The scripts and the tools (benchmark, compare and tools/) stand above the shared code
    (ampkit/), which imports nothing of them (alexnet.py included); no script imports tools."""
    _, graph = _graph()
    allowed = {"ampkit": {"ampkit"}, "tools": {"tools", "ampkit"},
               "scripts": {"scripts", "tools", "ampkit"}}
    wrong = sorted(f"{name} -> {dep}" for name, deps in graph.items() for dep in deps
                   if _layer(dep) not in allowed[_layer(name)])
    assert not wrong, wrong
    for name in TRAIN:
        assert not {n for n in _closure(name, graph) if _layer(n) != "ampkit"}, name


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


# ------------------------------------------------------------------------ the process group
# torch.distributed's collectives, and the functions of ampkit/distributed.py that make them
# (each a call that every rank must make).
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_to_all", "barrier",
               "broadcast", "broadcast_object_list", "gather_object", "monitored_barrier",
               "gather", "new_group", "recv", "reduce", "reduce_scatter", "scatter", "send",
               "max_over_ranks", "gather_from_ranks", "any_rank",
               "local_main_first", "rank_random_states",
               "before_epoch", "any_rank_asked", "after_step"}
# The modules whose calls every rank makes together, each saying so in its docstring; the
# rest of ampkit is single-process.
EVERY_RANK = {"engine", "meters", "checkpoint/manager", "run", "stop", "evaluate"}


def test_every_collective_is_in_the_scripts_or_the_process_groups_module():
    """torch.distributed is called from the scripts and ampkit/distributed.py alone (and
    ampkit/comm_hooks.py, which hands each bucket to PyTorch's own hooks, which DDP runs in
    every rank's backward); the
    modules that call distributed's collectives are the few that every rank runs together,
    and the plumbing (data, checkpoint files and writing, flags, logs, signals, the
    networks, precision, the device) makes none, so ``if rank == 0:`` around any of it
    cannot leave a peer waiting."""
    ampkit = AMP_DIR / "ampkit"
    callers = set()
    for path in sorted(ampkit.rglob("*.py")):
        rel = str(path.relative_to(ampkit).with_suffix(""))
        if rel in ("distributed", "comm_hooks"):
            continue
        assert "torch.distributed" not in path.read_text(), rel
        if set(_called(ast.parse(path.read_text()))) & COLLECTIVES or \
                {n.rpartition(".")[2] for n in _called(ast.parse(path.read_text()))} & COLLECTIVES:
            callers.add(rel)
    assert callers == EVERY_RANK, callers
    for rel in EVERY_RANK:
        assert "every rank" in ast.get_docstring(ast.parse((ampkit / f"{rel}.py").read_text()),
                                                 clean=True).lower() or any(
            "every rank" in (ast.get_docstring(n) or "").lower()
            for n in ast.walk(ast.parse((ampkit / f"{rel}.py").read_text()))
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))), rel
    comm_hook = next(n for n in ast.parse((ampkit / "comm_hooks.py").read_text()).body
                     if isinstance(n, ast.ClassDef) and n.name == "CommHook")
    hooks = {n.rpartition(".")[2] for n in _called(comm_hook)}
    assert not hooks & (COLLECTIVES - {"wait"}), hooks & COLLECTIVES


# ------------------------------------------------------------------------ helpers' inputs
# Parsing, the flags a checkpoint records and compares on a resume, and the eval scripts'
# set-up may read the parsed flags; every other helper takes named values.
TAKES_ARGS = {"flags.py": None, "checkpoint/files.py": {"args_to_plain"},
              "checkpoint/manager.py": {"__init__", "read_resumable"},
              "checkpoint/messages.py": {"mismatches"},
              # The eval scripts' set-up, which is their flags': one place for the three.
              "evaluate.py": {"__init__"}}
# Which flags were given is parsing's, and the resume's, which keeps a saved learning rate
# unless --lr was given.
READS_GIVEN = {"flags.py", "checkpoint/manager.py"}


def test_helpers_take_named_values_not_the_parsed_flags():
    ampkit = AMP_DIR / "ampkit"
    wrong = []
    for path in sorted(ampkit.rglob("*.py")):
        rel = str(path.relative_to(ampkit))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = {a.arg for a in node.args.args + node.args.kwonlyargs}
                allowed = rel in TAKES_ARGS and (TAKES_ARGS[rel] is None
                                                 or node.name in TAKES_ARGS[rel])
                if "args" in params and not allowed:
                    wrong.append(f"{rel}:{node.lineno} {node.name}")
            if isinstance(node, ast.Attribute) and node.attr == "given" \
                    and rel not in READS_GIVEN:
                wrong.append(f"{rel}:{node.lineno} .given")
    assert not wrong, wrong


# ------------------------------------------------------------------------ sizes and names
def test_modules_follow_concepts_not_a_line_count():
    """A module holds one concept, which fits in 400 lines; a package's modules are its
    parts. No module of ampkit is a sliver: under 60 lines, it is a package's face or a
    concept of its own (the run's random streams, the exceptions, where the run stands,
    the profiler)."""
    sizes = {str(p.relative_to(AMP_DIR)): len(p.read_text().splitlines())
             for p in AMP_DIR.rglob("*.py")}
    assert not {f: n for f, n in sizes.items() if n > 400}
    slivers = {f for f, n in sizes.items() if f.startswith("ampkit") and n < 60
               and not f.endswith("__init__.py")}
    assert slivers <= {"ampkit/randomness.py", "ampkit/errors.py", "ampkit/checkpoint/progress.py",
                       "ampkit/profiler.py"}, slivers


def test_no_long_functions_or_classes():
    """A function fits a screen (60 lines), a class three; a train script's ``train()``, its
    whole run in view (set-up, epochs, end), at most 100."""
    def limit(name, node):
        return 100 if name.startswith("train_") and node.name == "train" else 60
    too_long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
                for name, tree in _project_modules().items() for node in ast.walk(tree)
                if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and node.end_lineno - node.lineno + 1 > limit(name, node))
                or (isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 180)]
    assert not too_long, too_long


def test_one_name_for_one_idea():
    """Retired names do not come back: the bare network is ``network`` (``Parts.network``), the
    wrapped one ``model``; the compute dtype is ``amp_dtype``; unreadable images are not
    "skipped" steps; a step's micro-batches are not a "window"."""
    retired = re.compile(r"\b(compute_dtype|autocast_dtype|EpochStats|EpochSums|EpochFigures|"
                         r"fits_in_memory|take_skipped|report_skipped|make_parts|_cast|Parts|"
                         r"SavePolicy|checkpoint_state|RESUME_ONLY|torchrun_env|elastic_store|"
                         r"single_process_device|process_device|start_at|agree_on_resumed)\b|"
                         r"\bwindows?\b|parts\.model\b")
    found = [f"{p.relative_to(AMP_DIR)}:{i}" for p in sorted(AMP_DIR.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if retired.search(line)]
    assert not found, found


def test_one_place_says_whether_torchrun_restarted_the_run():
    """torchrun's restart count is read by ``distributed.torchrun_attempt`` alone: the resume
    and the group's store cannot then disagree on whether this is a restart."""
    found = [f"{p.relative_to(AMP_DIR)}:{i}" for p in sorted(AMP_DIR.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "TORCHELASTIC_RESTART_COUNT" in line]
    assert found == ["ampkit/distributed.py:" + found[0].split(":")[1]], found


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


def test_the_code_runs_on_the_lowest_python_the_readme_states():
    """The README states the lowest Python; vermin finds every syntax and standard-library
    use newer than it (``hashlib.file_digest`` is 3.11's, say) in the code users run and
    the code that tests it."""
    import sys

    from conftest import REPO_ROOT
    from helpers.processes import run

    stated = re.search(r"Requires Python >= 3\.(\d+)", (REPO_ROOT / "README.md").read_text())
    assert stated, "the README states the lowest Python it runs on"
    lowest = f"3.{stated[1]}"
    assert sys.version_info >= (3, int(stated[1]))
    vermin = "import sys; from vermin.main import main; sys.exit(main())"
    found = run([sys.executable, "-c", vermin, f"--target={lowest}-", "--violations",
                 "--no-tips", "--eval-annotations", "AMP", "tests", "checks"])
    assert found.returncode == 0, found.describe()
