"""DistributedOptimizer: a Keras 3 optimizer whose apply() reduces the gradients first.

apply_gradients() and the Keras train step both end in apply(), so this
covers model.fit and custom loops alike. Each step runs through the
optimizer's GradientSteps (steps.py): a rank that has called join() follows
the others' steps, and the 8-bit wires get error feedback.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import keras

from reducer_client.api import Reducer
from reducer_client.process import next_index
from reducer_client.tensorflow._basics import check_op
from reducer_client.tensorflow._bridge import reduce_gradients
from reducer_client.tensorflow.steps import GradientSteps

__all__ = ["DistributedOptimizer", "load_model"]


class _DistributedOptimizerMixin:
    """Reduces the gradients of each apply() through the daemons, then applies them.

    Mixed in front of the wrapped class, whose name, module and config are
    kept, so saving works unchanged.
    """

    _reducer_op = "mean"
    _reducer_key = None
    # The GradientSteps its steps run through (steps.py: joinable, error
    # feedback); a plain Reducer or None until the first use (load_model's).
    _reducer_override: GradientSteps | Reducer | None = None

    def _gradient_steps(self, trainable_variables=None) -> GradientSteps:
        """This optimizer's GradientSteps, told which variables join() copies."""
        steps = self._reducer_override
        if not isinstance(steps, GradientSteps):
            steps = self._reducer_override = GradientSteps(
                steps, op=self._reducer_op, what=f"optimizer {self._reducer_key or 'optimizer'!r}")
        ref = weakref.ref(self)
        given = None if trainable_variables is None else list(trainable_variables)

        def variables() -> list:
            optimizer = ref()
            if optimizer is None:
                return []
            own = given if given is not None else list(
                getattr(optimizer, "_trainable_variables", []))
            return own + list(optimizer.variables)
        steps.track(variables)
        return steps

    def _wire_key(self, count: int, steps: GradientSteps) -> str:
        """The key of a step of `count` gradients: "tf/NAME/COUNT".

        Unnamed optimizers are "optimizer", "optimizer.1", ... on the client,
        in the order of their first step (the same on every rank): two of
        them must not share a key, whose error-feedback residues are kept
        per key (a node's slice senders, node/residues.py). Not self.name:
        Keras numbers optimizer names per process (sgd, sgd_1), and a rank
        that made one more optimizer would then wait on another key.
        """
        if self._reducer_key is None:
            index = next_index(steps.base(), "tf-optimizer")
            self._reducer_key = "optimizer" if index == 0 else f"optimizer.{index}"
        return f"tf/{self._reducer_key}/{count}"

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        steps = self._gradient_steps(trainable_variables)
        variables = list(getattr(self, "_trainable_variables", [])) \
            if trainable_variables is None else list(trainable_variables)
        grads = reduce_gradients(grads, variables, self._wire_key(len(grads), steps),
                                 self._reducer_op, steps)
        return super().apply(grads, trainable_variables)  # type: ignore[misc]


@functools.cache
def _distributed_class(base: type) -> type:
    return type(base.__name__, (_DistributedOptimizerMixin, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__})


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, op: str = "mean",  # noqa: N802
                         name: str | None = None, reducer: Reducer | None = None,
                         ) -> keras.optimizers.Optimizer:
    """A copy of a Keras 3 optimizer that averages gradients over all workers.

    The copy is an instance of the optimizer's own class (isinstance holds),
    built from its config; get_config() and saving are unchanged, so a saved
    model loads back with the plain optimizer (or use load_model() here to get
    it wrapped again). Wrap before training: an optimizer that already has
    state is refused. `name` sets the wire key (default: "optimizer",
    "optimizer.1", ... per client, in the order of their first steps).
    Compile the model with jit_compile=False: the reduction is a Python op.
    """
    check_op(op)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a keras.optimizers.Optimizer, got {type(optimizer)!r}")
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    if optimizer.built:
        raise ValueError("the optimizer already holds state (it was built or used); wrap "
                         "it before training, or load a saved model with "
                         "reducer_client.tensorflow.load_model()")
    wrapped = _distributed_class(type(optimizer)).from_config(optimizer.get_config())
    wrapped._reducer_op = op
    wrapped._reducer_key = name
    # Made now, so that its join tag is registered in creation order.
    wrapped._reducer_override = reducer if isinstance(reducer, GradientSteps) else \
        GradientSteps(reducer, op=op, what=f"optimizer {name or 'optimizer'!r}")
    return wrapped


def load_model(filepath: Any, custom_objects: dict | None = None, **kwargs: Any,
               ) -> keras.Model:
    """keras.models.load_model, with the saved optimizer loaded as a DistributedOptimizer.

    The optimizer's state (slots, iterations) is restored as usual; only its
    class is the distributed one (op="mean", the process-wide reducer).
    """
    objects = {cls.__name__: _distributed_class(cls) for cls in _keras_optimizer_classes()}
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects, **kwargs)


def _keras_optimizer_classes() -> list[type]:
    return [obj for obj in vars(keras.optimizers).values()
            if isinstance(obj, type) and issubclass(obj, keras.optimizers.Optimizer)
            and obj is not keras.optimizers.Optimizer]
