// add_rms_norm: a decoder layer's residual add and the RMS norm after it, in
// one launch: sums = residual + update, the sum mlx-lm's layer carries on, and
// normed = rms_norm(sums, weight, eps), the next block's input. mlx-lm makes
// them with an add and mx.fast.rms_norm, two launches; a Qwen3-MoE layer
// makes two such pairs (after its attention, and after its MoE block with
// the next layer's input norm), which fused_model.py makes one launch each.
// A group makes one row. Its thread t takes the row's values t, t + THREADS,
// ... (neighbouring threads, neighbouring values), each sum rounded to the
// rows' type as MLX's add rounds it (a float32 sum of two 16-bit values
// rounds to the nearest 16-bit value as the exact sum would), and adds their
// squares in that order; the threads' sums then meet in a fixed tree (fixed
// order, fixed bits; MLX's rms_norm sums in another order, so the normalizers
// may differ in their last bits, and a normalized value round the other way).
// The normalized values round as MLX's CUDA rms_norm.cu rounds them: the value
// times the normalizer, rounded to the rows' type, times the weight, rounded
// again. (MLX's Metal rms_norm takes a precise rsqrt where this takes the
// language's own: rules.fuses_add_rms_norm takes this launch on CUDA only.)
// The second pass reads back the sums the thread itself stored: one load
// where the inputs are two.
// Inputs: residual InT [rows, dims], update InT [rows, dims], norm_weight InT
//   [dims], params int32, the fields of launch.py's AddRmsNormParams in order
//   (read below; the epsilon as its float32 bits).
// Outputs: sums OutT [rows, dims], normed OutT [rows, dims].
// Template constants: InT, OutT (InT), THREADS (the group's size, a power of
//   two).
const int rows = params[0];
const int dims = params[1];
const float eps = BITS_TO_FLOAT(params[2]);
SHARED float thread_squares[THREADS];

for (int row = GROUP_ID; row < rows; row += NUM_GROUPS) {
  const i64 at = (i64)row * dims;
  float squares = 0.0f;
  for (int i = LOCAL_ID; i < dims; i += THREADS) {
    const float sum = ROUND_OUT(ADD_RN(LOAD_IN(residual, at + i), LOAD_IN(update, at + i)));
    STORE_OUT(sums, at + i, sum);
    squares = ADD_RN(squares, MUL_RN(sum, sum));
  }
  thread_squares[LOCAL_ID] = squares;
  BARRIER();
  for (int span = THREADS / 2; span > 0; span /= 2) {  // not `half`: a type in OpenCL and MSL
    if ((int)LOCAL_ID < span) {
      thread_squares[LOCAL_ID] = ADD_RN(thread_squares[LOCAL_ID], thread_squares[LOCAL_ID + span]);
    }
    BARRIER();
  }
  const float normalizer = rsqrt(ADD_RN(thread_squares[0] / (float)dims, eps));
  BARRIER();  // the next row's squares overwrite these
  for (int i = LOCAL_ID; i < dims; i += THREADS) {
    const float sum = LOAD_IN(sums, at + i);
    const float weight_value = LOAD_IN(norm_weight, i);
    STORE_OUT(normed, at + i, MUL_RN(weight_value, ROUND_OUT(MUL_RN(sum, normalizer))));
  }
}
