"""The RBAC authorizer of the in-cluster API proxy: request attributes, rules, decisions.

Pure functions, as the apiserver splits it: :func:`request_attributes` is its
``RequestInfoFactory`` (URL + method -> verb, API group, resource, subresource, namespace,
name), :func:`authorize` its RBAC authorizer over a :class:`Policy` (the ClusterRoles, Roles
and their bindings, as stored), :func:`forbidden` the ``Status`` it answers a denial with.
Not emulated: aggregated ClusterRoles (``aggregationRule``: only the rules stored on the role
count), escalation and ``bind`` checks on writes of roles, impersonation, field and label
selectors in authorization, and any authorizer other than RBAC (no Node, no webhook).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]
RBAC_GROUP = "rbac.authorization.k8s.io"
VERBS = {"GET": "get", "HEAD": "get", "POST": "create", "PUT": "update", "PATCH": "patch",
         "DELETE": "delete"}
NAMESPACE_SUBRESOURCES = {"status", "finalize"}  # /api/v1/namespaces/<ns>/status is one
TRUE = {"1", "t", "T", "true", "TRUE", "True"}  # Go's strconv.ParseBool
ANONYMOUS = "system:anonymous"
AUTHENTICATED = "system:authenticated"
UNAUTHENTICATED = "system:unauthenticated"
# The bootstrap policy's default bindings that matter to a client: system:discovery and
# system:public-info-viewer (non-resource URLs), system:basic-user (self reviews).
PUBLIC_INFO = {"nonResourceURLs": ["/healthz", "/livez", "/readyz", "/version", "/version/"],
               "verbs": ["get"]}
BOOTSTRAP: dict[str, list[Obj]] = {
    AUTHENTICATED: [
        {"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/openapi", "/openapi/*"],
         "verbs": ["get"]},
        PUBLIC_INFO,
        {"apiGroups": ["authorization.k8s.io"], "verbs": ["create"],
         "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"]},
        {"apiGroups": ["authentication.k8s.io"], "verbs": ["create"],
         "resources": ["selfsubjectreviews"]}],
    UNAUTHENTICATED: [PUBLIC_INFO]}


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()

    @classmethod
    def service_account(cls, namespace: str, name: str) -> User:
        """What a ServiceAccount token authenticates as."""
        return cls(f"system:serviceaccount:{namespace}:{name}", (
            "system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED))


@dataclass(frozen=True)
class Attributes:
    """What a request asks for. ``resource`` is empty for a non-resource URL (``path``)."""
    user: User
    verb: str
    path: str = ""
    api_group: str = ""
    api_version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def resource_request(self) -> bool:
        return bool(self.resource)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str  # "RBAC: allowed by ..." or why not (missing roles), as the apiserver logs it


@dataclass
class Policy:
    """The RBAC objects as listed from the API (``items`` of each list)."""
    cluster_roles: list[Obj] = field(default_factory=list)
    roles: list[Obj] = field(default_factory=list)
    cluster_role_bindings: list[Obj] = field(default_factory=list)
    role_bindings: list[Obj] = field(default_factory=list)


def request_attributes(method: str, target: str, user: User) -> Attributes:
    """The apiserver's request info for ``method target`` (``/apis/apps/v1/namespaces/x/
    deployments/web/scale?...``): GET with a name is get, without list (watch with
    ``watch=true``), DELETE without a name deletecollection; ``/api``, ``/apis/<group>``,
    ``/api/v1`` and other URLs that name no resource are non-resource requests."""
    path, _, query = target.partition("?")
    parts = [p for p in path.strip("/").split("/") if p]
    non_resource = Attributes(user, method.lower(), path)
    if len(parts) < 2 or parts[0] not in ("api", "apis") or (parts[0] == "apis" and len(
            parts) < 3):
        return non_resource
    group, version, rest = ("", parts[1], parts[2:]) if parts[0] == "api" else (
        parts[1], parts[2], parts[3:])
    if not rest:
        return non_resource
    verb = VERBS.get(method.upper(), method.lower())
    if rest[0] == "watch":  # the deprecated /watch/ prefix
        verb, rest = "watch", rest[1:]
    namespace = ""
    if rest and rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    if not rest:
        return non_resource
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        watch = urllib.parse.parse_qs(query).get("watch", [""])[0]
        verb = "watch" if watch in TRUE else "list"
    elif not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(user, verb, path, group, version, rest[0], subresource, namespace, name)


def rule_allows(rule: Obj, a: Attributes) -> bool:
    """One PolicyRule: verbs, then apiGroups + resources (``*``, ``res/sub``, ``*/sub``) +
    resourceNames (only a named object matches them), or nonResourceURLs (``*``, prefix*)."""
    if not _has(rule.get("verbs"), a.verb):
        return False
    if not a.resource_request:
        return any(u == "*" or u == a.path or (u.endswith("*") and a.path.startswith(u[:-1]))
                   for u in rule.get("nonResourceURLs") or [])
    wanted = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
    return (_has(rule.get("apiGroups"), a.api_group)
            and any(r in ("*", wanted) or (a.subresource and r == f"*/{a.subresource}")
                    for r in rule.get("resources") or [])
            and (not (names := rule.get("resourceNames")) or a.name in names))


def _has(values: list[str] | None, value: str) -> bool:
    return values is not None and ("*" in values or value in values)


def applies_to(subject: Obj, user: User, binding_namespace: str) -> bool:
    """A binding subject names the user: a ServiceAccount (namespace defaults to a
    RoleBinding's own), a User, or one of its Groups."""
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return bool(namespace) and user.name == f"system:serviceaccount:{namespace}:{name}"
    if kind == "User":
        return user.name == name
    return kind == "Group" and name in user.groups


def _bound_rules(policy: Policy, a: Attributes, errors: list[str]) -> Iterator[tuple[str, Obj]]:
    """(source, rule) for every rule granted to the user where the request applies: the
    bootstrap groups' rules, ClusterRoleBindings, and RoleBindings of the request's namespace
    (which may reference a Role of that namespace or a ClusterRole)."""
    for group in a.user.groups or (UNAUTHENTICATED,):
        for rule in BOOTSTRAP.get(group, []):
            yield f"the bootstrap policy to Group {group!r}", rule
    cluster_roles = {r["metadata"]["name"]: r for r in policy.cluster_roles}
    roles = {(r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in policy.roles}
    bindings = [(b, "ClusterRoleBinding", "") for b in policy.cluster_role_bindings]
    if a.namespace:
        bindings += [(b, "RoleBinding", a.namespace) for b in policy.role_bindings
                     if b["metadata"].get("namespace") == a.namespace]
    for binding, kind, namespace in bindings:
        if not any(applies_to(s, a.user, namespace) for s in binding.get("subjects") or []):
            continue
        ref = binding.get("roleRef") or {}
        if ref.get("kind") == "Role" and kind == "RoleBinding":
            role, qualified = roles.get((namespace, ref.get("name"))), "role"
        elif ref.get("kind") == "ClusterRole":
            role, qualified = cluster_roles.get(ref.get("name", "")), "clusterrole"
        else:
            continue
        if role is None:
            errors.append(f'{qualified}.{RBAC_GROUP} "{ref.get("name")}" not found')
            continue
        source = f'{kind} "{binding["metadata"]["name"]}" of {ref["kind"]} "{ref["name"]}"'
        for rule in role.get("rules") or []:
            yield source, rule


def authorize(policy: Policy, a: Attributes) -> Decision:
    """Allowed iff a rule bound to the user (or its groups) matches the request; the reason
    names the binding and role that allowed it, or the roles that were missing."""
    errors: list[str] = []
    for source, rule in _bound_rules(policy, a, errors):
        if rule_allows(rule, a):
            return Decision(True, f"RBAC: allowed by {source}")
    if not errors:
        return Decision(False, "")
    return Decision(False, "RBAC: " + (errors[0] if len(errors) == 1 else
                                       "[" + ", ".join(errors) + "]"))


def forbidden_message(a: Attributes) -> str:
    """The apiserver's ``forbiddenMessage`` (responsewriters)."""
    user = json.dumps(a.user.name)
    if not a.resource_request:
        return f"User {user} cannot {a.verb} path {json.dumps(a.path)}"
    resource = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
    where = (f"in the namespace {json.dumps(a.namespace)}" if a.namespace
             else "at the cluster scope")
    return (f"User {user} cannot {a.verb} resource {json.dumps(resource)} in API group "
            f"{json.dumps(a.api_group)} {where}")


def forbidden(a: Attributes, decision: Decision) -> Obj:
    """The 403 ``Status``: ``<resource>[.<group>] ["<name>"] is forbidden: User ... cannot
    ...[: RBAC: ...]``, with details (group, kind: the resource, name)."""
    message = forbidden_message(a) + (f": {decision.reason}" if decision.reason else "")
    if not a.resource_request:
        message = f"forbidden: {message}"
    else:
        qualified = f"{a.resource}.{a.api_group}" if a.api_group else a.resource
        named = f" {json.dumps(a.name)}" if a.name else ""
        message = f"{qualified}{named} is forbidden: {message}"
    details = {k: v for k, v in (("name", a.name), ("group", a.api_group),
                                 ("kind", a.resource)) if v}
    return status(403, "Forbidden", message, details)


def status(code: int, reason: str, message: str, details: Obj | None = None) -> Obj:
    out: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code}
    if details:
        out["details"] = details
    return out
