"""The one Keras 2 spelling of Horovod's TF2 scripts that Keras 3 broke, restored.

Horovod's examples broadcast an optimizer's state with
`hvd.broadcast_variables(opt.variables(), root_rank=0)`: in Keras 2
`variables` was a method, in Keras 3 it is a property holding a list, so the
call fails with "'list' object is not callable". Importing the shim makes
`optimizer.variables` a list that may also be called (returning itself);
as a list it is what Keras 3 returns.

Not restored (Keras 3 refuses it): compile(experimental_run_tf_function=...);
drop it, or pass jit_compile=False in its place (docs/howto/port-from-horovod.md).
"""

from __future__ import annotations

import keras

__all__ = ["VariablesList", "install"]


class VariablesList(list):
    """A list that also answers a call with itself (Keras 2's opt.variables())."""

    def __call__(self) -> VariablesList:
        return self


def install() -> None:
    """Wrap keras.optimizers.Optimizer.variables once (idempotent)."""
    base = keras.optimizers.Optimizer
    for cls in base.__mro__:
        prop = vars(cls).get("variables")
        if isinstance(prop, property):
            break
    else:  # pragma: no cover - a Keras without the property
        return
    if getattr(prop.fget, "_reducer_callable", False):
        return
    original = prop.fget

    def variables(self):  # type: ignore[no-untyped-def]
        return VariablesList(original(self))
    variables._reducer_callable = True  # type: ignore[attr-defined]
    variables.__doc__ = original.__doc__
    cls.variables = property(variables, prop.fset, prop.fdel, prop.__doc__)
