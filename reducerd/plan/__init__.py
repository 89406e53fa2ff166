"""`reducerd plan`: a capacity planner (../shared/INTERFACE.md section 8).

A leaf like reducerd.bench: only the command line imports it. The model is
in reducerd.plan.capacity and docs/explanation/performance.md.
"""

from reducerd.plan.cli import main

__all__ = ["main"]
