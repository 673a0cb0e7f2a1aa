"""Serving rlkit over other tools' APIs: the Tinker SDK's (``rlkit.serve_tinker``; needs the ``tinker`` extra to
decode the SDK's protobuf requests)."""

from rlkit.serving.tinker_http import TinkerServer, serve_tinker

__all__ = ["TinkerServer", "serve_tinker"]
