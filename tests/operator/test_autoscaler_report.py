"""How autoscaler decisions become status entries, Events and log lines (pure)."""

from __future__ import annotations

from typing import Any

from cleave.autoscaling import report
from cleave.autoscaling.policy import Decision

# --- report -------------------------------------------------------------------------------


def decision(role: str, desired: int, reason: str = "ttft asks for 3") -> Decision:
    return Decision(role, 1, desired, reason, {"latency_p90": "1.2", "ready": "1"})


def test_acting_changes_are_desired_against_the_deployment() -> None:
    found = report.changes([decision("prefill", 3), decision("decode", 1)],
                           {"prefill": 1, "decode": 1}, None, dry_run=False)
    assert [(c.role, c.current, c.desired, c.act, c.direction) for c in found] == [
        ("prefill", 1, 3, True, "up")]
    # Someone scaled by hand: the autoscaler owns the role and puts it back, and says so.
    [back] = report.changes([decision("prefill", 3)], {"prefill": 7},
                            {"dryRun": False, "desiredReplicas": {"prefill": 3}}, False)
    assert (back.current, back.desired, back.direction) == (7, 3, "down")


def test_advisory_changes_are_told_once() -> None:
    first = report.changes([decision("prefill", 3)], {"prefill": 1}, None, dry_run=True)
    assert [(c.act, c.desired) for c in first] == [(False, 3)]
    block = report.status_block(None, first, {"prefill": 3}, True, "t1")
    assert report.changes([decision("prefill", 3)], {"prefill": 1}, block, True) == []
    again = report.changes([decision("prefill", 1)], {"prefill": 1}, block, True)
    assert [(c.current, c.desired) for c in again] == [(1, 1)]  # back to where it is: told


def test_status_block_is_newest_first_and_bounded() -> None:
    block: dict[str, Any] | None = None
    for i in range(12):
        found = report.changes([decision("prefill", i + 2)], {"prefill": i + 1}, block, False)
        block = report.status_block(block, found, {"prefill": i + 2}, False, f"t{i}")
    assert block is not None
    assert len(block["decisions"]) == report.KEEP_DECISIONS
    assert [d["time"] for d in block["decisions"][:2]] == ["t11", "t10"]
    assert block["decisions"][0] == {
        "time": "t11", "role": "prefill", "current": 12, "desired": 13,
        "reason": "ttft asks for 3", "advisory": False,
        "inputs": {"latency_p90": "1.2", "ready": "1"}}
    assert block["desiredReplicas"] == {"prefill": 13}


def test_needs_write_only_for_a_change_or_a_mode_switch() -> None:
    block = {"dryRun": True, "desiredReplicas": {}, "decisions": []}
    assert not report.needs_write(None, [], False)
    assert not report.needs_write(block, [], True)
    assert report.needs_write(block, [], False)


def test_event_and_log_line() -> None:
    [up] = report.changes([decision("decode", 3, "kv asks for 3")], {"decode": 1}, None, False)
    assert report.event(up) == ("ScaledUp", "decode 1 -> 3: kv asks for 3")
    [advice] = report.changes([decision("decode", 0, "idle")], {"decode": 1}, None, True)
    assert report.event(advice) == ("WouldScaleDown", "advisory (dryRun): decode 1 -> 0: idle")
    line = report.log_line("ml/chat", up)
    assert line.startswith("autoscaler scale ml/chat decode 1 -> 3 (kv asks for 3)")
    assert "latency_p90=1.2" in line and "ready=1" in line
