"""The fx-chain cut: a model whose ``forward`` runs its modules one after another, read into steps and pieces.

What it takes: an ``nn.Module`` whose ``forward`` passes one tensor through its direct children and
torch operations in a chain (each result feeds only the next call), as torchvision's and timm's CNN
classifiers do: ``conv1 -> bn1 -> relu -> maxpool -> layer1 ... -> avgpool -> torch.flatten -> fc``.
The chain is read with ``torch.fx`` (children as leaves, traced in train and eval mode alike), and
each child is opened the same way when its own ``forward`` is such a chain (``nn.Sequential`` always
is), down to blocks whose ``forward`` is not (a residual, a gate): those stay whole. Everything is
then grouped into ``Piece`` layers (``chain_pieces``): a piece starts at every step holding a convolution, and the
pooled head (from the step that pools the image away to the output) is one piece. Anything else (several inputs or
outputs, a tensor used twice at the top, parameters used by ``forward`` itself, a forward fx cannot trace) is
refused with ConfigError naming the model and what to do instead (build the layer list yourself).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import fx, nn

from ..config import ConfigError
from .pieces import CHAIN_INPUT, DROPOUTS, Argument, Call, Piece, as_module

CHECK_BATCH = 2          # train-mode BatchNorm needs more than one value per channel
Side = int | tuple[int, int]   # the side of the check images: square, or (rows, cols)


@dataclass(frozen=True)
class Step:
    """One step of the chain: a module at ``path`` in the model, or a functional call (``path`` ``name()``)."""

    path: str
    module: nn.Module
    functional: bool = False


class ChildrenAsLeaves(fx.Tracer):
    """An fx tracer that records calls of a module's direct children without entering them."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return bool(module_qualified_name) and "." not in module_qualified_name


class NotAChain(Exception):
    """A module's forward is not a chain of its children and torch calls (the reason in the message)."""


@contextmanager
def mode(module: nn.Module, training: bool) -> Iterator[None]:
    """``module`` (and its sub-modules) in train or eval mode for a while, each one's own mode restored."""
    saved = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, was in saved:
            m.training = was


def traced(module: nn.Module) -> fx.Graph:
    """The graph of ``module.forward`` with its direct children as leaves; NotAChain when fx cannot trace it."""
    try:
        return ChildrenAsLeaves().trace(module)
    except Exception as err:     # fx raises many kinds (TraceError, TypeError, control flow on proxies ...)
        raise NotAChain(f"torch.fx cannot trace its forward ({type(err).__name__}: {err})") from err


def signature(graph: fx.Graph) -> list[str]:
    """The graph's calls as text, a dropout's ``training`` flag left out (it becomes an nn.Dropout following the
    model's mode), so that train and eval mode compare equal exactly when nothing else depends on the mode."""
    calls = []
    for node in graph.nodes:
        args, kwargs = node.args, dict(node.kwargs)
        if node.op == "call_function" and node.target in DROPOUTS:
            kwargs.pop("training", None)
            args = args[:2] + args[3:]
        calls.append(f"{node.op} {node.target} {args} {kwargs}")
    return calls


def _constant(value: object, chained: fx.Node) -> Argument:
    """A traced argument with the running tensor replaced by CHAIN_INPUT; NotAChain for any other node."""
    if value is chained:
        return CHAIN_INPUT
    if isinstance(value, fx.Node):
        raise NotAChain(f"{value.name} is used beside the running tensor")
    if isinstance(value, (tuple, list)):
        return type(value)(_constant(v, chained) for v in value)
    if isinstance(value, dict):
        return {k: _constant(v, chained) for k, v in value.items()}
    return value


def chain_of(module: nn.Module) -> list[tuple[str, Call | None]]:
    """The calls of ``module.forward`` in order: (child name, None) for a child, (name, Call) for a torch call.

    NotAChain unless the forward takes one tensor, returns one and passes it through every call once.
    """
    graphs = []
    for training in (True, False):
        with mode(module, training):
            graphs.append(traced(module))
    if signature(graphs[0]) != signature(graphs[1]):
        raise NotAChain("its forward differs between train and eval mode")
    graph = graphs[0]
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    if not inputs or any(node.users for node in inputs[1:]):
        raise NotAChain("its forward takes more than one tensor")
    calls: list[tuple[str, Call | None]] = []
    running = inputs[0]
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            raise NotAChain(f"its forward uses its own tensor {node.target!r}, not through a module")
        if node.op == "output":
            if node.args != (running,):
                raise NotAChain("its forward does not return the running tensor alone")
            break
        if len(running.users) != 1 or node not in running.users:
            raise NotAChain(f"{running.name} is used {len(running.users)} times (a residual or a branch)")
        if node.op == "call_module":
            if node.args != (running,) or node.kwargs:
                raise NotAChain(f"child {node.target!r} is called with more than the running tensor")
            calls.append((str(node.target), None))
        else:   # call_function / call_method
            target = node.target if node.op == "call_function" else str(node.target)
            args = _constant(node.args, running)
            kwargs = _constant(dict(node.kwargs), running)
            assert isinstance(args, tuple) and isinstance(kwargs, dict)
            calls.append((Call(target, args, kwargs).name, Call(target, args, kwargs)))
        running = node
    return calls


