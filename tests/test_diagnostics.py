"""Diagnostics against ground truth computed independently: shapes and bytes per rank, gradient norms from an
unsharded reference, memory accounting, replica fingerprints, the rollout table."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from fsdp_models import adamw, fsdp1, fsdp2, net
from torch import nn

from rlkit import diagnostics as dx
from rlkit.data.batch import Batch
from rlkit.diagnostics.agreement import outliers
from rlkit.runtime import context

MiB = 2**20
WORLD = 2


@pytest.fixture(scope="module")
def cluster(cpu_cluster):
    return cpu_cluster  # the session's (tests/conftest.py)


# -- no workers ---------------------------------------------------------------------------------

def test_checksum_is_exact_and_order_sensitive():
    x = torch.randn(1000, 33)
    assert dx.checksum(x) == dx.checksum(x.clone())
    assert dx.checksum(x.t()) == dx.checksum(x.t().contiguous())  # a view fingerprints its values
    flipped = x.clone()
    flipped.view(torch.int32)[7, 3] ^= 1  # one bit
    assert dx.checksum(flipped) != dx.checksum(x)
    swapped = x.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert dx.checksum(swapped) != dx.checksum(x)
    assert dx.checksum(torch.zeros(3)) != dx.checksum(torch.zeros(4))
    for t in (x.bfloat16(), x.double(), x > 0, torch.arange(10)):
        assert dx.checksum(t) == dx.checksum(t.clone())
    big = torch.randn(5_000_000)  # more than one conversion block
    changed = big.clone()
    changed[-1] += 1
    assert dx.checksum(big) == dx.checksum(big.clone()) != dx.checksum(changed)


def test_outliers_take_the_majority_and_break_ties_by_lowest_rank():
    assert outliers({0: "a", 1: "b", 2: "a"}) == ("a", [1])
    assert outliers({0: "a", 1: "b"}) == ("a", [1])
    assert outliers({0: 5, 1: 5}) == (5, [])


def test_memory_marks_count_parameters_gradients_optimizer_engine():
    model, engine = nn.Linear(64, 32), nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = dx.MemoryTracker(torch.device("cpu"), models=[model], optimizers=[optimizer], engine=engine)
    param_bytes = (64 * 32 + 32) * 4
    before = tracker.mark("setup")
    model(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    after = tracker.mark("optimizer_step")
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    assert before.parameters_mb * MiB == param_bytes and before.gradients_mb == 0 and before.optimizer_mb == 0
    assert after.gradients_mb * MiB == param_bytes
    assert after.optimizer_mb * MiB == state == 2 * param_bytes + 2 * 4  # exp_avg, exp_avg_sq, 2 step scalars
    assert after.engine_mb * MiB == param_bytes
    accounted = after.parameters_mb + after.gradients_mb + after.optimizer_mb + after.engine_mb
    assert after.other_mb == pytest.approx(after.rss_mb - accounted)
    assert math.isnan(after.peak_mb)  # CPU: no allocator peak
    table = dx.memory_table([tracker.marks, tracker.marks])
    assert list(table["rank"]) == [0, 0, 1, 1] and list(table["phase"][:2]) == ["setup", "optimizer_step"]
    tracker.reset()
    assert tracker.marks == []


def test_rollout_table_has_rank_terms_advantage_and_gap():
    batch = Batch(
        prompts=["1+1=", "1+1=", "2+2=", "2+2="],
        completions=["2", "3", "4", "5"],
        input_ids=torch.zeros(4, 5, dtype=torch.long),
        attention_mask=torch.ones(4, 5, dtype=torch.long),
        response_mask=torch.tensor([[1.0, 1.0, 0.0]] * 4),
        rollout_logprobs=torch.tensor([[-1.0, -2.0, 0.0]] * 4),
        old_logprobs=torch.tensor([[-1.5, -2.0, -9.0]] * 4),
        group=torch.tensor([0, 0, 1, 1]),
        rank=torch.tensor([0, 0, 1, 1]),
        finish_reason=["stop", "length", "stop", "stop"],
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        reward_terms={"correct": torch.tensor([1.0, 0.0, 1.0, 0.0])},
        advantages=torch.tensor([0.7, -0.7, 0.7, -0.7]).unsqueeze(1).expand(4, 3),  # [B, T], per token
    )
    df = batch.to_pandas()
    assert list(df["rank"]) == [0, 0, 1, 1]
    assert list(df["reward/correct"]) == [1.0, 0.0, 1.0, 0.0]
    assert list(df["advantage"]) == pytest.approx([0.7, -0.7, 0.7, -0.7])
    assert list(df["logprob_gap_max"]) == [0.5] * 4  # the masked third token is ignored
    assert list(df["logprob_gap_mean"]) == [0.25] * 4  # (0.5 + 0) / 2 tokens
    halves = batch.split(2)
    assert halves[1].rank.tolist() == [1, 1] and Batch.concat(halves).rank.tolist() == [0, 0, 1, 1]


# -- sharding layout ---------------------------------------------------------------------------

def inspect_wrapped(api: int) -> dx.RankReport:
    model = fsdp1(net()) if api == 1 else fsdp2(net())
    return dx.inspect(model, adamw(model), others={"engine": net()})


def fsdp1_local_numels(shapes: list[torch.Size], rank: int) -> list[int]:
    """FSDP1 flattens a unit's parameters in order, pads to a multiple of the world size, splits evenly."""
    numels = [math.prod(s) for s in shapes]
    per_rank = math.ceil(sum(numels) / WORLD)
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    starts = [sum(numels[:i]) for i in range(len(numels))]
    return [max(0, min(hi, s + n) - max(lo, s)) for s, n in zip(starts, numels, strict=True)]


