"""Forwards of small batches as compiled functions, cached on their module.

Decoding rebuilds every layer's graph in Python at every step, and a step of
a few tokens is bound by that host work. `mx.compile` traces a forward once
per shape and then replays it: the graph is built in C++, and its elementwise
ops are fused. The layer (`nn.SwitchGLU`) and the fused MoE blocks
(`fused_blocks.py`) call their forwards through `compiled_call` when
`compiles` says so.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

# Batches of up to this many tokens run compiled. Each new token count traces
# anew (once per layer and count, about a millisecond of host time), so
# prefill sizes, which are many and spend milliseconds on the GPU, stay
# uncompiled, and MLX's list of traces per function stays short.
COMPILE_MAX_TOKENS = 256


class _CompiledForwards(dict):
    """A module's compiled forwards, by what their trace depends on.

    Each captures the module it was made for, so a copy of the module starts
    with none of them."""

    def __deepcopy__(self, memo):
        return _CompiledForwards()

    def __copy__(self):
        return _CompiledForwards()


# Set while a compiled forward is traced: nothing inside it compiles again.
_trace_state = threading.local()


def tracing() -> bool:
    """Whether a compiled forward is being traced now (on this thread)."""
    return getattr(_trace_state, "active", False)


def compiles(max_tokens: int, x: mx.array) -> bool:
    """Whether a call on activations `x` `[..., D]` runs compiled."""
    return 0 < math.prod(x.shape[:-1]) <= max_tokens and not tracing()


class _CompiledForward:
    """One compiled forward of a module, holding no reference to the module.

    The module keeps its compiled forwards (`_CompiledForwards`). Were they to
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
        self._lock = threading.RLock()
        self._compiled = mx.compile(self._traced, inputs=self._inputs)

    def _traced(self, *arrays):
        _trace_state.active = True
        try:
            return self._forward(*arrays)
        finally:
            _trace_state.active = False

    def __call__(self, module: nn.Module, forward: Callable, *arrays: mx.array):
        with self._lock:
            self._inputs["module"] = module
            self._forward = forward
            try:
                return self._compiled(*arrays)
            finally:
                self._inputs.clear()
                self._forward = None


def compiled_call(module: nn.Module, forward: Callable, *arrays: mx.array, key: tuple):
    """`forward(*arrays)`, compiled with the module's arrays as implicit inputs.

    The module's arrays are read at every call, so new weights (a load,
    `nn.quantize`, training) are used at once. `key` names what else the
    trace reads (the forward, the layer's `tile_m`, Python arguments); the
    module and the default stream are added to it. MLX keeps one trace per
    key for each shape and dtype of the inputs.
    """
    forwards = module.__dict__.get("_compiled_forwards")
    if forwards is None:
        forwards = _CompiledForwards()
        object.__setattr__(module, "_compiled_forwards", forwards)
    # id(module): a shallow copy shares this dict, but must not its traces.
    cache_key = (id(module), *key, str(mx.default_stream(mx.default_device())))
    compiled = forwards.get(cache_key)
    if compiled is None:
        compiled = forwards[cache_key] = _CompiledForward()
    return compiled(module, forward, *arrays)
