"""Kube's writes against the API emulator's real answers when another writer got there first:
a race the next reconcile converges from (an object created, or gone, meanwhile) is no error
and counts no write; any other failure is raised."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from kmock_support import KubeEmulator, kube_emulator
from kubernetes.client.exceptions import ApiException

from cleave.operator.kube import Kube

NS = "default"
CONFIG: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": "c", "namespace": NS}, "data": {"k": "v"}}


class Stale(Kube):
    """A Kube whose read answers what it saw before the other writer acted."""

    def __init__(self, emu: KubeEmulator, seen: dict[str, Any] | None) -> None:
        super().__init__(emu.api_client())
        self.seen = seen

    def get(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        return self.seen


@pytest.fixture()
def emu() -> Iterator[KubeEmulator]:
    with kube_emulator() as emulator:
        yield emulator


def test_writes_that_lost_a_race_are_no_error_and_no_write(emu: KubeEmulator) -> None:
    kube = Kube(emu.api_client())
    assert kube.apply(CONFIG) == "created" and kube.writes == 1
    # Created by another writer after our read: 409, unchanged.
    assert Stale(emu, None).apply(CONFIG) == "unchanged"
    assert kube.delete(CONFIG) and kube.writes == 2
    # Deleted by another writer after our read: the patch's 404, unchanged.
    late = Stale(emu, {**CONFIG, "data": {"k": "old"}})
    assert late.apply(CONFIG) == "unchanged" and late.writes == 0
    assert emu.get("configmaps", NS, "c") is None  # the patch did not bring it back
    assert not kube.delete(CONFIG) and kube.writes == 2
    assert not kube.scale(NS, "gone", 1) and kube.writes == 2


class Failing(Kube):
    """A Kube whose API server fails every write (a 500), after the real read."""

    def _call(self, verb: str, obj: Mapping[str, Any], **kwargs: Any) -> Any:
        if verb == "read":
            return super()._call(verb, obj, **kwargs)
        raise ApiException(status=500, reason="Internal Server Error")


@pytest.mark.parametrize("write", [lambda k: k.apply(CONFIG), lambda k: k.delete(CONFIG)],
                         ids=["create", "delete"])
def test_a_write_that_failed_for_another_reason_is_raised(emu: KubeEmulator,
                                                          write: Any) -> None:
    kube = Failing(emu.api_client())
    with pytest.raises(ApiException) as info:
        write(kube)
    assert info.value.status == 500 and kube.writes == 0
