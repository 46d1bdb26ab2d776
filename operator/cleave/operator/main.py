"""``cleave operator``: run the LLMService controller with kopf."""

from __future__ import annotations

import argparse
import logging
from typing import Any


def add_operator_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("operator", help="run the Kubernetes operator for LLMService resources",
                       description="Reconcile LLMService custom resources into Deployments, "
                                   "Services and a Redis KV store (kopf).")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[],
                       help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="watch every namespace (the default when none is given)")
    p.add_argument("--standalone", action="store_true", default=True,
                   help="no peering with other operator instances (one replica)")
    p.add_argument("--liveness", default=None, metavar="URL",
                   help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--debug", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run_operator)


def _load_kube_config() -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]


def run_operator(args: argparse.Namespace) -> int:
    import kopf

    import cleave.operator.handlers  # noqa: F401  (registers the handlers)

    level = logging.DEBUG if args.debug else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s operator %(levelname)s %(message)s")
    _load_kube_config()
    options: dict[str, Any] = {"standalone": args.standalone,
                               "liveness_endpoint": args.liveness}
    if args.namespace:
        options["namespaces"] = args.namespace
    else:
        options["clusterwide"] = True
    kopf.run(**options)
    return 0
