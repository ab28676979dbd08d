// tiles_end: a text grouped_qmm_tiles.h includes, not a body. An item's
// end, item `item` of its run, its places at `slot` of the ring
// `item_places`: its sums, finished, stored (qmm_store.h). The body includes
// it after each item's steps (with ACROSS_ITEMS, the next item's first
// stages in flight meanwhile).
if (WARPGROUP) {
  WARPGROUP_WAIT(0, sums, TILES * ROW_TILES * 4);
}
const int input_split = item / block_items;
const int expert = item_places[slot];
const int last = item_places[slot + 2];
const int warp_row0 = item_places[slot + 1] + row_warp * 8 * ROW_TILES;
const int warp_column0 = (item % column_blocks) * BLOCK_COLUMNS + column_warp * 16 * COLUMN_TILES;
// include: qmm_store
