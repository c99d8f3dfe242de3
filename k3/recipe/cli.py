"""`k3 recipe run NAME|FILE --out DIR [--resume]`, `k3 recipe report DIR [--readme FILE]`, `k3 recipe list`: thin
front ends over `k3.recipe.run` and `k3.recipe.report` (docs/recipe.md)."""

from __future__ import annotations

import sys
from pathlib import Path


def cmd_recipe_run(args) -> int:
    from k3.recipe.recipe import load_recipe
    from k3.recipe.run import start_recipe
    from k3.recipe.view import StageView

    out = Path(args.out)
    recipe = load_recipe(args.recipe) if args.recipe else None
    if recipe is None and not args.resume:
        raise ValueError("name a recipe (k3 recipe list), or give --resume to continue the run in --out")
    code = start_recipe(recipe, out, args.resume, StageView())
    if (out / "recipe.json").is_file() and not args.no_report:
        from k3.recipe.report import write_report

        md, html = write_report(out)
        print(f"report card: {md} and {html}", file=sys.stderr)
    if code == 0:
        from k3.recipe.report import serve_commands

        for command in serve_commands(out):
            print(f"serve the model{' with speculative decoding' if '--draft' in command else ''}: {command}")
    elif code >= 128:
        print(f"continue with: k3 recipe run --out {out} --resume", file=sys.stderr)
    return code


def cmd_recipe_report(args) -> int:
    from k3.recipe.report import update_readme, write_report

    md, html = write_report(Path(args.dir))
    print(f"wrote {md} and {html}")
    for readme in args.readme or []:
        update_readme(Path(args.dir), Path(readme))
        print(f"updated the recipe block of {readme}")
    return 0


def cmd_recipe_list(args) -> int:
    from k3.recipe.recipe import list_recipes, load_recipe

    for name, about in list_recipes().items():
        recipe = load_recipe(name)
        minutes = sum(s.minutes for s in recipe.stages)
        print(f"{name:8s} {len(recipe.stages):2d} stages, ≈{minutes:.0f} min   {about}")
    return 0


def add_recipe_parser(sub) -> None:
    p = sub.add_parser("recipe", help="the whole lifecycle in one command: pre-train, SFT, RL, MOPD with QAT, draft, "
                                      "eval, serve; with a report card",
                       epilog="Recipes, stages, resume rules and the report card: docs/recipe.md.")
    rsub = p.add_subparsers(dest="recipe_command", required=True)
    r = rsub.add_parser("run", help="run a recipe's stages into DIR (DIR/<stage>/, DIR/recipe.json, DIR/report.md)",
                        epilog="Ctrl-C or SIGTERM: the running stage stops with a checkpoint; --resume continues at "
                               "the first unfinished stage. A failing stage stops the recipe with its own message "
                               "and exit code.")
    r.add_argument("recipe", nargs="?", help="a shipped recipe (k3 recipe list) or a .toml file; with --resume it may "
                                             "be left out (the run's own recipe is in DIR/recipe.json)")
    r.add_argument("--out", required=True, help="the recipe's folder")
    r.add_argument("--resume", action="store_true", help="continue the run in --out at its first unfinished stage")
    r.add_argument("--no-report", action="store_true", help="do not write the report card at the end")
    r.set_defaults(func=cmd_recipe_run)
    r = rsub.add_parser("report", help="(re)write DIR/report.md and DIR/report.html from the stages' outputs")
    r.add_argument("dir")
    r.add_argument("--readme", action="append", metavar="FILE",
                   help="also replace the <!-- recipe: NAME --> block of FILE with the headline numbers (repeatable)")
    r.set_defaults(func=cmd_recipe_report)
    r = rsub.add_parser("list", help="the shipped recipes")
    r.set_defaults(func=cmd_recipe_list)
