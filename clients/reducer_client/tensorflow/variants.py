"""Horovod's variants of the TensorFlow collectives, built on compat's:
grouped_allgather, broadcast_ (in place, on variables) and
broadcast_global_variables (TF1 graphs; refused eagerly, as Horovod does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from reducer_client.api import Reducer
from reducer_client.tensorflow.compat import allgather, broadcast

__all__ = ["grouped_allgather", "broadcast_", "broadcast_global_variables"]


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False, process_set: Any = None, *,
                      reducer: Reducer | None = None) -> list[tf.Tensor]:
    """allgather of each tensor of the list (one call each, in list order)."""
    return [allgather(t, None if name is None else f"{name}.{i}", process_set=process_set,
                      reducer=reducer) for i, t in enumerate(tensors)]


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: Any = None, *, reducer: Reducer | None = None) -> list[Any]:
    """Horovod's in-place broadcast: each variable takes root_rank's value; the
    assigned values back (in a graph, the assign ops' values to run)."""
    return [v.assign(broadcast(v, root_rank, None if name is None else f"{name}.{i}",
                               process_set=process_set, reducer=reducer))
            for i, v in enumerate(variables)]


def broadcast_global_variables(root_rank: int, *, reducer: Reducer | None = None) -> Any:
    """TF1 graphs: an op that assigns root_rank's global variables on every rank."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager "
                           "execution: use hvd.broadcast_variables(<model / optimizer "
                           "variables>) instead")
    return tf.group(*broadcast_(tf.compat.v1.global_variables(), root_rank, reducer=reducer))
