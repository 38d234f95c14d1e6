"""A Hugging Face Hub on loopback: a real HTTP server with the endpoints huggingface_hub calls.

Serves model repos (branches, tags, pull requests, private and gated repos, tokens with namespaces)
and accepts pushes through the client's own code path: repo creation, branches, README validation,
preupload, the LFS batch API (basic and multipart transfers, verify) and NDJSON commits. It keeps what
arrives (files, bytes, commit messages, every request) so tests can check it, and can be told to fail
chosen requests to test interrupted pushes (``fail``) or to lie in its paths-info answers
(``forge_paths_info``).

As the real Hub: resolve answers a Range request (the client sends the header as lowercase ``range``)
with 206 and the slice; tree and paths-info list LFS entries with their sha256 and a Xet hash; large
files are stored per repository, so a file reaches a repo only by an upload or by the duplicate endpoint
(``/api/models/SRC/lfs-files/duplicate``, which huggingface_hub 1.17+ calls for a cross-repo
``CommitOperationCopy``), never because another repo holds the same bytes. Every request keeps the bytes
it received and the bytes it was sent (``Seen.received``, ``Seen.sent``), counted on the wire's body.

Not implemented: Xet storage (CAS) uploads and downloads. The server never advertises Xet for
downloads, and tests that push run the client with HF_HUB_DISABLE_XET=1, the client's documented switch
to its LFS path. Xet hashes here are a stand-in (a hash of the content that is not its sha256): the Hub
checks them against the object, and so does this server.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

# The Hub's default .gitattributes: these names (and anything of 10 MB or more) are stored in LFS.
LFS_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.onnx",
    "*.h5",
    "*.msgpack",
    "*.model",
    "*.ot",
    "*.npz",
    "*.zip",
)
LFS_MIN_SIZE = 10 * 1024 * 1024
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()


def git_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def xet_hash(content: bytes) -> str:
    """A stand-in for the Xet hash of ``content`` (the real one is a Merkle hash of its chunks): as on the
    Hub, another hash of the same bytes than their sha256, which the duplicate endpoint checks."""
    return hashlib.sha256(b"xet\0" + content).hexdigest()


def is_lfs(path: str, size: int) -> bool:
    name = path.rsplit("/", 1)[-1]
    return size >= LFS_MIN_SIZE or any(fnmatch.fnmatch(name, p) for p in LFS_PATTERNS)


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    description: str
    files: dict[str, bytes]


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    gated: bool = False
    gated_allowed: set[str] = field(default_factory=set)  # users who accepted the conditions
    branches: dict[str, str] = field(default_factory=dict)  # name (or refs/pr/N) -> commit oid
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    prs: int = 0


@dataclass
class Seen:
    """One request as it arrived (the Authorization header is kept apart, never in `headers`)."""

    method: str
    path: str
    query: dict
    user: str | None
    auth: str | None
    headers: dict
    body: bytes
    status: int = 0
    sent: int = 0  # body bytes of the answer (0 for HEAD)

    @property
    def received(self) -> int:
        """Body bytes of the request."""
        return len(self.body)


class Loopback:
    """An HTTP server on 127.0.0.1 (any free port), served from a thread of its own inside ``with``."""

    def _listen(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


class HubServer(Loopback):
    """``with HubServer() as hub:`` starts it on 127.0.0.1 (any free port); ``hub.url`` is HF_ENDPOINT."""

    def __init__(self, *, multipart_threshold: int | None = None, chunk_size: int = 64 * 1024) -> None:
        self.repos: dict[str, Repo] = {}
        self.tokens: dict[str, tuple[str, set[str]]] = {}  # token -> (user, orgs)
        self.lfs: dict[str, dict[str, bytes]] = {}  # repo id -> sha256 -> content: each repo's large files
        # the duplicate endpoint answers every file with this error in its "failed" list (a storage region
        # that differs, say); None: it duplicates
        self.refuse_duplicate: str | None = None
        self.parts: dict[str, dict[int, bytes]] = {}
        self.requests: list[Seen] = []
        self.validated_cards: list[str] = []
        self.pushed: list[dict] = []  # one entry per commit received through the API
        self.faults: list[dict] = []
        self.forged: list[dict] = []  # paths-info answers that lie (forge_paths_info)
        self._duplicated: list[dict] = []
        # model info field -> the request's Authorization header, in a 200 answer (a careless mirror)
        self.echo_auth_in: str | None = None
        self.multipart_threshold = multipart_threshold
        self.chunk_size = chunk_size
        self.lock = threading.RLock()
        self._counter = itertools.count(1)
        self._listen(_handler(self))

    # --- lifecycle -----------------------------------------------------------------------------

    # --- set-up, for tests ---------------------------------------------------------------------
    def add_token(self, token: str, user: str, orgs: tuple[str, ...] = ()) -> None:
        self.tokens[token] = (user, set(orgs))

    def add_model(
        self,
        repo_id: str,
        files: dict[str, bytes] | Path,
        *,
        private: bool = False,
        gated: bool = False,
        branch: str = "main",
        message: str = "add model",
    ) -> str:
        """Create (or add a commit to) a repo holding ``files`` (a dict, or every file of a folder)."""
        if isinstance(files, Path):
            files = {p.relative_to(files).as_posix(): p.read_bytes() for p in sorted(files.rglob("*")) if p.is_file()}
        with self.lock:
            repo = self.repos.get(repo_id) or self._create(repo_id, private=private)
            repo.gated = repo.gated or gated
            base = repo.branches.get(branch) or repo.branches["main"]
            merged = dict(repo.commits[base].files)
            merged.update(files)
            for path, content in files.items():
                if is_lfs(path, len(content)):
                    self.lfs.setdefault(repo_id, {})[sha256(content)] = content
            return self._commit(repo, branch, merged, message, "", base)

    def fail(
        self,
        method: str,
        path_pattern: str,
        *,
        status: int = 507,
        times: int | None = 1,
        message: str = "simulated failure",
        echo_auth: bool = False,
    ) -> None:
        """Answer the next ``times`` matching requests (None: all of them) with ``status``.

        ``echo_auth``: the error message quotes the request's Authorization header after ``message``, as
        careless servers and proxies do (``rejected credentials Bearer hf_...``)."""
        self.faults.append(
            {
                "method": method,
                "pattern": re.compile(path_pattern),
                "status": status,
                "times": times,
                "message": message,
                "echo_auth": echo_auth,
            }
        )

    def forge_paths_info(self, repo_id: str, files: dict[str, bytes], *, times: int = 1) -> None:
        """Answer the next ``times`` paths-info requests for ``repo_id`` as if ``files`` (path -> bytes) held those
        bytes, the other paths as they are: a server (or a proxy) whose answer changes between calls. What the repo
        holds, and every other request, is unchanged."""
        self.forged.append({"repo_id": repo_id, "files": dict(files), "times": times})

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return repo.commits[self._resolve(repo, revision)].files

    def downloads(self) -> list[str]:
        """Paths of files served whole by GET .../resolve/... (what the client downloaded; byte ranges read
        are in ``ranges``)."""
        out = []
        for r in self.requests:
            m = re.match(r"^/[^/]+/[^/]+/resolve/[^/]+/(.+)$", r.path)
            if r.method == "GET" and m and r.status == 200:
                out.append(unquote(m.group(1)))
        return out

    def served(self, pattern: str = "") -> int:
        """Body bytes sent in answers to requests whose path matches ``pattern`` (a regex; all by default)."""
        return sum(r.sent for r in self.requests if re.search(pattern, r.path))

    def received(self, pattern: str = "") -> int:
        """Body bytes received in requests whose path matches ``pattern``."""
        return sum(r.received for r in self.requests if re.search(pattern, r.path))

    def ranges(self) -> list[tuple[str, str]]:
        """(path, Range header) of every GET .../resolve/... answered 206: the slices the client read."""
        return [(r.path, _header(r.headers, "range")) for r in self.requests if r.status == 206]

    def duplicated(self) -> list[dict]:
        """What the duplicate endpoint copied: {"source", "target", "sha256", "filename"} for each file."""
        return list(self._duplicated)

    def lfs_uploads(self) -> list[str]:
        """sha256 of every large file that arrived through an LFS upload (basic or multipart)."""
        return [
            r.path.split("/")[2]
            for r in self.requests
            if r.path.startswith("/__lfs/")
            and r.status == 200
            and ((r.method == "PUT" and r.path.count("/") == 2) or r.path.endswith("/complete"))
        ]

    # --- state ---------------------------------------------------------------------------------
    def _create(self, repo_id: str, *, private: bool) -> Repo:
        repo = Repo(repo_id, private=private)
        self.repos[repo_id] = repo
        self._commit(repo, "main", {".gitattributes": GITATTRIBUTES}, "initial commit", "", None)
        return repo

    def _commit(
        self, repo: Repo, branch: str, files: dict[str, bytes], message: str, description: str, parent: str | None
    ) -> str:
        digest = hashlib.sha1(f"{repo.repo_id}\0{parent}\0{message}\0{next(self._counter)}".encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha1(files[path]).digest())
        oid = digest.hexdigest()
        repo.commits[oid] = Commit(oid, parent, message, description, dict(files))
        repo.branches[branch] = oid
        return oid

    def _resolve(self, repo: Repo, revision: str) -> str | None:
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.tags:
            return repo.tags[revision]
        if revision in repo.commits:
            return revision
        return None


class _Reply(Exception):
    def __init__(self, status: int, body=None, headers: dict | None = None) -> None:
        self.status, self.body, self.headers = status, body, headers or {}


def _error(status: int, message: str, code: str | None = None, **headers) -> _Reply:
    h = {"X-Error-Message": message, **headers}
    if code:
        h["X-Error-Code"] = code
    return _Reply(status, {"error": message}, h)


def request_body(handler: BaseHTTPRequestHandler) -> bytes:
    """A request's body as it arrived: chunked, or of its Content-Length."""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))


