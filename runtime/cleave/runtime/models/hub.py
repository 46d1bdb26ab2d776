"""Models from the Hugging Face hub, or any server that answers as it does (``HF_ENDPOINT``).

A hub id (``Qwen/Qwen2.5-0.5B-Instruct``) at a revision (branch, tag or commit; vLLM's
``--revision``) is downloaded with huggingface_hub's ``snapshot_download`` into
``<cache>/hub`` (the Cleave cache, ``CLEAVE_CACHE_DIR``), the layout huggingface_hub itself
uses, so its own cache tools work on it. Only the files :mod:`weights` names are fetched. The
token is ``HF_TOKEN`` (or huggingface_hub's stored login). With ``HF_HUB_OFFLINE=1``, or when
the hub cannot be reached, a model already in the cache is used without any request.

Torch-free: the router (no torch) resolves hub models too.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cleave.common.model_source import looks_like_hub_id
from cleave.runtime.models.weights import NoWeightsError, needed_names, weight_names

HUB_SUBDIR = "hub"
_COMMIT = re.compile(r"[0-9a-f]{40}")
_BLOB = re.compile(r"[0-9a-f]{64}")  # an LFS blob's name in the cache: its sha256
OFFLINE_HINT = ("set HF_HUB_OFFLINE=1 to use only the cache (fill it first where the hub is "
                "reachable: cleave download ID)")


class HubError(ValueError):
    """A hub model cannot be had; the message says why and what to do."""


class _Unreachable(Exception):
    pass


@dataclass(frozen=True)
class HubPlan:
    """What a hub id at a revision resolves to, without downloading weights."""

    repo_id: str
    revision: str
    commit: str
    files: tuple[str, ...]
    weight_bytes: int

    def describe(self) -> str:
        weights = weight_names(self.files)
        return (f"{self.repo_id}@{self.revision} -> commit {self.commit[:12]}, "
                f"{len(weights)} weight file(s) ({weights[0].rsplit('.', 1)[-1]}, "
                f"{self.weight_bytes / 1e6:.1f} MB), {len(self.files)} files to download")


def is_hub_id(source: str) -> bool:
    """``org/name`` (or a bare legacy name like ``gpt2``) that is not a local path."""
    return looks_like_hub_id(source) and not Path(source).expanduser().exists()


def hub_cache(cache_dir: Path) -> Path:
    return cache_dir / HUB_SUBDIR


def _offline() -> bool:
    # Read now, not at import: huggingface_hub reads HF_HUB_OFFLINE once when imported.
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None  # likewise read at import by huggingface_hub


@contextmanager
def _hub_errors(repo_id: str, revision: str) -> Iterator[None]:
    """huggingface_hub's exceptions as one clear line each; unreachable as ``_Unreachable``."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = _endpoint() or "huggingface.co"
    try:
        yield
    except GatedRepoError:
        raise HubError(f"'{repo_id}' is gated: accept its terms on the hub with your account, "
                       "then set HF_TOKEN to a token of that account (on Kubernetes: "
                       "spec.model.tokenSecret)") from None
    except RepositoryNotFoundError:
        raise HubError(f"model '{repo_id}' not found on {where} and not a local path (a "
                       "private repo needs HF_TOKEN; a local model is a directory or a .gguf "
                       "file)") from None
    except RevisionNotFoundError:
        raise HubError(f"'{repo_id}' has no revision '{revision}'") from None
    except (OfflineModeIsEnabled, httpx2.TransportError) as e:
        raise _Unreachable(f"{where} unreachable ({type(e).__name__}: {e})") from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else 0
        if status == 401:
            raise HubError(f"{where} refused the token for '{repo_id}' (401): check "
                           "HF_TOKEN") from None
        if status >= 500:
            raise _Unreachable(f"{where} answered {status}") from e
        raise HubError(f"{where}: {e}") from None


