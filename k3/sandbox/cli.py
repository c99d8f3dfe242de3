"""`k3 sandbox ...`: serve the API, build templates, probe the host, list or kill sandboxes.
`k3.cli` wires it in with `add_sandbox_parser(subparsers)`.

    k3 sandbox serve --port 49999 [--api-key KEY] [--state-dir DIR] [--memory-mb 512 --cpus 1 --pids 256]
    k3 sandbox template build [--from ROOT_DIR] [--name base]
    k3 sandbox template list
    k3 sandbox probe
    k3 sandbox list | kill ID... | kill --all
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def _config(args):
    from k3.sandbox.manager import SandboxConfig

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(SandboxConfig)
             if getattr(args, f.name, None) is not None}
    return SandboxConfig(**given)


def _manager(args):
    from k3.sandbox.manager import Manager

    return Manager(_config(args))


def cmd_serve(args) -> int:
    import uvicorn

    from k3.sandbox.server import create_app

    manager = _manager(args)
    tid = manager.ensure_template("base")
    print(f"k3 sandbox: template base={tid}, {len(manager.list())} sandboxes recovered, state in {manager.dir}; "
          f"point the e2b SDK here with E2B_API_URL=E2B_SANDBOX_URL=http://{args.host}:{args.port}", file=sys.stderr)
    uvicorn.run(create_app(manager, api_key=args.api_key), host=args.host, port=args.port, log_level=args.log_level)
    manager.close()
    return 0


def cmd_template_build(args) -> int:
    from k3.sandbox.manager import Manager
    from k3.sandbox.template import NAME, build_dir_template, build_host_template

    manager = Manager(_config(args))
    if not NAME.fullmatch(args.name):
        raise ValueError(f"template name {args.name!r}: letters, digits, '.', '_', '-'")
    if args.src:
        tid = build_dir_template(manager.templates, Path(args.src), args.name, manager.uid, manager.gid)
    else:
        tid = build_host_template(manager.templates, manager.uid, manager.gid, args.name)
    print(json.dumps({"name": args.name, "templateID": tid, "root": str(manager.templates.root(tid))}))
    return 0


def cmd_template_list(args) -> int:
    print(json.dumps(_manager(args).templates.list(), indent=1))
    return 0


def cmd_probe(args) -> int:
    from k3.sandbox import probe

    report = probe.report()
    for name, p in report.items():
        print(f"{name:8s} {'ok ' if p.ok else 'no '} {p.reason}")
    return 0 if report["bwrap"] and report["overlay"] else 1


def cmd_list(args) -> int:
    for s in _manager(args).list():
        print(json.dumps({"sandboxID": s.id, "state": s.state, "template": s.template, "layers": len(s.layers),
                          "metadata": s.metadata}))
    return 0


def cmd_kill(args) -> int:
    manager = _manager(args)
    ids = [s.id for s in manager.list()] if args.all else args.ids
    for sid in ids:
        manager.kill(sid)
    print(f"killed {len(ids)} sandboxes")
    return 0


def add_sandbox_parser(subparsers) -> None:
    p = subparsers.add_parser("sandbox", help="agent sandboxes: E2B-compatible server, templates, probes")
    sub = p.add_subparsers(dest="sandbox_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--state-dir", type=Path, help="default $K3_SANDBOX_DIR, /var/lib/k3-sandbox as root")

    q = sub.add_parser("serve", help="serve the E2B-compatible API (control + data plane) on one port")
    common(q)
    q.add_argument("--host", default="127.0.0.1")
    q.add_argument("--port", type=int, default=49999)
    q.add_argument("--api-key", help="require X-API-Key on the control plane")
    q.add_argument("--log-level", default="warning")
    for name in ("memory_mb", "pids", "cpus", "timeout", "command_timeout", "max_output_bytes", "max_file_bytes"):
        kind = float if name in ("cpus", "timeout", "command_timeout") else int
        q.add_argument("--" + name.replace("_", "-"), type=kind, help="default: SandboxConfig." + name)
    q.set_defaults(func=cmd_serve)

    t = sub.add_parser("template", help="build or list templates")
    tsub = t.add_subparsers(dest="template_command", required=True)
    q = tsub.add_parser("build", help="build a template (default: 'base' from this host's shell and Python)")
    common(q)
    q.add_argument("--from", dest="src", help="a root folder (debootstrap'd Debian, unpacked image) to copy")
    q.add_argument("--name", default="base")
    q.set_defaults(func=cmd_template_build)
    q = tsub.add_parser("list", help="cached templates")
    common(q)
    q.set_defaults(func=cmd_template_list)

    q = sub.add_parser("probe", help="which kernel features and tools this host has")
    q.set_defaults(func=cmd_probe)
    q = sub.add_parser("list", help="sandboxes in the state folder")
    common(q)
    q.set_defaults(func=cmd_list)
    q = sub.add_parser("kill", help="kill sandboxes (by id, or --all)")
    common(q)
    q.add_argument("ids", nargs="*")
    q.add_argument("--all", action="store_true")
    q.set_defaults(func=cmd_kill)


def main(argv: list[str] | None = None) -> int:
    """`python -m k3.sandbox.cli ...`, the same as `k3 sandbox ...`."""
    parser = argparse.ArgumentParser(prog="k3")
    add_sandbox_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sandbox", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
