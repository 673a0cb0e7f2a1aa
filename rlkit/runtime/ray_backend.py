"""The Ray backend's controller side: one ``RayWorker`` actor per rank in a placement group.

``rlkit.launch(backend="ray", address=...)`` builds it; only this module and ``ray_actor`` import
Ray. Each rank gets one bundle (``{"CPU": 1}``, or ``{"CPU": 1, "GPU": 1}`` on GPUs, packed onto
as few nodes as possible); torch.distributed rendezvous at rank 0's node. Calls and results
travel through Ray's object store: each distinct tensor of a call is one object (stored once
however many ranks receive it), read without copying by the workers on its node.

Connecting: ``address=None`` starts a single-node Ray instance on this machine, without dashboard;
``"auto"`` joins the Ray cluster this machine belongs to; ``"ray://HOST:PORT"`` is Ray client.
Ray (2.60) cannot be confined to loopback: it replaces a loopback node address by the machine's
and its servers listen on every interface; its token authentication (on by default) refuses
peers without the cluster's token. Keep Ray's ports behind a firewall on shared networks. If Ray
is already initialised in this process, it is used as it is. Shutting the cluster down kills the
actors and removes the placement group; Ray itself keeps running (``ray.shutdown()`` stops an
instance this process started).
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlkit.runtime import transport
from rlkit.runtime.errors import RankFailure, RemoteError, WorkerDied, decode_reply
from rlkit.runtime.local import choose_device
from rlkit.runtime.logs import OutputForwarder, tail
from rlkit.runtime.ray_actor import Mailbox, RayWorker

Outcome = tuple[int, int, bool, Any]  # (rank, call_id, ok, result or RankFailure)
MAILBOX_EVERY_S = 0.2
ALIVE_S = 5.0  # a worker whose last heartbeat is older than this shows alive=False


class RayBackend:
    """``world_size`` Ray actors, one per rank."""

    def __init__(
        self,
        world_size: int,
        *,
        cluster_id: str,
        device: str,
        address: str | None,
        timeout: float,
        log_dir: Path,
        env: dict[str, str] | None,
    ) -> None:
        self.world_size = world_size
        self.log_dir = log_dir
        self.output = OutputForwarder()
        for rank in range(world_size):
            self.output.add(rank, log_dir / f"rank{rank}.log")
        self._actors: list[Any] = []
        self._infos: list[dict[str, Any]] = []
        self._devices = ["-"] * world_size
        self._pg: Any = None
        self._mailbox: Any = None
        self._call_id = -1
        self._pending: dict[int, Any] = {}  # rank -> ObjectRef of its running call
        self._refs: list[Any] = []  # the running call's arguments in the object store
        self._beats: dict[int, tuple[float, float]] = {}
        self._stacks: dict[int, str] = {}
        self._dead: dict[int, str] = {}
        self._collected = 0.0
        try:
            self._start(cluster_id, device, address, timeout, env)
        except BaseException:
            self.stop()
            raise

    def _start(
        self, cluster_id: str, device: str, address: str | None, timeout: float, env: dict[str, str] | None
    ) -> None:
        deadline = time.monotonic() + timeout
        _init_ray(address, self.world_size)
        self.address = ray.get_runtime_context().gcs_address
        self.device = choose_device(device, int(ray.cluster_resources().get("GPU", 0)), self.world_size)
        bundle = {"CPU": 1, "GPU": 1} if self.device == "cuda" else {"CPU": 1}
        self._pg = placement_group([bundle] * self.world_size, strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(
                f"Ray could not place {self.world_size} bundles of {bundle} within "
                f"the launch timeout; available: {ray.available_resources()}"
            )
        self._mailbox = ray.remote(Mailbox).options(num_cpus=0).remote(self.world_size)
        options = {"runtime_env": {"env_vars": dict(env)}} if env else {}
        worker_cls = ray.remote(RayWorker)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            self._actors.append(
                worker_cls.options(
                    num_cpus=1, num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy, **options
                ).remote(rank, cluster_id, self._mailbox)
            )
        self._infos = self._get([a.info.remote() for a in self._actors], deadline, "start")
        port = self._get([self._actors[0].free_port.remote()], deadline, "start")[0]
        configs = self._configs(port)
        replies = self._get(
            [a.join.remote(c) for a, c in zip(self._actors, configs, strict=True)], deadline, "join the process group"
        )
        failures = [
            RankFailure.from_info(r, self._infos[r]["host"], "-", e) for r, (ok, e) in enumerate(replies) if not ok
        ]
        if failures:
            raise RemoteError(failures, note="(while starting the workers)")
        self._devices = [device for _, device in replies]

    def _configs(self, master_port: int) -> list[dict[str, Any]]:
        """Each rank's join config: local ranks count the actors on the same node."""
        nodes = [info["node"] for info in self._infos]
        configs = []
        for rank, node in enumerate(nodes):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(nodes[:rank].count(node)),
                "LOCAL_WORLD_SIZE": str(nodes.count(node)),
                "MASTER_ADDR": self._infos[0]["ip"],
                "MASTER_PORT": str(master_port),
            }
            # One GPU per actor: Ray makes it the only visible one, cuda:0.
            configs.append({"device": self.device, "sys_path": list(sys.path), "env": env, "cuda_index": 0})
        return configs

    def _get(self, refs: list[Any], deadline: float, step: str) -> list[Any]:
        try:
            return ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError:
            raise TimeoutError(f"the Ray workers did not {step} within the launch timeout") from None

    # -- one call -------------------------------------------------------------------------------

    def encode(
        self, fn: Callable[..., Any], per_rank: list[tuple[tuple, dict[str, Any]]]
    ) -> list[tuple[bytes, list[Any]]]:
        """Pickle every rank's call; each distinct tensor goes into the object store once."""
        oob = transport.OutOfBand()
        stored: dict[int, Any] = {}
        payloads = []
        for args, kwargs in per_rank:
            data, buffers = oob.dumps((fn, args, kwargs))
            for buffer in buffers:
                if id(buffer) not in stored:
                    stored[id(buffer)] = ray.put(buffer)
            payloads.append((data, [stored[id(b)] for b in buffers]))
        self._refs = list(stored.values())
        return payloads

    def send(self, call_id: int, payloads: list[tuple[bytes, list[Any]]]) -> None:
        self._call_id = call_id
        self._pending = {
            rank: actor.call.remote(call_id, data, refs)
            for rank, (actor, (data, refs)) in enumerate(zip(self._actors, payloads, strict=True))
        }

    def poll(self, timeout: float) -> list[Outcome]:
        """Wait up to ``timeout`` s; the calls that finished, as ``(rank, call_id, ok, value)``."""
        refs = list(self._pending.values())
        ready = ray.wait(refs, num_returns=1, timeout=timeout)[0] if refs else []
        if refs and ready:
            ready = ray.wait(refs, num_returns=len(refs), timeout=0)[0]
        elif not refs:
            time.sleep(timeout)
        if ready or time.monotonic() - self._collected > MAILBOX_EVERY_S:
            self._collect()  # output printed before the results, in order
        done = []
        for rank, ref in list(self._pending.items()):
            if ref in ready:
                del self._pending[rank]
                outcome = self._take(rank, ref)
                if outcome is not None:
                    done.append(outcome)
        return done

    def _take(self, rank: int, ref: Any) -> Outcome | None:
        try:
            ok, reply, lines = ray.get(ref)
        except RayActorError as exc:
            self._dead[rank] = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            self.output.close(rank)
            return None
        except RayError as exc:  # Ray could not run or return the call (e.g. an object was lost)
            return (
                rank,
                self._call_id,
                False,
                RankFailure(
                    rank,
                    self._infos[rank]["host"],
                    self._devices[rank],
                    type(exc).__name__,
                    str(exc),
                    traceback.format_exc(),
                ),
            )
        self.output.feed(rank, lines)
        return rank, self._call_id, ok, self._decode(rank, ok, reply)

    def _decode(self, rank: int, ok: bool, reply: Any) -> Any:
        return decode_reply(
            rank, self._infos[rank]["host"], self._devices[rank], ok, reply, lambda packed: transport.loads(*packed)
        )

    def _collect(self) -> None:
        """Heartbeats, output lines and stacks from the mailbox."""
        self._collected = time.monotonic()
        beats, lines, stacks = ray.get(self._mailbox.collect.remote())
        self._beats.update(beats)
        self._stacks.update(stacks)
        for rank, rank_lines in sorted(lines.items()):
            self.output.feed(rank, rank_lines)

    def end_call(self) -> None:
        """Release the call's objects in the object store."""
        self._refs = []

    def cancel(self, call_id: int, ranks: list[int]) -> None:
        ray.get(self._mailbox.command.remote(ranks, ("cancel", call_id)))

    def stacks(self, ranks: list[int], timeout: float) -> dict[int, str]:
        """Each rank's Python stacks ('' for a rank that did not answer within ``timeout`` s)."""
        self._stacks = {}
        ray.get(self._mailbox.command.remote(ranks, ("stacks",)))
        deadline = time.monotonic() + timeout
        while any(r not in self._stacks for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
            self._collect()
        return {r: self._stacks.get(r, "") for r in ranks}

    def find_dead(self, during: str) -> WorkerDied | None:
        if not self._dead:
            return None
        rank = min(self._dead)
        log = self._infos[rank]["log"]
        return WorkerDied(
            rank,
            self._infos[rank]["pid"],
            None,
            during=during,
            cause=f"Ray reports that its actor died ({self._dead[rank]})",
            log_path=f"{self.log_dir / f'rank{rank}.log'} (all of it: {log} on {self._infos[rank]['host']})",
            log_tail=tail(self.log_dir / f"rank{rank}.log"),
        )

    # -- state and lifetime ---------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """One dict per rank: rank, pid, host, device, alive, busy, heartbeat (unix time), rss_mb."""
        rows = []
        for rank, info in enumerate(self._infos):
            beat, rss = self._beats.get(rank, (math.nan, math.nan))
            alive = rank not in self._dead and time.time() - beat < ALIVE_S
            rows.append(
                {
                    "rank": rank,
                    "pid": info["pid"],
                    "host": info["host"],
                    "device": self._devices[rank],
                    "alive": alive,
                    "busy": rank in self._pending,
                    "heartbeat": beat,
                    "rss_mb": rss,
                }
            )
        return rows

    def stop(self) -> None:
        """Kill the actors and the mailbox, remove the placement group."""
        for actor in [*self._actors, *([self._mailbox] if self._mailbox is not None else [])]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone, or Ray is shut down
                pass
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - Ray is shut down
                pass
        self._actors, self._mailbox, self._pg, self._pending, self._refs = [], None, None, {}, []
        for rank in range(self.world_size):
            self.output.close(rank)
        self.output.release(None)


def _init_ray(address: str | None, world_size: int) -> None:
    if ray.is_initialized():
        return
    if address is None:
        ray.init(
            address="local", num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False, log_to_driver=False
        )
    else:
        ray.init(address=address, log_to_driver=False)