def steps_of(module: nn.Module, path: str = "") -> list[Step]:
    """``module`` opened into its chain of steps, children opened in turn; a module that is not a chain is one step.

    Raises NotAChain only for the root (``path == ""``), where there is nothing to fall back on.
    """
    children = dict(module.named_children())
    if path and not children:
        return [Step(path, module)]
    try:
        calls = chain_of(module)
    except NotAChain:
        if not path:
            raise
        return [Step(path, module)]
    steps: list[Step] = []
    taken: set[str] = set()
    for name, call in calls:
        if call is None:
            full = f"{path}.{name}" if path else name
            steps.extend(steps_of(children[name], full))
            continue
        label = f"{name}()"
        count = 2
        while label in taken:
            label, count = f"{name}()#{count}", count + 1
        taken.add(label)
        steps.append(Step(f"{path}.{label}" if path else label, as_module(call), functional=True))
    return steps


def holds_convolution(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())


def in_channels_of(model: nn.Module) -> int:
    """The input channels of the first convolution (3 when there is none)."""
    first = next((m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    return int(first.in_channels) if first is not None else 3


def run_steps(steps: Sequence[Step], x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Size]]:
    """The steps' output on ``x`` and every step's output shape (no gradients; modules as they are)."""
    shapes = []
    with torch.no_grad():
        for step in steps:
            x = step.module(x)
            if not isinstance(x, torch.Tensor):
                raise NotAChain(f"step {step.path} returns a {type(x).__name__}, not one tensor")
            shapes.append(x.shape)
    return x, shapes


def pooled_at(shapes: Sequence[torch.Size], input_shape: torch.Size) -> int | None:
    """The index of the step that pools the image away (4-D in with a spatial extent, 2-D or 1x1 out)."""
    before = input_shape
    for index, shape in enumerate(shapes):
        spatial = len(before) == 4 and before[-1] * before[-2] > 1
        if spatial and (len(shape) == 2 or (len(shape) == 4 and shape[-1] == shape[-2] == 1)):
            return index
        before = shape
    return None


def grouped(steps: Sequence[Step], head: int | None) -> list[list[Step]]:
    """Steps into pieces: a new piece at every step holding a convolution (a piece without one yet takes it)
    and at ``head``, whose piece runs to the end. Steps without a convolution stay with the convolution
    before them, except the ones between a block and a plain convolution, which go with that convolution
    (a transition's BatchNorm and ReLU, a downsampling's LayerNorm)."""
    pieces: list[list[Step]] = []
    for index, step in enumerate(steps):
        in_head = head is not None and index > head
        opens = holds_convolution(step.module) and not in_head and bool(pieces) and any(
            holds_convolution(s.module) for s in pieces[-1])
        if not pieces or index == head or opens:
            pieces.append([step])
        else:
            pieces[-1].append(step)
            continue
        if len(pieces) > 1 and isinstance(step.module, nn.modules.conv._ConvNd) and index != head:
            previous = pieces[-2]
            last_conv = max(i for i, s in enumerate(previous) if holds_convolution(s.module))
            if not isinstance(previous[last_conv].module, nn.modules.conv._ConvNd):
                pieces[-1][:0] = previous[last_conv + 1:]
                del previous[last_conv + 1:]
    return pieces


@contextmanager
def state_kept(model: nn.Module) -> Iterator[None]:
    """Buffers (BatchNorm statistics ...) and the random state restored after the block, whatever ran inside."""
    saved = [(buffer, buffer.clone()) for buffer in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def check_images(model: nn.Module, size: Side) -> torch.Tensor:
    """The random images a cut is checked on (the model's dtype and device, a fixed seed)."""
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    rows, cols = (size, size) if isinstance(size, int) else size
    return torch.randn(CHECK_BATCH, in_channels_of(model), rows, cols, generator=generator, dtype=dtype).to(device)


def side_text(side: Side) -> str:
    """``64x64`` for a side of 64, ``224x256`` for (224, 256)."""
    rows, cols = (side, side) if isinstance(side, int) else side
    return f"{rows}x{cols}"


def chain_pieces(model: nn.Module, side: Side) -> list[nn.Module]:
    """``model``'s chain of steps grouped into ``Piece`` layers, the pooled head found on check images of ``side``;
    ConfigError when ``model`` is not a chain of its modules or fails on the check images."""
    name = type(model).__name__
    try:
        steps = steps_of(model)
    except NotAChain as err:
        raise ConfigError("model", f"{name} cannot be cut into a layer list: {err}. layer_list takes a model "
                          f"whose forward passes one tensor through its children and torch calls one after "
                          f"another (torchvision's and timm's CNN classifiers, timm's ViTs); build the layer "
                          f"list yourself (modules whose nn.Sequential equals your model) and pass that") from None
    added = nn.ModuleList(s.module for s in steps if s.functional)   # dropouts and calls the cut made
    added.train(model.training)
    x = check_images(model, side)
    try:
        with mode(model, False), mode(added, False), state_kept(model):
            _, shapes = run_steps(steps, x)
    except NotAChain as err:
        raise ConfigError("model", f"{name} cannot be cut into a layer list: {err}") from None
    except (RuntimeError, AssertionError) as err:     # timm asserts the sizes it takes
        raise ConfigError("model", f"{name} fails on a {side_text(side)} check image ({err}); "
                          f"pass layer_list(model, check_size=...) a size it takes") from None
    return [Piece([(s.path, s.module) for s in group]) for group in grouped(steps, pooled_at(shapes, x.shape))]
