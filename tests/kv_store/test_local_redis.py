"""The private redis-server of benchmarks and ``cleave up``: it starts, answers, keeps the
memory it frees for reuse (unless the environment says otherwise), and leaves nothing behind."""

from __future__ import annotations

import pytest
import redis

from cleave.kv_store.local_redis import LocalRedis, start_local_redis


def _decay_settings(server: LocalRedis) -> list[str]:
    """jemalloc's own account of its options, as the running server reports them."""
    client = redis.Redis(unix_socket_path=str(server.unixsocket))
    try:
        stats = client.execute_command("MEMORY", "MALLOC-STATS").decode()
    finally:
        client.close()
    return [line.strip() for line in stats.splitlines() if line.strip().startswith("opt.")
            and "decay_ms" in line]


def test_a_local_redis_keeps_freed_memory_and_cleans_up(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    with start_local_redis() as server:
        assert _decay_settings(server) == [
            "opt.dirty_decay_ms: -1 (arenas.dirty_decay_ms: -1)",
            "opt.muzzy_decay_ms: -1 (arenas.muzzy_decay_ms: -1)"]
        workdir = server.workdir
        assert server.unixsocket.exists()
    assert server.proc.poll() is not None  # stopped
    assert not workdir.exists()


def test_a_malloc_conf_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_CONF", "dirty_decay_ms:1000")
    with start_local_redis() as server:
        assert "opt.dirty_decay_ms: 1000 (arenas.dirty_decay_ms: 1000)" in _decay_settings(server)
