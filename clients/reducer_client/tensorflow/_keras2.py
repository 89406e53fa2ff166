"""The two Keras 2 spellings of Horovod's TF2 scripts that Keras 3 broke, restored.

- Horovod's examples broadcast an optimizer's state with
  `hvd.broadcast_variables(opt.variables(), root_rank=0)`: in Keras 2
  `variables` was a method, in Keras 3 it is a property holding a list, so
  the call fails with "'list' object is not callable". Importing the shim
  makes `optimizer.variables` a list that may also be called (returning
  itself); as a list it is what Keras 3 returns.
- Horovod's Keras examples compile with `experimental_run_tf_function=False`,
  which Keras 3 refuses (TypeError). Importing the shim makes Model.compile
  accept it and drop it; where it is given and jit_compile is not, the step
  is compiled with jit_compile=False (the shim's reductions are Python ops,
  which XLA cannot compile: the argument's intent in those scripts).
"""

from __future__ import annotations

import functools

import keras

__all__ = ["VariablesList", "install"]


class VariablesList(list):
    """A list that also answers a call with itself (Keras 2's opt.variables())."""

    def __call__(self) -> VariablesList:
        return self


def install() -> None:
    """Wrap Optimizer.variables and Model.compile once (idempotent)."""
    _install_variables()
    _install_compile()


def _install_compile() -> None:
    owner = next(cls for cls in keras.Model.__mro__ if "compile" in vars(cls))
    original = vars(owner)["compile"]
    if getattr(original, "_reducer_keras2", False):
        return

    @functools.wraps(original)
    def compile(self, *args, experimental_run_tf_function=None, **kwargs):  # noqa: A001
        if experimental_run_tf_function is not None:
            kwargs.setdefault("jit_compile", False)
        return original(self, *args, **kwargs)
    compile._reducer_keras2 = True  # type: ignore[attr-defined]
    owner.compile = compile


def _install_variables() -> None:
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
