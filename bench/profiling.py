"""One profiled step on a worker (functions for ``cluster.run``): the top operators by self device time, and the
same grouped by input shapes (which ``mul``, which ``copy_``), as text tables. Never part of a timed step."""

from __future__ import annotations


def start_profiler() -> None:
    import torch

    from rlkit.runtime import context

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities, record_shapes=True)
    prof.start()
    context().state["bench.profiler"] = prof


def stop_profiler(rows: int = 25) -> dict[str, str]:
    """{"ops": top ``rows`` operators, "shapes": the top ``rows`` (operator, input shapes) pairs}."""
    import torch

    from rlkit.runtime import context

    prof = context().state.pop("bench.profiler")
    prof.stop()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    ops = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
    shapes = prof.key_averages(group_by_input_shape=True).table(
        sort_by=key, row_limit=rows, max_name_column_width=40, max_shapes_column_width=80)
    return {"ops": ops, "shapes": shapes}
