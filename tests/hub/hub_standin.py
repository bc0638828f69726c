"""A loopback stand-in for the Hugging Face Hub API, and a guard that keeps tests off the network.

:class:`HubStandIn` is a small ``http.server`` on 127.0.0.1 that answers the calls ``huggingface_hub`` 2.4 makes to
push a folder and to download it again, with the real API's paths, payloads and error headers:

- ``POST /api/repos/create`` (``create_repo``): 401 without the accepted token, 409 when the repo exists.
- ``GET /api/models/{repo}[/revision/{rev}]`` (``repo_info``), ``GET /api/models/{repo}/tree/{rev}[/{path}]``.
- ``POST /api/validate-yaml``: the card's front matter must be YAML and ``base_model`` a repo id (the Hub refuses a
  local path there).
- ``POST /api/models/{repo}/preupload/{rev}``: ``lfs`` for weights and binary files, ``regular`` otherwise, with the
  remote oid (so unchanged files are skipped, as on the Hub).
- ``POST /{repo}.git/info/lfs/objects/batch`` and ``PUT /lfs-upload/{oid}`` (git-LFS "basic" transfer). The Xet
  storage protocol is not emulated: tests set ``HF_HUB_DISABLE_XET`` so that huggingface_hub takes the LFS path.
- ``POST /api/models/{repo}/commit/{rev}`` (NDJSON): one commit, applied atomically, recorded in :attr:`commits`.
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` (``hf_hub_download``, ``from_pretrained``).

Everything received is recorded (:attr:`requests`, :attr:`commits`, :attr:`repos`); :attr:`fail` makes one endpoint
answer an error, to test failures midway. :func:`offline_guard_source` is Python that refuses any connection or name
lookup outside the loopback interface, installed in-process by a fixture and in subprocesses as ``sitecustomize``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

TOKEN = "hf_standin_token_0123456789"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".png", ".jpg")
_REPO = r"(?P<repo>[^/]+/[^/]+)"


def git_blob_oid(content: bytes) -> str:
    """The git sha1 of a blob, what the Hub reports as the oid of a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Repo:
    """One model repo: its files at the head commit, its commits, its visibility."""

    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    lfs: set[str] = field(default_factory=set)
    head: str = "0" * 40


class HubStandIn:
    """The stand-in server; use as a context manager. ``endpoint`` is what ``HF_ENDPOINT`` should be."""

    def __init__(self, token: str = TOKEN, user: str = "user"):
        self.token, self.user = token, user
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.commits: list[dict] = []
        self.fail: dict[str, tuple[int, str]] = {}  # endpoint name -> (status, message), e.g. {"commit": (500, ...)}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "HubStandIn":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def paths(self) -> list[str]:
        """``"METHOD /path"`` of every request received, in order."""
        return [f"{method} {path}" for method, path in self.requests]


