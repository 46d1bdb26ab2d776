"""Service discovery, as CoreDNS with the endpoints controller would answer it, in hosts files.

A Service with a selector resolves to the IPs of its ready pods (all running ones with
``publishNotReadyAddresses``), headless or not: there are no virtual IPs, so a client
connects to a pod directly and the Service's ``port`` must equal its ``targetPort``. Names:
``svc.ns.svc.cluster.local``, ``svc.ns.svc``, ``svc.ns`` and, in the same namespace, ``svc``;
a pod with ``hostname`` and ``subdomain`` (a StatefulSet's) also as ``host.svc.ns...``; and
``kubernetes.default.svc`` is the API proxy on the bridge.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .controllers import is_ready

Obj = dict[str, Any]


class Record(NamedTuple):
    namespace: str
    short: str  # the name as seen from the same namespace
    ip: str
    names: list[str]  # the names valid from any namespace


def _names(base: str) -> list[str]:
    return [f"{base}.svc.cluster.local", f"{base}.svc", base]


def records(pods: list[Obj], services: list[Obj], api_ip: str,
            ) -> tuple[list[Record], dict[tuple[str, str], list[str]]]:
    """Every name with its IPs, and each Service's (namespace, name) -> sorted pod IPs."""
    found = [Record("default", "kubernetes", api_ip, _names("kubernetes.default"))]
    service_ips: dict[tuple[str, str], list[str]] = {}
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec") or {}
        ns, name, selector = meta["namespace"], meta["name"], spec.get("selector")
        if not selector or spec.get("type") == "ExternalName":
            continue  # no selector: its Endpoints are someone else's; ExternalName: no CNAMEs
        chosen = [p for p in pods if p["metadata"]["namespace"] == ns
                  and (p.get("status") or {}).get("podIP")
                  and all((p["metadata"].get("labels") or {}).get(k) == v
                          for k, v in selector.items())
                  and (is_ready(p) or spec.get("publishNotReadyAddresses"))]
        service_ips[ns, name] = sorted(p["status"]["podIP"] for p in chosen)
        found += [Record(ns, name, ip, _names(f"{name}.{ns}")) for ip in service_ips[ns, name]]
        for p in chosen:
            if p["spec"].get("subdomain") == name and (host := p["spec"].get("hostname")):
                found.append(Record(ns, f"{host}.{name}", p["status"]["podIP"],
                                    _names(f"{host}.{name}.{ns}")))
    return found, service_ips


def hosts_lines(found: list[Record], namespace: str) -> dict[str, list[str]]:
    """IP -> names, as a pod in ``namespace`` sees them."""
    by_ip: dict[str, list[str]] = {}
    for r in found:
        by_ip.setdefault(r.ip, []).extend(r.names + ([r.short] if r.namespace == namespace
                                                     else []))
    return by_ip
