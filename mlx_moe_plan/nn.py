"""A drop-in `SwitchGLU` for mlx-lm MoE models, built on plan, gather and unsort.

`SwitchGLU` takes the constructor arguments, parameter names and call of
`mlx_lm.models.switch_layers.SwitchGLU`, and reuses mlx-lm's own
`SwitchLinear` projections, so checkpoints load unchanged and `nn.quantize`
turns them into `QuantizedSwitchLinear` exactly as it does mlx-lm's.
`patch_model` swaps it into a loaded model in place.

Expert GEMMs use MLX's `gather_mm` / `gather_qmm` in one of three
formulations: sorted single rows (`tile_m=1`: one expert index a row), tiles
(`tile_m` rows a tile, one expert a tile by the plan's construction, rows seen
as `[max_tiles, tile_m, D]` with `rhs_indices=tile_experts`), or no plan at all
(`tile_m=MLX_LM`: mlx-lm's own call, which decoding runs). The default,
`default_tile_m`, is the rule measured per backend (benchmarks/RESULTS.md);
`tile_m` overrides it per layer. Small batches run compiled
(`COMPILE_MAX_TOKENS`): decoding is bound by the host's graph building. Needs
mlx-lm installed.

MoE blocks that weight and sum the experts' outputs themselves
(`(switch_mlp(x, inds) * scores[..., None]).sum(-2)`) can take the fused path,
`SwitchGLU.weighted_sum`: one `moe_combine` in place of unsort, multiply and
sum. `patch_model` gives it to the blocks of `FUSED_BLOCKS` whose code is the
code it was written against.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import threading
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

try:
    from mlx_lm.models import switch_layers as _mlx_lm_switch
except ImportError as error:  # the layer is an mlx-lm drop-in; the ops are not
    raise ImportError(
        "mlx_moe_plan.nn replaces mlx-lm's SwitchGLU and needs mlx-lm: "
        "pip install mlx-lm (or this package's [bench] extra)"
    ) from error

from . import _backend
from .combine import moe_combine
from .gather import moe_gather, moe_unsort
from .plan import moe_plan


# The tile_m of mlx-lm's own formulation: its SwitchGLU call, op for op (no
# plan): each token against its K experts as routed below 64 routed entries,
# rows sorted by its two argsorts from there (`do_sort = indices.size >= 64`
# in mlx-lm 0.32.2's switch_layers). At decode sizes it beat our planned
# sorted rows on the H200: they launch three custom kernels, each of which
# costs MLX more host time to run than mlx-lm's few index ops, and at T = 1 it
# is what an unpatched model decodes with (patched, bit for bit alike).
MLX_LM = 0
MLX_LM_SORTS_FROM_ENTRIES = 64
# On MLX's CUDA backend (H200, MLX 0.32.4, 4-bit weights, four shapes, T = 1 to
# 2048), tiles beat sorted single rows wherever experts average 2 rows or more
# (1.45x to 24x), tie with them at 1 and lose by up to 16% below: 16-row tiles
# while experts average fewer than 64 rows, 64-row tiles from there. Above the
# launch noise of the smallest sizes, the rule picks the fastest formulation
# measured or one within 4% of it (`python -m benchmarks.layer --tile-m
# auto,0,1,8,16,32,64`, RESULTS.md).
TILED_FROM_ROWS_PER_EXPERT = 2
LARGE_TILES_FROM_ROWS_PER_EXPERT = 64


def default_tile_m(num_entries: int, num_experts: int, stream=None) -> int:
    """The GEMM formulation the layer uses unless told: the measured rule.

    On MLX's CUDA backend, tiles once experts average
    `TILED_FROM_ROWS_PER_EXPERT` routed entries (16 rows, or 64 once they
    average `LARGE_TILES_FROM_ROWS_PER_EXPERT`), and mlx-lm's own call
    (`MLX_LM`) below. Elsewhere (the CPU, whose `gather_qmm` pays for every
    padding row, and Metal, not yet measured) `MLX_LM` below
    `MLX_LM_SORTS_FROM_ENTRIES` entries, where mlx-lm does not sort, and sorted
    single rows (1) from there.

    Args:
        num_entries (int): Routed entries, `T * K` (`indices.size`).
        num_experts (int): Number of experts E.
        stream (Stream or Device, optional): Where the layer runs. Default:
          the default device's stream.

    Returns:
        int: `MLX_LM` (0), 1, 16 or 64.
    """
    stream = _backend.resolve_stream(stream)
    if stream.device.type == mx.gpu and _backend.gpu_backend() == "cuda":
        if num_entries < TILED_FROM_ROWS_PER_EXPERT * num_experts:
            return MLX_LM
        return 64 if num_entries >= LARGE_TILES_FROM_ROWS_PER_EXPERT * num_experts else 16
    return MLX_LM if num_entries < MLX_LM_SORTS_FROM_ENTRIES else 1


# Batches of up to this many tokens run each patched layer, or fused block, as
# one compiled function (`mx.compile`): decoding rebuilds every layer's graph
# in Python at every step, and a step of a few tokens is host-bound. Replaying
# a traced graph builds it in C++ and fuses the elementwise ops. Each new
# token count traces anew (once per layer and count, about a millisecond), so
# prefill sizes, which are many and spend milliseconds on the GPU, stay
# uncompiled. `compile_max_tokens=0` on the layer turns compiling off.
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


def _compiled_call(module: nn.Module, forward: Callable, *arrays: mx.array, key: tuple):
    """`forward(*arrays)`, run as `mx.compile(forward, inputs=module)`.

    The module's arrays are the compiled function's implicit inputs, so new
    weights (a load, `nn.quantize`, training) are read at every call. `key`
    names what else the trace reads (the forward, the layer's `tile_m`,
    Python arguments); the default stream is added to it. MLX keeps one trace
    per key for each shape and dtype of the inputs.
    """
    forwards = module.__dict__.get("_compiled_forwards")
    if forwards is None:
        forwards = _CompiledForwards()
        object.__setattr__(module, "_compiled_forwards", forwards)
    # id(module): a shallow copy shares this dict, but must not its traces.
    cache_key = (id(module), *key, str(mx.default_stream(mx.default_device())))
    compiled = forwards.get(cache_key)
    if compiled is None:
        def traced(*arrays):
            _trace_state.active = True
            try:
                return forward(*arrays)
            finally:
                _trace_state.active = False

        compiled = forwards[cache_key] = mx.compile(traced, inputs=module)
    return compiled(*arrays)


def _compiles(max_tokens: int, x: mx.array) -> bool:
    """Whether a call on activations `x` `[..., D]` runs compiled."""
    return 0 < math.prod(x.shape[:-1]) <= max_tokens and \
        not getattr(_trace_state, "active", False)


def _checked_tile_m(tile_m: int | None) -> int | None:
    if tile_m is None:
        return None
    if isinstance(tile_m, bool) or not isinstance(tile_m, int):
        raise TypeError(f"tile_m: expected an int or None, got {type(tile_m).__name__}")
    if tile_m < 0:
        raise ValueError(f"tile_m: must be MLX_LM (0), 1 (sorted rows) or a tile height "
                         f"above 1, got {tile_m}")
    return tile_m


def _row_strided(rows: mx.array) -> mx.array:
    """`rows` `[n, 1, H]` as a reshape of `[n, H]`: strides `(H, H, 1)`."""
    return rows.reshape(-1, rows.shape[-1]).reshape(rows.shape)


class SwitchGLU(nn.Module):
    """mlx-lm's `SwitchGLU` with the token dispatch of `mlx_moe_plan`.

    Args:
        input_dims (int): Model dimension D.
        hidden_dims (int): Expert hidden dimension I.
        num_experts (int): Number of experts E.
        activation (Module): `activation(x_up, x_gate)`. Default: SwiGLU.
        bias (bool): Projection biases. Default: ``False``.
        tile_m (int, optional): GEMM formulation: `MLX_LM` (0) for mlx-lm's
          own call (no plan; meant for small batches: large ones are not
          sliced as our sorted rows are), 1 for sorted single rows, more for
          tiles of that many rows. Default: `default_tile_m` per call.

    Expert ids must lie in `[0, num_experts)`, as a router gives them. The
    planned formulations skip others (their outputs are zero); mlx-lm's
    hands them to MLX's `gather_qmm`, which does not check them.
    """

    # Rows a single sorted-rows GEMM call takes at most; larger batches run in
    # slices of sorted rows (still sorted). MLX's CUDA backend has failed to
    # launch sorted gather_qmm over 81,920 rows (cuGraphAddKernelNode: invalid
    # argument) where 20,480 ran.
    max_rows_per_gemm = 32768
    # Calls of up to this many tokens run compiled (COMPILE_MAX_TOKENS); 0: never.
    compile_max_tokens = COMPILE_MAX_TOKENS

    def __init__(
        self,
        input_dims: int,
        hidden_dims: int,
        num_experts: int,
        activation: nn.Module | None = None,
        bias: bool = False,
        *,
        tile_m: int | None = None,
    ):
        super().__init__()
        self.tile_m = _checked_tile_m(tile_m)
        linear = _mlx_lm_switch.SwitchLinear
        self.gate_proj = linear(input_dims, hidden_dims, num_experts, bias=bias)
        self.up_proj = linear(input_dims, hidden_dims, num_experts, bias=bias)
        self.down_proj = linear(hidden_dims, input_dims, num_experts, bias=bias)
        self.activation = _mlx_lm_switch.SwiGLU() if activation is None else activation

    @classmethod
    def from_mlx_lm(cls, layer: nn.Module, *, tile_m: int | None = None) -> "SwitchGLU":
        """A `SwitchGLU` sharing `layer`'s projections and activation (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.tile_m = _checked_tile_m(tile_m)
        new.gate_proj = layer.gate_proj
        new.up_proj = layer.up_proj
        new.down_proj = layer.down_proj
        new.activation = layer.activation
        return new

    @property
    def num_experts(self) -> int:
        return self.gate_proj.num_experts

    def _formulation(self, indices: mx.array) -> int:
        if self.tile_m is not None:
            return self.tile_m
        return default_tile_m(indices.size, self.num_experts)

    def _plan(self, indices: mx.array, tile_m: int):
        return moe_plan(mx.stop_gradient(indices), self.num_experts, tile_m=tile_m)

    def _mlx_lm(self, x: mx.array, indices: mx.array) -> mx.array:
        """mlx-lm's own `SwitchGLU` call on these projections: `[..., K, D]`."""
        return _mlx_lm_switch.SwitchGLU.__call__(self, x, indices)

    def _mlp(self, rows: mx.array, experts: mx.array) -> mx.array:
        """The expert MLP of `rows` `[n, m, D]`, expert `experts[i]` for `rows[i]`."""
        x_up = self.up_proj(rows, experts, sorted_indices=True)
        x_gate = self.gate_proj(rows, experts, sorted_indices=True)
        if rows.shape[-2] == 1 and "bias" in self.up_proj:
            # mlx-lm's SwitchLinear adds its bias through expand_dims, and an
            # elementwise op may hand that input's strides on to its output:
            # the stride-1 axis of _expert_rows' note, which would reach the
            # down projection's input and, through the activation's gradient,
            # the cotangents of these two. A reshape round trip gives them
            # their true row stride, and so everything computed from them.
            x_up = _row_strided(x_up)
            x_gate = _row_strided(x_gate)
        return self.down_proj(self.activation(x_up, x_gate), experts, sorted_indices=True)

    def _expert_rows(self, x: mx.array, plan) -> mx.array:
        """The expert MLP of every row of the plan, `[capacity, D]`."""
        rows = moe_gather(x, plan)
        hidden = rows.shape[-1]  # spelled out: -1 cannot be inferred for 0 rows
        if plan.tile_m > 1:
            # Tiles past num_tiles hold zero rows and expert -1: give them the
            # last expert, so the experts stay sorted as sorted_indices
            # promises (a wrong promise gives wrong weight gradients); nothing
            # reads their outputs.
            last = self.num_experts - 1
            experts = mx.where(plan.tile_experts < 0, last, plan.tile_experts)
            tiles = rows.reshape(plan.max_tiles, plan.tile_m, hidden)
            out = self._mlp(tiles, experts)
            return out.reshape(plan.capacity, out.shape[-1])
        # [capacity, 1, D] by reshape, not expand_dims, and back by reshape,
        # not squeeze (whose gradient is an expand_dims). MLX gives the size-1
        # axis expand_dims inserts a stride of 1, and MLX 0.32.4's CUDA sorted
        # gather_mm of one-row batches (a grouped GEMM over each expert's
        # rows) takes that stride for the distance between rows: on the H200
        # it read expand_dims' rows wrongly (max error 7.2 in a 32-wide
        # product) and reshaped ones right (1e-6).
        rows = rows.reshape(plan.capacity, 1, hidden)
        experts = plan.row_experts  # sorted by construction
        step = self.max_rows_per_gemm
        if plan.capacity <= step:
            out = self._mlp(rows, experts)
        else:
            out = mx.concatenate([self._mlp(rows[i : i + step], experts[i : i + step])
                                  for i in range(0, plan.capacity, step)])
        return out.reshape(plan.capacity, out.shape[-1])

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """Args: x `[..., D]`, indices `[..., K]`. Returns `[..., K, D]`, as mlx-lm's."""
        if _compiles(self.compile_max_tokens, x):
            return _compiled_call(self, self._forward, x, indices, key=("call", self.tile_m))
        return self._forward(x, indices)

    def _forward(self, x: mx.array, indices: mx.array) -> mx.array:
        tile_m = self._formulation(indices)
        if tile_m == MLX_LM:
            return self._mlx_lm(x, indices)
        plan = self._plan(indices, tile_m)
        return moe_unsort(self._expert_rows(x, plan), plan)

    def weighted_sum(self, x: mx.array, indices: mx.array, scores: mx.array, *,
                     in_rows_dtype: bool = False) -> mx.array:
        """`(self(x, indices) * scores[..., None]).sum(-2)` with one `moe_combine`.

        The fused path for MoE blocks that weight and sum the experts' outputs
        themselves: no `[..., K, D]` intermediate. The sum runs in float32 over
        ascending k, rounded once to the result's dtype, so its last bits may
        differ from the unfused product-sum in the activations' dtype. The
        `MLX_LM` formulation has no plan to combine with: it computes the
        unfused expression itself, bit for bit mlx-lm's.

        Args:
            x (array): `[..., D]`.
            indices (array): `[..., K]`.
            scores (array): Float weights, `[..., K]`.
            in_rows_dtype (bool): The result in the experts' output dtype, as
              blocks that end in `.astype(y.dtype)` give it. Default: that
              dtype promoted with `scores.dtype`, as the unfused expression.

        Returns:
            array: `[..., D]`.
        """
        if _compiles(self.compile_max_tokens, x):
            def forward(x, indices, scores):
                return self._weighted_sum(x, indices, scores, in_rows_dtype)

            return _compiled_call(self, forward, x, indices, scores,
                                  key=("weighted_sum", self.tile_m, in_rows_dtype))
        return self._weighted_sum(x, indices, scores, in_rows_dtype)

    def _weighted_sum(self, x: mx.array, indices: mx.array, scores: mx.array,
                      in_rows_dtype: bool) -> mx.array:
        tile_m = self._formulation(indices)
        if tile_m == MLX_LM:
            y = self._mlx_lm(x, indices)
            weighted = (y * scores[..., None]).sum(-2)
            return weighted.astype(y.dtype) if in_rows_dtype else weighted
        plan = self._plan(indices, tile_m)
        rows = self._expert_rows(x, plan)
        dtype = rows.dtype if in_rows_dtype else mx.result_type(rows.dtype, scores.dtype)
        return moe_combine(rows, plan, weights=scores, dtype=dtype)


