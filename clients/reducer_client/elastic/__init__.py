"""Elastic training (Horovod's hvd.elastic) over reducerd: incarnations, states, run.

The shims bind it: reducer_client.torch.elastic (run, TorchState,
ObjectState), reducer_client.tensorflow.elastic (run, TensorFlowKerasState,
KerasState, ObjectState). incarnation.py says how a restarted or reset job
never receives an earlier incarnation's sums; run.py how survivors go on;
lobby.py how a worker joins a running job.
"""

from reducer_client.elastic.incarnation import IncarnationReducer, agree, missing_ranks
from reducer_client.elastic.lobby import HostsUpdatedInterrupt, join_requested
from reducer_client.elastic.run import MAX_RESETS, make_run, record_settings, reset
from reducer_client.elastic.state import ObjectState, State, broadcast_object

__all__ = ["IncarnationReducer", "agree", "missing_ranks", "make_run", "record_settings",
           "reset", "MAX_RESETS", "State", "ObjectState", "broadcast_object",
           "HostsUpdatedInterrupt", "join_requested"]
