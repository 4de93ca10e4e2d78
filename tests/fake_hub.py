"""A local HTTP server with the Hugging Face Hub endpoints huggingface_hub's downloads use, for tests that run the
real snapshot_download against it (HF_ENDPOINT / huggingface_hub.constants.ENDPOINT), never the internet:

    GET  /api/models/{repo}[/revision/{rev}]            repo_info: {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{rev}[/{path}]          list_repo_tree: [{"type", "path", "size", "oid"}]
    HEAD/GET /{repo}/resolve/{rev}/{file}                a file, with X-Repo-Commit, ETag, Content-Length

Unknown repos, revisions and files answer 404 with the Hub's X-Error-Code (RepoNotFound, RevisionNotFound,
EntryNotFound), which huggingface_hub turns into its typed errors. Every request is recorded (hub.requests).

    with FakeHub({"org/tiny": {"main": {"config.json": b"{...}", ...}, "v2": {...}}}) as hub: hub.url ...
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]]):
        """repos: repo id -> revision (branch or tag name) -> file path -> content."""
        self.repos = repos
        self.requests: list[tuple[str, str]] = []  # (method, path)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                hub._handle(self, body=True)

            def do_HEAD(self):  # noqa: N802
                hub._handle(self, body=False)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloaded(self) -> set[str]:
        """Files fetched with GET (repo/file)."""
        out = set()
        for method, path in self.requests:
            if method == "GET" and "/resolve/" in path:
                repo, rest = path.lstrip("/").split("/resolve/", 1)
                out.add(f"{repo}/{rest.split('/', 1)[1]}")
        return out

    @staticmethod
    def commit(repo: str, revision: str) -> str:
        return hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()

    def _revision(self, repo: str, rev: str) -> tuple[str, dict[str, bytes]] | None:
        for name, files in self.repos[repo].items():
            if rev in (name, self.commit(repo, name)):
                return self.commit(repo, name), files
        return None

    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path))
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/") :]
            if "/tree/" in rest:
                repo, tail = rest.split("/tree/", 1)
                rev, _, sub = tail.partition("/")
                return self._tree(h, repo, rev, sub, body)
            repo, _, rev = rest.partition("/revision/")
            return self._info(h, repo, rev or "main", body)
        if "/resolve/" in path:
            repo, tail = path.lstrip("/").split("/resolve/", 1)
            rev, _, name = tail.partition("/")
            return self._file(h, repo, rev, name, body)
        self._error(h, 404, "EntryNotFound", "no such route")

    def _found(self, h, repo: str, rev: str):
        if repo not in self.repos:
            self._error(h, 404, "RepoNotFound", f"Repository Not Found for url: {repo}")
            return None
        found = self._revision(repo, rev)
        if found is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return found

    def _info(self, h, repo, rev, body):
        found = self._found(h, repo, rev)
        if found:
            sha, files = found
            self._json(
                h,
                {
                    "id": repo,
                    "modelId": repo,
                    "sha": sha,
                    "private": False,
                    "siblings": [{"rfilename": f} for f in sorted(files)],
                },
                body,
            )

    def _tree(self, h, repo, rev, sub, body):
        found = self._found(h, repo, rev)
        if found:
            _, files = found
            prefix = sub.rstrip("/") + "/" if sub else ""
            self._json(
                h,
                [
                    {"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for f, data in sorted(files.items())
                    if f.startswith(prefix)
                ],
                body,
            )

    def _file(self, h, repo, rev, name, body):
        found = self._found(h, repo, rev)
        if not found:
            return
        sha, files = found
        if name not in files:
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist", sha)
        data = files[name]
        h.send_response(200)
        h.send_header("X-Repo-Commit", sha)
        h.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    @staticmethod
    def _json(h, obj, body):
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    @staticmethod
    def _error(h, status, code, message, sha=None):
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if sha:
            h.send_header("X-Repo-Commit", sha)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


def folder_files(folder: str) -> dict[str, bytes]:
    """Every file of a local folder, by its path relative to it (a repo's content for FakeHub)."""
    import os

    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, folder).replace(os.sep, "/")] = f.read()
    return out
