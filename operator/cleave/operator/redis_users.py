"""The managed Redis's ACL users: each component may run only the commands it sends.

Pure, like ``builders``. Three users, each with its own password (one Secret,
``credentials.REDIS_USERS``, one key each; a pod's env takes only its own key):

- ``cleave-worker`` (the prefill and decode pods): the commands the block store sends
  (kv_store/cleave/kv_store/redis_store.py, resp.py, transfer.py): SET (puts, with EX),
  GETEX (every read renews the block's TTL, so no plain GET), STRLEN (the lookup before a
  read of unknown size), PING (``/ready``), on the service's own keys only
  (``cleave:v1:<ns>.<name>:*``). No SELECT: the URL names database 0, which neither client
  selects. tests/kv_store/test_redis_acl_users.py records what the store sends and checks
  it is this list, no more, no less.
- ``cleave-router``: STRLEN (how much of a prompt is cached), read-only, on the same keys.
- ``default``: every command, with the admin password; only the Redis pod holds it (a human
  with ``kubectl exec`` into that pod uses it; no Cleave process does).

AUTH and HELLO need no grant (Redis allows them to every user). Nobody gets KEYS, SCAN,
FLUSHALL, CONFIG, or another service's keys. redis-py's CLIENT SETINFO on connect is turned
off in kv_store/redis_config.py rather than granted.
"""

from __future__ import annotations

from dataclasses import dataclass

from cleave.kv_store.keys import namespace_pattern
from cleave.operator import credentials
from cleave.operator.metadata import Manifest
from cleave.operator.spec import LLMServiceSpec, SecretRef

REDIS_PORT = 6379
WORKER_USER = "cleave-worker"
ROUTER_USER = "cleave-router"
WORKER_COMMANDS = ("set", "getex", "strlen", "ping")
ROUTER_COMMANDS = ("strlen",)
# The Secret's keys, and the Redis pod's variables that carry them into its ACL file.
SECRET = credentials.REDIS_USERS
ADMIN_KEY, WORKER_KEY, ROUTER_KEY = SECRET.keys
_ENV = {ADMIN_KEY: "REDIS_ADMIN_PASSWORD", WORKER_KEY: "REDIS_WORKER_PASSWORD",
        ROUTER_KEY: "REDIS_ROUTER_PASSWORD"}


@dataclass(frozen=True)
class RedisPasswords:
    """The managed Redis's passwords, generated once by the operator (never logged)."""

    admin: str
    worker: str
    router: str

    def __repr__(self) -> str:
        return "RedisPasswords(***)"

    def as_data(self) -> dict[str, str]:
        return {ADMIN_KEY: self.admin, WORKER_KEY: self.worker, ROUTER_KEY: self.router}


NO_PASSWORDS = RedisPasswords("", "", "")  # an external store: no managed users


def secret(spec: LLMServiceSpec, owner: Manifest, passwords: RedisPasswords) -> Manifest:
    return SECRET.secret(spec, owner, passwords.as_data())


def user_of(component: str) -> tuple[str, str]:
    """The ACL user a component connects as, and its key in the Secret."""
    return (ROUTER_USER, ROUTER_KEY) if component == "router" else (WORKER_USER, WORKER_KEY)


def acl_rules(kv_namespace: str) -> list[str]:
    """The ACL file, one user a line, with ``${VAR}`` where the Redis pod's shell puts each
    password (from its environment: never in the pod spec or on a command line)."""
    keys = namespace_pattern(kv_namespace)
    worker = " ".join(f"+{c}" for c in WORKER_COMMANDS)
    router = " ".join(f"+{c}" for c in ROUTER_COMMANDS)
    return [f"user default on >${{{_ENV[ADMIN_KEY]}}} ~* &* +@all",
            f"user {WORKER_USER} reset on >${{{_ENV[WORKER_KEY]}}} ~{keys} -@all {worker}",
            f"user {ROUTER_USER} reset on >${{{_ENV[ROUTER_KEY]}}} %R~{keys} -@all {router}"]


def server_script(kv_namespace: str, options: list[str]) -> str:
    """The Redis container's ``sh -c`` script: write the ACL file (mode 600, in the pod's own
    /tmp, or $TMPDIR) from the passwords in its environment, then run redis-server on it with
    ``options`` and any arguments the script is given."""
    lines = " ".join(f'"{rule}"' for rule in acl_rules(kv_namespace))
    return ('umask 077 && acl="${TMPDIR:-/tmp}/users.acl" && '
            f'printf "%s\\n" {lines} > "$acl" && '
            f'exec redis-server --aclfile "$acl" {" ".join(options)} "$@"')


def server_env(spec: LLMServiceSpec) -> list[Manifest]:
    """The Redis pod's variables: all three passwords (its script writes the ACL file)."""
    return [credentials.env(env, SECRET.ref(spec, key)) for key, env in _ENV.items()]


def password_ref(spec: LLMServiceSpec, component: str) -> SecretRef:
    """The one key of the Secret that ``component``'s pods take: their own user's password."""
    return SECRET.ref(spec, user_of(component)[1])
