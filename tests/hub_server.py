"""A local HTTP server that answers as the Hugging Face hub does, for tests without internet.

Point ``HF_ENDPOINT`` at :attr:`FakeHub.url`. It serves the requests huggingface_hub makes to
resolve and download a model (``huggingface_hub/hf_api.py`` and ``file_download.py``):

- ``GET /api/models/{repo}/revision/{rev}[?blobs=true]``: model info, ``sha`` and ``siblings``
  (with size, blob id and LFS sha256);
- ``GET /api/models/{repo}/tree/{rev}?recursive=...``: the file listing ``snapshot_download``
  caches per commit;
- ``HEAD`` and ``GET /{repo}/resolve/{rev}/{path}``: a file, with ``X-Repo-Commit``, ``ETag``
  (an LFS file's sha256, else its git blob id) and ``Content-Length``.

Errors carry the hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound,
GatedRepo), which huggingface_hub turns into its typed exceptions. Every request is recorded
(:attr:`FakeHub.requests`) so tests can assert what was and was not downloaded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pth")


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    gated_token: str | None = None  # set: only this Bearer token may download its files


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


def _entry(name: str, data: bytes) -> dict[str, Any]:
    entry: dict[str, Any] = {"size": len(data), "oid": _git_blob_id(data)}
    if _is_lfs(name):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                        "pointerSize": 134}
    return entry


class FakeHub:
    """Repos in memory behind a threaded HTTP server on 127.0.0.1; ``with FakeHub() as hub``."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self._server: ThreadingHTTPServer | None = None

    def add_commit(self, repo_id: str, files: dict[str, bytes], ref: str = "main") -> str:
        """A commit holding exactly ``files``; ``ref`` (a branch or tag) now points at it."""
        repo = self.repos.setdefault(repo_id, Repo())
        digest = hashlib.sha1()
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        digest.update(str(len(repo.commits)).encode())
        sha = digest.hexdigest()
        repo.commits[sha] = dict(files)
        repo.refs[ref] = sha
        return sha

    def add_directory(self, repo_id: str, directory: Path, ref: str = "main",
                      extra: dict[str, bytes] | None = None) -> str:
        files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
        return self.add_commit(repo_id, {**files, **(extra or {})}, ref)

    def downloads(self) -> list[str]:
        """File paths fetched with GET (HEAD requests only read metadata)."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests
                if m == "GET" and "/resolve/" in p]

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


class _HubError(Exception):
    def __init__(self, status: int, code: str) -> None:
        super().__init__(code)
        self.status, self.code = status, code


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:  # quiet: pytest shows failures, not traffic
            pass

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def do_GET(self) -> None:
            self._answer(head=False)

        def _answer(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            try:
                if path.startswith("/api/models/"):
                    self._json(self._api(path.removeprefix("/api/models/")))
                elif "/resolve/" in path:
                    self._file(path.lstrip("/"), head)
                else:
                    raise _HubError(404, "RepoNotFound")
            except _HubError as e:
                self.send_response(e.status)
                self.send_header("X-Error-Code", e.code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        def _repo(self, repo_id: str, download: bool = False) -> Repo:
            repo = hub.repos.get(repo_id)
            if repo is None:
                raise _HubError(404, "RepoNotFound")
            # As on the hub, a gated repo's metadata is public; its files need the token.
            if download and repo.gated_token is not None and \
                    self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
                raise _HubError(401, "GatedRepo")
            return repo

        def _commit(self, repo: Repo, rev: str) -> str:
            sha = repo.refs.get(rev, rev if rev in repo.commits else None)
            if sha is None:
                raise _HubError(404, "RevisionNotFound")
            return sha

        def _api(self, rest: str) -> Any:
            kind = "/revision/" if "/revision/" in rest else "/tree/"
            repo_id, _, rev = rest.partition(kind)
            repo = self._repo(repo_id)
            sha = self._commit(repo, rev)
            files = repo.commits[sha]
            if kind == "/tree/":
                return [{"type": "file", "path": n, **_entry(n, d)} for n, d in files.items()]
            siblings = []
            for n, d in sorted(files.items()):
                e = _entry(n, d)
                lfs = e.get("lfs")
                siblings.append({"rfilename": n, "size": e["size"], "blobId": e["oid"],
                                 **({"lfs": {"sha256": lfs["oid"], "size": lfs["size"],
                                             "pointerSize": lfs["pointerSize"]}} if lfs else {})})
            return {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                    "gated": "manual" if repo.gated_token else False, "siblings": siblings}

        def _json(self, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _file(self, path: str, head: bool) -> None:
            repo_id, _, rest = path.partition("/resolve/")
            rev, _, name = rest.partition("/")
            repo = self._repo(repo_id, download=True)
            sha = self._commit(repo, rev)
            data = repo.commits[sha].get(name)
            if data is None:
                raise _HubError(404, "EntryNotFound")
            entry = _entry(name, data)
            etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
            self.send_response(200)
            self.send_header("X-Repo-Commit", sha)
            self.send_header("ETag", f'"{etag}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

    return Handler
