"""`cleave simulate` end to end, the PNG timeline, and the baseline autoscalers."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from cleave.autoscaling.baselines import HpaConcurrency, Observation
from cleave.autoscaling.costmodel import build_cost_model
from cleave.autoscaling.llmd import LlmdLaw, LlmdSloFormula, formula
from cleave.autoscaling.policy import DECODE, PREFILL, RoleSignals
from cleave.autoscaling.scenarios import hpa_targets, run_policy, size_static
from cleave.autoscaling.simulator import SimConfig
from cleave.autoscaling.timeline import draw_timeline
from cleave.autoscaling.traces import poisson, step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CFG = SimConfig(build_cost_model("H200", "70b"), cold_start_s=60.0)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def cleave(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cleave.common.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_timeline_png_is_a_valid_png(tmp_path: Path) -> None:
    res = run_policy("cleave", step(900, seed=0), CFG, 8)
    out = draw_timeline(res, tmp_path / "t.png")
    assert png_size(out) == (1000, 1000)
    assert out.stat().st_size > 20_000  # four panels of lines, not an empty canvas


def test_cli_runs_end_to_end(tmp_path: Path) -> None:
    proc = cleave("simulate", "--trace", "step", "--duration", "600", "--cold-start", "30",
                  "--png", "t.png", "--json", "s.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "SLO attainment" in proc.stdout and "GPU-hours" in proc.stdout
    assert "simulating" in proc.stderr  # what it is doing, before it does it
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["policy"] == "cleave" and summary["requests"] > 1000
    assert 0 <= summary["slo_attainment"] <= 1 and summary["gpu_hours"] > 0
    assert summary["model"]["prefill_gpus_per_replica"] == 2
    assert png_size(tmp_path / "t.png")[0] > 0


def test_cli_static_policy_and_json_on_stdout(tmp_path: Path) -> None:
    proc = cleave("simulate", "--trace", "poisson", "--rate", "2", "--duration", "300",
                  "--policy", "static", "--static-replicas", "2,1", "--json", "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["replica_hours"] == {"prefill": pytest.approx(2 * 300 / 3600, abs=1e-3),
                                        "decode": pytest.approx(300 / 3600, abs=1e-3)}


def test_cli_reads_a_jsonl_trace_and_rejects_a_bad_one(tmp_path: Path) -> None:
    lines = [json.dumps({"arrival_s": i * 0.5, "prompt_tokens": 800, "output_tokens": 40})
             for i in range(200)]
    (tmp_path / "ok.jsonl").write_text("\n".join(lines) + "\n")
    proc = cleave("simulate", "--trace", "ok.jsonl", "--json", "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["requests"] == 200
    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n{oops\n")
    proc = cleave("simulate", "--trace", "bad.jsonl", cwd=tmp_path)
    assert proc.returncode == 2 and "bad.jsonl:2: not JSON" in proc.stderr


@pytest.mark.parametrize("args", [["--trace", "nope"], ["--gpu", "B200"], ["--rate", "-1"],
                                  ["--policy", "static", "--static-replicas", "2"],
                                  ["--policy", "static", "--static-replicas", "0,1"],
                                  ["--cold-start", "-1"], ["--max-replicas", "0"],
                                  ["--rate", "0.0001"]])  # a trace with no request
def test_cli_bad_input_is_a_clear_error(tmp_path: Path, args: list[str]) -> None:
    proc = cleave("simulate", *args, "--duration", "60", cwd=tmp_path)
    assert proc.returncode == 2 and "error" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_help_explains_the_options(tmp_path: Path) -> None:
    proc = cleave("simulate", "--help", cwd=tmp_path)
    assert proc.returncode == 0
    for option in ("--trace", "--gpu", "--cold-start", "--policy", "--png", "--json"):
        assert option in proc.stdout


# --- baselines ---------------------------------------------------------------------------

def obs(ttft: float | None, tpot: float | None, ready: int = 2,
        in_flight: float = 0.0) -> Observation:
    return Observation({PREFILL: RoleSignals(latency_p90=ttft, ready=ready),
                        DECODE: RoleSignals(latency_p90=tpot, ready=ready)},
                       {PREFILL: in_flight, DECODE: in_flight})


def test_llmd_formula_scales_every_role_on_the_worst_slo_ratio() -> None:
    lo, hi = {PREFILL: 1, DECODE: 1}, {PREFILL: 10, DECODE: 10}
    llmd = LlmdSloFormula(2.0, 0.05, lo, hi)
    up = llmd.decide(0.0, obs(2.2, 0.01))  # TTFT at 1.1 of its SLO: 2 * 1.1 / 0.55
    assert up[PREFILL][0] == up[DECODE][0] == 4
    # between 0.40 and 0.55 nothing moves; below, down once the 180 s window agrees
    llmd = LlmdSloFormula(2.0, 0.05, lo, hi)
    assert llmd.decide(0.0, obs(0.9, 0.024))[DECODE][0] == 2  # signal 0.48
    assert llmd.decide(100.0, obs(0.2, 0.01))[PREFILL][0] == 2  # 0.1, but the window holds
    assert llmd.decide(200.0, obs(0.2, 0.01))[PREFILL][0] == 1
    assert llmd.decide(215.0, obs(None, None, ready=1))[PREFILL][0] == 1  # no traffic reads 0


def test_llmd_law_clamps_credits_in_flight_replicas_and_limits_the_burst() -> None:
    lo, hi = {DECODE: 3}, {DECODE: 8}
    llmd = LlmdSloFormula(3.0, 0.1, lo, hi)
    # A 10x spike is clamped at 2.0: 2 + ceil(2 (2 / 0.55 - 1)) = 8, but the HPA adds at most
    # max(100 %, 4 pods) per 60 s: 2 -> 6.
    assert llmd.decide(0.0, obs(30.0, 0.05))[DECODE][0] == 6
    # Four of six ready: the ask is credited by 4/6; the smoothed signal (2 + 0.6) / 2 = 1.3
    # asks 6 + ceil(6 (1.3 * 4/6 / 0.55 - 1)) = 10, bounded to 8, but still inside the period.
    starting = Observation({PREFILL: RoleSignals(latency_p90=1.8, ready=4, starting=2),
                            DECODE: RoleSignals(latency_p90=0.05, ready=4, starting=2)},
                           {PREFILL: 0.0, DECODE: 0.0})
    assert llmd.decide(15.0, starting)[DECODE][0] == 6
    # A new period: the rest of the burst (the t=0 sample has left the 45 s average).
    spike = Observation({PREFILL: RoleSignals(latency_p90=30.0, ready=4, starting=2),
                         DECODE: RoleSignals(latency_p90=0.05, ready=4, starting=2)},
                        {PREFILL: 0.0, DECODE: 0.0})
    assert llmd.decide(61.0, spike)[DECODE][0] == 8
    # The credit: at signal 0.6 with 4 of 6 ready the formula (as llm-d's plot_run.py evaluates
    # it) asks 6 + ceil(6 (0.6 * 4/6 / 0.55 - 1)) = 5; the HPA's down window decides whether it
    # may (tests/operator/test_autoscaler_llmd.py).
    assert formula(0.6, 6, 4, LlmdLaw()) == 5


def test_hpa_scales_on_requests_in_flight_per_replica() -> None:
    hpa = HpaConcurrency({PREFILL: 3.0, DECODE: 100.0}, {PREFILL: 1, DECODE: 1},
                         {PREFILL: 10, DECODE: 10})
    out = hpa.decide(0.0, obs(None, None, ready=2, in_flight=12.0))
    assert out[PREFILL][0] == 4  # 6 per replica against 3
    assert out[DECODE][0] == 2  # 6 against 100, but the 300 s down window holds
    assert hpa.decide(301.0, obs(None, None, ready=2, in_flight=12.0))[DECODE][0] == 1
    assert hpa.decide(15.0, obs(None, None, ready=2, in_flight=6.3))[PREFILL][0] == 2  # tolerance


def test_hpa_targets_come_from_the_same_utilization() -> None:
    targets = hpa_targets(CFG, poisson(600, 3.0, seed=0))
    assert 2.0 < targets[PREFILL] < 5.0  # an M/G/1 queue at 80 % holds ~3 requests
    assert 150 < targets[DECODE] <= 0.8 * 256


def test_static_sizing_finds_the_smallest_deployment_that_meets_the_slo() -> None:
    trace = poisson(900, 6.0, seed=0)
    (p, d), res = size_static(trace, CFG, 8)
    assert res.slo_attainment() >= 0.99
    smaller = run_policy("static", trace, CFG, 8, static=(p - 1, d))
    assert smaller.slo_attainment() < 0.99
