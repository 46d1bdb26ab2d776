"""``cleave operator``: run the LLMService controller with kopf."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

DEFAULT_METRICS_PORT = 9090


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
    p.add_argument("--metrics-port", type=int, metavar="PORT", default=None,
                   help="serve the operator's Prometheus metrics (the autoscaler's desired "
                        "replicas and decisions) on this port, 0 for none (default "
                        f"$CLEAVE_OPERATOR_METRICS_PORT or {DEFAULT_METRICS_PORT})")
    p.add_argument("--debug", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run_operator)


def _load_kube_config() -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]


def _metrics_port(args: argparse.Namespace) -> int:
    if args.metrics_port is not None:
        port, where = args.metrics_port, "--metrics-port"
    else:
        where = "CLEAVE_OPERATOR_METRICS_PORT"
        raw = os.environ.get(where, str(DEFAULT_METRICS_PORT))
        try:
            port = int(raw)
        except ValueError:
            raise SystemExit(f"{where} must be a port number, got {raw!r}") from None
    if not 0 <= port <= 65535:
        raise SystemExit(f"{where} must be 0..65535, got {port}")
    return int(port)


def run_operator(args: argparse.Namespace) -> int:
    metrics_port = _metrics_port(args)
    import kopf

    import cleave.operator.handlers  # noqa: F401  (registers the handlers)

    level = logging.DEBUG if args.debug else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s operator %(levelname)s %(message)s")
    _load_kube_config()
    if metrics_port:
        from cleave.autoscaling.metrics_server import start_metrics_server

        start_metrics_server(metrics_port)
        logging.getLogger("cleave.operator").info(
            "operator metrics on http://0.0.0.0:%d/metrics", metrics_port)
    options: dict[str, Any] = {"standalone": args.standalone,
                               "liveness_endpoint": args.liveness}
    if args.namespace:
        options["namespaces"] = args.namespace
    else:
        options["clusterwide"] = True
    kopf.run(**options)
    return 0