# ---- fused MoE blocks: each forward is its mlx-lm block's __call__ with the
# experts' weighted sum as one `weighted_sum`, the rest line for line.


def _softmax_top_k(block: nn.Module, x: mx.array) -> tuple[mx.array, mx.array]:
    """Qwen3-MoE's and Qwen3-Next's routing: top-k of the softmax, renormalized."""
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    k = block.top_k
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if block.norm_topk_prob:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def _qwen3_moe(block: nn.Module, x: mx.array) -> mx.array:
    inds, scores = _softmax_top_k(block, x)
    return block.switch_mlp.weighted_sum(x, inds, scores, in_rows_dtype=True)


def _qwen3_next(block: nn.Module, x: mx.array) -> mx.array:
    inds, scores = _softmax_top_k(block, x)
    y = block.switch_mlp.weighted_sum(x, inds, scores)
    shared_y = mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return y + shared_y


def _mixtral(block: nn.Module, x: mx.array) -> mx.array:
    gates = block.gate(x)
    k = block.num_experts_per_tok
    inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
    scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
    return block.switch_mlp.weighted_sum(x, inds, scores)


def _deepseek_v3(block: nn.Module, x: mx.array) -> mx.array:
    inds, scores = block.gate(x)
    y = block.switch_mlp.weighted_sum(x, inds, scores, in_rows_dtype=True)
    if block.config.n_shared_experts is not None:
        y = y + block.shared_experts(x)
    return y


