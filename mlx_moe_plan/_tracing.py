"""What MLX's transforms and the package's compiled forwards are doing, which
MLX's Python API does not say: for the GPU glue, whether a launch must carry
its gradient; for the layers, whether a compiled forward is being traced, in
which nothing compiles again.

MLX runs a function under `mx.grad`, `mx.vjp`, `mx.jvp`, `mx.vmap` and
`mx.compile` on tracers, and marks every array made from one as a tracer too
while the transform runs (`traced`). A launch on arrays no transform traces
depends on nothing a transform varies, and one outside every transform can
never be differentiated: neither needs the custom function that carries its
gradient (`_gpu._when_traced`).

Nor does a launch traced by the package's own compiled forwards for MLX to
replay (`_compiled`): MLX traces a compiled function on a call whose arrays
no transform traces, and replays that tape only on such calls; on traced
arrays it calls the function itself (mlx/compile.cpp). So nothing in such a
tape is ever differentiated or vmapped, and the gradient's graph nodes in it
would be replayed at every step for nothing. `tracing_compiled` says a trace
is one of those: one whose call came outside every transform
(`transforming`), which leaves out, to be safe, the rarer trace on untraced
arrays inside one.
"""

from __future__ import annotations

import contextlib
import threading

from ._extension import _ext

# Whether a running transform traces any of a list of arrays.
traced = _ext.traced
# Whether a transform runs now, on this thread.
transforming = _ext.transforming

_state = threading.local()


def compiled_trace() -> bool:
    """Whether one of the package's compiled forwards (`_compiled`) is being
    traced now, on this thread: nothing inside it compiles again."""
    return getattr(_state, "compiled", False)


def replayed_trace() -> bool:
    """Whether the package's compiled forward being traced now, on this
    thread, is traced for MLX to replay only (`tracing_compiled`)."""
    return getattr(_state, "for_replay", False)


@contextlib.contextmanager
def tracing_compiled(for_replay: bool):
    """Within the block, a compiled forward is traced (`compiled_trace()`),
    for MLX to replay only or not (`replayed_trace()`): as its call, made
    before MLX's trace began, found itself outside every transform
    (`not transforming()`) or not."""
    kept = compiled_trace(), replayed_trace()
    _state.compiled, _state.for_replay = True, for_replay
    try:
        yield
    finally:
        _state.compiled, _state.for_replay = kept


def carries_gradients(arrays) -> bool:
    """Whether a launch on `arrays` must be made in the custom function that
    carries its gradient: a transform traces one of them, and not only the
    package's trace of a compiled forward for MLX to replay."""
    return traced(arrays) and not replayed_trace()
