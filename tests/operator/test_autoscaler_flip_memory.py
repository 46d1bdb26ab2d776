"""The role the operator remembers of each worker pod's run (``flips.Said``): what its stats
told, or a flip it took or left unanswered, taken when its stats miss the timeout; and what a
flip's ``POST /internal/role`` tells (taken, refused, unknown), against real HTTP servers."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from autoscaler_pods import Profile, Workers, free_port, pod_servers

from cleave.operator.autoscaler.flips import (
    FlipAnswer,
    Outcome,
    after_flip,
    container_run,
    flip,
    roles_now,
)


def worker_pod(name: str, uid: str, restarts: int, ip: str = "10.0.0.7",
               port: int = 8100) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid},
            "spec": {"containers": [{"name": "worker",
                                     "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "worker", "restartCount": restarts}]}}


def test_a_silent_pod_keeps_the_role_its_worker_last_told_until_it_restarts() -> None:
    p, d = worker_pod("p", "u-p", 0), worker_pod("d", "u-d", 0)
    roles, said = roles_now({"prefill": [p], "decode": [d]}, {"p": "prefill", "d": "prefill"},
                            {})
    assert roles == {"p": "prefill", "d": "prefill"}  # d was flipped
    # d's stats miss the timeout: it is where it last said, not home.
    roles, said = roles_now({"prefill": [p], "decode": [d]}, {"p": "prefill"}, said)
    assert roles["d"] == "prefill"
    # A restarted container (same pod) or a new pod of the same name starts in its home role.
    for again in (worker_pod("d", "u-d", 1), worker_pod("d", "u-d2", 0)):
        roles, _ = roles_now({"prefill": [p], "decode": [again]}, {}, said)
        assert roles == {"p": "prefill", "d": "decode"}
    # A pod never heard from is home and remembered as nothing; a gone pod is forgotten.
    roles, said = roles_now({"decode": [worker_pod("e", "u-e", 0)]}, {}, said)
    assert roles == {"e": "decode"} and said == {}


def test_an_unanswered_flip_counts_in_the_role_asked_until_the_stats_tell() -> None:
    d = worker_pod("d", "u-d", 0)
    run, pods = container_run(d), {"decode": [d]}
    said = after_flip({}, run, "prefill", Outcome.UNKNOWN)
    roles, said = roles_now(pods, {}, said)
    assert roles == {"d": "prefill"}  # silent: it may have switched, so it counts as asked
    # Its stats answer: they win. It never switched, and stays home while silent again.
    roles, said = roles_now(pods, {"d": "decode"}, said)
    assert roles == {"d": "decode"}
    assert roles_now(pods, {}, said)[0] == {"d": "decode"}
    # A taken flip is remembered; a refused one changes nothing; a pod without a uid has no run.
    assert after_flip(said, run, "prefill", Outcome.TAKEN) == {run: "prefill"}
    assert after_flip(said, run, "prefill", Outcome.REFUSED) == said == {run: "decode"}
    assert after_flip({}, None, "prefill", Outcome.UNKNOWN) == {}
    # A restarted container is a new run: home, whatever the last run was asked.
    said = after_flip({}, run, "prefill", Outcome.UNKNOWN)
    assert roles_now({"decode": [worker_pod("d", "u-d", 1)]}, {}, said)[0] == {"d": "decode"}


@pytest.fixture()
def workers() -> Iterator[Workers]:
    w = Workers()
    yield w
    w.close()


@contextlib.contextmanager
def _never_connects() -> Iterator[int]:
    """A port whose listener's queue is full (backlog 0, one connection never accepted):
    Linux drops the next SYN, so a connect hangs, as to a pod that went unreachable."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            yield port


async def test_a_flip_is_unknown_only_when_sent_and_not_answered(workers: Workers) -> None:
    """Taken on a 200; refused on another answer (here a 404: a pod without the route) or when
    no connection opens; unknown when the worker got the request and did not answer in time
    (it switched: a worker that answers late may have)."""
    fast = workers.add(Profile("decode"))
    slow = workers.add(Profile("decode"))
    workers.slow, workers.slow_paths, workers.stall_s = {slow}, {"/internal/role"}, 1.0
    with pod_servers() as servers:
        _, no_route = servers.add(Profile("decode"))
        async with aiohttp.ClientSession() as session:
            async def ask(port: int) -> FlipAnswer:
                return await flip(session, worker_pod("w", "u", 0, "127.0.0.1", port),
                                  "prefill", 0.3, {})

            assert await ask(fast) == FlipAnswer(Outcome.TAKEN)
            refused = await ask(no_route)
            assert refused.outcome is Outcome.REFUSED and refused.detail.startswith("HTTP 404")
            assert (await ask(free_port())).outcome is Outcome.REFUSED
            with _never_connects() as port:  # the SYN goes unanswered: nothing was sent
                assert await ask(port) == FlipAnswer(Outcome.REFUSED, "ConnectionTimeoutError")
            assert await ask(slow) == FlipAnswer(Outcome.UNKNOWN, "TimeoutError")
    assert sorted(workers.flips) == sorted([(fast, "prefill"), (slow, "prefill")])