class Serving(BaseHTTPRequestHandler):
    """A quiet HTTP/1.1 handler (keep-alive, as the client expects; every reply has a Content-Length) that hands
    every method to ``_serve``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self):
        self._serve("GET")

    def do_HEAD(self):
        self._serve("HEAD")

    def do_POST(self):
        self._serve("POST")

    def do_PUT(self):
        self._serve("PUT")

    def _body(self) -> bytes:
        return request_body(self)

    def _serve(self, method: str) -> None:
        raise NotImplementedError


def _handler(hub: HubServer):
    class Handler(Serving):
        def _serve(self, method: str) -> None:
            split = urlsplit(self.path)
            body = self._body() if method in ("POST", "PUT") else b""
            auth = self.headers.get("Authorization")
            token = auth.removeprefix("Bearer ").strip() if auth else None
            headers = {k: v for k, v in self.headers.items() if k.lower() != "authorization"}
            seen = Seen(method, split.path, parse_qs(split.query), None, token, headers, body)
            with hub.lock:
                hub.requests.append(seen)
            try:
                if token is not None and token not in hub.tokens:
                    raise _error(401, "Invalid credentials in Authorization header")
                seen.user = hub.tokens[token][0] if token else None
                self._fault(method, split.path, auth)
                result = route(hub, method, split.path, seen)
                reply = _Reply(result.status, result) if isinstance(result, _Raw) else _Reply(200, result)
            except _Reply as r:
                reply = r
            seen.status = reply.status
            seen.sent = self._send(method, reply)

        def _fault(self, method: str, path: str, auth: str | None = None) -> None:
            with hub.lock:
                for f in hub.faults:
                    if f["method"] == method and f["pattern"].search(path) and f["times"] != 0:
                        if f["times"] is not None:
                            f["times"] -= 1
                        raise _error(f["status"], f"{f['message']} {auth}" if f["echo_auth"] else f["message"])

        def _send(self, method: str, reply: _Reply) -> int:
            body, headers = reply.body, dict(reply.headers)
            if isinstance(body, _Raw):
                headers.update(body.headers)
                data = body.data
            elif body is None:
                data = b""
            else:
                data = json.dumps(body).encode()
                headers.setdefault("Content-Type", "application/json")
            self.send_response(reply.status)
            for k, v in headers.items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(data)))  # for HEAD: the size GET would send
            self.end_headers()
            if method == "HEAD":
                return 0
            self.wfile.write(data)
            return len(data)

    return Handler


@dataclass
class _Raw:
    data: bytes
    headers: dict
    status: int = 200


# --- routes ----------------------------------------------------------------------------------------


def route(hub: HubServer, method: str, path: str, req: Seen):
    parts = [unquote(p) for p in path.strip("/").split("/")]
    if parts[:2] == ["api", "models"] and len(parts) >= 4:
        repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
        if method == "GET" and not rest:
            return model_info(hub, repo_id, "main", req)
        if method == "GET" and rest[0] == "revision" and len(rest) == 2:
            return model_info(hub, repo_id, rest[1], req)
        if method == "GET" and rest[0] == "tree" and len(rest) >= 2:
            return tree(hub, repo_id, rest[1], "/".join(rest[2:]), req)
        if method == "POST" and rest[0] == "preupload" and len(rest) == 2:
            return preupload(hub, repo_id, rest[1], req)
        if method == "POST" and rest[0] == "paths-info" and len(rest) == 2:
            return paths_info(hub, repo_id, rest[1], req)
        if method == "POST" and rest == ["lfs-files", "duplicate"]:
            return duplicate(hub, repo_id, req)
        if method == "POST" and rest[0] == "commit" and len(rest) == 2:
            return commit(hub, repo_id, rest[1], req)
        if method == "POST" and rest[0] == "branch" and len(rest) == 2:
            return create_branch(hub, repo_id, rest[1], req)
    if parts == ["api", "repos", "create"] and method == "POST":
        return create_repo(hub, req)
    if parts == ["api", "validate-yaml"] and method == "POST":
        return validate_yaml(hub, req)
    if (
        len(parts) == 6
        and parts[2:] == ["info", "lfs", "objects", "batch"]
        and parts[1].endswith(".git")
        and method == "POST"
    ):
        return lfs_batch(hub, f"{parts[0]}/{parts[1].removesuffix('.git')}", req)
    if parts[0] == "__lfs":
        return lfs_transfer(hub, method, parts[1:], req)
    if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
        return resolve_file(hub, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), req)
    raise _error(404, f"no route for {method} {path}")


def _owner_of(hub: HubServer, repo_id: str, user: str | None) -> bool:
    if user is None:
        return False
    name, orgs = next((u, o) for u, o in hub.tokens.values() if u == user)
    return repo_id.split("/")[0] in ({name} | orgs)


def _readable(hub: HubServer, repo_id: str, req: Seen) -> Repo:
    repo = hub.repos.get(repo_id)
    if repo is None or (repo.private and not _owner_of(hub, repo_id, req.user)):
        # like the Hub: 401 without a token, 404 with one; never says whether a private repo exists
        raise _error(401 if req.user is None else 404, "Repository not found", "RepoNotFound")
    if repo.gated and not _owner_of(hub, repo_id, req.user) and req.user not in repo.gated_allowed:
        status = 401 if req.user is None else 403
        raise _error(
            status,
            f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it.",
            "GatedRepo",
        )
    return repo


def _writable(hub: HubServer, repo_id: str, req: Seen) -> Repo:
    repo = _readable(hub, repo_id, req)
    if not _owner_of(hub, repo_id, req.user):
        raise _error(403 if req.user else 401, f"You don't have write access to {repo_id}")
    return repo


def _commit_of(repo: Repo, revision: str) -> str:
    for candidate in (revision, unquote(revision)):
        if candidate in repo.branches or candidate in repo.tags or candidate in repo.commits:
            return repo.branches.get(candidate) or repo.tags.get(candidate) or candidate
    raise _error(404, f"Invalid rev id: {revision}", "RevisionNotFound")


def model_info(hub: HubServer, repo_id: str, revision: str, req: Seen) -> dict:
    repo = _readable(hub, repo_id, req)
    oid = _commit_of(repo, revision)
    files = repo.commits[oid].files
    card = {}
    if "README.md" in files:
        m = re.match(r"^---\n(.*?)\n---", files["README.md"].decode(errors="replace"), re.S)
        card = (yaml.safe_load(m.group(1)) or {}) if m else {}
    info = {
        "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
        "id": repo_id,
        "modelId": repo_id,
        "author": repo_id.split("/")[0],
        "sha": oid,
        "private": repo.private,
        "gated": "auto" if repo.gated else False,
        "disabled": False,
        "tags": list(card.get("tags") or []),
        "library_name": card.get("library_name"),
        "cardData": card or None,
        "siblings": [{"rfilename": p} for p in sorted(files)],
        "lastModified": "2026-01-01T00:00:00.000Z",
        "createdAt": "2026-01-01T00:00:00.000Z",
    }
    if hub.echo_auth_in:
        info[hub.echo_auth_in] = req.auth if str(req.auth).startswith("Basic ") else f"Bearer {req.auth}"
    return info


def _entry(path: str, content: bytes) -> dict:
    entry = {"type": "file", "oid": git_oid(content), "size": len(content), "path": path}
    if is_lfs(path, len(content)):
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256(content)}\nsize {len(content)}\n"
        entry["oid"] = git_oid(pointer.encode())
        entry["lfs"] = {"oid": sha256(content), "size": len(content), "pointerSize": len(pointer)}
        entry["xetHash"] = xet_hash(content)
    return entry


def paths_info(hub: HubServer, repo_id: str, revision: str, req: Seen) -> list:
    """POST /api/models/REPO/paths-info/REV, a form of ``paths`` (repeated) and ``expand``: the entries of
    those paths that exist (files; a folder's entry for a folder), in the order asked."""
    repo = _readable(hub, repo_id, req)
    files = repo.commits[_commit_of(repo, revision)].files
    with hub.lock:  # a lie told once (forge_paths_info): these paths answered as other bytes
        forged = next((f for f in hub.forged if f["repo_id"] == repo_id and f["times"] > 0), None)
        if forged is not None:
            forged["times"] -= 1
            files = {**files, **forged["files"]}
    form = parse_qs(req.body.decode())
    out = []
    for path in form.get("paths", []):
        if path in files:
            out.append(_entry(path, files[path]))
        elif any(p.startswith(path.rstrip("/") + "/") for p in files):
            out.append({"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path})
    return out


def duplicate(hub: HubServer, source_id: str, req: Seen) -> dict:
    """POST /api/models/SRC/lfs-files/duplicate {"target": {"type", "name"}, "files": [{"xetHash", "sha256",
    "filename"}]}: copy the source repo's large files into the target repo's store, server-side. The token
    must read the source and write the target; a file the source does not hold, or whose Xet hash is not
    its own, is answered in "failed"."""
    source = _readable(hub, source_id, req)
    if req.user is None:
        raise _error(401, "You must be authenticated to duplicate files")
    payload = json.loads(req.body)
    target = payload.get("target") or {}
    if target.get("type", "model") != "model":
        raise _error(400, "this server holds model repos only")
    target_id = str(target.get("name"))
    _writable(hub, target_id, req)
    held = hub.lfs.get(source.repo_id, {})
    failed = []
    with hub.lock:
        for f in payload.get("files") or []:
            content = held.get(f.get("sha256"))
            if hub.refuse_duplicate is not None:
                failed.append({"sha256": f.get("sha256"), "error": hub.refuse_duplicate})
            elif content is None or xet_hash(content) != f.get("xetHash"):
                failed.append({"sha256": f.get("sha256"), "error": "file not found in the source repository"})
            else:
                hub.lfs.setdefault(target_id, {})[f["sha256"]] = content
                hub._duplicated.append(
                    {"source": source_id, "target": target_id, "sha256": f["sha256"], "filename": f.get("filename")}
                )
    return {"failed": failed}


def _header(headers: dict, name: str) -> str:
    """A request header by name, whatever its case (the client sends ``range`` in lowercase)."""
    return next((v for k, v in headers.items() if k.lower() == name), "")


def tree(hub: HubServer, repo_id: str, revision: str, prefix: str, req: Seen) -> list:
    repo = _readable(hub, repo_id, req)
    files = repo.commits[_commit_of(repo, revision)].files
    recursive = req.query.get("recursive", ["false"])[0].lower() in ("true", "1")
    base = prefix.strip("/") + "/" if prefix.strip("/") else ""
    out, dirs = [], set()
    for path in sorted(files):
        if not path.startswith(base):
            continue
        rest = path[len(base) :]
        if "/" in rest:
            for i, _ in enumerate(rest.split("/")[:-1]):
                d = base + "/".join(rest.split("/")[: i + 1])
                if (recursive or i == 0) and d not in dirs:
                    dirs.add(d)
                    out.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d})
            if not recursive:
                continue
        out.append(_entry(path, files[path]))
    return out


def resolve_file(hub: HubServer, repo_id: str, revision: str, path: str, req: Seen) -> _Raw:
    repo = _readable(hub, repo_id, req)
    oid = _commit_of(repo, revision)
    files = repo.commits[oid].files
    if path not in files:
        raise _error(404, "Entry not found", "EntryNotFound", **{"X-Repo-Commit": oid})
    content = files[path]
    lfs = is_lfs(path, len(content))
    etag = sha256(content) if lfs else git_oid(content)
    headers = {
        "X-Repo-Commit": oid,
        "ETag": f'"{etag}"',
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
    }
    if lfs:
        headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(content))})
    status, data = 200, content
    asked = _header(req.headers, "range").strip()
    if asked and req.method == "GET":
        start, end = _byte_range(asked, len(content))
        data, status = content[start : end + 1], 206
        headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
    return _Raw(data, headers, status)


