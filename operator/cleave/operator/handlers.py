"""kopf handlers: thin wrappers that run one level-based reconcile and report it.

Every trigger (create, update, resume after an operator restart, a periodic timer) does the
same thing, so missed or repeated events cannot leave a service half-built. A spec the
operator cannot honour becomes a Degraded condition, never a crash loop. Services with a role
to autoscale also get a daemon: the autoscaler loop (``autoscaler.controller``).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import aiohttp
import kopf
from kubernetes import client

from cleave.autoscaling import metrics
from cleave.operator.autoscaler.controller import ServiceAutoscaler
from cleave.operator.kube import GROUP, PLURAL, VERSION, Kube
from cleave.operator.reconcile import reconcile
from cleave.operator.spec import SpecError, parse_spec
from cleave.operator.status import reconciled_part

# How often children are re-compared (pods turn ready, someone edits a child by hand).
RECHECK_SECONDS = float(os.environ.get("CLEAVE_RECHECK_SECONDS", "30"))
# Unset: each service's spec.autoscaling.intervalSeconds; > 0: that interval for every
# service (tests); 0: no autoscaler loop at all.
AUTOSCALE_SECONDS = os.environ.get("CLEAVE_AUTOSCALE_SECONDS")
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
    if reconciled_part(body.get("status") or {}) != outcome.status:
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


def _autoscaled(body: kopf.Body, **_: Any) -> bool:
    """Whether the Cleave autoscaler owns a role of this service (the spec's own rule).
    kopf starts the loop when this turns true and stops it when it turns false, so External,
    Disabled and unreadable services never have one."""
    try:
        return bool(parse_spec(body).autoscaled_roles())
    except SpecError:
        return False


async def autoscale(*, body: kopf.Body, stopped: kopf.DaemonStopped,
                    logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any) -> None:
    """The service's autoscaler loop: kopf gives the daemon a body that follows the object,
    so a spec change (targets, dryRun, interval) applies from the next tick on."""
    meta = body["metadata"]
    loop = ServiceAutoscaler(kube())

    def post_event(reason: str, message: str) -> None:
        kopf.event(body, type="Normal", reason=reason, message=message)

    try:
        async with aiohttp.ClientSession() as session:
            while not stopped:
                wait = 5.0
                try:
                    wait = await loop.run_once(copy.deepcopy(dict(body)), session,
                                               time.monotonic(), post_event)
                except Exception:  # one failed tick (API down) must not end the loop
                    logger.exception("autoscaler tick failed")
                await stopped.wait(wait)
    finally:
        metrics.forget(meta["name"], meta["namespace"])


if AUTOSCALE_SECONDS is None or float(AUTOSCALE_SECONDS) > 0:
    kopf.daemon(GROUP, VERSION, PLURAL, when=_autoscaled,
                cancellation_timeout=10.0)(autoscale)
