"""Out-of-memory on a rank: recognised (CUDA, torch's CPU allocator, MemoryError), and reported by the
controller as ``WorkerOutOfMemory`` naming the rank and the function, with the rank's memory report."""

from __future__ import annotations

import pytest
import torch

from rlkit.runtime import RemoteError, WorkerOutOfMemory, context, launch
from rlkit.runtime.errors import RankFailure, remote_error
from rlkit.runtime.memory import is_out_of_memory, report

IMPOSSIBLE = 2**45  # float32 elements: 128 TiB


def _allocator_error() -> RuntimeError:
    try:
        torch.empty(IMPOSSIBLE)
    except RuntimeError as exc:
        return exc
    raise AssertionError("allocating 128 TiB succeeded")


class PolicyWorker:
    """Stands for a role: ``update`` runs out of host memory on rank 1."""

    def setup(self) -> None:
        context().set_memory_report("policy", lambda: {"parameters GiB": 1.5, "optimizer": "AdamW, sharded"})
        context().set_memory_report("engine", lambda: "KV cache 0.25 GiB")

    def update(self) -> str:
        if context().rank == 1:
            torch.empty(IMPOSSIBLE)
        return "updated"

    def teardown(self) -> None:
        for name in ("policy", "engine"):
            context().set_memory_report(name, None)


@pytest.fixture(scope="module")
def cluster():
    with launch(2, device="cpu") as c:
        yield c


# -- no workers needed -------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_allocation_failures_are_recognised_and_other_errors_are_not():
    allocator = _allocator_error()
    assert "DefaultCPUAllocator: can't allocate memory" in str(allocator) and type(allocator) is RuntimeError
    assert is_out_of_memory(allocator) and is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        raise ValueError("while building the batch") from allocator
    except ValueError as chained:
        assert is_out_of_memory(chained)
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError())


@pytest.mark.timeout(10)
def test_report_shows_the_host_and_each_registered_report_even_when_one_fails():
    text = report(torch.device("cpu"), {"policy": lambda: {"parameters GiB": 1.5, "layers": 2},
                                        "broken": lambda: 1 / 0, "engine": lambda: "KV cache 0.25 GiB"})
    lines = text.splitlines()
    assert lines[0].startswith("host: this process ") and "GiB available" in lines[0]
    assert lines[1:] == ["policy:", "  parameters GiB: 1.50", "  layers: 2", "broken:",
                         "  (the report failed: ZeroDivisionError: division by zero)", "engine:", "  KV cache 0.25 GiB"]
    assert "torch allocator" not in text  # CUDA figures only on CUDA


@pytest.mark.timeout(10)
def test_remote_error_is_worker_out_of_memory_only_when_a_rank_ran_out():
    plain = RankFailure(0, "vm", "cpu", "ValueError", "boom", "Traceback ...")
    oom = RankFailure(1, "vm", "cpu", "RuntimeError", "DefaultCPUAllocator: can't allocate memory", "Traceback ...",
                      memory="host: ...")
    assert type(remote_error([plain], "mod.fn")) is RemoteError
    error = remote_error([oom, plain], "mod.PolicyWorker.update")
    assert isinstance(error, WorkerOutOfMemory) and error.ranks == [0, 1] and error.out_of_memory == [oom]
    assert error.call == "mod.PolicyWorker.update"


# -- on the workers ----------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_out_of_memory_on_a_rank_names_it_the_function_and_its_memory_report(cluster):
    role = PolicyWorker()
    cluster.run(role.setup)
    try:
        with pytest.raises(WorkerOutOfMemory) as info:
            cluster.run(role.update)
    finally:
        cluster.run(role.teardown)
    error = info.value
    assert isinstance(error, RemoteError) and error.ranks == [1]
    assert error.call.endswith("test_runtime_memory.PolicyWorker.update")
    [failure] = error.out_of_memory
    assert failure.rank == 1 and failure.exc_type == "RuntimeError"
    message = str(error)
    assert message.startswith(f"rank 1 (host {failure.host}, device cpu) ran out of memory in {error.call}: "
                              "RuntimeError: [enforce fail")
    assert "DefaultCPUAllocator: can't allocate memory" in message
    report_lines = ["Memory of rank 1 when it ran out:", "policy:", "  parameters GiB: 1.50",
                    "  optimizer: AdamW, sharded", "engine:", "  KV cache 0.25 GiB"]
    assert all(line in message.splitlines() for line in report_lines)
    assert "host: this process" in failure.memory and "torch.empty(IMPOSSIBLE)" in message  # the traceback
    assert cluster.run(lambda: context().memory_reports) == [{}, {}]  # teardown removed them
    assert cluster.run(lambda: "still usable") == ["still usable"] * 2


@pytest.mark.timeout(60)
def test_python_memory_error_counts_and_a_plain_error_does_not(cluster):
    def fail():
        if context().rank == 0:
            raise MemoryError("no room for the batch")
        raise KeyError("not memory")

    with pytest.raises(WorkerOutOfMemory) as info:
        cluster.run(fail)
    assert [f.rank for f in info.value.out_of_memory] == [0] and info.value.ranks == [0, 1]
    assert "rank 0 (host" in str(info.value) and "ran out of memory in" in str(info.value)
    assert "also rank 1 (host" in str(info.value) and "raised KeyError: 'not memory'" in str(info.value)
    with pytest.raises(RemoteError) as plain:
        cluster.run(lambda: 1 / 0)
    assert type(plain.value) is RemoteError and "out of memory" not in str(plain.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
def test_cuda_out_of_memory_reports_the_allocator_figures():
    def overflow():
        held = torch.empty(2**28, device=context().device)  # 1 GiB of float32, held while the next fails
        context().set_memory_report("policy", lambda: {"held GiB": held.numel() * 4 / 2**30})
        torch.empty(2**50, device=context().device)

    with launch(1, device="cuda") as cluster, pytest.raises(WorkerOutOfMemory) as info:
        cluster.run(overflow)
    [failure] = info.value.out_of_memory
    assert failure.exc_type == "torch.OutOfMemoryError" and "CUDA out of memory" in failure.message
    assert "cuda:0 (torch allocator): allocated 1.00 GiB" in failure.memory
    assert "peak allocated" in failure.memory and "held GiB: 1.00" in failure.memory
