# Shared test machinery: the backend parameter, the one Hypothesis profile, the
# routing strategy and the bit-exact assertions against mlx_moe_plan.reference
# (the NumPy definition of docs/DESIGN.md's semantics that every backend must
# match), which wrap the reference's own comparisons; the reference's gather
# and combine of MLX arrays and of the OpenCL harness's rows alike; and the
# grouped GEMM's check, which the GPU and PoCL tests share.

from __future__ import annotations

import importlib
import os
import re

# Float32 matmuls in exact float32, not TensorFloat-32 (MLX's default on CUDA):
# the layer tests compare a patched model with mlx-lm's, whose GEMM kernels
# differ (sorted rows against unsorted below mlx-lm's sort threshold), and
# TF32's 10-bit products make that difference 1e-4 rather than 1e-7. MLX reads
# this once, at its first matmul.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import mlx_moe_plan
from mlx_moe_plan import _backend
from mlx_moe_plan import reference as ref
from mlx_moe_plan.kernels import launch

# One profile. Small by default so that the CPU suite stays well under its time
# budget on two cores; HYPOTHESIS_PROFILE=thorough asks for many more examples,
# HYPOTHESIS_PROFILE=sanitize for few (compute-sanitizer runs kernels ~100x slower).
# Derandomized in CI so that a red run can be reproduced from its log alone.
_EXAMPLES = {"thorough": 1000, "sanitize": 5}.get(os.environ.get("HYPOTHESIS_PROFILE", ""), 20)
settings.register_profile(
    "mlx_moe_plan",
    deadline=None,
    derandomize="CI" in os.environ,
    max_examples=_EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("mlx_moe_plan")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs on the GPU stream (Metal or CUDA MLX)")
    config.addinivalue_line("markers", "pocl: runs the kernel bodies as OpenCL C on PoCL")


# --- the backend parameter ---------------------------------------------------

_NO_GPU = "this MLX has neither Metal nor CUDA (mlx_moe_plan._backend.gpu_backend() is None)"


@pytest.fixture(
    scope="session",  # session scope: Hypothesis refuses function-scoped fixtures
    params=[
        pytest.param(mx.cpu, id="cpu"),
        pytest.param(
            mx.gpu,
            id="gpu",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(_backend.gpu_backend() is None, reason=_NO_GPU),
            ],
        ),
    ],
)
def device(request) -> mx.Device:
    """The device every op of a test runs on, passed as `stream=device`.

    On the GPU every kernel output starts as a poison value that no kernel
    writes, so an element a kernel leaves unwritten fails the comparison.
    """
    from mlx_moe_plan import _gpu

    _gpu.POISON = -7777.0 if request.param == mx.gpu else None
    # An mx.Device, not the bare mx.cpu / mx.gpu enum: the package's stream
    # argument takes a Stream, a Device or None (see test_errors for the enum).
    return mx.Device(request.param)


