"""Forwards of small batches as compiled functions, cached on their module.

Decoding rebuilds every layer's graph in Python at every step, and a step of
a few tokens is bound by that host work. `mx.compile` traces a forward once
per shape and then replays it: the graph is built in C++, and its elementwise
ops are fused. The layer (`nn.SwitchGLU`) and the fused MoE blocks
(`fused_blocks.py`) call their forwards through `compiled_if_small`, which
runs them through `compiled_call` when `compiles` says so. The fused blocks
then hand some of those calls' outputs to MLX's evaluation at once
(`submit_as_built`), so that the GPU starts on a step or a prompt's chunk
the host is still building.

The layers of a model are alike but for their weights, and they share one
trace. With a trace for each layer, a step's replays walked as many tapes as
there are layers, out of the CPU's caches: a block replayed in a decoding
step took three times as long as one replayed alone, and the patched step
built no faster than mlx-lm's (benchmarks/HISTORY.md, "One trace for the
layers alike (6aa1022)").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import _backend, _tracing, rules

# Batches of up to this many tokens run compiled. Each new token count traces
# anew (once per kind of layer and count, about a millisecond of host time), so
# prefill sizes, which are many and spend milliseconds on the GPU, stay
# uncompiled, and MLX's list of traces per function stays short.
COMPILE_MAX_TOKENS = 256


class ModuleCache(dict):
    """What the package keeps on a module for the host's sake: its compiled
    forwards (`compiled_call`), its projections' routes
    (`projections._route`).

    Each entry may capture the module it was made for, or answer for its
    arrays as they were, so a deep copy of the module starts with none; a
    shallow copy shares the cache, and its entries are keyed by the module's
    id. Nor is it part of the module's structure (`_structure`), which would
    change as it fills."""

    def __deepcopy__(self, memo):
        return ModuleCache()

    def __copy__(self):
        return ModuleCache()


def module_cache(module: nn.Module, name: str) -> ModuleCache:
    """The `ModuleCache` named `name` on `module`, made empty on first use."""
    cache = module.__dict__.get(name)
    if cache is None:
        cache = ModuleCache()
        object.__setattr__(module, name, cache)  # not a parameter, nor a child module
    return cache


# Plain attributes that no compiled forward reads, left out of a module's
# structure: a fused block's position among the model's layers
# (`submit_as_built` reads it outside the trace) and a projection's place
# among its siblings (`projections.Siblings`, never joined in a trace) differ
# from layer to layer, which would give each layer a trace of its own.
UNTRACED_ATTRIBUTES = frozenset({"submit_position", "_siblings"})


def compiles(max_tokens: int, x: mx.array) -> bool:
    """Whether a call on activations `x` `[..., D]` runs compiled."""
    return 0 < math.prod(x.shape[:-1]) <= max_tokens and not _tracing.compiled_trace()


class _CompiledForward:
    """One compiled forward of a module, holding no reference to the module.

    The module keeps its compiled forwards (a `ModuleCache`). Were they to
    hold the module in turn, as `mx.compile(forward, inputs=module)` does
    through both arguments, a module and its weights would be a reference
    cycle, freed only when Python's cyclic collector runs: a dropped patched
    model would keep its gigabytes until then. So the module and the call's
    forward stay only for the length of a call: the compiled function's
    implicit inputs are a dict that holds the module while it runs (MLX reads
    that dict's arrays at every call, and swaps its tracers in while it
    traces), and the trace calls the forward of the call that traces it. A
    lock keeps two threads' calls from sharing that state.
    """

    def __init__(self):
        self._inputs: dict = {}
        self._forward: Callable | None = None
        self._for_replay = False
        self._lock = threading.RLock()
        self._compiled = mx.compile(self._traced, inputs=self._inputs)

    def _traced(self, *arrays):
        with _tracing.tracing_compiled(self._for_replay):
            return self._forward(*arrays)

    def __call__(self, module: nn.Module, forward: Callable, *arrays: mx.array):
        with self._lock:
            self._inputs["module"] = module
            self._forward = forward
            # Asked before MLX's trace begins, inside which a transform always
            # runs: a call outside every transform traces for replay only.
            self._for_replay = not _tracing.transforming()
            try:
                return self._compiled(*arrays)
            finally:
                self._inputs.clear()
                self._forward = None


# Traces by what they depend on: the structure of a module (its classes,
# their plain attributes, the paths of its arrays) and the call's key. Each
# holds a small tape and no module, and there are few: one for each kind of
# layer, shape and stream a process runs.
_SHARED_FORWARDS: dict[tuple, _CompiledForward] = {}
_SHARED_LOCK = threading.Lock()
_PLAIN_TYPES = (bool, int, float, str, type(None), mx.Dtype)


def _plain(value):
    """`value` as hashable plain data; TypeError if it holds anything else."""
    if isinstance(value, _PLAIN_TYPES):
        return type(value), value  # True and 1 are equal, but not the same attribute
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_plain(item) for item in value)
    if isinstance(value, (set, frozenset)):
        return "set", frozenset(_plain(item) for item in value)
    if isinstance(value, dict):
        return "dict", tuple((_plain(k), _plain(v)) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value), _plain(vars(value))
    raise TypeError(f"not plain data: {type(value).__name__}")


def _structure(module: nn.Module) -> tuple | None:
    """What a trace of `module`'s forward reads besides the values of its
    arrays: every submodule's class and plain attributes, and the paths of
    the arrays the compiled function takes, in order. None where an attribute
    is not plain data (a distributed group, a function, an array held
    outside the parameters): such a module's traces are its own."""
    try:
        parts = tuple((path, type(m), _plain({name: value for name, value in vars(m).items()
                                              if not isinstance(value, ModuleCache)
                                              and name not in UNTRACED_ATTRIBUTES}))
                      for path, m in module.named_modules())
    except TypeError:
        return None
    return parts, tuple(path for path, _ in tree_flatten(module))


