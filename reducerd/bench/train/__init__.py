"""`reducerd bench --train MODEL`: whole data-parallel training steps on loopback or
an emulated cluster, through reducerd's torch shim and DDP over Gloo.

Modules: specs (architectures' parameter shapes and FLOPs, no torch),
config (the typed configuration and the scaling of a real setting),
modeled (the torch model with modeled compute), trainers (each system's
step), worker (one worker process), runner (processes, cluster, runs),
report (figures, tables, JSON, plot), cli (the command line).
"""