@pytest.fixture
def on_the_cpu(monkeypatch):
    """MLX's default device the CPU inside the test, then the one before: a
    test that stands a GPU launch in on the CPU backend (`gpu_glue_on_the_cpu`)
    runs there on a machine whose MLX has a GPU too, where a GPU default
    would route past the stand-in. mlx-lm's batch generation runs on a stream
    of the default device as mlx-lm was imported (`generation_stream`): a CPU
    one inside the test too."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:  # the module: mlx_lm's package binds the name `generate` to its function
        generate = importlib.import_module("mlx_lm.generate")
    except ImportError:
        generate = None
    if generate is not None:
        monkeypatch.setattr(generate, "generation_stream", mx.new_stream(mx.cpu))
    yield
    mx.set_default_device(before)


def gpu_glue_on_the_cpu(monkeypatch, kernel: str, launched, *, module, rule: str,
                        from_rows: int) -> None:
    """The CPU backend given the GPU glue's optional `kernel` (its checks and
    custom function) and its `_computes`, the glue's launches replaced by
    `launched` (`glue_launched_by`); `module`'s `on_cuda` saying yes and the
    rule's constant `rules.<rule>` at `from_rows`, as on CUDA: the fused
    forwards and the glue, run on a machine without a GPU. The test asks
    for `on_the_cpu`."""
    assert mx.default_device().type == mx.cpu, "a stand-in on the CPU: request on_the_cpu"
    from mlx_moe_plan import _gpu, rules
    # imported here, not above: the GPU suite runs from a tree without the C++ extension
    from mlx_moe_plan import _cpu

    gpu = _gpu.GpuBackend("cuda")
    monkeypatch.setattr(rules, rule, from_rows)
    monkeypatch.setattr(module, "on_cuda", lambda stream=None: True)
    glue_launched_by(monkeypatch, kernel, launched)
    monkeypatch.setattr(_cpu.CPU, kernel, getattr(gpu, kernel), raising=False)
    monkeypatch.setattr(_cpu.CPU, f"{kernel}_computes", getattr(gpu, f"{kernel}_computes"),
                        raising=False)


def glue_launched_by(monkeypatch, kernel: str, launched) -> None:
    """The GPU glue of `kernel` binding its launches by `launched` (for
    `_gpu._KERNEL_launched`: a factory taking the static sizes, returning a
    callable over the arrays), its steps kept in a fresh cache for the test
    (`_gpu._KERNEL_step`): no step made before answers, and none made with
    `launched` outlives the test."""
    from mlx_moe_plan import _gpu

    monkeypatch.setattr(_gpu, f"_{kernel}_launched", launched)
    monkeypatch.setattr(_gpu, f"_{kernel}_step", getattr(_gpu, f"_{kernel}_step").fresh())


def recording_calls(bind, record, calls: list):
    """`bind` (a glue's `_gpu._KERNEL_launched`, or a stand-in for it) with
    `record(*arrays)` of each call of what it binds appended to `calls`: a
    test's count of a glue's calls, its launches bound once a size."""
    def bound(*sizes):
        launched = bind(*sizes)

        def recorded(*arrays):
            calls.append(record(*arrays))
            return launched(*arrays)

        return recorded

    return bound


# --- dtypes and conversions ----------------------------------------------------

FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
FLOAT_NAMES = list(FLOAT_DTYPES)


def dtype_name(dtype: mx.Dtype) -> str:
    """The reference's name of an MLX float dtype ("bfloat16" means uint16 bits)."""
    for name, value in FLOAT_DTYPES.items():
        if value == dtype:
            return name
    raise AssertionError(f"not a row dtype: {dtype}")


to_numpy = ref.to_numpy  # how the reference reads MLX arrays; the tests import it from here


def stored(values) -> tuple[np.ndarray, str]:
    """`values` as the reference takes them, and the reference's name of their
    dtype: an MLX float array, or NumPy rows as the reference stores them
    (bfloat16 as uint16 bits, as the OpenCL harness holds them)."""
    if isinstance(values, mx.array):
        return to_numpy(values), dtype_name(values.dtype)
    return values, "bfloat16" if values.dtype == np.uint16 else values.dtype.name


def _reference_name(dtype) -> str | None:
    return dtype if dtype is None or isinstance(dtype, str) else dtype_name(dtype)


def reference_gather(x, plan, dtype=None) -> np.ndarray:
    """`reference.moe_gather` of `x` (see `stored`) by `plan` (a ReferencePlan,
    or any object with its row_tokens and capacity), converted to `dtype` (an
    MLX dtype or the reference's name; None: x's own)."""
    values, x_dtype = stored(x)
    with np.errstate(over="ignore"):  # float32 -> float16 overflow to inf is intended
        return ref.moe_gather(values, plan, dtype=_reference_name(dtype), x_dtype=x_dtype)


def reference_combine(rows, plan, weights=None, dtype=None) -> np.ndarray:
    """`reference.moe_combine` of `rows` (see `stored`) by `plan` (a
    ReferencePlan, or any object with its positions, top_k and row_weights),
    weighted by `weights` (float32, or None: the plan's), rounded to `dtype`
    (an MLX dtype or the reference's name; None: the rows' own)."""
    values, rows_dtype = stored(rows)
    with np.errstate(over="ignore"):
        return ref.moe_combine(values, plan, weights=weights, rows_dtype=rows_dtype,
                               dtype=_reference_name(dtype))


def as_float32(array: mx.array) -> np.ndarray:
    """The exact float32 values of an MLX float array (every row dtype widens exactly)."""
    return np.array(array.astype(mx.float32))


def assert_logits_close(got, want) -> None:
    """Each step's logits of `got` within bfloat16's rounding of `want`'s
    (a launch that rounds or sums in another order than MLX's ops)."""
    for got_step, want_step in zip(got, want):
        g, w = as_float32(got_step), as_float32(want_step)
        np.testing.assert_allclose(g, w, rtol=2 ** -6, atol=2 ** -6 * np.abs(w).max())


# MLX's releases whose CUDA quantized_matmul multiplies some rows wrongly
# (`mlx_multiplies_rows`): up to the newest tested. Their rows are trusted from
# MLX_SHORT_ROWS values, and of two quantization groups or more.
MLX_ROWS_WRONG_UP_TO = (0, 32, 4)
MLX_SHORT_ROWS = 128


def mlx_version() -> tuple[int, ...]:
    """MLX's release as numbers (a dev build's suffix dropped)."""
    return tuple(int(re.match(r"\d+", part).group()) for part in mx.__version__.split(".")[:3])


def mlx_multiplies_rows(in_dims: int, group_size: int) -> bool:
    """Whether MLX's own `quantized_matmul`, on the default device, can be
    trusted with several rows of `in_dims` values quantized in groups of
    `group_size`: always off CUDA (the CPU's kernels are what the other tests
    hold every backend to; Metal's fault, if any, is not known); on CUDA
    where the rows hold MLX_SHORT_ROWS values and two groups or more, or in
    an MLX newer than MLX_ROWS_WRONG_UP_TO.

    MLX 0.32.4's CUDA kernels get several rows of 64 values wrong, the width
    of the small models these tests build: on an H100 its products of 2 and
    of 40 rows came out unrelated to the exact ones (float32 relative error
    1, bfloat16 up to 1e36) while single rows (its matrix-vector kernel) and
    128 values or more were right; on an H200 a check of two such rows by 16
    columns came out right, and then the test models' logits, through
    products of the same width, came out NaN where mlx-lm's model had given
    finite ones the call before. A product checked once cannot tell, so this
    is a rule of the shape, not a check. Rows of one quantization group are
    wrong too: on an H100, two rows of 128 values in one group of 128, by 4
    columns, came out 1.1 from the exact product (float32): MLX's CUDA
    backend (its sources of the 0.32 series) has a kernel of its own for rows
    of one group. A test whose reference, or whose own path, is MLX's product
    at such a shape has nothing to compare there, and skips."""
    return (not _backend.on_cuda() or mlx_version() > MLX_ROWS_WRONG_UP_TO
            or (in_dims >= MLX_SHORT_ROWS and in_dims >= 2 * group_size))


def assert_bitwise(actual, expected, what: str) -> None:
    """`actual` (MLX array) holds exactly the bits of `expected` (NumPy array).

    Floats are compared as integers of their width, so that -0.0 differs from
    0.0 and NaN payloads count (`reference.bitwise_mismatch`).
    """
    problem = ref.bitwise_mismatch(actual, expected)
    if problem:
        raise AssertionError(f"{what}: {problem}")


def random_floats(rng: np.random.Generator, shape, dtype: mx.Dtype) -> mx.array:
    """Normal values in `dtype`: never all zeros, which would hide unwritten rows."""
    values = rng.standard_normal(shape).astype(np.float32)
    return mx.array(values).astype(dtype)


# --- layouts: the same logical values, stored contiguously or not --------------

LAYOUTS = ("contiguous", "transposed", "strided_last", "strided_first")


def with_layout(values: np.ndarray, layout: str, rng: np.random.Generator) -> mx.array:
    """An MLX array equal to `values` whose memory is laid out as `layout` says.

    The strided layouts are slices of a larger buffer whose other elements hold
    random bits, so that reading the wrong element shows.
    """
    if layout == "contiguous" or values.ndim == 0:
        return mx.array(values)
    if layout == "transposed":
        axes = tuple(reversed(range(values.ndim)))
        base = mx.array(np.ascontiguousarray(values.transpose(axes)))
        return mx.transpose(base, axes)
    axis = values.ndim - 1 if layout == "strided_last" else 0
    shape = list(values.shape)
    shape[axis] *= 2
    if values.dtype.kind in "iu":
        info = np.iinfo(values.dtype)
        filler = rng.integers(info.min, info.max, size=shape, dtype=values.dtype, endpoint=True)
    else:
        filler = rng.standard_normal(shape).astype(values.dtype)
    index = [slice(None)] * values.ndim
    index[axis] = slice(None, None, 2)
    filler[tuple(index)] = values
    return mx.array(filler)[tuple(index)]


def float_with_layout(values: np.ndarray, dtype: mx.Dtype, layout: str, rng) -> mx.array:
    """`with_layout` for float32 `values` stored as `dtype` (converted before the view).

    "broadcast" differs: it repeats the first row of `values` with stride 0, so
    compare against the returned array's values, not `values`.
    """
    if layout == "broadcast" and values.size:  # stride 0: the first row, repeated
        first = mx.array(values.reshape(-1, values.shape[-1])[:1]).astype(dtype)
        leading_ones = (1,) * (values.ndim - 1)
        return mx.broadcast_to(first.reshape(leading_ones + first.shape[-1:]), values.shape)
    if layout == "broadcast":
        layout = "contiguous"
    if layout == "contiguous" or values.ndim == 0:
        return mx.array(values).astype(dtype)
    if layout == "transposed":
        axes = tuple(reversed(range(values.ndim)))
        base = mx.array(np.ascontiguousarray(values.transpose(axes))).astype(dtype)
        mx.eval(base)  # the transpose below must be a view of a stored buffer
        return mx.transpose(base, axes)
    axis = values.ndim - 1 if layout == "strided_last" else 0
    shape = list(values.shape)
    shape[axis] *= 2
    filler = rng.standard_normal(shape).astype(np.float32)
    index = [slice(None)] * values.ndim
    index[axis] = slice(None, None, 2)
    filler[tuple(index)] = values
    base = mx.array(filler).astype(dtype)
    mx.eval(base)
    return base[tuple(index)]


# --- routings ------------------------------------------------------------------

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INDEX_DTYPES = ("int32", "int64", "uint32", "int16", "uint8", "int8", "uint16", "uint64")


def _skip_values(dtype: np.dtype, rng, count: int) -> np.ndarray:
    """Negative ids (skipped entries) representable in `dtype`, extremes included."""
    info = np.iinfo(dtype)
    choices = [-1, -2, info.min, -int(rng.integers(1, 1 + min(-info.min, 10**6)))]
    if dtype == np.int64:
        choices += [-(2**40), INT32_MIN, INT32_MIN - 1, -(2**32) + 3]
    elif dtype == np.int32:
        choices += [INT32_MIN]
    return np.array(rng.choice(choices, count), dtype=np.int64)


def _invalid_values(dtype: np.dtype, num_experts: int, rng, count: int) -> np.ndarray:
    """Ids `>= num_experts` representable in `dtype`, including ones that would
    alias a valid expert if truncated to 32 or 16 bits."""
    info = np.iinfo(dtype)
    if info.max < num_experts:
        return np.empty(0, np.int64)
    e = int(rng.integers(0, num_experts))
    choices = [num_experts, min(num_experts + 1, info.max), info.max,
               int(rng.integers(num_experts, min(int(info.max), 2**62), endpoint=True))]
    if info.max >= INT32_MAX:
        choices += [INT32_MAX]
    if info.max > INT32_MAX:  # wrap to int32 -1 or to a valid expert if truncated
        choices += [2**31, 2**31 + e, 2**32 - 1, 2**32 + e]
    if info.max > 2**32:
        choices += [2**32 + 3, 2**40 + e, info.max]
    if dtype == np.uint64:  # the reference reads ids as int64: stay below 2**63
        choices = [min(c, 2**62) for c in choices]
    picked = [choices[i] for i in rng.integers(0, len(choices), count)]
    return np.array(picked, dtype=np.uint64 if dtype == np.uint64 else np.int64)


def make_ids(rng, shape, num_experts: int, dtype: str, mode: str,
             skip_rate: float, invalid_rate: float) -> np.ndarray:
    """Expert ids of `shape` ([..., K]) in `dtype`; see `routings` for the modes."""
    dtype = np.dtype(dtype)
    info = np.iinfo(dtype)
    top_k = shape[-1]
    count = int(np.prod(shape))
    routable = min(num_experts, int(info.max) + 1)
    if mode == "one_expert":  # one expert owns every routed entry
        ids = np.full(count, rng.integers(0, routable), dtype=np.int64)
    elif mode == "few_experts":
        few = rng.integers(0, routable, size=min(3, routable))
        ids = rng.choice(few, count).astype(np.int64)
    elif mode == "distinct_per_token" and top_k <= routable:  # like a real top-k
        tokens = count // top_k
        ids = np.stack([rng.permutation(routable)[:top_k] for _ in range(tokens)]).reshape(-1) \
            if tokens else np.empty(0, np.int64)
        ids = ids.astype(np.int64)
    else:
        ids = rng.integers(0, routable, size=count).astype(np.int64)
    if mode == "duplicates" and top_k > 1 and count:  # the same expert twice in a token
        ids2 = ids.reshape(-1, top_k)
        ids2[:, rng.integers(1, top_k)] = ids2[:, 0]
        ids = ids2.reshape(-1)
    out = ids.astype(dtype)
    kinds = rng.random(count)
    if info.min < 0:
        skipped = np.flatnonzero(kinds < skip_rate)
        out[skipped] = _skip_values(dtype, rng, skipped.size).astype(dtype)
    invalid = np.flatnonzero((kinds >= skip_rate) & (kinds < skip_rate + invalid_rate))
    values = _invalid_values(dtype, num_experts, rng, invalid.size)
    if values.size:
        out[invalid] = values.astype(dtype)
    return out.reshape(shape)


@dataclass
class Routing:
    """One drawn routing: the MLX inputs of `moe_plan` and their NumPy values."""

    indices: mx.array  # possibly a non-contiguous view
    ids: np.ndarray  # the same values, for the reference
    num_experts: int
    tile_m: int
    weights: mx.array | None  # possibly a non-contiguous view, float32/16/bfloat16
    weight_values: np.ndarray | None  # their exact float32 values
    layout: str
    seed: int

    @property
    def token_shape(self) -> tuple:
        return self.ids.shape[:-1]

    @property
    def num_tokens(self) -> int:
        return int(np.prod(self.token_shape))

    @property
    def top_k(self) -> int:
        return self.ids.shape[-1]

    def plan(self, device, **kwargs) -> mlx_moe_plan.MoEPlan:
        return mlx_moe_plan.moe_plan(
            self.indices, self.num_experts, weights=self.weights, tile_m=self.tile_m,
            stream=device, **kwargs,
        )

    def reference_plan(self) -> ref.ReferencePlan:
        return ref.moe_plan(self.ids, self.num_experts, weights=self.weight_values,
                            tile_m=self.tile_m)


def experts_strategy(max_experts: int = mlx_moe_plan.MAX_EXPERTS):
    """E from 1 to the limit, weighted towards small E (many collisions) and the ends."""
    return st.one_of(
        st.integers(min(2, max_experts), min(8, max_experts)),
        st.integers(1, max_experts),
        st.sampled_from(sorted({1, 2, max_experts})),
        st.sampled_from(sorted({min(e, max_experts) for e in (16, 60, 128, 256, 512)})),
    )


def token_shapes_strategy(max_tokens: int):
    """Leading shapes: [T], [B, L], none ([K] alone: one token) and, about one
    draw in seven, no tokens at all (T = 0)."""
    tokens = st.tuples(st.integers(1, max_tokens))
    batches = st.tuples(st.integers(1, 4), st.integers(1, max(1, max_tokens // 4)))
    empty = st.sampled_from([(0,), (0, 3), (2, 0)])
    return st.one_of(tokens, tokens, batches, batches, tokens, st.just(()), empty)


@st.composite
def routings(
    draw,
    max_tokens: int = 64,
    max_k: int = 16,
    max_experts: int = mlx_moe_plan.MAX_EXPERTS,
    max_tile_m: int = 128,
    index_dtypes=INDEX_DTYPES,
    weights: str = "maybe",  # "maybe", "always" or "never"
    weight_dtypes=FLOAT_NAMES,
):
    """Routings covering docs/DESIGN.md's cases: K from 1 to 16, E from 1 to the limit,
    skipped (-1 and other negative) and invalid ids, duplicate experts in a token,
    T = 0, one expert owning every entry, tile_m from 1 to 128, leading shapes
    [K], [T, K] and [B, L, K], every index dtype, non-contiguous views, and
    weights in every float dtype or none."""
    top_k = draw(st.one_of(st.sampled_from([1, 2]), st.integers(1, max_k),
                           st.sampled_from(sorted({min(k, max_k) for k in (4, 8, 10, 16)}))))
    token_shape = draw(token_shapes_strategy(max_tokens))
    shape = token_shape + (top_k,)
    num_experts = draw(experts_strategy(max_experts))
    tile_m = draw(st.one_of(st.just(1), st.integers(1, max_tile_m),
                            st.sampled_from([m for m in (4, 16, 32, 64, 128) if m <= max_tile_m])))
    index_dtype = draw(st.sampled_from(index_dtypes))
    mode = draw(st.sampled_from(["uniform", "uniform", "one_expert", "few_experts",
                                 "distinct_per_token", "duplicates"]))
    skip_rate = draw(st.sampled_from([0.0, 0.1, 0.3, 0.5, 1.0]))
    invalid_rate = draw(st.sampled_from([0.0, 0.05, 0.2, 0.5]))
    invalid_rate = min(invalid_rate, 1.0 - skip_rate)
    layout = draw(st.sampled_from(LAYOUTS))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)

    ids = make_ids(rng, shape, num_experts, index_dtype, mode, skip_rate, invalid_rate)
    indices = with_layout(ids, layout, rng)

    with_weights = weights == "always" or (weights == "maybe" and draw(st.booleans()))
    weight_array = weight_values = None
    if with_weights:
        weight_dtype = FLOAT_DTYPES[draw(st.sampled_from(weight_dtypes))]
        raw = rng.standard_normal(shape).astype(np.float32)
        weight_array = float_with_layout(raw, weight_dtype, layout, rng)
        weight_values = as_float32(weight_array)
    return Routing(indices, ids, num_experts, tile_m, weight_array, weight_values, layout, seed)


# --- the plan, field by field --------------------------------------------------

ARRAY_FIELDS = ref.PLAN_ARRAY_FIELDS  # the tests import these from here
SCALAR_FIELDS = ref.PLAN_SCALAR_FIELDS


def assert_plan_matches(plan: mlx_moe_plan.MoEPlan, expected: ref.ReferencePlan) -> None:
    """Every field of `plan` equals the reference's, bit for bit and type for type."""
    problem = ref.plan_mismatch(plan, expected)
    if problem:
        raise AssertionError(problem)


# --- the grouped GEMM (kernels/grouped_qmm.h): float tolerance, not bits -----------


def quantized_experts(rng, num_experts, out_dims, in_dims, bits, group_size, name):
    """Random packed weights (every field value) and normal scales and biases."""
    words = in_dims * bits // 32
    weight = rng.integers(0, 2**32, (num_experts, out_dims, words), dtype=np.uint64)
    groups = (num_experts, out_dims, in_dims // group_size)
    scales = ref.from_float32((rng.standard_normal(groups) * 0.05).astype(np.float32), name)
    biases = ref.from_float32((rng.standard_normal(groups) * 0.05).astype(np.float32), name)
    return weight.astype(np.uint32), scales, biases


def grouped_qmm_case(rng, counts, out_dims, in_dims, bits, group_size, name, tail):
    """The inputs of one grouped GEMM: experts with `counts` rows each, then
    `tail` tail rows. Returns expert_offsets, weight, scales, biases, rows
    (stored as `name`, bfloat16 as its bits) and row_experts."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    capacity = int(offsets[-1]) + tail
    weight, scales, biases = quantized_experts(rng, len(counts), out_dims, in_dims, bits,
                                               group_size, name)
    rows = ref.from_float32(rng.standard_normal((capacity, in_dims)).astype(np.float32), name)
    experts = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    row_experts = np.concatenate([experts, np.full(tail, len(counts) - 1, np.int32)])
    return offsets, weight, scales, biases, rows, row_experts


# The block tiles with the weights made 16-bit in shared memory
# (SHARED_WEIGHTS): the rule's block (launch.SHARED_WEIGHTS_TILING: 128 rows,
# one 16-column tile a matrix a warp, 3 stages) at 4 warps side by side and
# 64 values a stage.
SHARED_WEIGHTS_BLOCK = dict(launch.SHARED_WEIGHTS_TILING, block_column_warps=4,
                            block_stage_values=64)
# The row tiles only the made weights' block takes, past the register
# form's (wgmma's N of 8 times as many): the tests of those widths take them
# from here.
OTHER_MADE_WEIGHTS_ROW_TILES = tuple(sorted(set(launch.SHARED_WEIGHTS_ROW_TILES)
                                            - set(launch.WARPGROUP_ROW_TILES)))
# `block_min_groups` at every block's rows and input, not only where the
# tiling takes it (of 4-bit weights: `launch.MIN_GROUPS_BITS`): the tests and
# the recorded launches of the bound block take it from here.
EVERY_SIZE_MIN_GROUPS = dict(block_min_groups_up_to_rows=1 << 20,
                             block_min_groups_up_to_in_dims=1 << 20)


@st.composite
def grouped_qmm_cases(draw):
    """`check_grouped_qmm`'s arguments after `run`, the rng as its seed:
    experts without rows, with one, with more than a pass of 8 rows (and no
    rows at all); columns past a group's last; one to four quantization
    groups a row (one load's STEPS, 1, or more); tail rows."""
    counts = draw(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 20)), min_size=1,
                           max_size=6))
    out_dims = draw(st.one_of(st.sampled_from([1, 7, 8, 9]), st.integers(1, 40)))
    group_size = draw(st.sampled_from(launch.GROUPED_QMM_QUANT_GROUPS))
    in_dims = draw(st.integers(1, 4)) * group_size
    bits = draw(st.sampled_from(launch.GROUPED_QMM_BITS))
    name = draw(st.sampled_from(launch.GROUPED_QMM_DTYPES))
    tail = draw(st.integers(0, 9))
    seed = draw(st.integers(0, 2**32 - 1))
    return seed, counts, out_dims, in_dims, bits, group_size, name, tail


def check_grouped_qmm(run, rng, counts, out_dims, in_dims, bits, group_size, name, tail):
    """One grouped GEMM of `grouped_qmm_case`'s inputs through `run`: its
    output in the rows' dtype, a row each, within `assert_gemm_close` of the
    float64 reference.

    Args:
        run: The implementation, `run(offsets, weight, scales, biases, rows,
          row_experts, bits, group_size, name)`, returning an MLX array or
          NumPy rows as the reference stores them.
        rng, counts, out_dims, in_dims, bits, group_size, name, tail:
          `grouped_qmm_case`'s.
    """
    case = grouped_qmm_case(rng, counts, out_dims, in_dims, bits, group_size, name, tail)
    offsets, weight, scales, biases, rows, _ = case
    out, out_name = stored(run(*case, bits, group_size, name))
    assert out_name == name and out.shape == (rows.shape[0], out_dims)
    assert_gemm_close(out, rows, weight, scales, biases, offsets, bits, group_size, name)


def token_rows(tokens: np.ndarray, row_tokens: np.ndarray) -> np.ndarray:
    """The rows a plan's `row_tokens` make of `tokens`, zeros where -1 (the
    rows grouped_qmm reads with TOKEN_ROWS)."""
    rows = tokens[np.maximum(row_tokens, 0)]
    rows[row_tokens < 0] = 0
    return rows


def grouped_qmm_by_mlx_ops(rows, weight, scales, biases, expert_offsets, row_experts, *,
                           bits, group_size, row_tokens=None, up=None, bias=None,
                           up_bias=None, clamped_swiglu=None, dense=False) -> mx.array:
    """What grouped_qmm computes (`GpuBackend.grouped_qmm`'s arguments), in
    MLX's ops: with `row_tokens`, each row the token it names clamped into the
    tokens and the tail rows past `expert_offsets[-1]` zeros; each
    projection's `bias` and `up_bias` added; with `up`, silu(gate) * up (or
    the `clamped_swiglu`). A stand-in for the kernel where no GPU runs it,
    and MLX's unfused ops for the fused form's gradient (`dense` shapes only
    the kernel's launch, not what it computes)."""
    if row_tokens is not None:
        tokens = mx.clip(row_tokens, 0, rows.shape[0] - 1)
        in_spans = mx.arange(row_tokens.shape[0]) < expert_offsets[-1]
        rows = mx.where(in_spans[:, None], rows[tokens], 0)

    def project(weight, scales, biases, bias):
        # [rows, 1, D] by reshape: see nn.SwitchGLU._expert_rows_used.
        out = mx.gather_qmm(rows.reshape(-1, 1, rows.shape[-1]), weight, scales, biases,
                            rhs_indices=row_experts, transpose=True, group_size=group_size,
                            bits=bits, sorted_indices=True)
        out = out.reshape(rows.shape[0], out.shape[-1])
        if bias is None:
            return out
        in_spans = mx.arange(out.shape[0]) < expert_offsets[-1]  # the tail rows: zeros
        return out + mx.where(in_spans[:, None], bias[row_experts], 0)

    out = project(weight, scales, biases, bias)
    return out if up is None else \
        mlx_lm_activation(out, project(*up, up_bias), clamped_swiglu)


def mlx_lm_activation(gate, up, clamped_swiglu=None):
    """mlx-lm's own activation of a gate and an up projection's outputs:
    SwiGLU's silu(gate) * up, or with `clamped_swiglu` (alpha, limit)
    gpt-oss's `swiglu_oai`: what the fused kernel computes, written apart
    from the package's own `_gpu.gated_activation` so each checks the other."""
    from mlx_lm.models import activations, switch_layers

    # The modules as mlx-lm's SwitchGLU calls them: activation(x_up, x_gate).
    if clamped_swiglu is None:
        return switch_layers.SwiGLU()(up, gate)
    alpha, limit = clamped_swiglu
    return activations.SwigluOAI(alpha=alpha, limit=limit)(up, gate)


def assert_gemm_close(actual, rows, weight, scales, biases, offsets, bits, group_size, name, *,
                      up=None, out_biases=None, clamped_swiglu=None):
    """`actual` within the rounding of a float32 sum and of `name` of the
    float64 reference, and zeros on the tail rows. With `out_biases`, each
    projection's bias [E, out] (the gate's, then up's) added to its sums.
    With `up`, the (weight, scales, biases) of a second projection, `actual`
    is silu(gate) * up of the two projections' float sums, or gpt-oss's
    `clamped_swiglu` (alpha, limit) of them."""
    def absolute(values):
        return ref.from_float32(np.abs(ref.to_float32(values, name)), name)

    row_experts = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))

    def gemm(weight, scales, biases, bias):
        """The reference's sums (and the bias of each row's expert), and the
        bound on a float32 sum's error: the sum of the terms' magnitudes (the
        kernel sums scale * q * x and bias * x apart, so the terms are those:
        the reference's GEMM of the absolute rows, scales and biases, exact
        in every dtype), and a float32 rounding of the bias's addition."""
        sums = ref.grouped_qmm(rows, weight, scales, biases, offsets, bits, group_size, name)
        magnitude = ref.grouped_qmm(absolute(rows), weight, absolute(scales), absolute(biases),
                                    offsets, bits, group_size, name)
        error = (rows.shape[1] + 8) * 2.0**-24 * magnitude
        if bias is not None:
            row_bias = np.zeros_like(sums)
            row_bias[:len(row_experts)] = ref.to_float32(bias, name)[row_experts]
            sums = sums + row_bias
            error = error + 2.0**-24 * (np.abs(sums) + np.abs(row_bias))
        return sums, error, magnitude

    gate_bias, up_bias = (None, None) if out_biases is None else (out_biases[0], out_biases[-1])
    expected, sum_error, magnitude = gemm(weight, scales, biases, gate_bias)
    if up is not None:
        gate, gate_error, gate_magnitude = expected, sum_error, magnitude
        up_sums, up_error, up_magnitude = gemm(*up, up_bias)
        if clamped_swiglu is None:
            silu = gate / (1 + np.exp(-gate))
            expected = silu * up_sums
            # silu's slope is within [-0.1, 1.1].
            gate_slope, up_slope = 1.1 * np.abs(up_sums), np.abs(silu)
        else:
            alpha, limit = clamped_swiglu
            clamped_gate = np.minimum(gate, limit)
            glu = clamped_gate / (1 + np.exp(-alpha * clamped_gate))
            linear = np.clip(up_sums, -limit, limit) + 1
            expected = linear * glu
            # g * sigmoid(alpha g)'s slope is within [-0.1, 1.1] for every
            # alpha (silu's, of alpha g); the clamps only flatten it.
            gate_slope, up_slope = 1.1 * np.abs(linear), np.abs(glu)
        # The activation's float evaluation (exp, a division, products): a
        # few ulps of float32.
        # Both sums off at once: the slopes' bound times the product of the errors.
        sum_error = (gate_slope * gate_error + up_slope * up_error + 1.1 * gate_error * up_error
                     + 2.0**-20 * (np.abs(gate) + 1) * (np.abs(up_sums) + 1))
    unit = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}[name]
    if launch.grouped_qmm_body(len(actual), len(offsets) - 1) == "grouped_qmm_tiles":
        # grouped_qmm_tiles.h multiplies weights rounded to the rows' format
        # (scale * q + bias rounded once): each term off by a unit at most.
        sum_error = sum_error + unit * (magnitude if up is None else
                                        gate_slope * gate_magnitude + up_slope * up_magnitude)
    values = ref.to_float32(np.asarray(actual), name).astype(np.float64)
    assert np.isfinite(values).all(), "an unwritten (poisoned) or overflowed element"
    # Rounding below the normal range is absolute: half the least subnormal.
    least = {"float32": 2.0**-150, "float16": 2.0**-25, "bfloat16": 2.0**-134}[name]
    tolerance = unit * np.abs(expected) + sum_error + least
    worst = np.max(np.abs(values - expected) - tolerance, initial=-1.0)
    assert worst <= 0, f"max excess over tolerance {worst}"
    assert (values[offsets[-1]:] == 0).all(), "tail rows must be zeros"


