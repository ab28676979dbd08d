// qmm_params: a text the bodies include, not a body. grouped_qmm.h and
// grouped_qmm_tiles.h take the same params (launch.GroupedQmmParams, in its
// order) and split a warp's lanes as the multiply-add's fragments do, and
// say `// include: qmm_params` where kernels.compact puts this text.
const int num_experts = params[0];
const int in_dims = params[1];
const int out_dims = params[2];
const int capacity = params[3];
const int column_blocks = params[4];
const int num_rows = params[5];

const int row_groups = in_dims / QUANT_GROUP;
const int row_words = in_dims / VALUES;
const int lane = LOCAL_ID % 32;
const int warp = LOCAL_ID / 32;
const int fragment_row = lane / 4;  // PTX's groupID
const int fragment_slot = lane % 4;  // PTX's threadID_in_group
