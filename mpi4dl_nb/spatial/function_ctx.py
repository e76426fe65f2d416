"""The context torch hands a custom autograd Function's forward and backward, as a typed seam.

torch types that object loosely (its ``FunctionCtx`` lacks ``saved_tensors``, and the stub
of ``saved_tensors`` is a one-element tuple), and every Function stores its own attributes
on it. ``FunctionContext`` names the members the package's Functions use; a Function that
keeps more declares them in a Protocol of its own::

    class _HaloCtx(FunctionContext, Protocol):
        exchange: HaloExchange
"""

from __future__ import annotations

from typing import Protocol

import torch


class FunctionContext(Protocol):
    """What the custom Functions use of torch's ctx: saved tensors and the inputs' grad needs."""

    @property
    def saved_tensors(self) -> tuple[torch.Tensor, ...]: ...

    @property
    def needs_input_grad(self) -> tuple[bool, ...]: ...

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None: ...
