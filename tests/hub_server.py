"""A local Hub: the HTTP API `huggingface_hub` uses to push a folder, weights through the LFS path as on the Hub.

Why a server and not a mock of HfApi: the push runs as it really runs (huggingface_hub's own requests, retries,
preupload, LFS batch, the PUT of the bytes, verify, the commit), so a change in any of them shows. huggingface_hub's
own tests push to a staging Hub, which this machine cannot reach. As on the Hub, `preupload` answers "lfs" for
safetensors (the Hub's default .gitattributes) and for files over 10 MB, the LFS batch hands out an upload URL
(S3's part on the Hub: no Hub token goes there) and the commit names LFS files by sha256 only, so a commit of an
object that never arrived is refused. Run it with HF_HUB_DISABLE_XET=1: with hf_xet installed huggingface_hub
sends LFS-mode files to Xet storage (a content-addressed chunk store), which this server does not speak.

Failure modes, set per instance: `token` (anything else is 401), `forbidden` orgs (403 on create and on write),
`noop_create` (a create that succeeds yet leaves no repo, as a repo deleted meanwhile), `interrupt_uploads`
(each weights PUT is cut off after a few bytes, as a dropped connection).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.model")
LFS_SIZE = 10 * 1024 * 1024


class LocalHub:
    """Start with `LocalHub()`, stop with `.close()`; `.env()` is what a push needs in its environment."""

    def __init__(self, token: str | None = None, forbidden: tuple[str, ...] = (), noop_create: bool = False,
                 interrupt_uploads: bool = False):
        self.token, self.forbidden, self.noop_create = token, set(forbidden), noop_create
        self.interrupt_uploads = interrupt_uploads
        self.repos, self.branches, self.commits, self.auth = {}, [], [], set()
        self.lfs: dict[str, bytes] = {}  # oid -> bytes that arrived through the LFS upload URL
        self.files: dict[tuple[str, str], dict[str, bytes]] = {}  # (repo, revision) -> the files after each commit
        self.puts = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def reply(self, payload, status=200, headers=()):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in headers:
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                sent = self.headers.get("Authorization")
                hub.auth.add(sent)
                if hub.token is not None and sent != f"Bearer {hub.token}":
                    self.reply({"error": "Invalid credentials in Authorization header"}, 401)
                    return False
                return True

            def _missing(self, repo):
                self.reply({"error": f"Repository not found: {repo}"}, 404, [("X-Error-Code", "RepoNotFound")])

            def do_GET(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                if not self._authorized():
                    return
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = "/".join(parts[2:4])
                    if repo not in hub.repos:
                        return self._missing(repo)
                    if parts[4:5] == ["tree"]:  # list_repo_tree (upload_folder's delete_patterns): every file, flat
                        files = hub.files.get((repo, parts[5]), {})
                        return self.reply([{"type": "file", "path": name, "size": len(data),
                                            "oid": hashlib.sha1(data).hexdigest()} for name, data in sorted(files.items())])
                    return self.reply({"id": repo, "sha": "0" * 40, "private": False, "siblings": []})
                self.reply({"error": f"LocalHub does not serve GET {self.path}"}, 404)

            def do_PUT(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[0] != "lfs-upload":
                    return self.reply({"error": f"LocalHub does not serve PUT {self.path}"}, 404)
                hub.puts += 1
                length = int(self.headers.get("Content-Length") or 0)
                if hub.interrupt_uploads:  # a few bytes arrive, then the connection drops
                    self.rfile.read(min(length, 64))
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                data = self.rfile.read(length)
                if hashlib.sha256(data).hexdigest() != parts[1]:
                    return self.reply({"error": "sha256 mismatch"}, 400)
                hub.lfs[parts[1]] = data
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):
                body = self._body()
                path = self.path.split("?")[0].strip("/")
                parts = path.split("/")
                if parts[0] == "lfs-verify":
                    found = json.loads(body)
                    ok = hub.lfs.get(found["oid"]) is not None and len(hub.lfs[found["oid"]]) == found["size"]
                    return self.reply({} if ok else {"error": "object not uploaded"}, 200 if ok else 404)
                if not self._authorized():
                    return
                if parts[:2] == ["api", "validate-yaml"]:
                    return self.reply({"errors": [], "warnings": []})
                if parts[:3] == ["api", "repos", "create"]:
                    data = json.loads(body)
                    repo = f"{data.get('organization')}/{data['name']}"
                    if data.get("organization") in hub.forbidden:
                        return self.reply({"error": "You don't have the rights to create a model under the namespace "
                                                    f"\"{data.get('organization')}\""}, 403)
                    if not hub.noop_create:
                        hub.repos.setdefault(repo, data)
                    return self.reply({"url": f"{hub.url}/{repo}"})
                if path.endswith(".git/info/lfs/objects/batch"):
                    return self._lfs_batch(json.loads(body))
                repo, verb = "/".join(parts[2:4]), parts[4]
                if repo not in hub.repos:
                    return self._missing(repo)
                if repo.split("/")[0] in hub.forbidden:
                    return self.reply({"error": f"You don't have write access to {repo}"}, 403)
                if verb == "branch":
                    hub.branches.append((repo, parts[5]))
                    return self.reply({})
                if verb == "preupload":
                    files = json.loads(body)["files"]
                    return self.reply({"files": [{"path": f["path"], "uploadMode": _mode(f), "shouldIgnore": False,
                                                  "oid": None} for f in files]})
                if verb == "commit":
                    return self._commit(repo, parts[5], body)
                self.reply({"error": f"LocalHub does not serve POST {self.path}"}, 404)

            def _lfs_batch(self, request):
                objects = []
                for item in request["objects"]:
                    entry = {"oid": item["oid"], "size": item["size"]}
                    if item["oid"] not in hub.lfs:  # already there: no actions, the client skips it
                        entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{item['oid']}"},
                                            "verify": {"href": f"{hub.url}/lfs-verify/{item['oid']}"}}
                    objects.append(entry)
                self.reply({"transfer": "basic", "objects": objects})

            def _commit(self, repo, revision, body):
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                files, lfs_files, deleted = {}, [], []
                for item in lines:
                    value = item["value"]
                    if item["key"] == "file":
                        files[value["path"]] = base64.b64decode(value["content"])
                    elif item["key"] == "lfsFile":
                        if value["oid"] not in hub.lfs:
                            return self.reply({"error": f"LFS object {value['oid']} of {value['path']} was never "
                                                        "uploaded"}, 422)
                        files[value["path"]] = hub.lfs[value["oid"]]
                        lfs_files.append(value["path"])
                    elif item["key"] == "deletedFile":
                        deleted.append(value["path"])
                state = hub.files.setdefault((repo, revision), {})
                for name in deleted:
                    state.pop(name, None)
                state.update(files)
                hub.commits.append({"repo": repo, "revision": revision, "files": files, "lfs": sorted(lfs_files),
                                    "deleted": sorted(deleted), "summary": lines[0]["value"]["summary"]})
                self.reply({"commitUrl": f"{hub.url}/{repo}/commit/{len(hub.commits):040d}",
                            "commitOid": f"{len(hub.commits):040d}", "success": True})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def env(self, token: str | None = None) -> dict[str, str]:
        """The environment of a push to this hub: its endpoint, a token, the LFS path (see the module doc)."""
        env = {"HF_ENDPOINT": self.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}
        if token or self.token:
            env["HF_TOKEN"] = token or self.token
        return env

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _mode(item: dict) -> str:
    lfs = item.get("size", 0) > LFS_SIZE or any(fnmatch.fnmatch(item["path"], p) for p in LFS_PATTERNS)
    return "lfs" if lfs else "regular"
