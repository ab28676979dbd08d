const unsigned LOCAL_ID = threadIdx.x;
const unsigned GROUP_ID = blockIdx.x;
const unsigned GROUP_SIZE = blockDim.x;
const unsigned NUM_GROUPS = gridDim.x;
