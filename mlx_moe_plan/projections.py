"""A decoding batch's rows as one matrix for a model's dense quantized projections.

A batch of sequences decoding together hands every projection of the model
`[B, 1, D]`: B matrices of one row. MLX's CUDA `quantized_matmul` computes
such an input as B products of one row from 8 rows on, and each of them
reads the whole weight matrix, where the same rows as one matrix `[B, D]` are
one product that reads the weights once. The attention projections, shared
experts, routers and the lm_head of a batch are then read B times a step.

`patch_model` (`dense_rows=True`, the default) gives the model's `QuantizedLinear`
layers, and the `as_linear` of its `QuantizedEmbedding` layers (a tied
lm_head), a call that hands `quantized_matmul` the rows as one matrix where
`rules.dense_as_rows` measured that faster, and otherwise the input as it
is. The layers keep their class's parameters and code (they become instances
of a subclass of their own class), so checkpoints, `nn.quantize` and
`load_weights` work as before, and where the rule keeps the input's shape the
layer computes what mlx-lm's does, op for op.

With `patch_model(dense=True)` (the default), the same layers compute rows
through the package's grouped kernel as one expert where its GEMM was
measured faster than MLX's: a decoding batch's where
`rules.dense_decoding_expert` says so, a prefill's where
`rules.dense_as_expert` does. Those rules time the GPU's work; a call of
the grouped kernel costs the host more than one of `quantized_matmul`, so
it runs compiled and its route is asked once a shape (`_route`). Whole
models decoded faster with it than without at batches of 8, 32 and 64
sequences, and within the noise at one (benchmarks/RESULTS.md, "Whole
models on one GPU").

On CUDA, the projections a module calls on one input one after another
(attention's queries, keys and values; a dense MLP's gate and up) also
become `Siblings`: their matrices stacked into one, so that a decoding
step computes them all with one GEMM where `rules.dense_joins_siblings`
says so.
"""

from __future__ import annotations

import functools
import operator

import mlx.core as mx
import mlx.nn as nn

from . import _backend
from ._backend import on_cuda
from ._compiled import COMPILE_MAX_TOKENS, KeptBeside, compiled_if_small, module_cache, step_rows
from ._gpu import cache_by_stream, device_ints
from ._tracing import compiled_trace
from .rules import (dense_as_expert, dense_as_rows, dense_decoding_expert, dense_from_rows,
                    dense_joins_siblings)


class RowsProjection:
    """Marks a dense quantized layer whose class `patch_model` swapped for one
    that hands a decoding batch's rows to its GEMM as one matrix
    (`decoding_rows`) and rows to the grouped kernel as one expert
    (`dense_expert`), each where its rule says so.

    An input of fewer values than `plain_below_size` computes MLX's call at
    once, asking no rule: fewer rows than any rule takes for the layer
    (`rules.dense_from_rows`, read when the layer took the rows call,
    `read_floors`) times its input's values. A model's projections are
    called a few hundred times a decoding step, and at batch 1 even the
    route's cached key cost the step's host more than MLX's call
    (benchmarks/RESULTS.md, "Whole models on one GPU"): one size compared is
    the cheapest test. 0 asks at every call. Weights replaced by others of
    other sizes leave it as it was, which changes which route is asked, never
    what the layer computes."""

    decoding_rows: bool = True
    dense_expert: bool = False
    plain_below_size: int = 0


def _as_rows(layer: nn.Module, x: mx.array) -> bool:
    """Whether `layer` computes `x` `[..., 1, D]` of several matrices as rows."""
    rows = step_rows(x) if layer.decoding_rows else 0
    # One row is one matrix either way (a batch of one). The sizes are asked
    # first and the stream only where they would take rows on CUDA: every
    # projection of a batched step passes here, outside any compiled trace.
    return (rows > 1 and dense_as_rows(layer["weight"].shape[0], x.shape[-1], rows, layer.bits,
                                       x.dtype.size * 8, layer.mode, cuda=True)
            and on_cuda())


def _as_expert(layer: nn.Module, x: mx.array) -> bool:
    """Whether `layer` computes `x` through the grouped kernel as one expert
    (`dense_expert`): a decoding step's `[..., 1, D]` where
    `dense_decoding_expert` says so, a prefill's `[..., D]` where
    `dense_as_expert` does."""
    if not layer.dense_expert or x.ndim < 2:
        return False
    out_dims, in_dims, rows = layer["weight"].shape[0], x.shape[-1], x.size // x.shape[-1]
    rule = dense_decoding_expert if step_rows(x) else dense_as_expert
    if not rule(out_dims, in_dims, rows, layer.bits, x.dtype.size * 8, layer.mode, cuda=True):
        return False
    stream = _backend.resolve_stream(None)
    if not on_cuda(stream):
        return False
    return _backend.grouped_kernel_computes(layer, _backend.implementation(stream), x.dtype)


