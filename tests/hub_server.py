"""A local stand-in for the Hugging Face hub, for tests: the hub's URL layout over a folder.

``HubServer(root)`` serves every ``root/ORG/REPO/...`` file as repository ``ORG/REPO``
at one commit, on a free port of 127.0.0.1, with what ``huggingface_hub`` calls:

- ``GET /api/models/ORG/REPO[/revision/REV]`` — the repository's info, with each
  file's size and LFS sha256 (``HfApi.model_info(files_metadata=True)``);
- ``HEAD|GET /ORG/REPO/resolve/REV/FILE`` — the file, with ``X-Repo-Commit``,
  ``ETag`` and ``X-Linked-Etag`` (its sha256, as the hub gives for LFS files),
  ``X-Linked-Size``, ``Accept-Ranges`` and single ``Range: bytes=A-B`` requests (206);
- a missing repository, revision or file is 404 with the hub's ``X-Error-Code``.

It counts the body bytes it sends per client, the client named by a
``meshnet-client/NAME`` word in its User-Agent (``other`` without one), and can
be told to misbehave: ``corrupt(file, offset, times)`` flips one byte the next times
it is sent; ``cut_after(n)`` ends every response after ``n`` more body bytes until
``cut_after(None)``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_CLIENT = re.compile(r"meshnet-client/([\w.-]+)")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
_CHUNK = 1 << 16


class HubServer:
    """The hub's layout for the repositories under ``root``; a context manager."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sent: Counter[str] = Counter()  # body bytes sent, per client name
        self.requests: list[tuple[str, str, str | None]] = []  # (client, path, range)
        self._corrupt: Counter[tuple[str, int]] = Counter()
        self._cut: int | None = None
        self._pause_s = 0.0
        self._lock = threading.Lock()
        self._sha: dict[Path, str] = {}
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=10)

    def corrupt(self, file: str, offset: int, times: int = 1) -> None:
        """Flip the byte at ``offset`` of ``file`` (ORG/REPO/NAME) the next ``times`` times
        it is sent."""
        with self._lock:
            self._corrupt[(file, offset)] += times

    def cut_after(self, n: int | None) -> None:
        """End each response after ``n`` more body bytes (None: serve whole)."""
        with self._lock:
            self._cut = n

    def throttle(self, seconds: float) -> None:
        """Wait ``seconds`` before each 64 KiB of a file body (0: none): a slow link."""
        self._pause_s = seconds

    def sha256(self, path: Path) -> str:
        if path not in self._sha:
            self._sha[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self._sha[path]

    def _take_cut(self, n: int) -> int:
        with self._lock:
            if self._cut is None:
                return n
            allowed = min(n, self._cut)
            self._cut -= allowed
            return allowed

    def _take_corrupt(self, file: str, start: int, end: int) -> list[int]:
        with self._lock:
            hits = [
                o for (f, o), n in self._corrupt.items() if n and f == file and start <= o < end
            ]
            for o in hits:
                self._corrupt[(file, o)] -= 1
            return hits


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: tests read the counters

        def do_GET(self) -> None:
            self._route(body=True)

        def do_HEAD(self) -> None:
            self._route(body=False)

        def _client(self) -> str:
            found = _CLIENT.search(self.headers.get("User-Agent", ""))
            return found.group(1) if found else "other"

        def _route(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self._client(), path, self.headers.get("Range")))
            api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if api:
                return self._info(api.group(1), api.group(2) or "main", body)
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if resolve:
                return self._file(resolve.group(1), resolve.group(2), resolve.group(3), body)
            self._error(404, None, "no such route")

        def _repo(self, repo: str, revision: str) -> Path | None:
            folder = hub.root / repo
            if not folder.is_dir():
                self._error(404, "RepoNotFound", f"Repository {repo} not found")
                return None
            if revision not in ("main", COMMIT):
                self._error(404, "RevisionNotFound", f"Revision {revision} not found")
                return None
            return folder

        def _info(self, repo: str, revision: str, body: bool) -> None:
            folder = self._repo(repo, revision)
            if folder is None:
                return
            siblings = []
            for f in sorted(p for p in folder.rglob("*") if p.is_file()):
                size = f.stat().st_size
                lfs = {"size": size, "sha256": hub.sha256(f), "pointerSize": 134}
                siblings.append({"rfilename": str(f.relative_to(folder)), "size": size, "lfs": lfs})
            data = json.dumps({"id": repo, "sha": COMMIT, "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _file(self, repo: str, revision: str, name: str, body: bool) -> None:
            folder = self._repo(repo, revision)
            if folder is None:
                return
            path = folder / name
            if ".." in Path(name).parts or not path.is_file():
                self._error(404, "EntryNotFound", f"{name} not found in {repo}")
                return
            size = path.stat().st_size
            start, end = 0, size
            wanted = self.headers.get("Range")
            ranged = wanted is not None and body
            if ranged:
                m = _RANGE.match(wanted or "")
                if m is None or int(m.group(1)) >= size:
                    self._error(416, None, "bad range")
                    return
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            sha = hub.sha256(path)
            self.send_response(206 if ranged else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{sha}"')
            self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(size))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if body:
                self._send(f"{repo}/{name}", path, start, end)

        def _send(self, file: str, path: Path, start: int, end: int) -> None:
            flips = hub._take_corrupt(file, start, end)
            with path.open("rb") as fh:
                fh.seek(start)
                pos = start
                while pos < end:
                    chunk = bytearray(fh.read(min(_CHUNK, end - pos)))
                    for o in flips:
                        if pos <= o < pos + len(chunk):
                            chunk[o - pos] ^= 0xFF
                    if hub._pause_s:
                        time.sleep(hub._pause_s)
                    allowed = hub._take_cut(len(chunk))
                    with hub._lock:  # counted before it goes: a client that has read the
                        hub.sent[self._client()] += allowed  # last byte finds it counted
                    self.wfile.write(chunk[:allowed])
                    if allowed < len(chunk):
                        self.close_connection = True
                        self.wfile.flush()
                        self.connection.shutdown(2)
                        return
                    pos += len(chunk)

        def _error(self, status: int, code: str | None, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler
