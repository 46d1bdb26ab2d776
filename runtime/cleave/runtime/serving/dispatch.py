"""Where a request's decode runs, and how it survives the worker running it.

Every worker holds the whole model and can run both phases, so the roles are a preference, not
a wall: the decode goes to a decode worker, and when none is healthy (the only one died, or the
role is scaled to zero while prefill is not) a prefill worker serves the request whole. A
worker that drops the stream mid-answer is resumed on another one of either role from the
tokens already sent (resume.py). A prefill worker's decoding shows in its own
``cleave_generation_tokens_total{role="prefill"}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from cleave.runtime import metrics
from cleave.runtime.serving import protocol as api
from cleave.runtime.serving.deadline import Deadline
from cleave.runtime.serving.fleet import Fleet
from cleave.runtime.serving.resume import continuation, rebased
from cleave.runtime.serving.routing import choose_server
from cleave.runtime.serving.upstream import WorkerRejected, WorkerUnavailable
from cleave.runtime.serving.wire import GenerateRequest, TokenLine

log = logging.getLogger("cleave.router")


async def decode_stream(fleet: Fleet, rid: str, payload: GenerateRequest, sent: list[int],
                        start: float, deadline: Deadline, idle_timeout: float
                        ) -> AsyncIterator[TokenLine]:
    """The worker lines of one request's decode, from whichever worker can give them.

    ``sent`` holds the tokens the client already has (a prefill's first token) and grows as
    lines pass; a worker failing after more were sent resumes elsewhere from there. Every
    attempt shares the request's one ``deadline`` (a 504 once it passes).
    """
    handed = len(sent)
    cached_tokens: int | None = 0
    tried: set[str] = set()
    while True:
        chosen = choose_server(fleet.decode_candidates(), fleet.prefill_candidates(),
                               frozenset(tried))
        if chosen is None:
            if len(sent) > handed:
                raise api.APIError(502, "the decode worker failed mid-response and no other "
                                   "could continue it", "server_error", code="worker_failed")
            raise api.APIError(503, "no worker is available", "service_unavailable")
        _, worker = chosen
        tried.add(worker.url)
        resumed = len(sent) > handed
        attempt = continuation(payload, sent) if resumed else payload
        pool = fleet.pool_for(worker.url)
        left = deadline.remaining()
        try:
            async for line in pool.generate(worker.url, attempt, left, min(idle_timeout, left)):
                if not sent and line.token_ids:
                    metrics.TTFT.labels("router").observe(time.perf_counter() - start)
                if resumed:
                    line = rebased(line, cached_tokens)
                else:
                    cached_tokens = line.cached_tokens
                sent.extend(line.token_ids)
                yield line
            metrics.E2E.labels("router").observe(time.perf_counter() - start)
            return
        except WorkerRejected as e:
            if e.status == 424:  # KV missing under policy "fail"
                raise api.APIError(503, str(e), "service_unavailable") from None
            if e.status >= 500:
                raise api.APIError(502, str(e), "server_error", code="worker_failed") from None
            raise api.APIError(400, str(e)) from None
        except WorkerUnavailable as e:
            deadline.remaining()  # a 504 if that attempt used up the request's time
            if len(sent) > handed:
                log.warning("request %s: %s after %d tokens; resuming it on another worker",
                            rid, e, len(sent))
            else:
                log.warning("request %s: %s; trying another worker", rid, e)