def expected_layout(api: int) -> dict[tuple[str, int], tuple[tuple[int, ...], int]]:
    """(name, rank) -> (local shape, unit storage bytes for that parameter) from the unsharded model."""
    reference = net()
    units: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, p in reference.named_parameters():
        unit = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else ""
        units.setdefault(unit, []).append((name, p))
    out = {}
    for members in units.values():
        for rank in range(WORLD):
            if api == 1:
                numels = fsdp1_local_numels([p.shape for _, p in members], rank)
                for (name, _), n in zip(members, numels, strict=True):
                    out[name, rank] = ((n,), 0)
            else:
                for name, p in members:
                    rows = p.shape[0]
                    chunk = math.ceil(rows / WORLD)
                    mine = max(0, min(rows, (rank + 1) * chunk) - rank * chunk)
                    out[name, rank] = ((mine, *p.shape[1:]), chunk * math.prod(p.shape[1:]) * 4)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api", [1, 2])
def test_sharding_layout_matches_ground_truth(cluster, api):
    table = dx.sharding(cluster.run(inspect_wrapped, api))
    reference = dict(net().named_parameters())
    expected = expected_layout(api)
    params = table.params
    assert sorted(set(params["name"])) == sorted(reference)
    for name, p in reference.items():
        rows = params[params["name"] == name].sort_values("rank")
        assert [tuple(s) for s in rows["global_shape"]] == [tuple(p.shape)] * WORLD
        assert rows["local_numel"].sum() == p.numel() and rows["local_bytes"].sum() == p.numel() * 4
        assert [tuple(s) for s in rows["local_shape"]] == [expected[name, r][0] for r in range(WORLD)], name
        assert (rows["local_bytes"] == rows["local_numel"] * 4).all()
    units = table.units.set_index("name")
    assert sorted(units.index) == ["(root)", "blocks.0", "blocks.1", "blocks.2"]
    assert (units["strategy"] == "FULL_SHARD").all() and (units["shard_size"] == WORLD).all()
    for unit in units.index:
        if unit == "(root)":
            members = [n for n in reference if not n.startswith("blocks.")]
        else:
            members = [n for n in reference if n.startswith(f"{unit}.")]
        numel = sum(reference[n].numel() for n in members)
        for r in range(WORLD):
            held = units.loc[unit, f"rank{r}_mb"] * MiB
            padded = math.ceil(numel / WORLD) * 4 if api == 1 else sum(expected[n, r][1] for n in members)
            assert held == padded, (unit, r)
    totals = table.totals.set_index(["rank", "role"])
    for r in range(WORLD):
        mine = params[params["rank"] == r]["local_bytes"].sum()
        assert totals.loc[(r, "model"), "parameters_mb"] * MiB == mine
        assert totals.loc[(r, "engine"), "parameters_mb"] * MiB == sum(p.numel() * 4 for p in reference.values())
        assert not totals.loc[(r, "engine"), "sharded"] and totals.loc[(r, "model"), "sharded"]
    assert table.unwrapped == []


def diverged_engine() -> dx.RankReport:
    model = fsdp2(net())
    engine = net()
    if context().rank == 1:
        with torch.no_grad():
            engine.head.weight[0, 0] += 1e-6  # a weight sync that missed one element on one rank
    return dx.inspect(model, adamw(model), others={"engine": engine})


@pytest.mark.timeout(60)
def test_ranks_differ_names_the_tensor_and_rank_of_an_engine_copy(cluster):
    findings = dx.lint(cluster.run(diverged_engine))
    assert findings.ids == ["ranks-differ"]
    assert findings.items[0].ranks == (1,)
    assert findings.items[0].evidence == "engine:head.weight on rank 1 differs from rank 0"


# -- memory ------------------------------------------------------------------------------------

def stepped(api: int, no_shard: bool) -> dx.RankReport:
    from torch.distributed.fsdp import ShardingStrategy

    if api == 1:
        strategy = ShardingStrategy.NO_SHARD if no_shard else ShardingStrategy.FULL_SHARD
        model = fsdp1(net(), sharding_strategy=strategy)
    else:
        model = fsdp2(net(), mesh_shape=(2, 1) if no_shard else (2,))
    optimizer = adamw(model)
    model(torch.arange(8).view(2, 4)).sum().backward()
    optimizer.step()
    return dx.inspect(model, optimizer)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api", [1, 2])
