"""Every Secret the operator writes, and every reference a pod makes to a secret key.

One mechanism for all of them. A Secret the operator generates is a :class:`Generated`: its
name (``<service>-<suffix>``), its component label and its keys, stated once here; the same
object builds the Secret, the references pods make to its keys, and tells the reconcile what
to read back (each is written once and never again: a new value would cut every client off).
A user's Secret (a :class:`~cleave.operator.spec.SecretRef` of the spec) is referenced the
same way. A pod takes a key as a variable (:func:`env`) or as one file (:func:`key_volume`),
never the whole Secret: each pod holds only the keys it needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cleave.operator.metadata import Manifest, meta
from cleave.operator.spec import CaRef, LLMServiceSpec, SecretRef


@dataclass(frozen=True)
class Generated:
    """A Secret the operator generates for each service (its values come from the caller:
    the reconcile reads the existing ones, or draws fresh ones the first time)."""

    suffix: str  # the Secret is <service name>-<suffix>
    component: str  # its app.kubernetes.io/component label
    keys: tuple[str, ...]

    def name(self, spec: LLMServiceSpec) -> str:
        return f"{spec.name}-{self.suffix}"

    def ref(self, spec: LLMServiceSpec, key: str) -> SecretRef:
        if key not in self.keys:  # a reference to a key never written: the pod won't start
            raise KeyError(f"{self.suffix} has no key {key!r} (only {self.keys})")
        return SecretRef(self.name(spec), key)

    def secret(self, spec: LLMServiceSpec, owner: Manifest,
               values: Mapping[str, str]) -> Manifest:
        if set(values) != set(self.keys):
            raise KeyError(f"{self.suffix} takes the keys {self.keys}, not {tuple(values)}")
        return {"apiVersion": "v1", "kind": "Secret",
                "metadata": meta(spec, self.name(spec), self.component, owner),
                "type": "Opaque", "stringData": {k: values[k] for k in self.keys}}


# The key every worker's and the router's internal API calls carry (security.py).
INTERNAL_TOKEN = Generated("internal-token", "internal-token", ("token",))
# The service's own KV salt, unless kvStore.saltSecret names the user's (builders.py).
KV_SALT = Generated("kv-salt", "kv-salt", ("salt",))
# The managed Redis's ACL users' passwords, one key each (redis_users.py). Not the
# single-password ``<name>-redis-auth`` of before: Secrets are written once, so a new name is
# how services made before the ACL users get their three keys.
REDIS_USERS = Generated("redis-users", "redis", ("admin", "worker", "router"))
GENERATED = (INTERNAL_TOKEN, KV_SALT, REDIS_USERS)


def env(variable: str, ref: SecretRef) -> Manifest:
    """A container variable holding one secret key."""
    return {"name": variable, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def key_volume(volume: str, source: CaRef, path: str) -> Manifest:
    """A volume holding one key of a Secret (or ConfigMap) as the file ``path``: only that key
    reaches the pod, not the rest of the object."""
    items = [{"key": source.key, "path": path}]
    if source.kind == "Secret":
        return {"name": volume, "secret": {"secretName": source.name, "items": items}}
    return {"name": volume, "configMap": {"name": source.name, "items": items}}
