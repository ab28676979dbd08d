const unsigned LOCAL_ID = get_local_id(0);
const unsigned GROUP_ID = get_group_id(0);
const unsigned GROUP_SIZE = get_local_size(0);
const unsigned NUM_GROUPS = get_num_groups(0);
