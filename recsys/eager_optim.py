"""torch.optim optimizers without their torch._dynamo wrappers: `SGD`, `Adagrad`, `Adam`, `AdamW`, and
`Optimizer` to subclass.

    opt = eager_optim.Adam(params, lr=1e-3)        # a torch.optim.Adam: same update, state and state_dict

torch.optim wraps `step` (graph breaks for torch.compile), `zero_grad`, `add_param_group` (called by
the constructor), `state_dict` and `load_state_dict` (`torch._disable_dynamo`) in code that imports
torch._dynamo on first use: ~1.5 CPU-s, on the path to a trainer's first step (`benchmarks/startup.py`).
Nothing here is compiled, so these subclasses call the wrapped functions themselves (`__wrapped__`,
kept by functools.wraps): the same arithmetic, under `torch.no_grad()` as torch's own step runs
(`defaults["differentiable"]` False). A torch without those wrappers gets torch's classes unchanged.
"""

from __future__ import annotations

import torch

_METHODS = {name: getattr(getattr(torch.optim.Optimizer, name), "__wrapped__", None)
            for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict")}
_UNWRAPPED = None not in _METHODS.values()


def eager(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """A subclass of the torch.optim optimizer `cls` whose methods do not import torch._dynamo."""
    step = getattr(cls.step, "__wrapped__", None)
    if step is None or not _UNWRAPPED:
        return cls
    return type(cls.__name__, (cls,), {"__module__": __name__, "__doc__": cls.__doc__,
                                       "step": torch.no_grad()(step), **_METHODS})


Optimizer = type("Optimizer", (torch.optim.Optimizer,), {"__module__": __name__, **_METHODS}) if _UNWRAPPED \
    else torch.optim.Optimizer
"""torch.optim.Optimizer for optimizers of our own (their `step` is theirs: decorate it with torch.no_grad)."""


SGD = eager(torch.optim.SGD)
Adagrad = eager(torch.optim.Adagrad)
Adam = eager(torch.optim.Adam)
AdamW = eager(torch.optim.AdamW)

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "Optimizer", "eager"]
