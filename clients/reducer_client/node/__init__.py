"""Node-local aggregation: the workers of one host reduce together first.

topology.py places the worker on its node, shm.py holds the shared-memory
segments, coordinator.py the node's control messages, group.py ties them
together for ReducerClient.
"""
