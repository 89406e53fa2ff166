"""reducerd: a daemon that sums gradient shards from data-parallel workers."""

__version__ = "0.1.0"
__all__ = ["__version__"]
