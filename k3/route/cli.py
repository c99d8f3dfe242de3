"""`k3 route`: the fleet router in front of `k3 serve` replicas (docs/serving.md "The fleet router").

    k3 route --replica http://10.0.0.1:8000 --replica http://10.0.0.2:8000 --port 9000

Every `RouterConfig` field is a flag (`--health-interval`, `--short-budget-tokens`, …). The router loads no
model: it needs only the replicas' URLs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

FIELD_HELP = {
    "balance": "affinity: a conversation's turns go to its ring primary; least-loaded: fewest in flight (a plain "
               "load balancer, no affinity)",
    "session_header": "a request header naming the conversation (before prompt_cache_key and the prefix hash)",
    "prefix_chars": "a completions prompt is keyed by this many first characters",
    "vnodes": "virtual nodes per replica on the hash ring",
    "health_interval": "seconds between health checks of every replica",
    "health_timeout": "seconds a health check may take",
    "fail_after": "failed health checks in a row that mark a replica down",
    "connect_timeout": "seconds to connect to a replica before trying the next",
    "read_timeout": "seconds between bytes of a replica's response",
    "long_threshold": "estimated tokens (prompt + max_tokens) above which a request is of the long class",
    "short_budget_tokens": "estimated tokens the short class may have in flight",
    "short_max_requests": "short requests in flight",
    "long_budget_tokens": "estimated tokens the long class may have in flight",
    "long_max_requests": "long requests in flight",
    "bytes_per_token": "body bytes per prompt token, for the estimate",
    "default_max_tokens": "completion budget assumed when a request sets none (k3 serve's default)",
    "retry_after": "seconds a 429/503 asks the client to wait",
    "max_request_bytes": "larger request bodies get 413",
}


def add_route_parser(subparsers) -> None:
    """Add `route` to `k3`'s subcommands."""
    from k3.route.config import RouterConfig

    p = subparsers.add_parser("route", help="fleet router: conversation affinity, failover and admission over "
                                            "k3 serve replicas")
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a k3 serve base URL (http://host:port), once per replica")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    hints = typing.get_type_hints(RouterConfig)
    for f in dataclasses.fields(RouterConfig):
        if f.name == "replicas":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_ = f"{FIELD_HELP[f.name]} (default {f.default})"
        if typing.get_origin(kind) is typing.Literal:
            p.add_argument(flag, choices=typing.get_args(kind), default=f.default, help=help_)
        else:
            p.add_argument(flag, type=kind, default=f.default, help=help_)
    p.set_defaults(func=cmd_route)


def cmd_route(args: argparse.Namespace) -> int:
    import uvicorn

    from k3.route.app import create_router_app
    from k3.route.config import RouterConfig

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig) if f.name != "replicas"}
    try:
        config = RouterConfig(replicas=args.replica, **fields)
    except ValueError as e:
        print(f"k3 route: {e}", file=sys.stderr)
        return 2
    app = create_router_app(config)
    print(f"# routing http://{args.host}:{args.port}/v1 over {len(config.replicas)} replicas "
          f"({config.balance}): {', '.join(config.replicas)}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