def _handler(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep the test output clean
            pass

        # ------------------------------------------------------------------ plumbing
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, payload=None, headers: dict | None = None, raw: bytes | None = None):
            body = raw if raw is not None else (b"" if payload is None else json.dumps(payload).encode())
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if raw is None else "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, message: str, code: str | None = None):
            headers = {"X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, {"error": message}, headers)

        def _authorized(self) -> bool:
            if self.headers.get("Authorization") == f"Bearer {hub.token}":
                return True
            self._error(401, "Invalid credentials in Authorization header")
            return False

        def _failing(self, name: str) -> bool:
            if name in hub.fail:
                status, message = hub.fail[name]
                self._error(status, message)
                return True
            return False

        def _route(self, routes):
            path = self.path.split("?")[0]
            with hub._lock:
                hub.requests.append((self.command, path))
            body = self._body() if self.command in ("POST", "PUT") else b""
            sent = self.headers.get("Authorization")
            if sent is not None and sent != f"Bearer {hub.token}":  # the Hub refuses a wrong token on every call
                return self._error(401, "Invalid credentials in Authorization header")
            for pattern, method in routes:
                match = re.fullmatch(pattern, path)
                if match:
                    with hub._lock:
                        return method(body, **match.groupdict())
            self._error(404, f"stand-in has no route for {self.command} {path}")

        def do_GET(self):
            self._route([(rf"/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?", self.repo_info),
                         (rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?", self.tree),
                         (rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", self.resolve)])

        do_HEAD = do_GET

        def do_POST(self):
            self._route([(r"/api/repos/create", self.create),
                         (r"/api/validate-yaml", self.validate_yaml),
                         (rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)", self.preupload),
                         (rf"/{_REPO}\.git/info/lfs/objects/batch", self.lfs_batch),
                         (rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)", self.commit)])

        def do_PUT(self):
            self._route([(r"/lfs-upload/(?P<oid>[0-9a-f]{64})", self.lfs_put)])

        # ------------------------------------------------------------------ endpoints
        def _repo(self, repo: str) -> Repo | None:
            found = hub.repos.get(repo)
            if found is not None and found.private and self.headers.get("Authorization") is None:
                found = None  # the Hub answers a private repo without a token as if it did not exist
            if found is None:
                self._error(404, f"Repository Not Found for url: {self.path}.", "RepoNotFound")
            return found

        def create(self, body):
            if self._failing("create") or not self._authorized():
                return
            payload = json.loads(body)
            repo_id = f"{payload.get('organization') or hub.user}/{payload['name']}"
            if repo_id in hub.repos:  # the Hub's 409 carries the url; create_repo(exist_ok=True) reads it
                message = "You already created this model repo"
                return self._send(409, {"error": message, "url": f"{hub.endpoint}/{repo_id}"},
                                  {"X-Error-Message": message})
            hub.repos[repo_id] = Repo(private=payload.get("visibility") == "private" or bool(payload.get("private")))
            self._send(200, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})

        def repo_info(self, body, repo, rev=None):
            found = self._repo(repo)
            if found:
                siblings = [{"rfilename": name} for name in sorted(found.files)]
                self._send(200, {"id": repo, "modelId": repo, "sha": found.head, "private": found.private,
                                 "siblings": siblings, "tags": [], "downloads": 0, "likes": 0})

        def tree(self, body, repo, rev, sub=None):
            found = self._repo(repo)
            if not found:
                return
            prefix = (sub or "").strip("/")
            entries = [{"type": "file", "path": name, "size": len(data), "oid": git_blob_oid(data)}
                       for name, data in sorted(found.files.items())
                       if not prefix or name.startswith(prefix + "/")]
            if prefix and not entries:
                return self._error(404, f"{prefix} does not exist", "EntryNotFound")
            self._send(200, entries)

        def resolve(self, body, repo, rev, file):
            found = self._repo(repo)
            if not found:
                return
            data = found.files.get(file)
            if data is None:
                return self._error(404, "Entry not found", "EntryNotFound")
            etag = hashlib.sha256(data).hexdigest() if file in found.lfs else git_blob_oid(data)
            self._send(200, raw=data, headers={"X-Repo-Commit": found.head, "ETag": f'"{etag}"'})

        def validate_yaml(self, body):
            content = json.loads(body)["content"]
            match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
            try:
                metadata = yaml.safe_load(match.group(1)) if match else {}
            except yaml.YAMLError as error:
                return self._send(400, {"error": f"Invalid YAML in README.md: {error}"})
            base = (metadata or {}).get("base_model")
            for value in [base] if isinstance(base, str) else (base or []):
                if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(value)):
                    return self._send(400, {"error": f'"base_model" with value "{value}" is not a valid model id'})
            self._send(200, {"errors": [], "warnings": []})

        def preupload(self, body, repo, rev):
            if self._failing("preupload") or not self._authorized():
                return
            found = self._repo(repo)
            if not found:
                return
            files = []
            for item in json.loads(body)["files"]:
                sample = base64.b64decode(item["sample"])
                lfs = item["path"].endswith(LFS_SUFFIXES) or b"\0" in sample
                old = found.files.get(item["path"])
                oid = None
                if old is not None:
                    oid = hashlib.sha256(old).hexdigest() if item["path"] in found.lfs else git_blob_oid(old)
                files.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular",
                              "shouldIgnore": False, "oid": oid})
            self._send(200, {"files": files, "commitOid": found.head})

        def lfs_batch(self, body, repo):
            if self._failing("lfs_batch") or not self._authorized():
                return
            objects = []
            for item in json.loads(body)["objects"]:
                entry = {"oid": item["oid"], "size": item["size"], "authenticated": True}
                if item["oid"] not in hub.lfs_objects:
                    entry["actions"] = {"upload": {"href": f"{hub.endpoint}/lfs-upload/{item['oid']}"}}
                objects.append(entry)
            self._send(200, {"transfer": "basic", "objects": objects})

        def lfs_put(self, body, oid):
            if self._failing("lfs_upload"):
                return
            if hashlib.sha256(body).hexdigest() != oid:
                return self._error(400, "sha256 of the uploaded content does not match the oid")
            hub.lfs_objects[oid] = body
            self._send(200, {})

        def commit(self, body, repo, rev):
            if self._failing("commit") or not self._authorized():
                return
            found = self._repo(repo)
            if not found:
                return
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = lines[0]["value"]
            files, lfs, deleted = dict(found.files), set(found.lfs), []
            for line in lines[1:]:
                value = line["value"]
                if line["key"] == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                    lfs.discard(value["path"])
                elif line["key"] == "lfsFile":
                    if value["oid"] not in hub.lfs_objects:
                        return self._error(400, f"LFS object {value['oid']} of {value['path']} was never uploaded")
                    files[value["path"]] = hub.lfs_objects[value["oid"]]
                    lfs.add(value["path"])
                elif line["key"] == "deletedFile":
                    files.pop(value["path"], None)
                    lfs.discard(value["path"])
                    deleted.append(value["path"])
            oid = hashlib.sha1(f"{repo}:{len(hub.commits)}:{header['summary']}".encode()).hexdigest()
            found.files, found.lfs, found.head = files, lfs, oid
            hub.commits.append({"repo": repo, "revision": rev, "summary": header["summary"],
                                "description": header.get("description", ""), "oid": oid,
                                "paths": [line["value"]["path"] for line in lines[1:]], "deleted": deleted})
            self._send(200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{oid}", "commitOid": oid,
                             "pullRequestUrl": None})

    return Handler


def guard_network(monkeypatch) -> None:
    """Refuse, for the rest of the test, connections and name lookups outside the loopback interface."""
    namespace: dict = {}
    real = socket.socket.connect, socket.getaddrinfo
    exec(offline_guard_source(), namespace)  # patches the socket module; monkeypatch restores it afterwards
    guarded = socket.socket.connect, socket.getaddrinfo
    socket.socket.connect, socket.getaddrinfo = real
    monkeypatch.setattr(socket.socket, "connect", guarded[0])
    monkeypatch.setattr(socket, "getaddrinfo", guarded[1])


def offline_guard_source() -> str:
    """Python source that refuses connections and name lookups outside the loopback interface."""
    return '''
import socket as _socket

_LOOPBACK = ("127.0.0.1", "::1", "localhost")
_real_connect, _real_getaddrinfo = _socket.socket.connect, _socket.getaddrinfo


def _guarded_connect(self, address):
    if self.family == getattr(_socket, "AF_UNIX", None) or address[0] in _LOOPBACK:
        return _real_connect(self, address)
    raise ConnectionRefusedError(f"hf_knorm tests never leave the loopback interface (tried {address!r})")


def _guarded_getaddrinfo(host, *args, **kwargs):
    if host in _LOOPBACK or host is None:
        return _real_getaddrinfo(host, *args, **kwargs)
    raise OSError(f"hf_knorm tests never leave the loopback interface (tried to resolve {host!r})")


_socket.socket.connect = _guarded_connect
_socket.getaddrinfo = _guarded_getaddrinfo
'''