def plan(repo_id: str, revision: str | None) -> HubPlan:
    """Ask the hub what ``repo_id`` at ``revision`` holds and which files to fetch (one
    request; no download). Raises :class:`HubError` or ``_Unreachable``."""
    from huggingface_hub import HfApi

    rev = revision or "main"
    with _hub_errors(repo_id, rev):
        info = HfApi(endpoint=_endpoint()).model_info(
            repo_id, revision=rev, files_metadata=True, token=os.environ.get("HF_TOKEN"))
    siblings = {s.rfilename: s for s in info.siblings or []}
    try:
        files = needed_names(siblings)
    except NoWeightsError:
        raise HubError(f"'{repo_id}'@{rev} holds no weights in safetensors or "
                       f"pytorch_model*.bin form (files: {', '.join(sorted(siblings))})") from None
    size = sum(siblings[n].size or 0 for n in weight_names(files))
    assert info.sha is not None
    return HubPlan(repo_id, rev, info.sha, files, size)


def _download(p: HubPlan, cache_dir: Path) -> Path:
    from huggingface_hub import snapshot_download

    with _hub_errors(p.repo_id, p.revision):
        # The revision as asked (not the commit) so that huggingface_hub records the branch's
        # commit under refs/: an offline start later resolves the branch from the cache.
        return Path(snapshot_download(
            p.repo_id, revision=p.revision, allow_patterns=list(p.files),
            cache_dir=hub_cache(cache_dir), endpoint=_endpoint(),
            token=os.environ.get("HF_TOKEN")))


def _cached(repo_id: str, revision: str, cache_dir: Path) -> Path | None:
    """The snapshot a previous download left for ``revision``, complete, or None."""
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError

    try:
        tree = get_cached_repo_tree(repo_id, revision=revision, cache_dir=hub_cache(cache_dir))
        files = needed_names(f.path for f in tree)
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(files),
                                      cache_dir=hub_cache(cache_dir), local_files_only=True))
    except (CachedRepoTreeNotFoundError, LocalEntryNotFoundError, NoWeightsError):
        return None


def weights_digest(snapshot: Path) -> str:
    """The weight files' sha256s, combined as a local directory's are (``_file_digest``), so the
    same files share KV blocks whichever way they were given.

    Cheap: huggingface_hub names an LFS file's blob by its sha256 (the LFS oid the hub reports),
    and a snapshot's files are links to their blobs, so nothing is read. A file not stored in
    LFS (no sha256 name) is hashed.
    """
    digests = []
    for name in weight_names(p.name for p in snapshot.iterdir()):
        path = snapshot / name
        blob = path.resolve().name
        if _BLOB.fullmatch(blob):
            digests.append(blob)
        else:
            with path.open("rb") as f:
                digests.append(hashlib.file_digest(f, "sha256").hexdigest())
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def fetch(repo_id: str, revision: str | None, cache_dir: Path,
          progress: Callable[[str], None]) -> Path:
    """The snapshot directory of ``repo_id`` at ``revision``, downloading what is missing."""
    rev = revision or "main"
    # A commit never changes: once in the cache, no request is needed.
    if (_COMMIT.fullmatch(rev) or _offline()) and (found := _cached(repo_id, rev, cache_dir)):
        return found
    if _offline():
        raise HubError(f"HF_HUB_OFFLINE is set and '{repo_id}'@{rev} is not in the cache "
                       f"{hub_cache(cache_dir)}")
    try:
        p = plan(repo_id, rev)
        progress(f"downloading {p.describe()} into {hub_cache(cache_dir)}")
        return _download(p, cache_dir)
    except _Unreachable as e:
        found = _cached(repo_id, rev, cache_dir)
        if found is None:
            raise HubError(f"{e}, and '{repo_id}'@{rev} is not in the cache "
                           f"{hub_cache(cache_dir)}: check the network or HF_ENDPOINT, or "
                           f"{OFFLINE_HINT}") from None
        progress(f"{e}: using the cached {found}")
        return found


def check(repo_id: str, revision: str | None, cache_dir: Path) -> str:
    """What ``--check`` prints for a hub id: the commit and files it resolves to. Asks the hub
    (no weights downloaded); offline, says what the cache holds."""
    rev = revision or "main"
    if not _offline():
        try:
            return plan(repo_id, rev).describe()
        except _Unreachable as e:
            reason = str(e)
    else:
        reason = "HF_HUB_OFFLINE is set"
    found = _cached(repo_id, rev, cache_dir)
    if found is None:
        raise HubError(f"{reason}, and '{repo_id}'@{rev} is not in the cache "
                       f"{hub_cache(cache_dir)} ({OFFLINE_HINT})")
    return f"{repo_id}@{rev} -> cached commit {found.name[:12]} ({reason})"