# --- an attention's queries and keys, normalized and rotated (head_norm_rope) ---

# Relative precision of each row dtype: a value rounds to within half of it.
_PRECISION = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def head_norm_rope_tolerance(expected: np.ndarray, positions: np.ndarray, name: str,
                             scale: float) -> np.ndarray:
    """How far a backend's queries or keys `[batch, heads, length, head_dim]`
    may lie from the reference's, a bound a head: three roundings of its
    largest value (a normalized value may round the other way on a float32
    sum, and the rotation's result once more), and the angle's float32 error
    (its factor's and product's roundings, the sine's and cosine's), which
    grows with the position (`positions` `[batch, length]`)."""
    largest = 2 * np.abs(ref.to_float32(expected, name)).max(axis=-1, keepdims=True)
    angle = 2.0 ** -24 * (8 + 8 * np.abs(positions * scale))[:, None, :, None]
    return largest * (3 * _PRECISION[name] + angle)


def check_head_norm_rope(actual, expected, positions, name: str, scale: float) -> None:
    """Each of `actual`'s queries and keys (NumPy, stored as `name`) within
    `head_norm_rope_tolerance` of `expected`'s."""
    for got, want in zip(actual, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        error = np.abs(ref.to_float32(got, name) - ref.to_float32(want, name))
        bound = head_norm_rope_tolerance(want, positions, name, scale)
        assert np.all(error <= bound), (error.max(), np.unravel_index(
            np.argmax(error - bound), error.shape))


# --- a decoding step's attention (decode_attention) -----------------------------------

def decode_attention_by_ops_launched(backend, batch, heads, kv_heads, head_dim, dtype,
                                     has_sinks, has_mask, scale, poison, stream):
    """A stand-in for `_gpu._decode_attention_launched` on the CPU: the
    launches of these sizes computed by MLX's attention, called as the glue
    calls them (`_gpu._decode_attention_by_ops_bound`)."""
    from mlx_moe_plan import _gpu

    return _gpu._decode_attention_by_ops_bound(has_sinks, has_mask, scale, stream)


def check_decode_attention(actual, expected, values, name: str) -> None:
    """`actual` (NumPy or MLX `[batch, heads, 1, head_dim]`, stored as `name`)
    within the kernel's rounding of `expected` (the float64 reference): each
    softmax weight rounded to `name` before it multiplies the values (a
    relative error of the format's precision eps, so at most eps times the
    largest value a sum weighs), the output rounded once (eps |expected|),
    and the float32 sums' own error, small beside both; twice that bound."""
    actual = ref.to_numpy(actual) if isinstance(actual, mx.array) else np.asarray(actual)
    assert actual.shape == expected.shape
    eps = 2.0 ** -8 if name == "bfloat16" else 2.0 ** -11
    largest = np.abs(ref.to_float32(np.asarray(values), name)).max()
    error = np.abs(ref.to_float32(actual, name) - expected)
    bound = 2 * eps * (largest + np.abs(expected)) + 1e-6
    assert np.all(error <= bound), (error.max(), np.unravel_index(
        np.argmax(error - bound), error.shape))


# --- a residual add and the RMS norm after it (add_rms_norm) -------------------------

def check_add_rms_norm(actual, expected, name: str) -> None:
    """`actual`'s sums (NumPy or MLX, stored as `name`) bit for bit `expected`'s,
    and its normed rows within two units in the last place of a row's largest
    value (the normalized value may round the other way on a float32 sum,
    and its product with the weight once more; a unit is at most twice the
    dtype's precision times the value), and that sum's own float32 error
    (its additions, fewer than a row's values, and the square root's)."""
    (sums, normed), (want_sums, want_normed) = actual, expected
    assert_bitwise(sums, want_sums, "sums")
    normed = ref.to_numpy(normed) if isinstance(normed, mx.array) else np.asarray(normed)
    assert normed.dtype == want_normed.dtype and normed.shape == want_normed.shape
    wanted = ref.to_float32(want_normed, name)
    error = np.abs(ref.to_float32(normed, name) - wanted)
    sum_error = 2.0 ** -24 * (8 + want_normed.shape[-1])
    bound = 2 * np.abs(wanted).max(axis=-1, keepdims=True) * (2 * _PRECISION[name] + sum_error)
    assert np.all(error <= bound), (error.max(), np.unravel_index(np.argmax(error - bound),
                                                                  error.shape))
