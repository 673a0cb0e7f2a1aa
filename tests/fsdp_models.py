"""Small models and FSDP1 / FSDP2 set-ups shared by the diagnostics tests (importable on workers)."""

from __future__ import annotations

import torch
from torch import nn

D = 16


class Block(nn.Module):
    """A residual MLP block with a fixed random projection (a buffer every rank must hold identically)."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("proj", torch.randn(d, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x)) @ self.proj


class Net(nn.Module):
    """embed -> 3 blocks -> head; ``vocab`` sets how much of the model sits outside the blocks."""

    def __init__(self, vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def fsdp1(model: nn.Module, *, wrap=(Block,), **kwargs) -> nn.Module:
    """FSDP1 on CPU: ``wrap`` classes become units (none: one unit), use_orig_params=True unless given."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs.setdefault("use_orig_params", True)
    policy = ModuleWrapPolicy(set(wrap)) if wrap else None
    return FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=policy, **kwargs)


def fsdp2(model: Net, *, blocks=True, root=True, mesh_shape=(2,), block_mp=None, root_mp=None) -> nn.Module:
    """FSDP2: fully_shard each block, then the root; mesh_shape (2, 1) is HSDP that replicates and never shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = ("replicate", "shard")[-len(mesh_shape):]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if blocks:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=block_mp or MixedPrecisionPolicy())
    if root:
        fully_shard(model, mesh=mesh, mp_policy=root_mp or MixedPrecisionPolicy())
    return model


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)
