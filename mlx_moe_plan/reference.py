"""NumPy reference of the semantics in docs/DESIGN.md.

Short, obvious code that every backend must match bit for bit. Nothing here
is fast: it is the definition the tests and the benchmark check against, with
the comparisons both apply (`bitwise_mismatch`, `plan_mismatch`). The
package's ops never import it, nor NumPy (tests/test_structure.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


def capacity_for(num_entries: int, num_experts: int, tile_m: int) -> int:
    """Rows a plan reserves: every entry, plus the worst-case padding.

    The reference's own statement of the formula; the package computes it in
    `mlx_moe_plan/_sizes.py`, and tests/test_plan.py checks both against a
    third, written out by hand.
    """
    if tile_m == 1:
        return num_entries
    worst = num_entries + min(num_experts, num_entries) * (tile_m - 1)
    return -(-worst // tile_m) * tile_m


@dataclass
class ReferencePlan:
    row_tokens: np.ndarray
    row_experts: np.ndarray
    row_weights: np.ndarray | None
    row_entries: np.ndarray
    positions: np.ndarray
    expert_counts: np.ndarray
    expert_offsets: np.ndarray
    tile_experts: np.ndarray
    num_rows: int
    num_tiles: int
    num_invalid: int
    num_experts: int
    tile_m: int
    capacity: int
    max_tiles: int
    top_k: int


def moe_plan(indices, num_experts: int, weights=None, tile_m: int = 1) -> ReferencePlan:
    indices = np.asarray(indices)
    top_k = indices.shape[-1]
    ids = indices.reshape(-1).astype(np.int64)
    num_entries = ids.size
    routed = (ids >= 0) & (ids < num_experts)
    num_invalid = int(np.count_nonzero(ids >= num_experts))

    counts = np.bincount(ids[routed], minlength=num_experts).astype(np.int32)
    spans = -(-counts // tile_m) * tile_m
    offsets = np.concatenate([[0], np.cumsum(spans)]).astype(np.int32)
    capacity = capacity_for(num_entries, num_experts, tile_m)
    max_tiles = capacity // tile_m
    num_rows = int(offsets[-1])

    row_tokens = np.full(capacity, -1, np.int32)
    row_entries = np.full(capacity, -1, np.int32)
    row_experts = np.full(capacity, num_experts - 1, np.int32)
    row_weights = None if weights is None else np.zeros(capacity, np.float32)
    positions = np.full(num_entries, -1, np.int32)

    next_row = offsets[:-1].copy()
    for entry in range(num_entries):  # ascending flat index: stable within an expert
        if routed[entry]:
            row = next_row[ids[entry]]
            next_row[ids[entry]] += 1
            positions[entry] = row
            row_tokens[row] = entry // top_k
            row_entries[row] = entry
    for expert in range(num_experts):  # padding rows carry their span's expert
        row_experts[offsets[expert] : offsets[expert + 1]] = expert
    if weights is not None:
        flat_weights = np.asarray(weights, np.float32).reshape(-1)
        used = positions >= 0
        row_weights[positions[used]] = flat_weights[used]

    num_tiles = num_rows // tile_m
    tile_experts = np.full(max_tiles, -1, np.int32)
    tile_experts[:num_tiles] = row_experts[: num_rows : tile_m][:num_tiles]

    return ReferencePlan(
        row_tokens=row_tokens,
        row_experts=row_experts,
        row_weights=row_weights,
        row_entries=row_entries,
        positions=positions.reshape(indices.shape),
        expert_counts=counts,
        expert_offsets=offsets,
        tile_experts=tile_experts,
        num_rows=num_rows,
        num_tiles=num_tiles,
        num_invalid=num_invalid,
        num_experts=num_experts,
        tile_m=tile_m,
        capacity=capacity,
        max_tiles=max_tiles,
        top_k=top_k,
    )


# Element conversions, rounding to nearest even like every backend.
def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values stored as `dtype` ("float32", "float16" or "bfloat16" as uint16 bits)."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype`; bfloat16 comes back as uint16 bits."""
    values = np.asarray(values, np.float32)
    if dtype != "bfloat16":
        return values.astype(dtype)
    bits = values.view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)


def moe_gather(x, plan: ReferencePlan, dtype: str | None = None, x_dtype: str | None = None):
    """`X[row] = x[row_tokens[row]]`, zeros on padding rows.

    `x` is a NumPy array (bfloat16 as uint16 bits with `x_dtype="bfloat16"`).
    """
    x_dtype = x_dtype or str(x.dtype)
    dtype = dtype or x_dtype
    tokens = np.asarray(x).reshape(-1, x.shape[-1])
    rows = np.zeros((plan.capacity, x.shape[-1]), np.float32)
    used = plan.row_tokens >= 0
    values = to_float32(tokens[plan.row_tokens[used]], x_dtype)
    rows[used] = values
    if dtype == x_dtype:  # a copy moves bits, NaN payloads included
        out = np.zeros((plan.capacity, x.shape[-1]), tokens.dtype)
        out[used] = tokens[plan.row_tokens[used]]
        return out
    return from_float32(rows, dtype)