def _forward_for(module: nn.Module, key: tuple) -> _CompiledForward:
    """The compiled forward that modules structured as `module` share for `key`."""
    structure = _structure(module)
    if structure is None:
        return _CompiledForward()
    with _SHARED_LOCK:
        return _SHARED_FORWARDS.setdefault((structure, *key), _CompiledForward())


class KeptBeside:
    """A plain attribute of a module that keeps another module beside it,
    outside the model's tree (`kept_module`, None once it keeps none), which
    `forget` reaches too."""

    kept_module: nn.Module | None


def forget(model: nn.Module) -> None:
    """Drop what the package keeps for the host's sake: every `ModuleCache` of
    `model`'s modules and of the modules they keep beside them (`KeptBeside`;
    their compiled forwards, their projections' routes) and the traces
    layers share. The next call traces and asks its rules anew, as it must
    after a rule or the kernels' tiling changed for the same shapes (a
    benchmark comparing them)."""
    with _SHARED_LOCK:
        _SHARED_FORWARDS.clear()
    for _, module in model.named_modules():
        for value in vars(module).values():
            if isinstance(value, ModuleCache):
                value.clear()
            elif isinstance(value, KeptBeside) and value.kept_module is not None:
                forget(value.kept_module)


@contextlib.contextmanager
def shared_traces_in(traces: dict):
    """Within the block, the traces layers share kept in `traces`, not the
    process's: they are keyed by the layers' structure and shapes, not by
    the rules a trace was made under, so copies of a model patched under
    different rules, run side by side (a benchmark's), keep theirs apart."""
    global _SHARED_FORWARDS
    with _SHARED_LOCK:
        kept, _SHARED_FORWARDS = _SHARED_FORWARDS, traces
    try:
        yield
    finally:
        with _SHARED_LOCK:
            _SHARED_FORWARDS = kept


def compiled_call(module: nn.Module, forward: Callable, *arrays: mx.array, key: tuple):
    """`forward(*arrays)`, compiled with the module's arrays as implicit inputs.

    The module's arrays are read at every call, so new weights (a load,
    `nn.quantize`, training) are used at once. `key` names what else the
    trace reads (the forward, the layer's `tile_m`, Python arguments); the
    default stream is added to it. Modules of the same structure (the layers
    of a model) share their traces (`_structure`); what a module is when it
    first calls with a key is what its trace reads, so attributes changed
    later are not seen unless the key names them. MLX keeps one trace per key
    for each shape and dtype of the inputs.
    """
    forwards = module_cache(module, "_compiled_forwards")
    key = (*key, str(mx.default_stream(mx.default_device())))
    # id(module): a shallow copy shares this dict, but may differ in structure.
    slot = (id(module), *key)
    compiled = forwards.get(slot)
    if compiled is None:
        compiled = forwards[slot] = _forward_for(module, key)
    return compiled(module, forward, *arrays)


def compiled_if_small(module: nn.Module, forward: Callable, x: mx.array, *arrays: mx.array,
                      max_tokens: int, key: tuple):
    """`forward(x, *arrays)`: compiled (`compiled_call`, `key`) where `compiles`
    says so for activations `x` and `max_tokens`, else as it is."""
    if compiles(max_tokens, x):
        return compiled_call(module, forward, x, *arrays, key=key)
    return forward(x, *arrays)


def step_rows(x: mx.array) -> int:
    """The rows of `x` where it is a decoding step's `[..., 1, D]`, else 0."""
    shape = x.shape
    return x.size // shape[-1] if len(shape) >= 3 and shape[-2] == 1 else 0


def submit_as_built(y: mx.array, x: mx.array, position: int, *, max_tokens: int) -> None:
    """Hand `y`, a fused MoE block's output on activations `x`, to MLX's
    evaluation now (`mx.async_eval`) where `rules.submits_block` says so for
    the block at `position`: a decoding step's `[..., 1, D]` that ran
    compiled (`compiles` for `max_tokens`), or a prompt's rows. The GPU
    computes the layers built so far while the host builds the rest of the
    step or chunk. Nothing computed changes, only when it is encoded. Inside
    a transformation (`mx.compile`, `mx.grad`, `mx.vmap`) MLX refuses to
    evaluate, and `y` stays lazy."""
    rows = step_rows(x)
    if rows and not compiles(max_tokens, x):
        return  # an uncompiled step (a batch past max_tokens): not measured
    if not rules.submits_block(rows or x.size // x.shape[-1], position,
                               cuda=_backend.on_cuda(), prompt=not rows):
        return
    try:
        mx.async_eval(y)
    except ValueError as error:
        if "graph transformation" not in str(error):
            raise
