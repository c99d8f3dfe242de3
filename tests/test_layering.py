"""The package layering holds: each k3 package imports only the packages `ALLOWED` lists for it, lazy imports
included, and never another package's private names. `cli` and `hf` are front ends and may import anything.

    cli, hf                                   front ends
    recipe       route                        the lifecycle in one command (`k3` subprocesses); the fleet router
    eval         posttrain                    evaluation and ablations; SFT, RL, MOPD
    serve                                     the server: one device, tensor/expert parallel, prefill/decode roles
    spec                                      the speculative draft, its training and the engine's drafter
    train        sandbox
    parallel                                  training and serving parallelism applied to a built model and engine
    convert
    checkpoint
    vision
    infer        optim        chat          runfolder
    model                     tokenizer
    ops          config                                     core
"""

from __future__ import annotations

import ast
from graphlib import TopologicalSorter
from pathlib import Path

import k3

ROOT = Path(k3.__file__).parent

# package -> the k3 packages it may import (top-level modules count as packages)
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "tokenizer": set(),
    "ops": set(),
    "chat": {"tokenizer"},
    "model": {"config", "ops"},
    "optim": {"config", "model", "ops"},
    "checkpoint": {"config", "model", "tokenizer", "vision"},  # load_trained builds a multimodal run's model
    "infer": {"config", "model", "ops"},
    # parallel: serving runs the engine SPMD over a sharded model, read slice by slice from a checkpoint or release
    "parallel": {"config", "model", "ops", "optim", "infer", "checkpoint", "convert"},
    "runfolder": set(),  # run-folder lock, stop signals, one-line failures: shared by the long-running commands
    "train": {"config", "model", "ops", "optim", "parallel", "checkpoint", "tokenizer", "runfolder", "vision"},
    "convert": {"config", "model", "ops", "checkpoint"},
    "vision": {"config", "model", "ops", "tokenizer", "chat", "runfolder"},  # composes the text model, one way
    # serve: images in chat requests are preprocessed and rendered by vision; the engine gets MediaInputs
    "serve": {"config", "model", "checkpoint", "infer", "tokenizer", "chat", "vision", "spec",  # spec: --draft
              "parallel"},  # --tensor-parallel, --role (k3.serve.across)
    "posttrain": {"config", "model", "ops", "optim", "parallel", "checkpoint", "tokenizer", "runfolder", "train",
                  "infer", "chat", "vision", "sandbox"},  # sandbox: the code environment's program runner
    "route": {"serve"},  # the fleet router: serve's error bodies and request limit; it loads no model
    "sandbox": set(),  # stands alone: agents' execution environment, also usable without the model
    # speculative decoding's draft and its training: a frozen target, the training pieces, the plain generation loop
    "spec": {"config", "model", "ops", "optim", "checkpoint", "tokenizer", "runfolder", "train", "infer"},
    # evaluation and ablations: models through the server or the engine, programs in the sandbox, ablation runs
    # through the training loop
    "eval": {"config", "model", "ops", "optim", "infer", "serve", "chat", "checkpoint", "tokenizer", "sandbox",
             "train", "runfolder"},
    # the lifecycle in one command: every stage is a `k3` subprocess; only the run folder's lock is shared
    "recipe": {"runfolder"},
}
FRONT_ENDS = {"cli", "hf"}


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return rel.parts[0]


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported k3 package, line) for every import in the file, at any depth (lazy imports count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "k3" else [f"k3.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}:{node.lineno}: use absolute imports (from k3.… import …)")
        else:
            continue
        found += [(n.split(".")[1], node.lineno) for n in names if n.startswith("k3.")]
    return found


def test_every_package_is_placed():
    packages = {_package(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert packages <= set(ALLOWED) | FRONT_ENDS, f"place new packages in ALLOWED: {packages - set(ALLOWED)}"


def test_allowed_layering_has_no_cycle():
    tuple(TopologicalSorter(ALLOWED).static_order())  # raises CycleError


def test_packages_import_only_below_them():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        src = _package(path)
        if src in FRONT_ENDS or src == "__init__":
            continue
        for dst, line in _imports(path):
            if dst != src and dst not in ALLOWED[src]:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {src} imports {dst}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _eager_imports(path: Path) -> set[str]:
    """k3 modules imported when `path` is imported: top-level statements only (no function bodies, no
    `if TYPE_CHECKING:`), relative imports resolved; `from pkg import mod` counts as `pkg.mod` when it is one."""
    found = set()
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    modules = {_module_name(p) for p in ROOT.rglob("*.py")}
    return {m for m in found if m in modules}


def test_no_import_cycle_between_modules():
    graph = {_module_name(p): _eager_imports(p) for p in ROOT.rglob("*.py")}
    for module, deps in graph.items():
        # a package imports its own submodules from __init__: not a cycle through the package
        graph[module] = {d for d in deps if not module.startswith(d + ".")} if module != "k3" else set()
    tuple(TopologicalSorter(graph).static_order())  # raises CycleError naming the cycle


def test_no_private_names_across_packages():
    """A package uses another's public names only: `from k3.optim.muon import _helper` elsewhere is refused."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        src = _package(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("k3."):
                dst = node.module.split(".")[1]
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if dst != src and private:
                    wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {private} from {node.module}")
    assert not wrong, "private names imported across packages:\n" + "\n".join(wrong)
