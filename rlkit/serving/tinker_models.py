"""The training clients and sampling sessions a Tinker server holds: one rlkit.TrainingClient per model id,
the ``seq_id`` order of its calls, and which saved weights each sampling session samples."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlkit.config.primitives import PrimitivesConfig
from rlkit.models import resolve_model_dir
from rlkit.runtime.cluster import Cluster
from rlkit.serving.futures import SeqOrder
from rlkit.serving.tinker_states import StateFolders
from rlkit.trainer.primitives import TrainingClient


@dataclass
class ServedModel:
    """One Tinker training client: ``model_id`` -> the rlkit client that runs its calls."""

    model_id: str
    base_model: str
    client: TrainingClient
    owned: bool
    """Built by the server (closed with it) rather than handed to it."""
    order: SeqOrder = field(default_factory=SeqOrder)
    saves: int = 0
    """``save_weights_for_sampler`` calls queued; the engine holds save ``saves``'s weights once they ran (0: the
    weights it started with)."""


@dataclass(frozen=True)
class SamplingSession:
    model_id: str
    save: int
    """Which save's weights it samples (0: the start, i.e. the base model plus fresh adapters)."""
    model_path: str | None = None


class ServedModels:
    """The models and sampling sessions of one server, over a cluster (a new model replaces the last one: one
    owner's roles live on a cluster at a time) or over one given rlkit.TrainingClient; ``save_state`` folders
    under ``state_dir``."""

    def __init__(self, target: Cluster | TrainingClient, config: PrimitivesConfig, state_dir: Path):
        self.target, self.config, self.states = target, config, StateFolders(state_dir)
        self._lock = threading.Lock()
        self._models: dict[str, ServedModel] = {}
        self._current: str | None = None
        self._sessions: dict[str, SamplingSession] = {}

    @property
    def base_model(self) -> str:
        """The served model's name for clients: "tiny", or its directory's name (never a path of this machine)."""
        model = self.target.config.model if isinstance(self.target, TrainingClient) else self.config.model
        return Path(model).name

    def create(self, model_id: str, base_model: str, lora: dict[str, Any], seed: int | None) -> ServedModel:
        """A new training client for Tinker's ``create_model`` (on the cluster: builds the roles, seconds), its
        adapters the served config's but for ``lora``'s settings (LoraConfig fields: ``create_model``'s rank, or all
        of a saved state's)."""
        if isinstance(self.target, TrainingClient):
            client, owned = self._given_client(base_model, lora), False
        else:
            config = dataclasses.replace(self.config, model=_local_model(base_model, self.config.model),
                                         lora=dataclasses.replace(self.config.lora, **lora),
                                         seed=self.config.seed if seed is None else seed)  # fmt: skip
            client, owned = TrainingClient(self.target, config), True
        model = ServedModel(model_id, base_model, client, owned)
        with self._lock:
            if self._current is not None and self._models[self._current].owned:
                self._models[self._current].client.close()
            self._models[model_id], self._current = model, model_id
        return model

    def _given_client(self, base_model: str, lora: dict[str, Any]) -> TrainingClient:
        assert isinstance(self.target, TrainingClient)
        client, problems = self.target, []
        if self._models:
            problems.append(f"this server serves the one rlkit.TrainingClient it was given, already model "
                            f"{self._current}; serve a cluster to create several")  # fmt: skip
        if resolve_model_dir(_local_model(base_model, client.config.model)) != client.model_dir:
            problems.append(f"base_model={base_model!r}: the served client trains {self.base_model!r}")
        served = client.config.lora
        problems += [f"lora {key}={value!r}: the served client's adapters have {key}={getattr(served, key)!r}"
                     for key, value in lora.items() if getattr(served, key) != value]  # fmt: skip
        if problems:
            raise ValueError("create_model: " + "; ".join(problems))
        return client

    def model(self, model_id: str) -> ServedModel:
        """The model, if it is still the one served (ValueError naming why not)."""
        with self._lock:
            if model_id not in self._models:
                raise ValueError(f"model_id={model_id!r}: no such model on this server (create_model first)")
            if model_id != self._current:
                raise ValueError(f"model {model_id} was replaced by model {self._current}: rlkit serves one "
                                 "training client per cluster at a time")  # fmt: skip
            return self._models[model_id]

    def current(self) -> ServedModel:
        with self._lock:
            current = self._current
        if current is None:
            raise ValueError("no training client yet: create one (create_lora_training_client) before sampling")
        return self.model(current)

    def add_session(self, session_id: str, session: SamplingSession) -> None:
        with self._lock:
            self._sessions[session_id] = session

    def session(self, session_id: str) -> SamplingSession:
        with self._lock:
            if session_id not in self._sessions:
                raise ValueError(f"sampling_session_id={session_id!r}: no such sampling session")
            return self._sessions[session_id]

    def session_for_path(self, model_path: str) -> SamplingSession:
        with self._lock:
            found = [s for s in self._sessions.values() if s.model_path == model_path]
        if not found:
            raise ValueError(f"model_path={model_path!r}: no weights saved under that path on this server")
        return found[0]

    def state_path(self, model_id: str, name: str | None) -> tuple[str, Path]:
        """The ``tinker://<model_id>/weights/<name>`` path of a ``save_state`` and its folder inside ``state_dir``."""
        return self.states.folder(model_id, name)

    def state_folder(self, tinker_path: str) -> Path:
        """The folder of a ``tinker://<model_id>/weights/<name>`` path this server saved and signed (ValueError
        otherwise)."""
        return self.states.verified(tinker_path)

    def close(self) -> None:
        """Finish the queued calls of the clients this server built."""
        with self._lock:
            models = list(self._models.values())
        for model in models:
            if model.owned:
                model.client.close()


def _local_model(base_model: str, default: str) -> str:
    """``base_model`` as rlkit loads it: "tiny", a local directory, or the served config's model when the
    client names that (or its public name, the directory's name)."""
    names = (default, str(resolve_model_dir(default)), Path(default).name)
    return default if base_model in names else base_model