def test_memory_scaling_against_the_whole_model(cluster, api):
    whole_params = sum(p.numel() * 4 for p in net().parameters())
    sharded = dx.memory_scaling(cluster.run(stepped, api, False))
    assert list(sharded["world_size"]) == [1, WORLD]
    assert sharded["parameters_mb"][0] * MiB == whole_params == sharded["gradients_mb"][0] * MiB
    assert sharded["optimizer_mb"][0] * MiB >= 2 * whole_params  # exp_avg and exp_avg_sq, plus step scalars
    assert 1.0 <= sharded["vs_ideal"][1] < 1.05  # only padding and uneven shards above 1/N
    replicated = dx.memory_scaling(cluster.run(stepped, api, True))
    assert replicated["vs_ideal"][1] == pytest.approx(WORLD)


def tracked_fsdp1() -> tuple[float, dx.RankReport]:
    model = fsdp1(net())
    tracker = dx.MemoryTracker(torch.device("cpu"), models=[model])
    return tracker.mark("setup").parameters_mb, dx.inspect(model)


@pytest.mark.timeout(60)
def test_memory_marks_count_fsdp1_views_once(cluster):
    for parameters_mb, report in cluster.run(tracked_fsdp1):
        units = dx.sharding([report]).units
        assert parameters_mb == pytest.approx(units[f"rank{report.rank}_mb"].sum(), abs=0)


# -- gradient norms ----------------------------------------------------------------------------

def grads_vs_reference(api: int, orig: bool, mesh: tuple[int, ...]) -> tuple[dx.GradReport, dict[str, float]]:
    """Grad report of a sharded model on this rank's half of a batch, and the squared grad norms of an
    unsharded copy on the whole batch (FSDP averages over ranks, so the two must agree)."""
    rank = context().rank
    model = fsdp1(net(), use_orig_params=orig) if api == 1 else fsdp2(net(), mesh_shape=mesh)
    ids = torch.arange(32).view(4, 8) * 7 % 64
    loss = model(ids[2 * rank : 2 * rank + 2]).pow(2).mean()
    loss.backward()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    if api == 1:
        norm = model.clip_grad_norm_(math.inf)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).full_tensor()
    report = dx.grad_report(model, loss=global_loss / WORLD, global_norm=norm)
    reference = net()
    reference(ids).pow(2).mean().backward()
    return report, {n: p.grad.double().pow(2).sum().item() for n, p in reference.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api,orig,mesh", [(1, True, (2,)), (1, False, (2,)), (2, True, (2,)), (2, True, (2, 1))])
def test_grad_norms_match_an_unsharded_reference(cluster, api, orig, mesh):
    """FSDP1 with and without orig params, FSDP2 sharded, and FSDP2 replicated (HSDP with shard size 1)."""
    results = cluster.run(grads_vs_reference, api, orig, mesh)
    replicated = mesh == (2, 1)
    truth = results[0][1]
    norms = dx.grad_norms([r for r, _ in results])
    assert norms.ok, norms.mismatches
    assert norms.global_norm == pytest.approx(math.sqrt(sum(truth.values())), rel=1e-5)
    units = norms.units.set_index("unit")
    for unit in ("blocks.0", "blocks.1", "blocks.2", "(root)"):
        inside = [v for n, v in truth.items() if n.startswith(unit + ".") or (unit == "(root)" and "blocks" not in n)]
        assert units.loc[unit, "global"] == pytest.approx(math.sqrt(sum(inside)), rel=1e-5)
        ranks = [units.loc[unit, f"rank{r}"] ** 2 for r in range(WORLD)]
        if replicated:  # every rank holds the whole gradient, counted once in the global norm
            assert ranks == pytest.approx([sum(inside)] * WORLD, rel=1e-5)
        else:
            assert sum(ranks) == pytest.approx(sum(inside), rel=1e-5)
    assert norms.ranks["norm_ok"].all()


def unsynced_grads() -> dx.GradReport:
    """FSDP2 without the root unit: embed and head are outside FSDP, so their gradients are never averaged."""
    rank = context().rank
    model = fsdp2(net(), root=False)
    loss = model(torch.arange(8).view(2, 4) + 8 * rank).pow(2).mean()
    loss.backward()
    return dx.grad_report(model, loss=loss)  # a local loss: ranks disagree


@pytest.mark.timeout(60)
def test_grad_mismatches_name_rank_and_tensor(cluster):
    norms = dx.grad_norms(cluster.run(unsynced_grads))
    assert not norms.ok
    found = {(m.rank, m.tensor, m.check) for m in norms.mismatches.itertuples()}
    assert found == {
        (1, "loss", "loss"),
        (1, "embed.weight", "replicated grad"),
        (1, "head.weight", "replicated grad"),
        (1, "head.bias", "replicated grad"),
    }
    assert "(unwrapped)" in set(norms.units["unit"])
