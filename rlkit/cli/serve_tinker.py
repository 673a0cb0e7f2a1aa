"""``rlkit serve-tinker``: launch workers and serve the Tinker SDK's LoRA train + sample API on them until
interrupted. Prints the URL and the run's API key for ``tinker.ServiceClient``. The first Ctrl-C (or SIGTERM) stops
accepting requests, cancels the queued calls and finishes the running one; a second one exits at once (the workers
end with their parent)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from rlkit.config import ConfigError, LoraConfig, PrimitivesConfig
from rlkit.runtime import launch
from rlkit.serving.tinker_http import serve_problems, serve_tinker


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-tinker", help="serve the Tinker SDK's API (LoRA training + sampling) on local workers")
    p.add_argument("--model", default="tiny", help='"tiny" or a local Hugging Face model directory (default tiny)')
    p.add_argument("--lora-alpha", type=float, default=16.0, help="the adapters' alpha (the SDK sends the rank)")
    p.add_argument("--world-size", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--host", default="127.0.0.1", help="where to listen (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (default 8000)")
    p.add_argument("--allow-remote", action="store_true", help="allow a --host other machines can reach")
    p.add_argument("--state-dir", default=None, help="where save_state writes (default: a new temporary folder)")


def serve(args: argparse.Namespace) -> int:
    """Check everything, launch, serve until SIGINT/SIGTERM, shut down; 2 on bad arguments."""
    try:
        problems = serve_problems(args.host, args.allow_remote, None, 10.0)
        config = PrimitivesConfig(model=args.model, lora=LoraConfig(rank=8, alpha=args.lora_alpha))
        if problems:
            raise ConfigError(problems)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: _interrupted(stop))
    cluster = launch(world_size=args.world_size, device=args.device)
    try:
        with serve_tinker(cluster, config=config, host=args.host, port=args.port,
                          allow_remote=args.allow_remote, state_dir=args.state_dir) as server:  # fmt: skip
            print(f"Tinker API at {server.url}\napi_key: {server.api_key}\n"
                  f"tinker.ServiceClient(base_url={server.url!r}, api_key=<api_key>); Ctrl-C stops", flush=True)
            stop.wait()
    finally:
        cluster.shutdown()
    print("stopped", flush=True)
    return 0


def _interrupted(stop: threading.Event) -> None:
    """The first interrupt stops the server gracefully; the second exits now."""
    if stop.is_set():
        print("interrupted again: exiting now", file=sys.stderr, flush=True)
        os._exit(130)
    print("stopping: the running call finishes, the queued ones are cancelled (Ctrl-C again: exit now)",
          file=sys.stderr, flush=True)  # fmt: skip
    stop.set()