def _gpt_oss(block: nn.Module, x: mx.array) -> mx.array:
    from mlx_lm.models.gpt_oss import mlx_topk  # the block's own top-k

    expert_logits, indices = mlx_topk(block.router(x), k=block.num_experts_per_tok, axis=-1)
    expert_weights = mx.softmax(expert_logits, axis=-1, precise=True)
    return block.experts.weighted_sum(x, indices, expert_weights)


# The blocks given the fused path: class -> (experts attribute, fused forward,
# SHA-256 prefix of the block's __call__ source as the forward was written
# against, mlx-lm 0.32.2). A block whose __call__ reads otherwise (another
# mlx-lm's) keeps its own: patched experts, unfused sum, still correct.
FUSED_BLOCKS: dict[str, tuple[str, Callable[[nn.Module, mx.array], mx.array], str]] = {
    "mlx_lm.models.qwen3_moe.Qwen3MoeSparseMoeBlock":
        ("switch_mlp", _qwen3_moe, "5d2e8164fcb6ebfc"),
    "mlx_lm.models.qwen3_next.Qwen3NextSparseMoeBlock":
        ("switch_mlp", _qwen3_next, "9c28cc63a2f1d683"),
    "mlx_lm.models.mixtral.MixtralSparseMoeBlock": ("switch_mlp", _mixtral, "95e4c55589ec0085"),
    "mlx_lm.models.deepseek_v3.DeepseekV3MoE": ("switch_mlp", _deepseek_v3, "5c396b22d20c5274"),
    "mlx_lm.models.gpt_oss.MLPBlock": ("experts", _gpt_oss, "7c6ef1cd838840ed"),
}


