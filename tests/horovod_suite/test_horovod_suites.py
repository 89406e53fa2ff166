"""Horovod's own torch test functions, by the import change alone, on 2 ranks.

Each listed function runs as Horovod's launcher would run it: 2 processes,
2 real daemons on 127.0.0.1, the module imported with `reducer_client.torch`
as `hvd` (README.md). The list is the functions that pass today; a case
that regresses fails here with Horovod's own assertion message.
"""

import pytest

pytest.importorskip("torch")

from suite_runner import run_cases  # noqa: E402
from support import run_workers  # noqa: E402

TORCH_CASES = [
    "test_horovod_reinit",
    "test_horovod_is_initialized",
    "test_horovod_rank",
    "test_horovod_size",
    "test_horovod_allreduce",
    "test_horovod_allreduce_average",
    "test_horovod_allreduce_inplace",
    "test_horovod_allreduce_async_fused",
    "test_horovod_allreduce_error",
    "test_horovod_allreduce_type_error",
    "test_horovod_allreduce_grad",
    "test_horovod_allreduce_grad_average",
    "test_horovod_grouped_allreduce",
    "test_horovod_grouped_allreduce_average",
    "test_horovod_grouped_allreduce_inplace",
    "test_horovod_grouped_allreduce_grad",
    "test_horovod_grouped_allreduce_grad_average",
    "test_horovod_allgather",
    "test_horovod_allgather_variable_size",
    "test_horovod_allgather_async_fused",
    "test_horovod_allgather_error",
    "test_horovod_allgather_type_error",
    "test_horovod_allgather_grad",
    "test_horovod_grouped_allgather",
    "test_horovod_grouped_allgather_grad",
    "test_horovod_broadcast",
    "test_horovod_broadcast_inplace",
    "test_horovod_broadcast_error",
    "test_horovod_broadcast_type_error",
    "test_horovod_broadcast_rank_error",
    "test_horovod_broadcast_grad",
    "test_broadcast_state_no_grad",
    "test_broadcast_object",
    "test_allgather_object",
    "test_compression_fp16",
    "test_duplicate_names",
    "test_dynamic_requires_grad",
    "test_gradient_clipping",
    "test_synchronize_step_warning",
    "test_no_named_parameters",
    "test_missing_named_parameters",
    "test_global_barrier_op",
    "test_barrier_with_multiple_collectives",
]


@pytest.mark.timeout(300)
def test_horovod_torch_functions_pass_by_the_import_change_alone(daemons):
    with daemons(2, round_timeout=20) as d:
        results = run_workers(run_cases, 2, (d.addresses, "hvd-torch",
                                             [("test_torch", TORCH_CASES)]), timeout=280)
    for rank, result in enumerate(results):
        outcomes = result["test_torch"]
        failed = {name: detail for name, (outcome, detail) in outcomes.items()
                  if outcome != "pass"}
        assert not failed, f"rank {rank}: " + "\n".join(f"{n}: {d}" for n, d in failed.items())
        assert set(outcomes) == set(TORCH_CASES)
