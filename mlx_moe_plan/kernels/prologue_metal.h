const unsigned LOCAL_ID = thread_index_in_threadgroup;
const unsigned GROUP_ID = threadgroup_position_in_grid.x;
const unsigned GROUP_SIZE = threads_per_threadgroup.x;
const unsigned NUM_GROUPS = threadgroups_per_grid.x;
