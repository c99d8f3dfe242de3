"""A recipe: a small TOML file listing the stages of a model's lifecycle, each the `k3` commands a user would type.

    name = "tiny"
    about = "…"
    [env]                                   # environment of every command (strings)
    OMP_NUM_THREADS = "1"
    [[stage]]
    name = "pretrain"                       # its folder: DIR/pretrain
    kind = "pretrain"                       # what the report reads from it (KINDS)
    minutes = 14                            # estimate, for the progress view's remaining time
    run = ["k3 train --preset tiny --out {out} --max-steps 300 --auto-resume"]

In a command, `{out}` is the stage's folder, `{NAME}` another stage's folder, `{dir}` the recipe's output folder,
`{stdlib}` this Python's standard library (the sources `k3 train` reads by default).
A `run` entry is a command line, or `{ set_json = FILE, values = { "a.b" = v } }` (set keys of a JSON file, the
dotted key a path into it: how a user turns on a config field such as QAT), or `{ serve = MODEL, requests = N,
max_tokens = M, args = "…", file = "serve.json" }` (start `k3 serve` on MODEL, time N chat requests against it, stop
it). The whole format is documented in docs/recipe.md.
"""

from __future__ import annotations

import re
import shlex
import sysconfig
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

# what the report reads from a stage's folder (docs/recipe.md, "The report card")
KINDS = ("pretrain", "sft-data", "sft", "rl", "qat", "mopd", "export", "draft", "eval", "serve", "other")
# a stage of a run-folder command is complete when these exist (its run.json and a committed checkpoint)
RUN_FOLDER_OUTPUTS = ("run.json", "checkpoints/step_*/COMMITTED")
_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
_PLACEHOLDER = re.compile(r"\{([a-z][a-z0-9-]*)\}")


@dataclass
class Stage:
    name: str
    kind: str
    run: list  # command strings and action tables, in order
    minutes: float = 1.0
    about: str = ""
    outputs: tuple[str, ...] = RUN_FOLDER_OUTPUTS
    resume: str = ""  # flags added to the (single) command when the stage continues a stopped run
    of: str | None = None  # the stage whose model this one measures, exports or serves
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Recipe:
    name: str
    about: str
    stages: list[Stage]
    env: dict[str, str]
    text: str  # the TOML it was read from (kept in recipe.json, so a resume runs the same recipe)
    readme: str = ""  # the headline for README.md's block

    def expand(self, text: str, root: Path, stage: Stage) -> str:
        """`text` with {out}, {dir}, {stdlib} and {STAGE} replaced by folders (quoted for the shell split that
        follows)."""

        def folder(m: re.Match) -> str:
            key = m.group(1)
            if key == "stdlib":
                return shlex.quote(sysconfig.get_paths()["stdlib"])
            path = root / stage.name if key == "out" else root if key == "dir" else root / key
            return shlex.quote(str(path))

        return _PLACEHOLDER.sub(folder, text)


def recipe_dir():
    return resources.files("k3.recipe") / "recipes"


def list_recipes() -> dict[str, str]:
    """{name: about} of the recipes shipped with k3."""
    out = {}
    for f in sorted(recipe_dir().iterdir(), key=lambda f: f.name):
        if f.name.endswith(".toml"):
            out[f.name[:-5]] = parse_recipe(f.read_text(), f.name).about
    return out


def load_recipe(name_or_file: str) -> Recipe:
    """A shipped recipe by name (`tiny`), or a TOML file. Raises ValueError naming the problem."""
    path = Path(name_or_file)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise ValueError(f"no recipe file {path}")
        return parse_recipe(path.read_text(), str(path))
    shipped = recipe_dir() / f"{name_or_file}.toml"
    if not shipped.is_file():
        raise ValueError(f"no recipe named {name_or_file!r}; shipped: {', '.join(list_recipes())} "
                         f"(or give a .toml file)")
    return parse_recipe(shipped.read_text(), shipped.name)


def parse_recipe(text: str, where: str = "recipe") -> Recipe:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: not valid TOML ({e})") from None
    unknown = set(data) - {"name", "about", "env", "stage", "readme"}
    if unknown:
        raise ValueError(f"{where}: unknown top-level keys {sorted(unknown)}")
    if not isinstance(data.get("name"), str):
        raise ValueError(f"{where}: needs a name")
    raw = data.get("stage")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: needs at least one [[stage]]")
    stages, names = [], set()
    for i, s in enumerate(raw):
        at = f"{where}: stage {i + 1}"
        unknown = set(s) - {"name", "kind", "run", "minutes", "about", "outputs", "resume", "of", "env"}
        if unknown:
            raise ValueError(f"{at}: unknown keys {sorted(unknown)}")
        name = s.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or name in ("out", "dir", "stdlib", "logs"):
            raise ValueError(f"{at}: name must be lower-case letters, digits and '-' (not out, dir, stdlib, logs), got "
                             f"{name!r}")
        if name in names:
            raise ValueError(f"{at}: a second stage named {name!r}")
        kind = s.get("kind", "other")
        if kind not in KINDS:
            raise ValueError(f"{at} ({name}): kind must be one of {', '.join(KINDS)}, got {kind!r}")
        run = s.get("run")
        if not isinstance(run, list) or not run:
            raise ValueError(f"{at} ({name}): run must be a non-empty list of commands")
        for entry in run:
            _check_entry(entry, f"{at} ({name})", names | {"out", "dir", "stdlib"})
        if s.get("resume") and len(run) != 1:
            raise ValueError(f"{at} ({name}): resume applies to a stage of one command")
        of = s.get("of")
        if of is not None and of not in names:
            raise ValueError(f"{at} ({name}): of names no earlier stage: {of!r}")
        minutes = s.get("minutes", 1.0)
        if not isinstance(minutes, (int, float)) or minutes < 0:
            raise ValueError(f"{at} ({name}): minutes must be a number ≥ 0")
        outputs = s.get("outputs", list(RUN_FOLDER_OUTPUTS))
        if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
            raise ValueError(f"{at} ({name}): outputs must be a list of paths (globs) inside the stage's folder")
        stages.append(Stage(name, kind, run, float(minutes), s.get("about", ""), tuple(outputs), s.get("resume", ""),
                            of, {k: str(v) for k, v in s.get("env", {}).items()}))
        names.add(name)
    env = {k: str(v) for k, v in data.get("env", {}).items()}
    return Recipe(data["name"], data.get("about", ""), stages, env, text, data.get("readme", ""))


def _check_entry(entry, at: str, known: set[str]) -> None:
    if isinstance(entry, str):
        words = shlex.split(entry)
        if not words or words[0] != "k3":
            raise ValueError(f"{at}: a command must start with k3, got {entry!r}")
        texts = [entry]
    elif isinstance(entry, dict) and "set_json" in entry:
        if set(entry) != {"set_json", "values"} or not isinstance(entry["values"], dict):
            raise ValueError(f"{at}: set_json takes a file and values = {{ key = value }}")
        texts = [entry["set_json"]]
    elif isinstance(entry, dict) and "serve" in entry:
        if set(entry) - {"serve", "requests", "max_tokens", "args", "file"}:
            raise ValueError(f"{at}: serve takes a model, requests, max_tokens, args and file")
        texts = [entry["serve"], entry.get("args", "")]
    else:
        raise ValueError(f"{at}: a run entry is a command line, {{ set_json = … }} or {{ serve = … }}, got {entry!r}")
    for text in texts:
        for ref in _PLACEHOLDER.findall(text):
            if ref not in known:
                raise ValueError(f"{at}: {{{ref}}} names no earlier stage")
