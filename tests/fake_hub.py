"""A stand-in for the Hugging Face Hub on 127.0.0.1 (HF_ENDPOINT): the few routes huggingface_hub's
snapshot_download uses (a revision's commit, a commit's file tree, a file's metadata and bytes) and
the error answers the Hub gives (an unknown repository, an unknown revision, a gated repository
without its token), so that downloads are tested without a network."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> bytes
    token: str | None = None  # gated: files are served only with "Authorization: Bearer <token>"

    def add_commit(self, ref: str, files: dict[str, bytes]) -> str:
        commit = hashlib.sha1(json.dumps(sorted((p, hashlib.sha1(b).hexdigest()) for p, b in files.items()))
                              .encode()).hexdigest()
        self.refs[ref] = commit
        self.commits[commit] = files
        return commit

    def commit_of(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(directory.iterdir()) if file.is_file()}


class FakeHub:
    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[str] = []  # "METHOD path" of each request, in order

    def repo(self, repo_id: str) -> FakeRepo:
        return self.repos.setdefault(repo_id, FakeRepo())

    def answer(self, method: str, path: str, authorization: str | None) -> tuple[int, dict[str, str], bytes]:
        self.requests.append(f"{method} {path}")
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            return self._api(parts[2] + "/" + parts[3], parts[4], parts[5])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), authorization)
        return 404, {}, b"{}"

    def _api(self, repo_id: str, route: str, revision: str) -> tuple[int, dict[str, str], bytes]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return 401, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}'
        commit = repo.commit_of(revision)
        if commit is None:
            return 404, {"X-Error-Code": "RevisionNotFound"}, b'{"error": "Invalid rev id"}'
        if route == "revision":
            body = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                    "gated": "manual" if repo.token else False,
                    "siblings": [{"rfilename": name} for name in repo.commits[commit]]}
        else:
            body = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in repo.commits[commit].items()]
        return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()

    def _file(self, repo_id: str, revision: str, name: str, authorization: str | None
              ) -> tuple[int, dict[str, str], bytes]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return 401, {"X-Error-Code": "RepoNotFound"}, b""
        if repo.token is not None and authorization != f"Bearer {repo.token}":
            return 403, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is restricted"}, b""
        commit = repo.commit_of(revision)
        if commit is None:
            return 404, {"X-Error-Code": "RevisionNotFound"}, b""
        data = repo.commits[commit].get(name)
        if data is None:
            return 404, {"X-Error-Code": "EntryNotFound"}, b""
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Type": "application/octet-stream"}
        return 200, headers, data


@contextlib.contextmanager
def serve_fake_hub(hub: FakeHub):
    """Serve `hub` on a free port of 127.0.0.1; yields its endpoint URL."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, with_body: bool) -> None:
            path = urlsplit(self.path).path
            status, headers, body = hub.answer(self.command, path, self.headers.get("Authorization"))
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - http.server's naming
            self._reply(with_body=True)

        def do_HEAD(self):  # noqa: N802
            self._reply(with_body=False)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