class FusedMoEBlock:
    """Marks an mlx-lm MoE block whose class `patch_model` swapped for one
    calling the fused forward (a subclass of the block's own class)."""


def _source_digest(function) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]
    except (OSError, TypeError):  # no source to read: not known to be safe
        return None


_FUSED_CLASSES: dict[tuple[type, Callable], type] = {}


def _fused_class(block_class: type, experts_name: str, forward) -> type:
    if (block_class, forward) not in _FUSED_CLASSES:
        def __call__(self, x: mx.array) -> mx.array:
            # Distributed blocks (a sharding group set) keep their own call.
            if getattr(self, "sharding_group", None) is not None:
                return block_class.__call__(self, x)
            experts = self[experts_name]
            if _compiles(experts.compile_max_tokens, x):
                return _compiled_call(self, lambda x: forward(self, x), x,
                                      key=("block", experts.tile_m))
            return forward(self, x)

        _FUSED_CLASSES[block_class, forward] = type(
            f"Fused{block_class.__name__}", (block_class, FusedMoEBlock),
            {"__call__": __call__, "__module__": __name__,
             "__doc__": f"{block_class.__qualname__} with the experts' weighted sum fused."})
    return _FUSED_CLASSES[block_class, forward]


def _fuse(module: nn.Module) -> bool:
    """Give `module` the fused forward if it is a known block, as written."""
    block_class = type(module)
    known = FUSED_BLOCKS.get(f"{block_class.__module__}.{block_class.__qualname__}")
    if known is None:
        return False
    experts, forward, digest = known
    if not isinstance(module.get(experts), SwitchGLU) or \
            _source_digest(block_class.__call__) != digest:
        return False
    module.__class__ = _fused_class(block_class, experts, forward)
    return True


