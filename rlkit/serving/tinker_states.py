"""The ``save_state`` folders of a Tinker server: ids and names checked, each folder resolved inside ``state_dir``
(no ``..``, no absolute path, no link out), and signed by the server. A state holds torch's checkpoint metadata,
which loading unpickles, so only a folder this server wrote for that very ``tinker://`` path is loaded: its
manifest lists every file's SHA-256 under an HMAC with the key in ``<state_dir>/.rlkit-state-key`` (owner-only)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
from pathlib import Path

SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MODEL_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}:train:[0-9]{1,9}$")
NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
_STATE_PATH = re.compile(r"^tinker://(?P<model>[^/]+)/weights/(?P<name>[^/]+)$")
_LEFTOVER = re.compile(r"^\..+\.(partial|old)-[0-9a-f]{8}$")  # rlkit.trainer.checkpoints.written_in_place's
MANIFEST = ".rlkit-manifest.json"
KEY_FILE = ".rlkit-state-key"


def model_id(session_id: str, model_seq_id: int) -> str:
    """The model id of a session's training client (ValueError for a session id this server would not issue)."""
    if not SESSION_ID.match(session_id) or not 0 <= model_seq_id < 10**9:
        raise ValueError(f"session_id={session_id!r}, model_seq_id={model_seq_id}: give a session id of this server "
                         "(letters, digits, '_', '-') and a model_seq_id from 0 to 999999999")  # fmt: skip
    return f"{session_id}:train:{model_seq_id}"


class StateFolders:
    """Folders ``<state_dir>/<model id>/<name>``; at start, the leftovers of interrupted saves are removed."""

    def __init__(self, state_dir: Path):
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.root = state_dir.resolve()
        self._key = _key(self.root / KEY_FILE)
        for leftover in [p for d in self.root.iterdir() if d.is_dir() for p in d.iterdir() if _LEFTOVER.match(p.name)]:
            shutil.rmtree(leftover, ignore_errors=True)

    def folder(self, model: str, name: str | None) -> tuple[str, Path]:
        """The ``tinker://<model>/weights/<name>`` path and its folder, resolved inside ``state_dir``."""
        if not MODEL_ID.match(model):
            raise ValueError(f"model id {model!r}: not one this server issues")
        if not name or not NAME.match(name):
            raise ValueError(f"save_state name={name!r}: give 1 to 128 letters, digits, '.', '_' or '-', not starting "
                             "with '.'")  # fmt: skip
        folder = self.root / model.replace(":", "_") / name
        if folder.resolve() != folder:
            raise ValueError(f"tinker://{model}/weights/{name}: its folder is a link; refused")
        return f"tinker://{model}/weights/{name}", folder

    def sign(self, tinker_path: str, folder: Path) -> None:
        """Write the manifest of the folder ``save_state`` just wrote for ``tinker_path``."""
        files = _digests(folder)
        manifest = {"path": tinker_path, "files": files, "mac": self._mac(tinker_path, files)}
        (folder / MANIFEST).write_text(json.dumps(manifest))

    def verified(self, tinker_path: str) -> Path:
        """The folder of ``tinker_path`` if this server wrote it for that path, unchanged (ValueError otherwise)."""
        found = _STATE_PATH.match(tinker_path) if isinstance(tinker_path, str) else None
        if found is None:
            raise ValueError(f"path={tinker_path!r}: give a tinker://<model id>/weights/<name> path that save_state "
                             "returned")  # fmt: skip
        folder = self.folder(found["model"], found["name"])[1]
        if not folder.is_dir():
            raise ValueError(f"path={tinker_path!r}: no state saved under that path on this server")
        if not (folder / MANIFEST).is_file():
            raise ValueError(f"path={tinker_path!r}: the folder has no {MANIFEST}, so it was not written by this "
                             "server's save_state: an rlkit from before the server signed its states (issue 42) wrote "
                             "it, or something else did; this server loads only the states it signed. To re-save a "
                             "state of an earlier rlkit with this version: rlkit.TrainingClient(cluster, "
                             "config).load_state(folder) in Python, rlkit.serve_tinker(that client), then the SDK's "
                             "save_state")  # fmt: skip
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            files = _digests(folder)
            signed = manifest["path"] == tinker_path and manifest["files"] == files and hmac.compare_digest(
                str(manifest["mac"]), self._mac(tinker_path, files))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            signed = False
        if not signed:
            raise ValueError(f"path={tinker_path!r}: the folder was not written by this server's save_state for that "
                             "path, or was changed since; refused (loading it would unpickle its files)")  # fmt: skip
        return folder

    def _mac(self, tinker_path: str, files: dict[str, str]) -> str:
        message = json.dumps({"path": tinker_path, "files": files}, sort_keys=True).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()


def _digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` but the manifest, by relative path (ValueError on a link)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            raise ValueError(f"{path.name}: a link inside a state folder")
        if path.is_file() and path.relative_to(folder).as_posix() != MANIFEST:
            digest = hashlib.sha256()
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            out[path.relative_to(folder).as_posix()] = digest.hexdigest()
    return out


def _key(path: Path) -> bytes:
    """The server's signing key: read from ``path``, or made there, readable by its owner only."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            key = f.read()
        if len(key) != 32:
            raise ValueError(f"{path}: not an rlkit state key (32 bytes); remove it to make a new one") from None
        return key
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key
