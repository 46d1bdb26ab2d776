"""kopf handlers: thin wrappers that run one level-based reconcile and report it.

Every trigger (create, update, resume after an operator restart, a periodic timer) does the
same thing, so missed or repeated events cannot leave a service half-built. A spec the
operator cannot honour becomes a Degraded condition, never a crash loop.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf
from kubernetes import client

from cleave.operator.kube import GROUP, PLURAL, VERSION, Kube
from cleave.operator.reconcile import reconcile

# How often children are re-compared (pods turn ready, someone edits a child by hand).
RECHECK_SECONDS = float(os.environ.get("CLEAVE_RECHECK_SECONDS", "30"))
_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube(client.ApiClient())
    return _kube


def use_api_client(api_client: client.ApiClient) -> None:
    """Point the handlers at a given API (tests, or a non-default kubeconfig)."""
    global _kube
    _kube = Kube(api_client)


def _run(body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    k = kube()
    outcome = reconcile(k, dict(body))
    for action, child in outcome.actions:
        kopf.event(body, type="Normal", reason=action.capitalize(),
                   message=f"{action} {child}")
    if outcome.error:
        kopf.event(body, type="Warning", reason="SpecInvalid", message=outcome.error)
        logger.warning("spec cannot be honoured: %s", outcome.error)
    current = dict(body.get("status") or {})
    current.pop("kopf", None)
    if current != outcome.status:
        meta = body["metadata"]
        k.patch_status(meta["namespace"], meta["name"], outcome.status)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf would turn its log lines into Events, one per handler run, timers included: an
    # idle service would then cost a write per recheck. Events are posted explicitly instead,
    # for what the operator does (created or patched a child, refused a spec).
    settings.posting.loggers = False


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_change(*, body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any],
              **_: Any) -> None:
    _run(body, logger)


def recheck(*, body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any],
            **_: Any) -> None:
    """Children change without the LLMService changing (pods become ready, get deleted)."""
    _run(body, logger)


if RECHECK_SECONDS > 0:  # 0 turns rechecks off (then kopf needs no finalizer on services)
    kopf.timer(GROUP, VERSION, PLURAL, interval=RECHECK_SECONDS,
               initial_delay=RECHECK_SECONDS)(recheck)