def patch_model(model: nn.Module, *, tile_m: int | None = None, fuse: bool = True) -> int:
    """Replace every mlx-lm `SwitchGLU` in `model`, in place, keeping its weights.

    Float and quantized layers alike: the projections are kept as they are.
    With `fuse`, the MoE blocks of `FUSED_BLOCKS` whose `__call__` is the one
    their fused forward was written against then sum their experts' weighted
    outputs with one `moe_combine` (`SwitchGLU.weighted_sum`); they become
    instances of a subclass of their own class and of `FusedMoEBlock`.

    Args:
        model (Module): A loaded mlx-lm model (or any module tree).
        tile_m (int, optional): The GEMM formulation of every new layer (see
          `SwitchGLU`). Default: `default_tile_m`, per call.
        fuse (bool): Fuse the weighted sums where that is known to be safe.
          Default: ``True``.

    Returns:
        int: How many layers were replaced.
    """
    replacements = [(path, SwitchGLU.from_mlx_lm(module, tile_m=tile_m))
                    for path, module in model.named_modules()
                    if path and isinstance(module, _mlx_lm_switch.SwitchGLU)]
    if replacements:  # MLX's own walk of lists and dicts of modules, and swap
        model.update_modules(tree_unflatten(replacements))
    if fuse:
        for _, module in model.named_modules():
            _fuse(module)
    return len(replacements)