def _byte_range(asked: str, size: int) -> tuple[int, int]:
    """The first and last byte of one HTTP range (``bytes=A-B``, ``bytes=A-``, ``bytes=-N``), as RFC 9110
    reads it: a last byte past the end means the end; a first byte past the end is unsatisfiable (416)."""
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", asked)
    if not m or not (m.group(1) or m.group(2)):
        raise _error(400, f"malformed or multiple ranges: {asked}")
    if not m.group(1):  # the last N bytes
        start, end = max(0, size - int(m.group(2))), size - 1
    else:
        start, end = int(m.group(1)), min(int(m.group(2) or size - 1), size - 1)
    if start >= size or start > end:
        raise _error(416, f"range {asked} not satisfiable for {size} bytes", **{"Content-Range": f"bytes */{size}"})
    return start, end


def create_repo(hub: HubServer, req: Seen) -> dict:
    if req.user is None:
        raise _error(401, "You must be authenticated to create a repo")
    payload = json.loads(req.body)
    if payload.get("type", "model") != "model":
        raise _error(400, "this server holds model repos only")
    repo_id = f"{payload.get('organization') or req.user}/{payload['name']}"
    if not _owner_of(hub, repo_id, req.user):
        raise _error(403, f"You don't have the rights to create a model under the namespace {repo_id.split('/')[0]}")
    with hub.lock:
        if repo_id in hub.repos:
            raise _Reply(
                409,
                {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"},
                {"X-Error-Message": "You already created this model repo"},
            )
        hub._create(repo_id, private=payload.get("visibility") == "private" or bool(payload.get("private")))
    return {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id}


def create_branch(hub: HubServer, repo_id: str, branch: str, req: Seen) -> dict:
    repo = _writable(hub, repo_id, req)
    payload = json.loads(req.body or b"{}")
    with hub.lock:
        if branch in repo.branches:
            raise _error(409, f"Reference already exists: refs/heads/{branch}")
        repo.branches[branch] = _commit_of(repo, payload.get("startingPoint") or "main")
    return {}


def validate_yaml(hub: HubServer, req: Seen) -> dict:
    content = json.loads(req.body)["content"]
    hub.validated_cards.append(content)
    m = re.match(r"^---\r?\n(.*?)\r?\n---", content, re.S)
    try:
        meta = yaml.safe_load(m.group(1)) if m else {}
    except yaml.YAMLError as exc:
        raise _Reply(400, {"errors": [{"message": f"YAML: {exc}"}]}, {"X-Error-Message": "Invalid YAML"}) from None
    errors = []
    if not isinstance(meta or {}, dict):
        errors.append("metadata must be a mapping")
    else:
        meta = meta or {}
        if "tags" in meta and not (isinstance(meta["tags"], list) and all(isinstance(t, str) for t in meta["tags"])):
            errors.append('"tags" must be a list of strings')
        base = meta.get("base_model")
        if base is not None and not (isinstance(base, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", base)):
            errors.append('"base_model" must be a model id')
    if errors:
        raise _Reply(400, {"errors": [{"message": e} for e in errors]}, {"X-Error-Message": "Invalid metadata"})
    return {"errors": [], "warnings": []}


def preupload(hub: HubServer, repo_id: str, revision: str, req: Seen) -> dict:
    repo = _readable(hub, repo_id, req)
    if req.user is None:
        raise _error(401, "You must be authenticated to upload")
    create_pr = req.query.get("create_pr", ["0"])[0] == "1"
    if not create_pr:
        _writable(hub, repo_id, req)
    files = repo.commits[_commit_of(repo, revision)].files
    out = []
    for f in json.loads(req.body)["files"]:
        lfs = is_lfs(f["path"], f["size"])
        existing = files.get(f["path"])
        oid = None if existing is None else (sha256(existing) if lfs else git_oid(existing))
        out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
    return {"files": out, "commitOid": _commit_of(repo, revision)}


def lfs_batch(hub: HubServer, repo_id: str, req: Seen) -> _Raw:
    _readable(hub, repo_id, req)
    if req.user is None:
        raise _error(401, "You must be authenticated to upload")
    payload = json.loads(req.body)
    if payload.get("operation") != "upload":
        raise _error(400, "only uploads are supported")
    multipart = hub.multipart_threshold is not None and "multipart" in payload.get("transfers", [])
    objects = []
    for obj in payload["objects"]:
        oid, size = obj["oid"], obj["size"]
        entry = {"oid": oid, "size": size}
        if oid not in hub.lfs.get(repo_id, {}):  # only this repo's own store counts, as on the Hub
            entry["authenticated"] = True
            to = f"?repo={quote(repo_id, safe='')}"
            if multipart and size > hub.multipart_threshold:
                n = -(-size // hub.chunk_size)
                header = {
                    "chunk_size": str(hub.chunk_size),
                    **{str(i): f"{hub.url}/__lfs/{oid}/part/{i}{to}" for i in range(1, n + 1)},
                }
                upload = {"href": f"{hub.url}/__lfs/{oid}/complete{to}", "header": header}
            else:
                upload = {"href": f"{hub.url}/__lfs/{oid}{to}"}
            entry["actions"] = {"upload": upload, "verify": {"href": f"{hub.url}/__lfs/verify{to}", "header": {}}}
        objects.append(entry)
    body = json.dumps({"transfer": "multipart" if multipart else "basic", "objects": objects}).encode()
    return _Raw(body, {"Content-Type": "application/vnd.git-lfs+json"})


def lfs_transfer(hub: HubServer, method: str, parts: list[str], req: Seen):
    repo_id = req.query.get("repo", [""])[0]
    if repo_id not in hub.repos:
        raise _error(404, "unknown repository for this LFS transfer")
    if method == "POST" and parts == ["verify"]:
        obj = json.loads(req.body)
        held = hub.lfs.get(repo_id, {}).get(obj["oid"])
        if held is None or len(held) != obj["size"]:
            raise _error(404, "object not found")
        return {}
    oid = parts[0]
    if method == "PUT" and len(parts) == 1:
        return _store(hub, repo_id, oid, req.body)
    if method == "PUT" and len(parts) == 3 and parts[1] == "part":
        with hub.lock:
            hub.parts.setdefault(oid, {})[int(parts[2])] = req.body
        return _Raw(b"", {"ETag": f'"{hashlib.md5(req.body).hexdigest()}"'})
    if method == "POST" and parts[1:] == ["complete"]:
        done = json.loads(req.body)
        chunks = hub.parts.get(oid, {})
        for p in done["parts"]:
            if f'"{hashlib.md5(chunks.get(p["partNumber"], b"")).hexdigest()}"' != p["etag"]:
                raise _error(400, f"part {p['partNumber']} does not match its etag")
        return _store(
            hub,
            repo_id,
            oid,
            b"".join(chunks[p["partNumber"]] for p in sorted(done["parts"], key=lambda p: p["partNumber"])),
        )
    raise _error(404, "unknown LFS transfer")


def _store(hub: HubServer, repo_id: str, oid: str, data: bytes) -> dict:
    if sha256(data) != oid:
        raise _error(400, f"content does not match sha256 {oid}")
    with hub.lock:
        hub.lfs.setdefault(repo_id, {})[oid] = data
    return {}


def commit(hub: HubServer, repo_id: str, revision: str, req: Seen) -> dict:
    create_pr = req.query.get("create_pr", ["0"])[0] == "1"
    repo = _readable(hub, repo_id, req) if create_pr else _writable(hub, repo_id, req)
    if req.user is None:
        raise _error(401, "You must be authenticated to commit")
    if req.headers.get("Content-Type") != "application/x-ndjson":
        raise _error(400, "expected application/x-ndjson")
    lines = [json.loads(line) for line in req.body.splitlines() if line.strip()]
    if not lines or lines[0]["key"] != "header":
        raise _error(400, "the first line must be the commit header")
    header = lines[0]["value"]
    branch = unquote(revision)
    if branch not in repo.branches:
        raise _error(404, f"Invalid rev id: {branch} is not a branch", "RevisionNotFound")
    with hub.lock:
        base = repo.branches[branch]
        if header.get("parentCommit") and header["parentCommit"] != base:
            raise _error(412, "A commit has happened since the parent commit")
        files = dict(repo.commits[base].files)
        changed = []
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":  # an upload, or a copy (no size: the client only names the object)
                held = hub.lfs.get(repo_id, {}).get(value["oid"])
                if held is None:
                    raise _error(422, f"LFS object {value['oid']} for {value['path']} is not in {repo_id}")
                if "size" in value and value["size"] != len(held):
                    raise _error(422, f"LFS object {value['oid']} for {value['path']} has another size")
                files[value["path"]] = held
            elif key in ("deletedFile", "deletedFolder"):
                files = {
                    p: c
                    for p, c in files.items()
                    if not (p == value["path"] or p.startswith(value["path"].rstrip("/") + "/"))
                }
            else:
                raise _error(400, f"unknown commit operation {key!r}")
            changed.append(value["path"])
        if create_pr:
            repo.prs += 1
            target = f"refs/pr/{repo.prs}"
            repo.branches[target] = base
        else:
            target = branch
        oid = hub._commit(repo, target, files, header["summary"], header.get("description", ""), base)
        hub.pushed.append(
            {
                "repo_id": repo_id,
                "branch": target,
                "base": branch,
                "commit": oid,
                "message": header["summary"],
                "description": header.get("description", ""),
                "paths": changed,
                "user": req.user,
            }
        )
    return {
        "success": True,
        "commitOid": oid,
        "commitUrl": f"{hub.url}/{repo_id}/commit/{oid}",
        "pullRequestUrl": f"{hub.url}/{repo_id}/discussions/{repo.prs}" if create_pr else None,
    }
