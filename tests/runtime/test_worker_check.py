"""`cleave worker --check` and `cleave router --check`: what a deployment check runs for each
container: every flag parsed, the model resolved, the configuration built, exit 0, nothing
served. A bad flag or value is exit 2 with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "cleave.common.cli"]


def check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args, "--check"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_worker_check_resolves_model_engine_store_and_salt(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    salt = tmp_path / "salt"
    salt.write_text("s3cret\n")
    done = check("worker", "--role", "decode", "--model", str(tiny_model_dir),
                 "--kv-cache-memory", "256Mi", "--redis-url", "redis://r.svc:6379/0",
                 "--kv-ttl-seconds", "120", "--kv-salt-file", str(salt))
    assert done.returncode == 0, done.stderr
    assert "configuration OK" in done.stdout
    assert "kv_cache_bytes=268435456" in done.stdout
    assert "ttl 120 s, salted: True" in done.stdout
    assert "s3cret" not in done.stdout + done.stderr  # a secret is never printed
    unsalted = check("worker", "--model", str(tiny_model_dir))
    assert "salted: False" in unsalted.stdout
    salted_by_env = check("worker", "--model", str(tiny_model_dir),
                          env={"CLEAVE_KV_SALT": "from-a-secret"})
    assert "salted: True" in salted_by_env.stdout


def test_worker_check_fails_on_what_would_crash_the_pod(tiny_model_dir: Path) -> None:
    for args, reason in ((["--kv-cache-memory", "lots"], "kv-cache-memory"),
                         (["--model", "/nowhere/model"], "not found"),
                         (["--dtype", "int3"], "dtype"),
                         (["--redis-url", "http://not-redis"], "redis")):
        done = check("worker", "--model", str(tiny_model_dir), *args)
        assert done.returncode == 2, (args, done.stdout)
        assert reason in done.stderr.lower() or reason in done.stderr, (args, done.stderr)


def test_router_check(tiny_model_dir: Path) -> None:
    done = check("router", "--model", str(tiny_model_dir), "--decode", "dns+http://d.svc:8100")
    assert done.returncode == 0, done.stderr
    assert "configuration OK" in done.stdout
    assert check("router", "--model", str(tiny_model_dir)).returncode == 2  # no decode worker
    for bad in (["--redis-url", "http://not-redis"], ["--api-key-file", "/no/such/key"]):
        done = check("router", "--model", str(tiny_model_dir), "--decode", "http://d:1", *bad)
        assert done.returncode == 2, (bad, done.stdout)
