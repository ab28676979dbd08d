// group_scan: a text the bodies include, not a body. plan.h, grouped_qmm.h
// and grouped_qmm_tiles.h each turn one count a thread into running totals
// the same way, and say `// include: group_scan` where kernels.compact puts
// this text.
// It reads `scan_value`, this thread's count, and `scan_threads`, the threads
// that take part (the group's first ones; a bound the same for the whole
// group, so every thread meets every barrier), and leaves in the body's
// SHARED int group_scan[] the inclusive scan (Hillis-Steele): group_scan[t]
// is the sum of threads 0 to t's counts, for t below scan_threads.
group_scan[LOCAL_ID] = scan_value;
BARRIER();
for (int step = 1; step < scan_threads; step *= 2) {
  const int preceding = LOCAL_ID >= step ? group_scan[LOCAL_ID - step] : 0;
  BARRIER();
  group_scan[LOCAL_ID] += preceding;
  BARRIER();
}
