"""The artifact store: run directories, status files, leases and versioned forecasts on any fsspec URL.

Layout (README.md, "Where things go"):

    {root}/runs/{step}-{fingerprint[:10]}/spec.json, status.json, metrics.jsonl, checkpoints/, result.json
    {root}/forecasts/{target}/{n}.json

`status.json` is the single source of truth about a step. Every change to it is a guarded
read-modify-write followed by an atomic replace, so a reader never sees half a file and two
writers never lose each other's update. The guard is a file lock on local disks, a process lock
for `memory://`, and on object stores a lock object created only if absent (`pipe_file(mode="create")`:
a conditional write at the server on S3 and GCS through s3fs/gcsfs, fsspec's check-then-write
elsewhere), followed by write-then-verify of the lease. A lease there is still best effort: a lock
object older than 30 s is taken for a crashed holder's and broken, and clocks must roughly agree.

An unreadable status.json never breaks more than its step: it reads as the status rebuilt from the
run directory (`rebuild_status`), and the next write moves it aside and writes the rebuilt one.

A lease is the right to run a step. Its holder writes a heartbeat every `ttl / 4` seconds; a
lease whose heartbeat is older than `ttl` belongs to a dead process and may be taken over. That
is what makes a SIGKILLed submitter harmless: the next submitter waits out the TTL and resumes, at
once when the lease was taken on this host by a pid that no longer exists (`holder_is_gone`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import fsspec
from filelock import FileLock

DEFAULT_ROOT = "ladder-runs"
OBJECT_LOCK_STALE_S = 30.0  # a guarded read-modify-write takes well under a second; older lock objects are dead
STATES = ("pending", "running", "done", "failed", "interrupted")


def lease_ttl_seconds() -> float:
    """Seconds without a heartbeat after which a lease is considered dead (LADDER_LEASE_TTL)."""
    return float(os.environ.get("LADDER_LEASE_TTL", "60"))


def holder_is_gone(lease: dict[str, Any] | None) -> bool:
    """True when the lease was taken on this host by a process that no longer exists (its pid is gone):
    a takeover need not wait out the TTL. Another host's holder can only be judged by its heartbeat."""
    if os.environ.get("LADDER_LEASE_PID_CHECK", "1") == "0":  # e.g. containers that share a hostname, not a pid space
        return False
    if not lease or lease.get("host") != socket.gethostname() or not isinstance(lease.get("pid"), int):
        return False
    try:
        os.kill(lease["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def lease_is_live(lease: dict[str, Any] | None, now: float, ttl: float) -> bool:
    """A lease whose heartbeat is younger than `ttl` and whose holder is not known to be gone."""
    return bool(lease) and now - lease.get("heartbeat", 0) < ttl and not holder_is_gone(lease)


def new_owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def resolve_root(root: str | None) -> str:
    return root or os.environ.get("LADDER_ROOT") or DEFAULT_ROOT


class StoreError(RuntimeError):
    pass


class CorruptFileError(StoreError):
    """A JSON file of the store that does not parse; `path` is its URL."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


_MEMORY_LOCKS: dict[str, threading.Lock] = {}
_MEMORY_LOCKS_GUARD = threading.Lock()


@dataclass(frozen=True)
class LeaseOutcome:
    """Result of trying to take a step's lease."""

    acquired: bool
    status: dict[str, Any]
    holder: str | None = None
    heartbeat_age: float | None = None


class Store:
    """Artifacts of every step under one root URL (local folder, gs://, s3://, memory://)."""

    def __init__(self, root: str | None = None):
        self.url = resolve_root(root).rstrip("/")
        self.fs, path = fsspec.core.url_to_fs(self.url)
        self.is_local = self.fs.protocol in ("file", "local") or "file" in tuple(self.fs.protocol)
        self.root = os.path.abspath(path) if self.is_local else path
        self.is_memory = "memory" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        # how a read-modify-write is guarded: a file lock, a process lock (memory:// lives in one process), or
        # a lock object created only if absent (object stores; see conditional_create)
        self.locking = "file" if self.is_local else "process" if self.is_memory else "object"

    # ------------------------------------------------------------------ paths

    def run_dir(self, name: str, fp: str) -> str:
        return f"{self.root}/runs/{name}-{fp[:10]}"

    def url_of(self, path: str) -> str:
        """A path of this store as something another process can open (a local path or a URL)."""
        if self.is_local:
            return path
        return self.fs.unstrip_protocol(path)

    def forecast_dir(self, target: str) -> str:
        return f"{self.root}/forecasts/{target}"

    # ------------------------------------------------------------------ plain files

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def read_json(self, path: str) -> Any | None:
        try:
            with self.fs.open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return None
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CorruptFileError(
                f"{self.url_of(path)} is not valid JSON ({error}); it may be corrupt, inspect or delete it.", self.url_of(path)
            ) from None

    def write_json(self, path: str, obj: Any) -> None:
        """Write JSON atomically: readers see the old file or the new one, never a mix."""
        data = (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode()
        parent = path.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if self.is_local:
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def append_text(self, path: str, text: str) -> None:
        """Append to a log file (object stores: read, then rewrite the whole object)."""
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if self.is_local:
            with open(path, "a") as handle:
                handle.write(text)
            return
        with self._guard(path):
            try:
                with self.fs.open(path, "rb") as handle:
                    old = handle.read()
            except FileNotFoundError:
                old = b""
            self.fs.pipe_file(path, old + text.encode())

    def create_json_exclusive(self, path: str, obj: Any) -> bool:
        """Create `path` only if it does not exist; False if it does (never overwrites)."""
        data = (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode()
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if self.is_local:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            return True
        with self._guard(path):
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True

    def conditional_create(self) -> bool:
        """True when this filesystem creates an object only-if-absent at the server (fsspec's
        ``pipe_file(mode="create")`` implemented by the backend: s3fs sends If-None-Match: *, gcsfs
        ifGenerationMatch=0). False means fsspec's own check-then-write, which two writers can race."""
        from fsspec.asyn import AsyncFileSystem
        from fsspec.spec import AbstractFileSystem

        own = getattr(type(self.fs), "_pipe_file", None) or type(self.fs).pipe_file
        if own in (AbstractFileSystem.pipe_file, AsyncFileSystem._pipe_file):
            return False  # no backend implementation: fsspec checks, then writes
        try:
            return "mode" in inspect.signature(own).parameters
        except (TypeError, ValueError):
            return False

    @contextlib.contextmanager
    def _object_lock(self, path: str) -> Iterator[None]:
        """Hold `path.lock`, an object created only if absent; a lock older than OBJECT_LOCK_STALE_S is
        a crashed holder's and is broken. Best effort where the store has no conditional create."""
        lock = f"{path}.lock"
        token = uuid.uuid4().hex
        deadline = time.time() + 60
        while True:
            body = json.dumps({"token": token, "owner": f"{socket.gethostname()}:{os.getpid()}", "at": time.time()}).encode()
            try:
                self.fs.pipe_file(lock, body, mode="create")
                break
            except FileExistsError:
                try:
                    held_since = float(json.loads(self.fs.cat_file(lock)).get("at", 0))
                except (FileNotFoundError, ValueError, AttributeError):
                    held_since = time.time()  # just released, or being written: try again
                if time.time() - held_since > OBJECT_LOCK_STALE_S:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm(lock)
                    continue
                if time.time() > deadline:
                    raise StoreError(
                        f"{self.url_of(lock)} has been held for over 60 s; if no ladder process is writing this step, delete it."
                    ) from None
                time.sleep(0.05 + 0.1 * (uuid.uuid4().int % 100) / 100)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                if json.loads(self.fs.cat_file(lock)).get("token") == token:
                    self.fs.rm(lock)

    @contextlib.contextmanager
    def _guard(self, path: str) -> Iterator[None]:
        if self.locking == "file":
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with FileLock(f"{path}.lock", timeout=60):
                yield
        elif self.locking == "object":
            with self._object_lock(path):
                yield
        else:
            with _MEMORY_LOCKS_GUARD:
                lock = _MEMORY_LOCKS.setdefault(f"{self.url}|{path}", threading.Lock())
            with lock:
                yield

    # ------------------------------------------------------------------ status

    def status_path(self, run_dir: str) -> str:
        return f"{run_dir}/status.json"

    def read_status(self, run_dir: str) -> dict[str, Any] | None:
        """The step's status; an unreadable status.json reads as the status rebuilt from the run directory
        (see `rebuild_status`, with `unreadable` naming the file) so one corrupt file affects only its step."""
        try:
            return self.read_json(self.status_path(run_dir))
        except CorruptFileError as error:
            return self.rebuild_status(run_dir, error.path)

    def rebuild_status(self, run_dir: str, unreadable: str) -> dict[str, Any]:
        """What status.json would say, from what the run directory holds; reads only.

        result.json -> done; metrics.jsonl or checkpoints -> interrupted (the next attempt resumes from the
        newest checkpoint), held by an unknown owner while metrics.jsonl was written within the lease TTL
        (a holder may still be running); nothing -> pending. Attempts and history are lost with the file.
        """
        now = time.time()
        sources = []
        try:
            result = self.read_json(f"{run_dir}/result.json")
        except CorruptFileError:
            result = None
        if isinstance(result, dict):
            sources.append("result.json")
        metrics = f"{run_dir}/metrics.jsonl"
        if self.fs.exists(metrics):
            sources.append("metrics.jsonl")
        try:
            if self.fs.ls(f"{run_dir}/checkpoints", detail=False):
                sources.append("checkpoints")
        except (FileNotFoundError, NotADirectoryError):
            pass
        status: dict[str, Any] = {"state": "pending", "attempts": 0, "history": []}
        if "result.json" in sources:
            status["state"] = "done"
        elif sources:
            status["state"] = "interrupted"
            written = self._modified(metrics) if "metrics.jsonl" in sources else None
            if written is not None and now - written < lease_ttl_seconds():
                status["state"] = "running"
                status["lease"] = {"owner": "unknown (status.json was unreadable)", "heartbeat": written, "acquired_at": written}
        status["unreadable"] = {"path": unreadable, "rebuilt_from": sources, "at": now}
        return status

    def _modified(self, path: str) -> float | None:
        try:
            return self.fs.modified(path).timestamp()
        except Exception:  # noqa: BLE001 - not every filesystem knows; then no holder is assumed
            return None

    def _move_aside(self, path: str) -> str:
        """Rename a corrupt file to `path.corrupt-<time>` (never delete it); returns the new path."""
        aside = f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:4]}"
        if self.is_local:
            os.replace(path, aside)
        else:
            self.fs.mv(path, aside)
        return aside

    def update_status(self, run_dir: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict[str, Any]:
        """Guarded read-modify-write of status.json; `change` edits the dict (or returns a new one).

        An unreadable status.json is moved aside and replaced by the status rebuilt from the run directory."""
        path = self.status_path(run_dir)
        with self._guard(path):
            try:
                status = self.read_json(path) or {"state": "pending", "attempts": 0, "history": []}
            except CorruptFileError as error:
                status = self.rebuild_status(run_dir, error.path)
                unreadable = status.pop("unreadable")
                aside = self.url_of(self._move_aside(path))
                status["rebuilt"] = {"moved_aside": aside, "rebuilt_from": unreadable["rebuilt_from"], "at": unreadable["at"]}
                status["history"].append({"event": "status_rebuilt", **status["rebuilt"]})
            updated = change(status)
            status = updated if updated is not None else status
            status["updated_at"] = time.time()
            self.write_json(path, status)
            return status

    def acquire_lease(self, run_dir: str, owner: str, *, ttl: float | None = None) -> LeaseOutcome:
        """Take the step's lease unless a live holder has it or the step is done."""
        ttl = lease_ttl_seconds() if ttl is None else ttl
        result: dict[str, Any] = {}

        def change(status: dict[str, Any]) -> None:
            now = time.time()
            lease = status.get("lease")
            if status.get("state") == "done":
                result.update(acquired=False)
                return
            if lease and lease.get("owner") != owner and lease_is_live(lease, now, ttl):
                result.update(acquired=False, holder=lease["owner"], age=now - lease["heartbeat"])
                return
            if lease and lease.get("owner") != owner:
                status.setdefault("history", []).append(
                    {"event": "lease_taken_over", "from": lease.get("owner"), "stale_for": now - lease.get("heartbeat", 0), "at": now,
                     **({"reason": f"pid {lease.get('pid')} on {lease.get('host')} is gone"} if holder_is_gone(lease) else {})}
                )
            status["lease"] = {"owner": owner, "heartbeat": now, "acquired_at": now, "host": socket.gethostname(), "pid": os.getpid()}
            status.pop("rebuilt", None)  # a new attempt: the rebuild stays in history only
            status["state"] = "running"
            status["attempts"] = int(status.get("attempts", 0)) + 1
            status["started_at"] = now
            status["host"] = socket.gethostname()
            status.pop("finished_at", None)
            result.update(acquired=True)

        status = self.update_status(run_dir, change)
        if not self.is_local and not self.is_memory and result.get("acquired"):
            time.sleep(1.0)  # object stores: let a racing writer land, then verify we still hold it
            status = self.read_status(run_dir) or {}
            if (status.get("lease") or {}).get("owner") != owner:
                holder = (status.get("lease") or {}).get("owner")
                return LeaseOutcome(False, status, holder, 0.0)
        return LeaseOutcome(bool(result.get("acquired")), status, result.get("holder"), result.get("age"))

    def heartbeat(self, run_dir: str, owner: str, progress: dict[str, Any] | None = None) -> bool:
        """Refresh the lease; False if someone else holds it now or a stop was requested (we must stop)."""
        held = {"ok": False}

        def change(status: dict[str, Any]) -> None:
            lease = status.get("lease") or {}
            if lease.get("owner") == owner and status.get("stop_requested") != owner:
                lease["heartbeat"] = time.time()
                if progress:
                    status["progress"] = progress
                held["ok"] = True

        self.update_status(run_dir, change)
        return held["ok"]

    def finish(self, run_dir: str, owner: str | None, state: str, *, error: str | None = None, extra: dict | None = None) -> dict:
        """Record the end of an attempt and release the lease (only if `owner` still holds it, or owner is None)."""
        assert state in STATES

        def change(status: dict[str, Any]) -> None:
            lease = status.get("lease") or {}
            if owner is not None and lease.get("owner") not in (None, owner):
                return  # someone else took over; their status is the truth
            now = time.time()
            status["state"] = state
            status["finished_at"] = now
            status["lease"] = None
            status.pop("stop_requested", None)
            if error is not None:
                status["last_error"] = error
            elif state == "done":
                status.pop("last_error", None)  # an earlier attempt's error no longer describes the step
            status.setdefault("history", []).append({"event": state, "at": now, "owner": owner, **({"error": error[-500:]} if error else {})})
            if extra:
                status.update(extra)

        return self.update_status(run_dir, change)

    # ------------------------------------------------------------------ forecasts

    def list_forecasts(self, target: str) -> list[int]:
        directory = self.forecast_dir(target)
        try:
            names = self.fs.ls(directory, detail=False)
        except FileNotFoundError:
            return []
        versions = []
        for name in names:
            stem = name.rsplit("/", 1)[-1]
            if stem.endswith(".json") and stem[:-5].isdigit():
                versions.append(int(stem[:-5]))
        return sorted(versions)

    def write_forecast(self, target: str, payload: dict[str, Any]) -> int:
        """Store a new forecast version n+1 for `target`; earlier versions are never touched."""
        for _ in range(100):
            version = (self.list_forecasts(target) or [0])[-1] + 1
            payload = {**payload, "version": version}
            if self.create_json_exclusive(f"{self.forecast_dir(target)}/{version}.json", payload):
                return version
        raise StoreError(f"could not allocate a forecast version for {target!r} after 100 tries.")

    def read_forecast(self, target: str, version: int | None = None) -> dict[str, Any] | None:
        versions = self.list_forecasts(target)
        if not versions:
            return None
        return self.read_json(f"{self.forecast_dir(target)}/{version or versions[-1]}.json")


class Heartbeat:
    """Background thread that keeps a lease alive; `lost` is set if another owner took the lease."""

    def __init__(self, store: Store, run_dir: str, owner: str, interval: float | None = None):
        self.store, self.run_dir, self.owner = store, run_dir, owner
        self.interval = interval or max(0.2, lease_ttl_seconds() / 4)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self.progress: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{owner}", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self.store.heartbeat(self.run_dir, self.owner, self.progress):
                    self.lost.set()
                    return
            except Exception:  # a flaky store must not kill the run; a stale lease is the worst case
                continue