def moe_combine(rows, plan: ReferencePlan, weights=None, rows_dtype: str | None = None,
                dtype: str | None = None):
    """`y[t] = sum_k w[t,k] * rows[positions[t,k]]`, float32, ascending k,
    rounded once to `dtype` (default: the rows' dtype)."""
    rows_dtype = rows_dtype or str(rows.dtype)
    positions = plan.positions.reshape(-1, plan.top_k)
    if weights is None:
        weights = np.zeros(positions.shape, np.float32)
        weights[positions >= 0] = plan.row_weights[positions[positions >= 0]]
    weights = np.asarray(weights, np.float32).reshape(positions.shape)
    values = to_float32(np.asarray(rows), rows_dtype)
    out = np.zeros((positions.shape[0], values.shape[-1]), np.float32)
    for k in range(plan.top_k):
        used = positions[:, k] >= 0
        term = weights[used, k][:, None] * values[positions[used, k]]
        out[used] = out[used] + term
    out = from_float32(out, dtype or rows_dtype)
    return out.reshape(plan.positions.shape[:-1] + (values.shape[-1],))


def moe_unsort(rows, plan: ReferencePlan):
    """Rows back to `[..., K, H]` order; zeros for skipped entries."""
    rows = np.asarray(rows)
    flat = plan.positions.reshape(-1)
    out = np.zeros((flat.size, rows.shape[-1]), rows.dtype)
    out[flat >= 0] = rows[flat[flat >= 0]]
    return out.reshape(plan.positions.shape + (rows.shape[-1],))


