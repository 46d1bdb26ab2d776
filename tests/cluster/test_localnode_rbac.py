"""The API proxy's RBAC: the authorizer as a pure function, then the proxy itself.

The proxy tests run an ``ApiProxy`` on 127.0.0.1 in front of an emulator, without a node
(no root, no lock): raw HTTP/1.1 on one TLS connection (keep-alive, Content-Length and
chunked bodies, a 403 between allowed requests), and the kubernetes client with a token
minted for a ServiceAccount (401 without a valid one, a watch through the proxy).
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import pytest
from kmock_support import KubeEmulator, kube_emulator
from kubernetes import client, watch
from localnode.apiproxy import ApiProxy
from localnode.rbac import Attributes, Policy, User, authorize, forbidden, request_attributes

Obj = dict[str, Any]
SA = User.service_account("team", "bot")


def role(name: str, *rules: Obj, namespace: str | None = None) -> Obj:
    kind = "Role" if namespace else "ClusterRole"
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"kind": kind, "metadata": meta, "rules": list(rules)}


def binding(name: str, ref_kind: str, ref: str, *subjects: Obj,
            namespace: str | None = None) -> Obj:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"metadata": meta, "subjects": list(subjects),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": ref_kind, "name": ref}}


def sa(name: str = "bot", namespace: str = "team") -> Obj:
    return {"kind": "ServiceAccount", "name": name, "namespace": namespace}


def rule(groups: list[str], resources: list[str], verbs: list[str], **more: Any) -> Obj:
    return {"apiGroups": groups, "resources": resources, "verbs": verbs, **more}


def can(policy: Policy, method: str, target: str, user: User = SA) -> bool:
    return authorize(policy, request_attributes(method, target, user)).allowed


def test_request_attributes() -> None:
    def attrs(method: str, target: str) -> tuple[str, ...]:
        a = request_attributes(method, target, SA)
        return (a.verb, a.api_group, a.resource, a.subresource, a.namespace, a.name)

    assert attrs("GET", "/api/v1/namespaces/x/pods") == ("list", "", "pods", "", "x", "")
    assert attrs("GET", "/api/v1/namespaces/x/pods?watch=true&rv=3") == (
        "watch", "", "pods", "", "x", "")
    assert attrs("GET", "/api/v1/namespaces/x/pods?watch=1")[0] == "watch"
    assert attrs("GET", "/api/v1/namespaces/x/pods?watch=false")[0] == "list"
    assert attrs("GET", "/api/v1/watch/namespaces/x/pods")[0] == "watch"
    assert attrs("GET", "/api/v1/namespaces/x/pods/p") == ("get", "", "pods", "", "x", "p")
    assert attrs("PATCH", "/apis/apps/v1/namespaces/x/deployments/d/scale") == (
        "patch", "apps", "deployments", "scale", "x", "d")
    assert attrs("PUT", "/apis/cleave.dev/v1alpha1/namespaces/x/llmservices/s/status") == (
        "update", "cleave.dev", "llmservices", "status", "x", "s")
    assert attrs("POST", "/api/v1/namespaces/x/events") == ("create", "", "events", "", "x", "")
    assert attrs("DELETE", "/api/v1/namespaces/x/pods/p")[0] == "delete"
    assert attrs("DELETE", "/api/v1/namespaces/x/pods")[0] == "deletecollection"
    assert attrs("GET", "/api/v1/namespaces") == ("list", "", "namespaces", "", "", "")
    assert attrs("GET", "/api/v1/namespaces/x") == ("get", "", "namespaces", "", "x", "x")
    assert attrs("PUT", "/api/v1/namespaces/x/status") == (
        "update", "", "namespaces", "status", "x", "x")
    assert attrs("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions") == (
        "list", "apiextensions.k8s.io", "customresourcedefinitions", "", "", "")
    for path in ("/api", "/api/v1", "/apis", "/apis/apps", "/apis/apps/v1", "/version",
                 "/openapi/v2", "/healthz"):
        a = request_attributes("GET", path, SA)
        assert not a.resource_request and (a.verb, a.path) == ("get", path)


def test_wildcards_and_verbs() -> None:
    policy = Policy(cluster_roles=[role("all", rule(["*"], ["*"], ["*"])),
                                   role("apps", rule(["apps"], ["*"], ["get", "list"]))],
                    cluster_role_bindings=[binding("b", "ClusterRole", "apps", sa())])
    assert can(policy, "GET", "/apis/apps/v1/namespaces/a/deployments")
    assert can(policy, "GET", "/apis/apps/v1/statefulsets")  # cluster-wide list
    assert can(policy, "GET", "/apis/apps/v1/namespaces/a/deployments/d/scale")  # * covers subs
    assert not can(policy, "GET", "/apis/apps/v1/deployments?watch=true")  # watch is not list
    assert not can(policy, "POST", "/apis/apps/v1/namespaces/a/deployments")
    assert not can(policy, "GET", "/api/v1/namespaces/a/pods")  # another group
    assert not can(policy, "GET", "/apis/apps/v1/deployments", User.service_account("t", "o"))
    policy.cluster_role_bindings.append(binding("c", "ClusterRole", "all", sa()))
    assert can(policy, "DELETE", "/api/v1/namespaces/a/pods")


def test_subresources() -> None:
    policy = Policy(cluster_roles=[role("r", rule(["apps"], ["deployments"], ["*"]),
                                        rule(["cleave.dev"], ["llmservices/status"], ["patch"]),
                                        rule([""], ["*/log"], ["get"]))],
                    cluster_role_bindings=[binding("b", "ClusterRole", "r", sa())])
    assert can(policy, "PATCH", "/apis/apps/v1/namespaces/a/deployments/d")
    assert not can(policy, "PATCH", "/apis/apps/v1/namespaces/a/deployments/d/scale")
    assert can(policy, "PATCH", "/apis/cleave.dev/v1alpha1/namespaces/a/llmservices/s/status")
    assert not can(policy, "PATCH", "/apis/cleave.dev/v1alpha1/namespaces/a/llmservices/s")
    assert can(policy, "GET", "/api/v1/namespaces/a/pods/p/log")
    assert not can(policy, "GET", "/api/v1/namespaces/a/pods/p")


def test_resource_names_only_for_named_objects() -> None:
    policy = Policy(roles=[role("r", rule([""], ["configmaps"], ["get", "list", "update",
                                                                 "create"],
                                          resourceNames=["cfg"]), namespace="team")],
                    role_bindings=[binding("b", "Role", "r", sa(), namespace="team")])
    assert can(policy, "GET", "/api/v1/namespaces/team/configmaps/cfg")
    assert can(policy, "PUT", "/api/v1/namespaces/team/configmaps/cfg")
    assert not can(policy, "GET", "/api/v1/namespaces/team/configmaps/other")
    assert not can(policy, "GET", "/api/v1/namespaces/team/configmaps")  # list: no name
    assert not can(policy, "POST", "/api/v1/namespaces/team/configmaps")  # create: no name


def test_role_bindings_grant_in_their_namespace_only() -> None:
    reader = role("reader", rule([""], ["configmaps", "namespaces"], ["get", "list"]))
    policy = Policy(cluster_roles=[reader], roles=[
        role("local", rule([""], ["secrets"], ["get"]), namespace="team"),
        role("local", rule([""], ["pods"], ["get"]), namespace="other")],
        role_bindings=[binding("to-cluster-role", "ClusterRole", "reader", sa(), namespace="a"),
                       # a Role of the binding's namespace, the subject's namespace defaulted
                       binding("to-role", "Role", "local", {"kind": "ServiceAccount",
                                                            "name": "bot"}, namespace="team")])
    assert can(policy, "GET", "/api/v1/namespaces/a/configmaps")
    assert not can(policy, "GET", "/api/v1/namespaces/b/configmaps")
    assert not can(policy, "GET", "/api/v1/configmaps")  # all namespaces: cluster scope
    assert not can(policy, "GET", "/api/v1/namespaces")  # cluster-scoped: never by RoleBinding
    assert can(policy, "GET", "/api/v1/namespaces/a")  # the namespace object itself: in "a"
    assert can(policy, "GET", "/api/v1/namespaces/team/secrets/s")
    assert not can(policy, "GET", "/api/v1/namespaces/team/pods/p")  # the other ns' Role
    assert not can(policy, "GET", "/api/v1/namespaces/a/secrets/s")


def test_group_subjects_and_missing_roles() -> None:
    policy = Policy(cluster_roles=[role("view", rule([""], ["pods"], ["list"]))],
                    cluster_role_bindings=[
                        binding("all-sas", "ClusterRole", "view",
                                {"kind": "Group", "name": "system:serviceaccounts:team"}),
                        binding("gone", "ClusterRole", "nowhere", sa())])
    assert can(policy, "GET", "/api/v1/pods")
    assert not can(policy, "GET", "/api/v1/pods", User.service_account("elsewhere", "bot"))
    a = request_attributes("GET", "/api/v1/namespaces/team/secrets/s", SA)
    decision = authorize(policy, a)
    assert not decision.allowed
    assert decision.reason == 'RBAC: clusterrole.rbac.authorization.k8s.io "nowhere" not found'
    assert forbidden(a, decision)["message"] == (
        'secrets "s" is forbidden: User "system:serviceaccount:team:bot" cannot get resource '
        '"secrets" in API group "" in the namespace "team": RBAC: '
        'clusterrole.rbac.authorization.k8s.io "nowhere" not found')


def test_non_resource_urls_and_messages() -> None:
    anonymous = User("system:anonymous", ("system:unauthenticated",))
    policy = Policy()
    assert can(policy, "GET", "/apis") and can(policy, "GET", "/api/v1")
    assert can(policy, "GET", "/openapi/v3/apis/apps/v1") and can(policy, "GET", "/version")
    assert not can(policy, "GET", "/metrics")
    assert not can(policy, "GET", "/apis", anonymous) and can(policy, "GET", "/version",
                                                              anonymous)
    assert not can(policy, "GET", "/api/v1/namespaces/team/pods", anonymous)
    policy.cluster_roles.append(role("m", {"nonResourceURLs": ["/metrics*"], "verbs": ["get"]}))
    policy.cluster_role_bindings.append(binding("m", "ClusterRole", "m", sa()))
    assert can(policy, "GET", "/metrics") and can(policy, "GET", "/metrics/slis")
    assert not can(policy, "POST", "/metrics")

    def message(a: Attributes) -> str:
        return str(forbidden(a, authorize(Policy(), a))["message"])

    assert message(request_attributes("POST", "/api/v1/namespaces/team/configmaps", SA)) == (
        'configmaps is forbidden: User "system:serviceaccount:team:bot" cannot create resource '
        '"configmaps" in API group "" in the namespace "team"')
    assert message(request_attributes("PATCH", "/apis/apps/v1/namespaces/team/deployments/d/"
                                      "scale", SA)) == (
        'deployments.apps "d" is forbidden: User "system:serviceaccount:team:bot" cannot patch '
        'resource "deployments/scale" in API group "apps" in the namespace "team"')
    assert message(request_attributes("GET", "/api/v1/namespaces", SA)) == (
        'namespaces is forbidden: User "system:serviceaccount:team:bot" cannot list resource '
        '"namespaces" in API group "" at the cluster scope')
    assert message(request_attributes("GET", "/metrics", anonymous)) == (
        'forbidden: User "system:anonymous" cannot get path "/metrics"')


# -- the proxy, in front of an emulator --------------------------------------------------------


@pytest.fixture(scope="module")
def emu() -> Iterator[KubeEmulator]:
    with kube_emulator() as emulator:
        rbac = client.RbacAuthorizationV1Api(emulator.api_client())
        rbac.create_namespaced_role("default", role("cm", rule(
            [""], ["configmaps"], ["get", "list", "watch", "create"]), namespace="default"))
        rbac.create_namespaced_role_binding("default", binding(
            "cm", "Role", "cm", sa("bot", "default"), namespace="default"))
        yield emulator


@pytest.fixture(scope="module")
def proxy(emu: KubeEmulator, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProxy]:
    host, port = emu.url.removeprefix("http://").split(":")
    p = ApiProxy("127.0.0.1", 0, (host, int(port)), tmp_path_factory.mktemp("tls"))
    p.start()
    yield p
    p.stop()


def read_response(f: Any) -> tuple[int, Obj]:
    """One response from a socket file: its status and JSON body (Content-Length/chunked)."""
    code = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) != b"\r\n":
        name, _, value = line.decode().partition(":")
        headers[name.lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int(f.readline().split(b";")[0], 16):
            body += f.read(size + 2)[:-2]
        assert f.readline() == b"\r\n"
    else:
        body = f.read(int(headers["content-length"]))
    return code, json.loads(body)


def test_keep_alive_bodies_and_denials_on_one_connection(proxy: ApiProxy) -> None:
    token = proxy.tokens.mint("default", "bot")
    context = ssl.create_default_context(cafile=str(proxy.ca_path))
    auth = f"Authorization: Bearer {token}\r\nHost: kubernetes\r\n"
    cm = json.dumps({"metadata": {"name": "raw"}, "data": {"a": "1"}}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part)
                       for part in (cm.replace(b"raw", b"chunky")[:10],
                                    cm.replace(b"raw", b"chunky")[10:])) + b"0\r\n\r\n"
    requests = [
        f"POST /api/v1/namespaces/default/configmaps HTTP/1.1\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(cm)}\r\n\r\n".encode() + cm,
        # denied: a Secret; its body is skipped, the connection stays usable
        f"POST /api/v1/namespaces/default/secrets HTTP/1.1\r\n{auth}"
        f"Content-Length: {len(cm)}\r\n\r\n".encode() + cm,
        f"POST /api/v1/namespaces/default/configmaps HTTP/1.1\r\n{auth}"
        f"Transfer-Encoding: chunked\r\n\r\n".encode() + chunked,
        f"GET /api/v1/namespaces/default/configmaps HTTP/1.1\r\n{auth}\r\n".encode(),
        f"GET /apis HTTP/1.1\r\n{auth}\r\n".encode(),
        f"DELETE /api/v1/namespaces/default/configmaps/raw HTTP/1.1\r\n{auth}\r\n".encode()]
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="kubernetes.default.svc") as tls:
        tls.sendall(b"".join(requests[:2]))  # the first two in one segment
        f = tls.makefile("rb")
        code, body = read_response(f)
        assert code == 201, (body, list(proxy.denied))
        code, status = read_response(f)
        assert (code, status["reason"], status["details"]) == (
            403, "Forbidden", {"kind": "secrets"})
        assert status["message"] == (
            'secrets is forbidden: User "system:serviceaccount:default:bot" cannot create '
            'resource "secrets" in API group "" in the namespace "default"')
        for request, want in zip(requests[2:], (201, 200, 200, 403), strict=True):
            tls.sendall(request)
            code, body = read_response(f)
            assert code == want, body
            if request.startswith(b"GET /api/v1"):
                assert [i["metadata"]["name"] for i in body["items"]] == ["raw", "chunky"]
    assert any("cannot delete" in line for line in proxy.denied)


def test_kubernetes_client_tokens_and_watch(proxy: ApiProxy) -> None:
    def api(token: str | None) -> client.CoreV1Api:
        config = client.Configuration(host=f"https://127.0.0.1:{proxy.port}")
        config.ssl_ca_cert = str(proxy.ca_path)
        if token:
            config.api_key = {"authorization": f"Bearer {token}"}
        return client.CoreV1Api(client.ApiClient(config))

    bot = api(proxy.tokens.mint("default", "bot"))
    bot.create_namespaced_config_map("default", {"metadata": {"name": "watched"}})
    events = watch.Watch().stream(bot.list_namespaced_config_map, "default", timeout_seconds=2)
    assert "watched" in {e["object"].metadata.name for e in events}
    assert bot.read_namespaced_config_map("watched", "default").metadata.name == "watched"
    for other, code in ((api(proxy.tokens.mint("default", "nobody")), 403),
                        (api("localnode.default.bot"), 401),  # a guessable form is not a token
                        (api("forged"), 401), (api(None), 403)):
        with pytest.raises(client.ApiException) as e:
            other.list_namespaced_config_map("default")
        assert e.value.status == code, e.value.body
        assert json.loads(e.value.body)["reason"] == {401: "Unauthorized",
                                                      403: "Forbidden"}[code]
    with pytest.raises(client.ApiException) as e:
        bot.list_namespaced_config_map("kube-system")
    assert 'in the namespace "kube-system"' in json.loads(e.value.body)["message"]


def test_expect_continue_and_closing_denials(proxy: ApiProxy) -> None:
    token = proxy.tokens.mint("default", "bot")
    context = ssl.create_default_context(cafile=str(proxy.ca_path))
    cm = json.dumps({"metadata": {"name": "expected"}}).encode()

    def head(kind: str) -> bytes:
        return (f"POST /api/v1/namespaces/default/{kind} HTTP/1.1\r\nHost: kubernetes\r\n"
                f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(cm)}\r\nExpect: 100-continue\r\n\r\n").encode()

    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="kubernetes") as tls:
        f = tls.makefile("rb")
        tls.sendall(head("configmaps"))
        assert f.readline().split()[1] == b"100"  # from the proxy: the emulator sends none
        assert f.readline() == b"\r\n"
        tls.sendall(cm)
        assert read_response(f)[0] == 201
        tls.sendall(head("secrets"))  # denied before its body: answered, then closed
        code, body = read_response(f)
        assert (code, body["reason"]) == (403, "Forbidden")
        assert f.read() == b""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="kubernetes") as tls:
        tls.sendall(b"NONSENSE\r\n\r\n")
        f = tls.makefile("rb")
        assert read_response(f)[0] == 400 and f.read() == b""
