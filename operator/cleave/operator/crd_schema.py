"""The LLMService CustomResourceDefinition, built in Python: the one source of truth.

``crds/llmservice.yaml`` and the chart's copy are generated from :func:`crd` by ``make crds``
(``python -m cleave.operator.crd_schema [PATH ...]``; no path prints the YAML), and
tests/operator/test_crd_schema.py fails when they drift. The spec and the document are here;
the node builders in ``crd_fields``, the worker roles in ``crd_role`` (prefill and decode are
both :func:`~cleave.operator.crd_role.role`: a field added there reaches both), the status in
``crd_status`` and the YAML layout in ``crd_yaml``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from cleave.operator.crd_fields import (
    Schema,
    array,
    boolean,
    column,
    integer,
    name,
    number,
    obj,
    quantity,
    rule,
    secret_ref,
    string,
)
from cleave.operator.crd_role import latency_target, placement, role
from cleave.operator.crd_status import status
from cleave.operator.spec import UNAUTHENTICATED_LOAD_BALANCER

GROUP, VERSION, KIND, PLURAL = "cleave.dev", "v1alpha1", "LLMService", "llmservices"


# --- spec ---------------------------------------------------------------------------------

def model() -> Schema:
    return obj("The model every worker and the router load.", {
        "name": name("The model name clients send in requests (the OpenAI model field), the "
                     "first /v1/models lists, and the one responses and the vllm:* metrics' "
                     "model_name label carry."),
        "aliases": array("More names clients may send for the model, listed by /v1/models "
                         "after name (vLLM's --served-model-name NAME [NAME ...] is name, then "
                         "these): e.g. a stable name kept while name moves to a new version.",
                         name("A model name.")),
        "source": string(
            "A Hugging Face hub id (org/name: each pod's init container downloads it into the "
            "pod's /cache), a built-in model name, or a path in the image or volume (HF "
            "directory or .gguf file). The workers load its weights, the router its tokenizer "
            "and chat template.",
            rules=[rule("size(self) > 0", "model.source must not be empty")]),
        "revision": string("A hub model's branch, tag or commit (default main). Pin a commit: "
                           "pods started after a push to a branch would load other weights."),
        "tokenSecret": secret_ref("A Secret key holding the Hugging Face token (HF_TOKEN) for "
                                  "a gated or private hub model; only the download init "
                                  "container gets it."),
        "dtype": string("The workers' weight and compute dtype; auto: bfloat16 where the "
                        "hardware runs it natively, else float32. Default auto.",
                        enum=["auto", "bfloat16", "float32", "float16"], default="auto"),
        "volume": obj("A PersistentVolumeClaim mounted read-only at /models in every worker "
                      "and router pod, for a source under /models.", {
            "claimName": name("The PersistentVolumeClaim's name, in the LLMService's "
                              "namespace."),
        }, required=["claimName"]),
    }, required=["name", "source"])


def router() -> Schema:
    return obj("The OpenAI-compatible router, the service's endpoint (Deployment and Service "
               "<name>-router): it sends each prompt to a prefill worker, then to a decode "
               "worker.", {
        "replicas": integer("Router pods. An HPA whose scaleTargetRef names <name>-router takes "
                            "them over. Default 1.", minimum=1, default=1),
        "port": integer("Port the router listens on and its Service exposes (in "
                        "status.endpoint). Default 8000.", minimum=1, maximum=65535,
                        default=8000),
        "serviceType": string("Type of the router's Service: ClusterIP (in-cluster only), "
                              "NodePort or LoadBalancer. Default ClusterIP.",
                              enum=["ClusterIP", "NodePort", "LoadBalancer"],
                              default="ClusterIP"),
        "disaggregateMinTokens": integer(
            "Prompts (or their part not already in the KV store) shorter than this many tokens "
            "are served by a decode worker alone, without a separate prefill. Default 64.",
            minimum=0, default=64),
        "kvLoadFailurePolicy": string(
            "What happens when a prefilled prompt's KV blocks cannot be loaded from the store: "
            "recompute the prompt on the decode worker, or fail the request (503). Default "
            "recompute.", enum=["recompute", "fail"], default="recompute"),
        "apiKeySecret": secret_ref("A Secret key holding the API key clients must send "
                                   "(Authorization: Bearer <key>). Unset: no key is needed."),
        "allowUnauthenticated": boolean(
            "Allow serviceType LoadBalancer without apiKeySecret: an endpoint anyone who "
            "reaches the load balancer may call; false refuses it. Default false.",
            default=False),
        **placement("router"),
    }, default={}, rules=[rule(
        "!has(self.serviceType) || self.serviceType != 'LoadBalancer' "
        "|| has(self.apiKeySecret) "
        "|| (has(self.allowUnauthenticated) && self.allowUnauthenticated)",
        UNAUTHENTICATED_LOAD_BALANCER.removeprefix("spec."))])


def redis_tls() -> Schema:
    return obj(
        "TLS to a rediss:// url whose certificate a private CA signs: the CA certificate "
        "(PEM) from a Secret or a ConfigMap key, mounted into the workers and the router "
        "(--redis-tls-ca-file), and the name the certificate carries where it is not url's "
        "host. Unset: the image's system CAs and url's host.", {
            "caSecret": secret_ref("A Secret key holding the CA certificate (PEM)."),
            "caConfigMap": obj("A ConfigMap key holding the CA certificate (PEM).", {
                "name": name("The ConfigMap's name, in the LLMService's namespace."),
                "key": name("The key within the ConfigMap."),
            }, required=["name", "key"]),
            "serverName": string("The name the server's certificate must carry (and the TLS "
                                 "SNI), where it is not url's host.", min_length=1),
        }, rules=[rule("!(has(self.caSecret) && has(self.caConfigMap))",
                       "kvStore.external.tls takes caSecret or caConfigMap, not both")])


def kv_store() -> Schema:
    return obj(
        "The Redis KV block store through which prefill workers hand prompts' KV cache to "
        "decode workers (and cached prompt prefixes are reused): exactly one of external or "
        "managed.", {
            "external": obj("A Redis you run; the workers and the router connect to url.", {
                "url": string("The Redis URL, redis://, rediss:// (TLS) or unix://, with its "
                              "database, e.g. redis://redis.infra:6379/0; no password (every "
                              "pod's command line shows the URL): use passwordSecret.",
                              pattern="^(redis|rediss|unix)://.+", rules=[rule(
                                  "!self.matches('^[a-z]+://[^/@]*:[^/@]*@') "
                                  "&& !self.matches('[?&]password=')",
                                  "kvStore.external.url must not hold a password: use "
                                  "kvStore.external.passwordSecret")]),
                "passwordSecret": secret_ref("A Secret key holding the Redis password, given "
                                             "to the workers and the router. Unset: none."),
                "tls": redis_tls(),
            }, required=["url"], rules=[rule("!has(self.tls) || self.url.startsWith('rediss://')",
                                             "kvStore.external.tls needs a rediss:// url")]),
            "managed": obj(
                "The operator runs a Redis StatefulSet and Service (<name>-redis) with one ACL "
                "user per component, their generated passwords in the Secret "
                "<name>-redis-users. Blocks are not persisted: a restarted Redis starts "
                "empty.", {
                    "image": string("The Redis image. Default redis:7.2.", min_length=1,
                                    default="redis:7.2"),
                    "memory": quantity(
                        "The Redis pod's memory request and limit, as a quantity; Redis keeps "
                        "80% of it for blocks (maxmemory) and evicts the least recently used "
                        "beyond that. Default 2Gi.", default="2Gi"),
                }),
            "ttlSeconds": integer("Seconds a stored KV block lives unless read again (each read "
                                  "renews it). Default 3600.", minimum=1, default=3600,
                                  bits=64),
            "saltSecret": secret_ref(
                "A Secret key holding the KV salt, mixed into every block hash: only workers "
                "with the same salt share blocks. Unset: the operator keeps a random salt per "
                "service in the Secret <name>-kv-salt, so two services never share blocks by "
                "accident (the key namespace, the service's name, also keeps services apart). "
                "Name a Secret to keep the salt yourself: changing it invalidates every "
                "stored block."),
        }, rules=[rule("has(self.external) != has(self.managed)",
                       "kvStore must set exactly one of external or managed")])


def autoscaling() -> Schema:
    return obj(
        "Who owns the worker replicas, and how the Cleave autoscaler runs; what it aims at is "
        "in each role's autoscaling block. See docs/autoscaling.md.", {
            "mode": string(
                "Owner of the replicas of a role with an autoscaling block: Cleave (the "
                "operator's autoscaler), External (an HPA or KEDA: worker replicas are never "
                "written) or Disabled (every role runs its fixed replicas). Default Cleave.",
                enum=["Cleave", "External", "Disabled"], default="Cleave"),
            "gpuBudget": integer(
                "Total GPUs across both roles (nvidia.com/gpu per replica times replicas): the "
                "autoscaler trims its decisions to fit. Unset: no budget.", minimum=0),
            "scaleToZero": boolean(
                "Let both roles reach zero replicas when idle (minReplicas 0); the router "
                "keeps the model listed and holds requests while the first replicas start. "
                "Default false.", default=False),
            "intervalSeconds": number("How often, in seconds, the Cleave autoscaler scrapes "
                                      "the pods and decides. Default 15.", minimum=1,
                                      default=15),
            "windowSeconds": number(
                "The window, in seconds, of the p90 latencies and token rates the autoscaler "
                "reads; at least intervalSeconds. Default 60.", minimum=1, default=60),
            "scaleDownDelaySeconds": number(
                "A role scales down (one replica per step) only when every recommendation over "
                "this many seconds agrees; scaling up is immediate. Default 300.", minimum=0,
                default=300),
            "coldStartSeconds": number(
                "How long, in seconds, a new worker replica takes to become ready; the "
                "autoscaler keeps room for the demand rises seen within this long. Unset or 0: "
                "no such room.", minimum=0),
            "prefillDecodeRatio": obj(
                "While both roles run, a role the autoscaler would grow past prefill/decode "
                "replicas in [min, max] is trimmed back (never below its minReplicas).", {
                    "min": number("Lowest prefill/decode replica ratio; at most max.", above=0),
                    "max": number("Highest prefill/decode replica ratio.", above=0),
                }, required=["min", "max"],
                rules=[rule("self.min <= self.max",
                            "autoscaling.prefillDecodeRatio.min must be <= max")]),
            "dryRun": boolean(
                "Advisory mode: decisions go to the status, Events, metrics and logs, marked "
                "advisory, and the Deployments are left alone. Default false.", default=False),
            "prometheus": obj("Read the signals from this Prometheus server instead of "
                              "scraping each pod.", {
                "url": string("The server's base URL, e.g. http://prometheus.monitoring.svc:9090"
                              "; the series need the labels the chart's ServiceMonitor gives.",
                              pattern="^https?://.+"),
            }, required=["url"]),
        }, default={}, rules=[rule(
            "!has(self.windowSeconds) || !has(self.intervalSeconds) "
            "|| self.windowSeconds >= self.intervalSeconds",
            "autoscaling.windowSeconds must be >= intervalSeconds")])


SCALE_TO_ZERO_RULE = (
    "(has(self.autoscaling) && has(self.autoscaling.scaleToZero) && self.autoscaling.scaleToZero)"
    " || ((!has(self.prefill) || !has(self.prefill.autoscaling)"
    " || !has(self.prefill.autoscaling.minReplicas) || self.prefill.autoscaling.minReplicas >= 1)"
    " && (!has(self.decode.autoscaling) || !has(self.decode.autoscaling.minReplicas)"
    " || self.decode.autoscaling.minReplicas >= 1))")


def spec() -> Schema:
    return obj("The serving stack wanted; docs/llmservice-spec.md is the contract.", {
        "image": string(
            "Runtime image for the prefill/decode workers and the router. Unset: the "
            "operator's runtime image (the chart's runtime.image), so upgrading the chart rolls "
            "the service onto the new runtime.", min_length=1),
        "imagePullSecrets": array(
            "Secrets (in the service's namespace) with the registry credentials to pull the "
            "runtime and Redis images, as in a pod spec.", obj("", {
                "name": name("The Secret's name."),
            }, required=["name"]), map_keys=["name"]),
        "model": model(),
        "prefill": role(
            "prefill", "Prefill workers: they compute each prompt's KV cache (time to first "
            "token) and hand it to a decode worker through the KV store. Omit, or set replicas "
            "0, for decode-only serving.", tokens="Prompt",
            signal="the time-to-first-token target",
            targets={"ttftSeconds": latency_target("time to first token", "prefill")}),
        "decode": role(
            "decode", "Decode workers (required): they generate the output tokens (time per "
            "output token) and serve short prompts alone.", tokens="Output",
            signal="the time-per-output-token and KV cache usage targets",
            targets={"tpotSeconds": latency_target("time per output token", "decode"),
                     "kvCacheUsage": number(
                         "Target fraction of the decode workers' KV cache in use, in (0, 1]: "
                         "above it (beyond a 10% band) the autoscaler adds decode replicas "
                         "before memory runs out. Unset: no KV target.", above=0, maximum=1)}),
        "router": router(),
        "kvStore": kv_store(),
        "autoscaling": autoscaling(),
    }, required=["model", "decode", "kvStore"], rules=[rule(
        SCALE_TO_ZERO_RULE,
        "autoscaling minReplicas must be >= 1 unless autoscaling.scaleToZero is true")])


# --- the document -------------------------------------------------------------------------

NAME_RULE = rule(
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 40",
    "metadata.name must be at most 40 lowercase letters, digits and '-', starting with a "
    "letter and ending with a letter or digit: it names the service's Services and pods")


def columns() -> list[Schema]:
    """``kubectl get llms`` columns, after NAME."""
    return [
        column("Ready", "string", '.status.conditions[?(@.type=="Ready")].status',
               "Whether every role has its desired replicas ready"),
        column("Model", "string", ".spec.model.name", "The model name clients send"),
        column("Prefill", "integer", ".status.prefill.readyReplicas", "Ready prefill workers"),
        column("Decode", "integer", ".status.decode.readyReplicas", "Ready decode workers"),
        column("Endpoint", "string", ".status.endpoint",
               "OpenAI-compatible base URL of the router"),
        column("Age", "date", ".metadata.creationTimestamp"),
    ]


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition document."""
    root = obj("A disaggregated LLM serving stack (prefill workers, decode workers, router, "
               "KV store).", {
        "apiVersion": string("The versioned schema of this object: cleave.dev/v1alpha1."),
        "kind": string("The REST resource this object represents: LLMService."),
        "metadata": {"type": "object"},
        "spec": spec(),
        "status": status(),
    }, required=["spec"], rules=[NAME_RULE])
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}",
                     "labels": {"app.kubernetes.io/name": "cleave",
                                "app.kubernetes.io/part-of": "cleave"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": KIND.lower(), "shortNames": ["llms"],
                      "categories": ["cleave"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns(),
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


# --- the writer ---------------------------------------------------------------------------

HEADER = """\
# GENERATED from operator/cleave/operator/crd_schema.py by `make crds`: edit that module, not
# this file. LLMService: one disaggregated (prefill/decode) LLM serving stack. The contract is
# docs/llmservice-spec.md; tests/operator/test_crd*.py check this schema and the examples.
"""


def render() -> str:
    """The CRD as YAML text, header included."""
    from cleave.operator.crd_yaml import to_yaml  # PyYAML: only the writer needs it

    return HEADER + to_yaml(crd())


def main(argv: list[str]) -> int:
    """No argument: print the YAML. Otherwise write it to each path (atomically)."""
    text = render()
    if not argv:
        sys.stdout.write(text)
    for target in map(Path, argv):
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