@cache_by_stream
def _one_expert_plan(count: int, stream: mx.Stream) -> tuple[mx.array, mx.array]:
    """The plan of one expert holding `count` rows: its spans `[0, count]`
    and every row's expert, 0; made once a count and stream (a decoding
    step's projections all take the same), in device memory (`device_ints`:
    the spans are 8 bytes, which MLX's CUDA backend would keep in managed
    memory, read remotely by the kernel at every call)."""
    plan = (device_ints((0, count), stream), mx.zeros((count,), dtype=mx.int32, stream=stream))
    mx.eval(plan)
    return plan


def _one_expert(layer: nn.Module, x: mx.array) -> mx.array:
    """`layer`'s GEMM of `x` by the grouped kernel: every row the one expert's,
    the layer's bias added in the kernel where it is in the rows' dtype (as
    the kernel reads it), else apart."""
    rows = x.reshape(-1, x.shape[-1])
    stream = _backend.resolve_stream(None)
    bias = _backend.kernel_bias(layer, rows.dtype)
    out = _backend.implementation(stream).grouped_qmm(
        rows, layer["weight"][None], layer["scales"][None], layer["biases"][None],
        *_one_expert_plan(rows.shape[0], stream), bits=layer.bits,
        group_size=layer.group_size, stream=stream, bias=None if bias is None else bias[None],
        dense=True)
    if bias is None and "bias" in layer:
        out = out + layer["bias"]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _route(layer: nn.Module, x: mx.array, join: bool) -> str:
    """How `layer` computes `x`: "siblings" where `join` (it is one of
    `Siblings` that go on) and `_joins` says so; else "expert" where
    `_as_expert` does, "rows" where `_as_rows` does, else "plain". For up to
    `COMPILE_MAX_TOKENS` rows (a decoding step's, a small batch's), asked
    once for each shape and dtype of `x`, of the layer's quantized matrices
    and its quantization, and kind of device, then kept on the layer: every
    projection of a decoding step asks at every step, and the answer cost
    the host more than MLX's call of the GEMM. Larger inputs ask every time,
    so that a server's many prompt lengths add nothing to keep."""
    if x.size > COMPILE_MAX_TOKENS * x.shape[-1]:
        return _asked_route(layer, x, join)
    scales = layer["scales"]
    # id: a shallow copy shares the cache.
    key = (id(layer), x.shape, x.dtype, layer["weight"].shape, scales.shape, scales.dtype,
           layer.bits, layer.mode, "biases" in layer, mx.default_device().type,
           layer.decoding_rows, layer.dense_expert, join)
    routes = module_cache(layer, "_projection_routes")
    route = routes.get(key)
    if route is None:
        route = routes[key] = _asked_route(layer, x, join)
    return route


def _asked_route(layer: nn.Module, x: mx.array, join: bool) -> str:
    """`_route`'s answer, asked of the rules: "siblings" only where `join`."""
    if join and _joins(layer, x):
        return "siblings"
    return "expert" if _as_expert(layer, x) else "rows" if _as_rows(layer, x) else "plain"


def _joins(layer: nn.Module, x: mx.array) -> bool:
    """Whether `layer`, one of `Siblings` (alike in all but their output
    rows), computes `x` with the others as one GEMM: a decoding step's rows
    where `rules.dense_joins_siblings` says so."""
    rows = step_rows(x)
    return (rows > 0 and layer.decoding_rows
            and dense_joins_siblings(x.shape[-1], rows, layer.bits, x.dtype.size * 8, layer.mode,
                                     cuda=True)
            and on_cuda())


