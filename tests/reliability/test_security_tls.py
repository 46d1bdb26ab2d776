"""Security: the KV store over TLS with a private CA, on a real ``cleave up``.

A redis-server serves TLS with a certificate a test CA signed for ``redis.test`` only, reached
at 127.0.0.1. With ``--redis-tls-ca-file`` (that CA) and ``--redis-tls-server-name
redis.test``, the prefill worker stores a prompt's blocks and the decode worker loads them.
With another CA the stack still serves (the store is a cache: requests recompute), and each
worker's ``/ready`` says why the store fails (the certificate check), and its log says so once
at start: a TLS mistake is never a silent, permanent recompute.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import trustme
from figures import report
from redis_servers import RedisServer, free_port, start_server
from up_stack import UpProcess, metric_total, running_up

from cleave.common import metric_names as names

LONG_PROMPT = "the engineer builds many books before dinner " * 6  # disaggregated
SERVER_NAME = "redis.test"  # the only name the server's certificate carries


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory,
              ) -> Iterator[tuple[RedisServer, int, Path]]:
    certs = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(certs / "ca.pem"))
    trustme.CA().cert_pem.write_to_path(str(certs / "other-ca.pem"))
    leaf = ca.issue_cert(SERVER_NAME)
    leaf.private_key_pem.write_to_path(str(certs / "server.key"))
    leaf.cert_chain_pems[0].write_to_path(str(certs / "server.pem"))
    port = free_port()
    server = start_server(extra_args=[
        "--tls-port", str(port), "--tls-cert-file", str(certs / "server.pem"),
        "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.pem"),
        "--tls-auth-clients", "no"])
    yield server, port, certs
    server.stop()


def _tls_up(model: Path, logdir: Path, port: int, ca: Path) -> Iterator[UpProcess]:
    return running_up(model, logdir, prefill=1, decode=1,  # type: ignore[no-any-return]
                      redis_url=f"rediss://127.0.0.1:{port}/0",
                      extra_args=["--redis-tls-ca-file", str(ca),
                                  "--redis-tls-server-name", SERVER_NAME])


def _ready_store(up: UpProcess) -> list[str]:
    stores = []
    for worker in up.workers():
        with urllib.request.urlopen(worker.url + "/ready", timeout=5) as r:
            stores.append(json.loads(r.read())["store"])
    return stores


def _complete(up: UpProcess) -> int:
    reply = openai.OpenAI(base_url=up.base_url, api_key="-", max_retries=0, timeout=30) \
        .completions.create(model=up.model, prompt=LONG_PROMPT, max_tokens=4,
                            extra_body={"ignore_eos": True})
    assert reply.usage is not None
    return reply.usage.completion_tokens


def test_workers_store_and_load_blocks_over_tls_with_the_right_ca(
        tiny_model_dir: Path, tmp_path: Path, tls_redis: tuple[RedisServer, int, Path]) -> None:
    server, port, certs = tls_redis
    began = time.monotonic()
    with _tls_up(tiny_model_dir, tmp_path, port, certs / "ca.pem") as up:
        came_up = time.monotonic() - began
        assert _complete(up) == 4
        assert _ready_store(up) == ["ok", "ok"]
        hits = metric_total(up.worker("decode-0").url, names.total(names.STORE_HITS))
        written = server.client().dbsize()  # through the plain port: what TLS clients wrote
    assert hits > 0 and written > 0
    report("security_redis_tls", came_up_s=round(came_up, 1), blocks_written=written,
           decode_hits=int(hits))


def test_a_wrong_ca_is_reported_by_every_workers_ready(
        tiny_model_dir: Path, tmp_path: Path, tls_redis: tuple[RedisServer, int, Path]) -> None:
    _, port, certs = tls_redis
    with _tls_up(tiny_model_dir, tmp_path, port, certs / "other-ca.pem") as up:
        assert _complete(up) == 4  # served all the same, by recomputing
        stores = _ready_store(up)
        log = up.log_text()
    assert len(stores) == 2
    for store in stores:
        assert store.startswith("unavailable (recomputing)"), store
        assert "certificate verify failed" in store, store
    said = [line for line in log.splitlines() if "the KV store is unavailable" in line]
    assert len(said) == 2 and all("certificate verify failed" in line for line in said), said
    report("security_redis_wrong_ca", ready_store=stores[0][:120])


@pytest.mark.parametrize("flag", ["--redis-tls-ca-file", "--redis-tls-server-name",
                                  "--redis-password-file"])
def test_tls_flags_without_a_redis_url_are_refused_before_anything_starts(flag: str) -> None:
    """They would apply to the private redis-server, which has neither TLS nor a password."""
    done = subprocess.run([sys.executable, "-m", "cleave.common.cli", "up", flag, "x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "apply to a --redis-url" in done.stderr and "redis-server on" not in done.stdout