def dequantize(weight, scales, biases, bits: int, group_size: int,
               dtype: str = "float32") -> np.ndarray:
    """MLX's affine quantization undone, in float64: `[..., out, in]`.

    `weight` uint32 `[..., out, in * bits / 32]`, its `bits`-bit fields packed
    from each word's low bits up; `scales`, `biases` `[..., out, in /
    group_size]` stored as `dtype`. A value is `scale * q + bias`.
    """
    weight = np.asarray(weight, np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    q = (weight[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(*weight.shape[:-1], -1).astype(np.float64)
    scale = np.repeat(to_float32(np.asarray(scales), dtype).astype(np.float64), group_size, -1)
    bias = np.repeat(to_float32(np.asarray(biases), dtype).astype(np.float64), group_size, -1)
    return scale * q + bias


def grouped_qmm(rows, weight, scales, biases, expert_offsets, bits: int, group_size: int,
                dtype: str = "float32") -> np.ndarray:
    """`out[row] = rows[row] @ dequantize(weight[e]).T` for expert e's span of rows
    `[expert_offsets[e], expert_offsets[e + 1])`, zeros past the last span, in
    float64: a GEMM's sums are checked within float tolerance, not bit for bit.

    `rows` `[capacity, in]` and the scales and biases stored as `dtype`.
    """
    values = to_float32(np.asarray(rows), dtype).astype(np.float64)
    dense = dequantize(weight, scales, biases, bits, group_size, dtype)
    out = np.zeros((values.shape[0], dense.shape[-2]), np.float64)
    for expert in range(dense.shape[0]):
        first, last = int(expert_offsets[expert]), int(expert_offsets[expert + 1])
        out[first:last] = values[first:last] @ dense[expert].T
    return out


def argsort_slice(values, start: int, count: int, dtype: str = "float32") -> np.ndarray:
    """Positions `[start, start + count)` of each row's stable ascending argsort,
    NaN after every number and the two zeros equal, as MLX's GPU sort orders
    a row: uint32 `[rows, count]` of `values` `[rows, E]` stored as `dtype`."""
    keys = to_float32(np.asarray(values), dtype)
    return np.argsort(keys, axis=-1, kind="stable")[..., start:start + count].astype(np.uint32)


def normalized(picked, dtype: str = "float32") -> np.ndarray:
    """`picked` `[..., k]` stored as `dtype` over their sum, as a router that
    renormalizes its top k computes it: the sum in float32 over ascending
    positions, rounded to `dtype`, then each value over it, rounded to
    `dtype` (bfloat16 as uint16 bits)."""
    values = to_float32(np.asarray(picked), dtype)
    total = np.zeros(values.shape[:-1], np.float32)
    for position in range(values.shape[-1]):
        total = (total + values[..., position]).astype(np.float32)
    total = to_float32(from_float32(total, dtype), dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        return from_float32(values / total[..., None], dtype)


def _rms_norm(values: np.ndarray, weight, eps: float, dtype: str) -> np.ndarray:
    """`values` (float64, each a `dtype` value) RMS-normalized over the last
    axis as MLX's rms_norm rounds: the normalized value rounded to `dtype`,
    times the weight, rounded again; float64. The sum of squares is
    float64's (near exact), in no backend's float32 order."""
    normalizer = 1 / np.sqrt(np.mean(values * values, axis=-1, keepdims=True) + eps)
    weight = to_float32(np.asarray(weight), dtype).astype(np.float64)
    normed = to_float32(from_float32(values * normalizer, dtype), dtype).astype(np.float64)
    return to_float32(from_float32(weight * normed, dtype), dtype).astype(np.float64)


def head_norm_rope(queries_in, keys_in, q_weight, k_weight, offsets, q_heads: int,
                   k_heads: int, q_at: int, k_at: int, eps: float, base: float, scale: float,
                   dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """Qwen3's attention's queries and keys from its projections' outputs
    `[batch, length, values]` stored as `dtype`: each head's RMS norm with its
    weight (the normalized value rounded to `dtype`, times the weight,
    rounded), then non-traditional RoPE over the whole head at position
    `offsets[b or 0] + l` (the angle as float32 computes it, the rotation
    exact, rounded once), as `[batch, heads, length, head_dim]`. The norm's
    sum is float64's here: a backend's float32 sum may round a normalized
    value the other way (kernels/head_norm_rope.h)."""
    head_dim = np.asarray(q_weight).shape[-1]
    half = head_dim // 2
    queries_in, keys_in = np.asarray(queries_in), np.asarray(keys_in)
    batch, length, _ = queries_in.shape
    offsets = np.asarray(offsets, np.int64).reshape(-1)
    positions = offsets[:, None] + np.arange(length) if offsets.size > 1 else \
        np.broadcast_to(offsets[0] + np.arange(length), (batch, length))
    inv_freq = np.exp2((-(np.arange(half, dtype=np.float32) / np.float32(half)))
                       * np.float32(np.log2(np.float32(base)))).astype(np.float32)
    theta = (np.float32(scale) * positions.astype(np.float32))[..., None] * inv_freq
    cos, sin = np.cos(theta.astype(np.float64)), np.sin(theta.astype(np.float64))

    def heads(rows_in, at, count, weight):
        values = to_float32(rows_in[..., at:at + count * head_dim], dtype).astype(np.float64)
        normed = _rms_norm(values.reshape(batch, length, count, head_dim), weight, eps, dtype)
        first, second = normed[..., :half], normed[..., half:]
        c, s = cos[:, :, None], sin[:, :, None]
        rotated = np.concatenate([first * c - second * s, first * s + second * c], axis=-1)
        return from_float32(rotated.transpose(0, 2, 1, 3), dtype)

    return heads(queries_in, q_at, q_heads, q_weight), heads(keys_in, k_at, k_heads, k_weight)


def decode_attention(queries, keys, values, sinks, scale: float,
                     dtype: str = "bfloat16", mask=None) -> np.ndarray:
    """A decoding step's attention in float64: `queries` `[batch, heads, 1,
    head_dim]`, `keys` and `values` `[batch, kv_heads, keys, head_dim]` (query
    head h attends to key-value head h // (heads // kv_heads)), `sinks`
    `[heads]` or None (a logit a head with no value), all stored as `dtype`;
    `mask` bool, broadcast to `[batch, heads, 1, keys]`, false where a key is
    not attended, or None.
    Returns `[batch, heads, 1, head_dim]` float64, unrounded: the kernel rounds
    the softmax's weights to `dtype` before they multiply the values, and
    its float32 sums in its own order (kernels/decode_attention.h)."""
    q = to_float32(np.asarray(queries), dtype).astype(np.float64)
    k = to_float32(np.asarray(keys), dtype).astype(np.float64)
    v = to_float32(np.asarray(values), dtype).astype(np.float64)
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = scale * q @ k.swapaxes(-1, -2)  # [batch, heads, 1, keys]
    if mask is not None:
        scores = np.where(np.asarray(mask, bool), scores, -np.inf)
    if sinks is not None:
        sink = to_float32(np.asarray(sinks), dtype).astype(np.float64)
        scores = np.concatenate(
            [scores, np.broadcast_to(sink[None, :, None, None], scores.shape[:-1] + (1,))], -1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return weights[..., :k.shape[2]] @ v


# --- comparing an implementation with the reference, bit for bit ---------------
# The tests assert these; the benchmark checks the same before it times.


def to_numpy(array: mx.array) -> np.ndarray:
    """An MLX array as the reference takes it: bfloat16 as its raw uint16 bits."""
    if array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16))
    return np.array(array)


def _bits(values: np.ndarray) -> np.ndarray:
    """Floats as unsigned integers of their width, so that -0.0 differs from 0.0
    and NaN payloads count."""
    if values.dtype.kind in "fc" or values.dtype.kind == "V":
        return values.view(np.dtype(f"u{values.dtype.itemsize}"))
    return values


def bitwise_mismatch(actual, expected) -> str | None:
    """How `actual` differs from `expected` bit for bit, or None if it does not.

    Args:
        actual (array): An MLX array (read with `to_numpy`) or NumPy values.
        expected (array): The reference's NumPy values.

    Returns:
        str | None: The first difference found, in shape, dtype or bits (how many
        elements differ and the first of them), or None when they are equal.
    """
    actual_np = to_numpy(actual) if isinstance(actual, mx.array) else np.asarray(actual)
    expected = np.asarray(expected)
    if actual_np.shape != expected.shape:
        return f"shape {actual_np.shape} != {expected.shape}"
    if actual_np.dtype != expected.dtype:
        return f"dtype {actual_np.dtype} != {expected.dtype}"
    actual_bits, expected_bits = _bits(actual_np), _bits(expected)
    if np.array_equal(actual_bits, expected_bits):
        return None
    wrong = np.argwhere(actual_bits != expected_bits)
    first = tuple(int(i) for i in wrong[0])
    return (f"{len(wrong)} of {expected.size} elements differ; first at {first}: "
            f"got {actual_np[first]!r}, expected {expected[first]!r}")


PLAN_ARRAY_FIELDS = ("row_tokens", "row_experts", "row_entries", "positions", "expert_counts",
                     "expert_offsets", "tile_experts")
PLAN_SCALAR_FIELDS = ("num_rows", "num_tiles", "num_invalid")
PLAN_STATIC_FIELDS = ("num_experts", "tile_m", "capacity", "max_tiles", "top_k")


def plan_mismatch(plan, expected: ReferencePlan) -> str | None:
    """How a plan differs from the reference's, field by field, or None if it does not.

    Args:
        plan (MoEPlan): The plan `mlx_moe_plan.moe_plan` made.
        expected (ReferencePlan): The reference's plan of the same routing.

    Returns:
        str | None: The first field that differs, in type, dtype or bits, and
        how; None when every field equals the reference's.
    """
    for name in PLAN_STATIC_FIELDS:
        value = getattr(plan, name)
        if type(value) is not int:
            return f"{name}: a Python int, got {type(value).__name__}"
        if value != getattr(expected, name):
            return f"{name}: {value} != {getattr(expected, name)}"
    for name in PLAN_ARRAY_FIELDS:
        value = getattr(plan, name)
        if not isinstance(value, mx.array):
            return f"{name}: an mx.array, got {type(value).__name__}"
        if value.dtype != mx.int32:
            return f"{name}: dtype {value.dtype}"
        problem = bitwise_mismatch(value, getattr(expected, name))
        if problem:
            return f"{name}: {problem}"
    for name in PLAN_SCALAR_FIELDS:
        value = getattr(plan, name)
        if not isinstance(value, mx.array):
            return f"{name}: an mx.array, got {type(value).__name__}"
        if value.dtype != mx.int32 or value.shape != ():
            return f"{name}: {value.dtype} {value.shape}"
        if value.item() != getattr(expected, name):
            return f"{name}: {value.item()} != {getattr(expected, name)}"
    if expected.row_weights is None:
        return None if plan.row_weights is None else "row_weights: None without weights"
    if plan.row_weights is None:
        return "row_weights: missing"
    if plan.row_weights.dtype != mx.float32:
        return f"row_weights: dtype {plan.row_weights.dtype}"
    problem = bitwise_mismatch(plan.row_weights, expected.row_weights)
    return f"row_weights: {problem}" if problem else None


def add_rms_norm(residual, update, weight, eps: float,
                 dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """A decoder layer's residual add and the RMS norm after it, on `[..., dims]`
    stored as `dtype`: the sums rounded once to `dtype` (as the layer's add
    rounds them), then `_rms_norm` of them, each stored as `dtype`. The
    norm's sum is float64's here: a backend's float32 sum may round a
    normalized value the other way (kernels/add_rms_norm.h)."""
    sums = from_float32(to_float32(np.asarray(residual), dtype).astype(np.float64)
                        + to_float32(np.asarray(update), dtype), dtype)
    values = to_float32(sums, dtype).astype(np.float64)
    return sums, from_float32(_rms_norm(values, weight, eps, dtype), dtype)
