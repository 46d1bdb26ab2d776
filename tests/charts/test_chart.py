"""Checks of the Helm chart in charts/cleave, with the real helm binary.

helm (v4) comes from tools/fetch-helm.sh, which installs it into .tools/bin; these tests skip
only when that binary is absent. Built-in kinds are validated offline with kubernetes-validate.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "cleave"
HELM = REPO / ".tools" / "bin" / "helm"
# The chart's copy of the CRD; it must match the canonical one byte for byte.
CHART_CRD = CHART / "files" / "crds" / "llmservice.yaml"
CANONICAL_CRD = REPO / "crds" / "llmservice.yaml"
METRICS_DOC = REPO / "docs" / "metrics.md"
KUBE_VERSION = "1.35.0"
RELEASE = "cleave"
NAMESPACE = "cleave-system"

requires_helm = pytest.mark.skipif(
    not HELM.is_file(), reason=f"{HELM} not found: run tools/fetch-helm.sh to install helm"
)

# Every optional feature on.
ALL_ON: dict[str, Any] = {
    "operator": {
        "logLevel": "debug",
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"example.com/owner": "ml-platform"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}
        ],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}
                            ]
                        }
                    ]
                }
            }
        },
    },
    "serviceAccount": {
        "create": True,
        "name": "cleave-custom-sa",
        "annotations": {"example.com/role": "cleave-operator"},
    },
    "crds": {"install": True, "keep": True},
    "runtime": {"image": "registry.example.com/cleave-runtime:9.9.9"},
    "monitoring": {
        "serviceMonitor": {
            "enabled": True,
            "interval": "30s",
            "labels": {"release": "kube-prometheus-stack"},
        },
        "grafanaDashboard": {"enabled": True, "labels": {"team": "ml"}},
    },
}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def template(
    values: dict[str, Any] | None = None, *extra: str, tmp_path: Path | None = None
) -> list[dict[str, Any]]:
    args = [
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
        *extra,
    ]
    if values is not None:
        assert tmp_path is not None
        values_file = tmp_path / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        args += ["-f", str(values_file)]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def operator_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs, "Deployment")
    return deployment


@pytest.fixture(scope="module")
def default_docs() -> list[dict[str, Any]]:
    if not HELM.is_file():
        pytest.skip(f"{HELM} not found: run tools/fetch-helm.sh to install helm")
    return template()


@pytest.fixture
def all_on_docs(tmp_path: Path) -> list[dict[str, Any]]:
    return template(ALL_ON, tmp_path=tmp_path)


# --- lint and render ----------------------------------------------------------------------


@requires_helm
@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
def test_helm_lint(strict: bool) -> None:
    result = helm(
        "lint", str(CHART), "--kube-version", KUBE_VERSION, *(["--strict"] if strict else [])
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@requires_helm
def test_default_render(default_docs: list[dict[str, Any]]) -> None:
    kinds = sorted(doc["kind"] for doc in default_docs)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "Deployment",
            "CustomResourceDefinition",
        ]
    )
    # Monitoring is off by default.
    assert not by_kind(default_docs, "ServiceMonitor")
    assert not by_kind(default_docs, "ConfigMap")


@requires_helm
def test_all_features_render(all_on_docs: list[dict[str, Any]]) -> None:
    (sa,) = by_kind(all_on_docs, "ServiceAccount")
    assert sa["metadata"]["name"] == "cleave-custom-sa"
    assert sa["metadata"]["annotations"] == {"example.com/role": "cleave-operator"}
    pod = operator_deployment(all_on_docs)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "cleave-custom-sa"
    for binding in by_kind(all_on_docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "cleave-custom-sa", "namespace": NAMESPACE}
        ]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"][0]["key"] == "dedicated"
    assert "nodeAffinity" in pod["affinity"]
    (crd,) = by_kind(all_on_docs, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (monitor,) = by_kind(all_on_docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "30s"
    (dashboard,) = by_kind(all_on_docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["labels"]["team"] == "ml"
    container = pod["containers"][0]
    assert "--debug" in container["args"]


@requires_helm
def test_existing_service_account(tmp_path: Path) -> None:
    docs = template({"serviceAccount": {"create": False, "name": "preexisting"}}, tmp_path=tmp_path)
    assert not by_kind(docs, "ServiceAccount")
    pod = operator_deployment(docs)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "preexisting"


@requires_helm
def test_rbac_can_be_disabled(tmp_path: Path) -> None:
    docs = template({"rbac": {"create": False}}, tmp_path=tmp_path)
    assert not [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io/")]


@requires_helm
def test_watch_namespaces_scope_rbac_and_args(tmp_path: Path) -> None:
    docs = template(
        {
            "operator": {"watchNamespaces": ["team-a", "team-b"]},
            "monitoring": {"serviceMonitor": {"enabled": True}},
        },
        tmp_path=tmp_path,
    )
    args = operator_deployment(docs)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args
    role_bindings = by_kind(docs, "RoleBinding")
    assert sorted(rb["metadata"]["namespace"] for rb in role_bindings) == ["team-a", "team-b"]
    # Only the cluster-scoped CRD read stays cluster-wide.
    (crb,) = by_kind(docs, "ClusterRoleBinding")
    assert crb["roleRef"]["name"].endswith("-operator-crds")
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


# --- offline schema validation ----------------------------------------------------------


def validate_builtin(docs: list[dict[str, Any]]) -> int:
    """Validate every built-in kind against the Kubernetes 1.35 schemas; return the count."""
    checked = 0
    for doc in docs:
        if doc["apiVersion"].split("/")[0] == "monitoring.coreos.com":
            continue  # a CRD-based kind (Prometheus Operator): no built-in schema
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        checked += 1
    return checked


@requires_helm
def test_default_render_validates(default_docs: list[dict[str, Any]]) -> None:
    assert validate_builtin(default_docs) == len(default_docs)


@requires_helm
def test_all_features_render_validates(all_on_docs: list[dict[str, Any]]) -> None:
    assert validate_builtin(all_on_docs) == len(all_on_docs) - 1  # all but the ServiceMonitor


@requires_helm
def test_watch_namespaces_render_validates(tmp_path: Path) -> None:
    docs = template({"operator": {"watchNamespaces": ["team-a"]}}, tmp_path=tmp_path)
    assert validate_builtin(docs) == len(docs)


# --- the CRD -----------------------------------------------------------------------------


@requires_helm
def test_crd_is_apiextensions_v1_and_faithful(default_docs: list[dict[str, Any]]) -> None:
    (crd,) = by_kind(default_docs, "CustomResourceDefinition")
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    kubernetes_validate.validate(crd, KUBE_VERSION, strict=True)
    assert crd["metadata"]["name"] == "llmservices.cleave.dev"
    assert crd["spec"]["group"] == "cleave.dev"
    assert crd["spec"]["names"]["kind"] == "LLMService"
    # The template round-trips the file through fromYaml/toYaml: nothing may change but the
    # labels and annotations it adds.
    source = yaml.safe_load(CHART_CRD.read_text())
    assert crd["spec"] == source["spec"]
    for key, value in (source["metadata"].get("labels") or {}).items():
        if key != "app.kubernetes.io/component":
            assert crd["metadata"]["labels"][key] == value
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # crds.keep


@requires_helm
def test_crd_appears_once_with_and_without_include_crds() -> None:
    for extra in ([], ["--include-crds"]):
        docs = template(None, *extra)
        assert len(by_kind(docs, "CustomResourceDefinition")) == 1, extra
    # Helm's special crds/ folder would install a second copy before the templates.
    assert not (CHART / "crds").exists(), (
        "charts/cleave/crds/ must not exist: the CRD is templated from files/crds/"
    )


@requires_helm
def test_crd_install_and_keep_toggles(tmp_path: Path) -> None:
    assert not by_kind(
        template({"crds": {"install": False}}, tmp_path=tmp_path), "CustomResourceDefinition"
    )
    (crd,) = by_kind(
        template({"crds": {"keep": False}}, tmp_path=tmp_path), "CustomResourceDefinition"
    )
    assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})


def test_chart_crd_matches_canonical() -> None:
    """charts/cleave/files/crds/llmservice.yaml is a byte-for-byte copy of crds/llmservice.yaml."""
    assert CANONICAL_CRD.is_file(), f"{CANONICAL_CRD} is missing"
    assert CHART_CRD.is_file(), f"{CHART_CRD} is missing"
    assert CHART_CRD.read_bytes() == CANONICAL_CRD.read_bytes(), (
        f"{CHART_CRD.relative_to(REPO)} has drifted from {CANONICAL_CRD.relative_to(REPO)}: "
        f"cp {CANONICAL_CRD.relative_to(REPO)} {CHART_CRD.relative_to(REPO)}"
    )


# --- RBAC and pod security -------------------------------------------------------------


@requires_helm
def test_rbac_has_no_wildcards(all_on_docs: list[dict[str, Any]]) -> None:
    roles = by_kind(all_on_docs, "ClusterRole") + by_kind(all_on_docs, "Role")
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for field in ("verbs", "resources", "apiGroups", "resourceNames", "nonResourceURLs"):
                assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
                assert not any("*" in item for item in rule.get(field, [])), rule


@requires_helm
def test_rbac_grants_what_the_operator_needs(default_docs: list[dict[str, Any]]) -> None:
    granted: dict[tuple[str, str], set[str]] = {}
    for role in by_kind(default_docs, "ClusterRole"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
    read = {"get", "list", "watch"}
    assert granted[("cleave.dev", "llmservices")] == read | {"patch"}
    assert granted[("cleave.dev", "llmservices/status")] == {"patch", "update"}
    for resource in ("deployments", "statefulsets"):
        assert granted[("apps", resource)] == read | {"create", "patch", "update", "delete"}
    assert granted[("apps", "deployments/scale")] == {"get", "patch", "update"}
    for resource in ("services", "configmaps", "secrets"):
        assert granted[("", resource)] == read | {"create", "patch", "delete"}
    assert granted[("", "pods")] == read
    assert granted[("", "events")] == {"create", "patch"}
    assert granted[("events.k8s.io", "events")] == {"create", "patch"}
    assert granted[("apiextensions.k8s.io", "customresourcedefinitions")] == read
    # Standalone kopf: no leases, no peering objects, nothing else.
    assert len(granted) == 12, sorted(granted)


def test_every_rbac_rule_is_commented() -> None:
    lines = (CHART / "templates" / "rbac.yaml").read_text().splitlines()
    rule_lines = [i for i, line in enumerate(lines) if line.strip().startswith("- apiGroups:")]
    assert rule_lines
    for i in rule_lines:
        assert lines[i - 1].strip().startswith("#"), f"rbac.yaml:{i + 1} has no comment"


@requires_helm
def test_operator_pod_is_locked_down(default_docs: list[dict[str, Any]]) -> None:
    deployment = operator_deployment(default_docs)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "add" not in security["capabilities"]
    # A writable /tmp, since the root filesystem is read-only.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


@requires_helm
def test_operator_command_env_and_probes(default_docs: list[dict[str, Any]]) -> None:
    (container,) = operator_deployment(default_docs)["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/cleave-dev/cleave-operator:0.1.0"
    assert container["command"] == ["cleave", "operator"]
    assert "--standalone" in container["args"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert "--all-namespaces" in container["args"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["CLEAVE_RUNTIME_IMAGE"] == "ghcr.io/cleave-dev/cleave-runtime:0.1.0"
    assert env["CLEAVE_LOG_LEVEL"] == "info"
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"healthz": 8080}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}


# --- values schema -----------------------------------------------------------------------


@requires_helm
@pytest.mark.parametrize(
    "bad",
    [
        ["--set", "operator.replicas=-1"],
        ["--set", "operator.replicas=2"],  # standalone kopf: at most one operator
        ["--set", "operator.unknownKey=1"],
        ["--set", "notAValue=1"],
        ["--set", "operator.logLevel=loud"],
        ["--set", "operator.image.pullPolicy=Sometimes"],
        ["--set-string", "crds.install=yes"],
        ["--set", "monitoring.serviceMonitor.interval=soon"],
        ["--set-json", 'operator.watchNamespaces=["team-*"]'],
        ["--set", "monitoring.grafanaDashboard.extra=true"],
    ],
    ids=lambda bad: bad[1],
)
def test_schema_rejects_bad_values(bad: list[str]) -> None:
    result = helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *bad)
    assert result.returncode != 0
    assert "schema" in result.stderr, result.stderr


@requires_helm
def test_schema_accepts_global_values() -> None:
    # A parent chart passes `global`; additionalProperties: false must not reject it.
    result = helm(
        "template",
        RELEASE,
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        "--set",
        "global.imageRegistry=registry.example.com",
    )
    assert result.returncode == 0, result.stderr


def test_every_value_is_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: dict[str, Any], sub: dict[str, Any], path: str) -> None:
        assert sub.get("type") == "object", path
        props = sub.get("properties")
        if props is None:
            return  # a free-form Kubernetes struct (affinity, securityContext, ...)
        assert sub.get("additionalProperties") is False, path
        for key, value in node.items():
            assert key in props, f"{path}.{key} is not in values.schema.json"
            if isinstance(value, dict) and "properties" in props[key]:
                walk(value, props[key], f"{path}.{key}")

    walk(values, schema, "")


def test_every_value_is_commented() -> None:
    """Each key of values.yaml has a comment, or is a section whose own keys all do."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    commented: dict[tuple[str, ...], bool] = {}
    stack: list[str] = []
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z_]\w*):", line)
        if match:
            stack = [*stack[: len(match.group(1)) // 2], match.group(2)]
            commented[tuple(stack)] = lines[i - 1].lstrip().startswith("#")

    def check(node: dict[str, Any], sub: dict[str, Any], path: tuple[str, ...]) -> None:
        for key, value in node.items():
            here = (*path, key)
            if commented[here]:
                continue
            prop = sub["properties"][key]
            assert isinstance(value, dict) and "properties" in prop, f"{here} has no comment"
            check(value, prop, here)

    check(values, schema, ())


# --- Grafana dashboard -------------------------------------------------------------------


@requires_helm
def test_dashboard_json(all_on_docs: list[dict[str, Any]]) -> None:
    (configmap,) = by_kind(all_on_docs, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (raw,) = configmap["data"].values()
    dashboard = json.loads(raw)
    assert dashboard == json.loads((CHART / "dashboards" / "cleave.json").read_text())
    assert dashboard["uid"] and dashboard["title"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert all(p["targets"] for p in panels)
    assert all("cleave_" in " ".join(t["expr"] for t in p["targets"]) for p in panels)
    text = "\n".join(exprs)
    for metric in (
        "cleave_time_to_first_token_seconds_bucket",
        "cleave_time_per_output_token_seconds_bucket",
        "cleave_kv_cache_usage_ratio",
        "cleave_kv_store_hits_total",
        "cleave_kv_store_misses_total",
        "cleave_kv_recompute_fallbacks_total",
    ):
        assert metric in text, metric
    assert "histogram_quantile(0.5" in text and "histogram_quantile(0.9" in text
    # Every cleave_ metric the dashboard uses is documented (the autoscaler's are not
    # exported yet, see docs/metrics.md).
    documented = METRICS_DOC.read_text()
    for name in set(re.findall(r"\bcleave_\w+", text)):
        base = re.sub(r"_bucket$", "", name)
        assert base in documented or name.startswith("cleave_autoscaler_"), name