def _in_rows(call):
    """The call of a rows projection whose own class calls `call(layer, x)`:
    its part of its `Siblings`' GEMM where it says "siblings" or another
    member made that GEMM on `x`; through the grouped kernel where `_route`
    says "expert" (compiled for small batches, as the MoE layers are: a call
    of the kernel costs the host far more than one of `quantized_matmul` to
    build); with `x` reshaped to rows `[n, D]` where it says "rows"; else as
    it is, and at once for an input that no rule takes
    (`RowsProjection.plain_below_size`): a member's replaced weights ended
    its siblings when they were set (`_ending_setitem`)."""

    def rows_call(layer: nn.Module, x: mx.array) -> mx.array:
        if x.size < layer.plain_below_size:
            return call(layer, x)  # no member joined on it either
        membership = _membership(layer)
        if membership is not None:
            part = membership.siblings.part(membership.index, layer, x)
            if part is not None:
                return part
        route = _route(layer, x, join=membership is not None)
        if route == "siblings":
            y = membership.siblings.join(membership.index, layer, x)
            if y is not None:
                return y
            route = _route(layer, x, join=False)
        if route == "plain":
            return call(layer, x)
        if route == "expert":
            return compiled_if_small(layer, functools.partial(_one_expert, layer), x,
                                     max_tokens=COMPILE_MAX_TOKENS, key=("dense_expert",))
        y = call(layer, x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return rows_call


_ROWS_CLASSES: dict[type, type] = {}


def _ending_setitem(own_setitem):
    """The item assignment of a rows projection whose own class assigns by
    `own_setitem`: a member of `Siblings` whose weight that replaced ends
    them at once (`_membership`), so their stacked bytes go whether or not a
    call asks a route. `load_weights`, `update`, `set_dtype` and attribute
    assignment all set a module's arrays as items."""

    def setitem(layer: nn.Module, key, value) -> None:
        own_setitem(layer, key, value)
        _membership(layer)

    return setitem


def _rows_class(layer_class: type) -> type:
    """A subclass of `layer_class` whose GEMM takes a decoding batch as rows."""
    if layer_class not in _ROWS_CLASSES:
        if issubclass(layer_class, nn.QuantizedEmbedding):
            members = {"as_linear": _in_rows(layer_class.as_linear)}
        else:
            members = {"__call__": _in_rows(layer_class.__call__)}
        members["__setitem__"] = _ending_setitem(layer_class.__setitem__)
        _ROWS_CLASSES[layer_class] = type(
            f"Rows{layer_class.__name__}", (layer_class, RowsProjection),
            {**members, "__module__": __name__,
             "__doc__": f"{layer_class.__qualname__} taking a decoding batch's rows as one "
                        "matrix where the measured rule says so."})
    return _ROWS_CLASSES[layer_class]


def _takes_rows(module: nn.Module) -> bool:
    """Whether `module` is a dense quantized layer whose GEMM call is MLX's own
    (a subclass that computes otherwise is left as it is)."""
    if isinstance(module, RowsProjection):
        return False
    if isinstance(module, nn.QuantizedLinear):
        return type(module).__call__ is nn.QuantizedLinear.__call__
    if isinstance(module, nn.QuantizedEmbedding):
        return type(module).as_linear is nn.QuantizedEmbedding.as_linear
    return False


# The projections that mlx-lm's models call on one input one after another:
# attention's queries, keys and values, a dense MLP's (a shared expert's) gate
# and up.
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_STACKED_ARRAYS = ("weight", "scales", "biases", "bias")


class Siblings:
    """Dense quantized projections of one module that its forward calls on
    the same input one after another, their arrays stacked by output rows
    into one layer (`stacked`), each member's arrays made views of it: the
    same bytes, so memory is not doubled, and the members keep their
    parameters and classes.

    The first member called on a decoding step's input `x` whose route is
    "siblings" (`rules.dense_joins_siblings`, on CUDA) computes every
    member's rows with one GEMM of the stacked layer (`join`) and keeps the
    others' parts for their calls on the same input object (`part`). Each
    member's part is its own rows of the stacked matrices, so a member checks
    that it still holds its views: one that does not (`load_weights`,
    `set_dtype`, the tracers of an `mx.compile` that takes the model's
    arrays as inputs) ends the siblings (`_end`), and from then on every
    member computes alone, as it did unpatched, while the stacked arrays go
    once no member's view holds them (`join_siblings` joins them anew).
    Inside the package's compiled traces (shared by layers of other arrays)
    members compute alone.

    Holds no module of the model, so that a dropped model is freed at once.
    A member that its forward does not call leaves its part kept until the
    next join.

    Args:
        members (list[Module]): The projections, `_joinable`.
    """

    def __init__(self, members: list[nn.Module]):
        first = members[0]
        self.size = len(members)
        self._names = _stacked_names(first)
        bounds = [0]
        for member in members:
            bounds.append(bounds[-1] + member["weight"].shape[0])
        self._splits = bounds[1:-1]
        self.stacked: nn.Module | None = _stacked_layer(first, {
            name: mx.concatenate([m[name] for m in members]) for name in self._names})
        self._views = []
        for index, member in enumerate(members):
            views = tuple(self.stacked[name][bounds[index]: bounds[index + 1]]
                          for name in self._names)
            for name, view in zip(self._names, views):
                member[name] = view
            self._views.append(views)
            object.__setattr__(member, "_siblings", _Membership(self, index))
        # The input of the last join and the parts not yet taken, replaced
        # whole: a thread reading it once sees one join's input and parts.
        self._kept: tuple[mx.array, dict[int, mx.array]] | None = None

    def part(self, index: int, layer: nn.Module, x: mx.array) -> mx.array | None:
        """Member `index`'s (`layer`'s) part of a GEMM that another member's
        call made on `x`, or None."""
        kept = self._kept
        if kept is None or kept[0] is not x:
            return None
        part = kept[1].pop(index, None)
        if part is None or not self._holds_views(index, layer):
            return None
        return part

    def join(self, index: int, layer: nn.Module, x: mx.array) -> mx.array | None:
        """Member `index`'s (`layer`'s) output on `x` by one GEMM of every
        member's rows, the others' parts kept; None where it computes alone."""
        y = self._stacked_call([(index, layer)], x)
        if y is None:
            return None
        parts = mx.split(y, self._splits, axis=-1)
        self._kept = (x, {i: part for i, part in enumerate(parts) if i != index})
        return parts[index]

    def output(self, members: tuple[nn.Module, ...], x: mx.array) -> mx.array | None:
        """The one GEMM's output on `x`, every member's rows one after another
        (`members`, all of them in order, read it whole: none keeps a part);
        None where they compute alone."""
        return self._stacked_call(list(enumerate(members)), x)

    def _stacked_call(self, members: list[tuple[int, nn.Module]], x: mx.array) -> mx.array | None:
        """The stacked layer on `x`, where the `(index, layer)` members still
        hold their views; None where they compute alone."""
        stacked = self.stacked
        if stacked is None or compiled_trace() or not all(self._holds_views(index, layer)
                                                          for index, layer in members):
            return None
        stacked.dense_expert = members[0][1].dense_expert  # the members' flags, as they are now
        return stacked(x)

    def _holds_views(self, index: int, layer: nn.Module) -> bool:
        """Whether `layer` (member `index`, or a shallow copy of it) still
        holds its views of the stacked arrays; if not, the siblings end."""
        if all(map(operator.is_, map(layer.get, self._names), self._views[index])):
            return True
        self._end()
        return False

    def _end(self) -> None:
        """Join no more: drop the stacked layer, the views and the parts (a
        member's replaced arrays would otherwise keep the stacked bytes twice)."""
        self.stacked, self._views, self._kept = None, [], None

    @property
    def ended(self) -> bool:
        return self.stacked is None

    def keeps(self, index: int, layer: nn.Module) -> bool:
        """Whether the siblings have not ended and `layer` (member `index`)
        holds its view of the stacked weight. Asked as a member's arrays are
        set (`_ending_setitem`), so that weights loaded since (`load_weights`)
        end them at once, and their bytes go, whether or not a join comes,
        and at every call that asks a route; the other arrays are checked
        where a part is made or taken."""
        if self.stacked is None:
            return False
        if layer.get("weight") is self._views[index][0]:
            return True
        self._end()
        return False


class _Membership(KeptBeside):
    """A member's place among its `Siblings`. A deep copy of the member
    starts with none (its arrays are copies: its views no longer)."""

    def __init__(self, siblings: Siblings, index: int):
        self.siblings, self.index = siblings, index

    @property
    def kept_module(self) -> nn.Module | None:
        return self.siblings.stacked

    def __deepcopy__(self, memo):
        return None


def _membership(layer: nn.Module) -> _Membership | None:
    """`layer`'s place among `Siblings` that go on (`Siblings.keeps`), or None."""
    membership = layer.__dict__.get("_siblings")
    if membership is None or not membership.siblings.keeps(membership.index, layer):
        return None
    return membership


def joined(members: tuple[nn.Module, ...], x: mx.array) -> mx.array | None:
    """The output on `x` of the one GEMM of `members`, their rows one after
    another, where they are every member of one `Siblings`, in order, and
    their calls on `x` would make that GEMM (`_route` "siblings"); else None,
    and each computes alone. For a forward that reads the output whole
    (`fused_attention`)."""
    if not all(isinstance(member, RowsProjection) for member in members):
        return None  # projections the patch left as they were: never siblings
    if x.size < members[0].plain_below_size:
        return None  # each member's own call then asks `_membership`
    memberships = [_membership(member) for member in members]
    if any(membership is None for membership in memberships):
        return None
    siblings = memberships[0].siblings
    if siblings.size != len(members) or any(
            membership.siblings is not siblings or membership.index != index
            for index, membership in enumerate(memberships)):
        return None
    if _route(members[0], x, join=True) != "siblings":
        return None
    return siblings.output(members, x)


def _stacked_names(layer: nn.Module) -> tuple[str, ...]:
    """The arrays of a quantized layer that `Siblings` stack, in order."""
    return tuple(name for name in _STACKED_ARRAYS if name in layer)


def _stacked_layer(like: nn.Module, arrays: dict[str, mx.array]) -> nn.Module:
    """A dense quantized layer of the rows class quantized as `like`, holding
    `arrays`: not a module of the model (its arrays are the members')."""
    layer = nn.Module.__new__(_rows_class(nn.QuantizedLinear))
    nn.Module.__init__(layer)
    layer.group_size, layer.bits, layer.mode = like.group_size, like.bits, like.mode
    for name, array in arrays.items():
        layer[name] = array
    layer.freeze()
    layer.decoding_rows = like.decoding_rows  # its dense_expert follows the members' (`join`)
    return layer


def _joinable(members: list) -> bool:
    """Whether `members` can be `Siblings`: rows projections of MLX's
    `QuantizedLinear`, affine, alike in everything but their output rows."""
    first = members[0]
    if not all(isinstance(m, nn.QuantizedLinear) and isinstance(m, RowsProjection)
               and _membership(m) is None for m in members):
        return False
    names = _stacked_names(first)
    return (first.mode == "affine" and first.decoding_rows
            and all(set(m.keys()) == set(names) for m in members)
            and all((m.bits, m.group_size, m.mode, m.dense_expert)
                    == (first.bits, first.group_size, first.mode, first.dense_expert)
                    for m in members)
            and all(m[name].dtype == first[name].dtype and m[name].ndim == first[name].ndim
                    and m[name].shape[1:] == first[name].shape[1:]
                    for m in members for name in names))


def join_siblings(model: nn.Module) -> int:
    """Make the rows projections that `model`'s modules call on one input
    (`SIBLING_NAMES`) `Siblings`, in place; their arrays become views of the
    stacked ones, built lazily.

    Args:
        model (Module): A model (or any module tree) after `take_rows`.

    Returns:
        int: How many groups were made.
    """
    groups = 0
    for _, module in model.named_modules():
        for names in SIBLING_NAMES:
            members = [module.get(name) for name in names]
            if all(m is not None for m in members) and _joinable(members):
                Siblings(members)
                groups += 1
    return groups


def read_floors(model: nn.Module) -> None:
    """Set every rows projection's `plain_below_size` from the rules as they
    are now (`rules.dense_from_rows`). `take_rows` does at patch time; a
    benchmark that changes the rules' constants on a patched model calls it
    after.

    Args:
        model (Module): A model (or any module tree) after `take_rows`.
    """
    for _, module in model.named_modules():
        if isinstance(module, RowsProjection):
            out_dims, packed_in_dims = module["weight"].shape
            module.plain_below_size = \
                dense_from_rows(out_dims) * packed_in_dims * 32 // module.bits


def take_rows(model: nn.Module, *, decoding: bool = True, expert: bool = False) -> int:
    """Give every dense quantized projection of `model` the rows call, in place.

    Args:
        model (Module): A model (or any module tree).
        decoding (bool): A decoding batch's rows as one matrix where
          `rules.dense_as_rows` says so, and on CUDA (the default stream's
          device) the projections called on one input as `Siblings`
          (`join_siblings`). Default: ``True``.
        expert (bool): Rows through the grouped kernel as one expert where
          `rules.dense_decoding_expert` (a decoding batch's) or
          `rules.dense_as_expert` (a prefill's) says so, before the above.
          Default: ``False``.

    Returns:
        int: How many layers were given it (layers that have it already are
        not counted, and keep what they were given).
    """
    layers = [module for _, module in model.named_modules() if _takes_rows(module)]
    for module in layers:
        module.__class__ = _rows_class(type(module))
        module.decoding_rows = decoding
        module.dense_expert = expert
    read_floors(model)
    if decoding and on_cuda():
        join_siblings(model)
    return len(layers)
