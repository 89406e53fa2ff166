"""`import reducer_client.tensorflow.keras as hvd`: the same shim, under the name
Horovod's Keras scripts import (horovod.tensorflow.keras)."""

from reducer_client.tensorflow import *  # noqa: F403
from reducer_client.tensorflow import __all__, callbacks  # noqa: F401
