"""FSDP lint gallery: each classic mistake planted in a small model on 2 gloo workers, FSDP1 and FSDP2.

Every case builds a model on both ranks, plants one mistake, and the lint must
report that mistake's id; the same case with the mistake fixed must report nothing.
"""

from __future__ import annotations

import pytest
import torch
from fsdp_models import Block, D, adamw, fsdp1, fsdp2, net
from torch import nn

from rlkit import diagnostics as dx
from rlkit.runtime import context


def build(case: str, fixed: bool) -> dx.RankReport:
    """On a worker: build ``case`` (planted, or ``fixed``) and inspect it."""
    rank = context().rank
    return CASES[case](fixed, rank)


def _optimizer_before_wrap(api):
    def case(fixed, rank):
        model = net()
        early = None if fixed else adamw(model)
        model = fsdp1(model, use_orig_params=fixed) if api == 1 else fsdp2(model)  # FSDP1's default: False
        return dx.inspect(model, early or adamw(model))
    return case


def _one_giant_unit(api):
    def case(fixed, rank):
        model = fsdp1(net(), wrap=(Block,) if fixed else ()) if api == 1 else fsdp2(net(), blocks=fixed)
        return dx.inspect(model, adamw(model))
    return case


def _no_shard(api):
    def case(fixed, rank):
        if api == 1:
            from torch.distributed.fsdp import ShardingStrategy

            strategy = ShardingStrategy.FULL_SHARD if fixed else ShardingStrategy.NO_SHARD
            model = fsdp1(net(), sharding_strategy=strategy)
        else:
            model = fsdp2(net(), mesh_shape=(2,) if fixed else (2, 1))
        return dx.inspect(model, adamw(model))
    return case


def _fp16_without_scaler(api):
    def case(fixed, rank):
        scaler = torch.amp.GradScaler("cpu") if fixed else None
        if api == 1:
            from torch.distributed.fsdp import MixedPrecision

            model = fsdp1(net(), mixed_precision=MixedPrecision(param_dtype=torch.float16))
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
            model = fsdp2(net(), block_mp=fp16, root_mp=fp16)
        return dx.inspect(model, adamw(model), scaler=scaler)
    return case


def _mixed_fp16_bf16(api):
    def case(fixed, rank):
        root = torch.bfloat16 if fixed else torch.float16
        if api == 1:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import MixedPrecision

            model = net()
            for i, block in enumerate(model.blocks):
                model.blocks[i] = FSDP(block, device_id=torch.device("cpu"), use_orig_params=True,
                                       mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
            model = fsdp1(model, wrap=(), mixed_precision=MixedPrecision(param_dtype=root))
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            model = fsdp2(net(), block_mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                          root_mp=MixedPrecisionPolicy(param_dtype=root))
        return dx.inspect(model, adamw(model))
    return case


def _use_orig_params_false(fixed, rank):
    model = fsdp1(net(), use_orig_params=fixed)
    return dx.inspect(model, adamw(model))


def _weights_loaded_after_wrap(api):
    def case(fixed, rank):
        loaded = net(seed=1).state_dict()
        model = net()
        if fixed:
            model.load_state_dict(loaded)
        model = fsdp1(model, use_orig_params=fixed) if api == 1 else fsdp2(model)
        if not fixed:  # what load_state_dict(assign=True) or a hand-written loader does
            inner = model.module.head if api == 1 else model.head
            inner.weight = nn.Parameter(loaded["head.weight"])
        return dx.inspect(model, adamw(model))
    return case


def _ranks_differ(api):
    def case(fixed, rank):
        # planted: each rank initialises on its own, and neither FSDP broadcasts by default; the fix here is
        # one seed (on GPU, FSDP1's sync_module_states=True also works; it refuses CPU modules)
        model = net(seed=0 if fixed else rank)
        model = fsdp1(model) if api == 1 else fsdp2(model)
        return dx.inspect(model, adamw(model))
    return case


def _frozen_trainable_mixed(fixed, rank):
    model = net()
    model.embed.requires_grad_(False)
    model = fsdp1(model, wrap=(Block, nn.Embedding) if fixed else (Block,))
    return dx.inspect(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))


def _memory_not_sharded(api):
    def case(fixed, rank):
        if api == 1:
            from torch.distributed.fsdp import ShardingStrategy

            strategy = ShardingStrategy.FULL_SHARD if fixed else ShardingStrategy.NO_SHARD
            model = fsdp1(net(vocab=1024), sharding_strategy=strategy)
        else:
            model = fsdp2(net(vocab=1024), root=fixed)
        optimizer = adamw(model)
        model(torch.arange(8).view(2, 4)).sum().backward()
        optimizer.step()
        return dx.inspect(model, optimizer)
    return case


def _wrong_device(api):
    def case(fixed, rank):
        model = fsdp1(net()) if api == 1 else fsdp2(net())
        blocks = model.module.blocks if api == 1 else model.blocks
        if not fixed:  # a module added after wrapping, never materialised
            blocks[0].register_buffer("mask", torch.ones(D, device="meta"))
        return dx.inspect(model, adamw(model))
    return case


def _unwrapped_params(fixed, rank):
    model = fsdp2(net(), root=fixed)
    return dx.inspect(model, adamw(model))


CASES = {
    "optimizer-before-wrap/fsdp1": _optimizer_before_wrap(1),
    "optimizer-before-wrap/fsdp2": _optimizer_before_wrap(2),
    "one-giant-unit/fsdp1": _one_giant_unit(1),
    "one-giant-unit/fsdp2": _one_giant_unit(2),
    "no-shard/fsdp1": _no_shard(1),
    "no-shard/fsdp2": _no_shard(2),
    "fp16-without-scaler/fsdp1": _fp16_without_scaler(1),
    "fp16-without-scaler/fsdp2": _fp16_without_scaler(2),
    "mixed-fp16-bf16/fsdp1": _mixed_fp16_bf16(1),
    "mixed-fp16-bf16/fsdp2": _mixed_fp16_bf16(2),
    "use-orig-params-false/fsdp1": _use_orig_params_false,
    "weights-loaded-after-wrap/fsdp1": _weights_loaded_after_wrap(1),
    "weights-loaded-after-wrap/fsdp2": _weights_loaded_after_wrap(2),
    "ranks-differ/fsdp1": _ranks_differ(1),
    "ranks-differ/fsdp2": _ranks_differ(2),
    "frozen-trainable-mixed/fsdp1": _frozen_trainable_mixed,
    "memory-not-sharded/fsdp1": _memory_not_sharded(1),
    "memory-not-sharded/fsdp2": _memory_not_sharded(2),
    "wrong-device/fsdp1": _wrong_device(1),
    "wrong-device/fsdp2": _wrong_device(2),
    "unwrapped-params/fsdp2": _unwrapped_params,
}


@pytest.fixture(scope="module")
def cluster(cpu_cluster):
    return cpu_cluster  # the session's (tests/conftest.py)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_planted_mistake_is_found_and_its_fix_clears_it(cluster, case):
    expected = case.split("/")[0]
    planted = dx.lint(cluster.run(build, case, False))
    assert expected in planted.ids, str(planted)
    finding = next(f for f in planted if f.id == expected)
    assert finding.message and finding.evidence and finding.fix and finding.ranks
    fixed = dx.lint(cluster.run(build, case, True))
    assert len(fixed) == 0, str(fixed)
