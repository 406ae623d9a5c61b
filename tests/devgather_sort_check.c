/* The pair table of the device gather (src/core/devgather.c) against its contract:
 * - pl_gather_sort on every path it has (few pairs, packed keys, wide offsets), both
 *   directions: every slot once, each row its slot's, rows in order, ties by slot;
 * - pl_gather_stage_edges (over a sorted table) and pl_gather_fill_in_order (the table in batch
 *   order), with repeated edge rows: pair i of an in-order table is slot i, every pair of an
 *   item outside the registered range names a staged copy holding that item's bytes, each
 *   distinct edge item is staged once, the other pairs name their row, and a cap below the
 *   distinct edges is refused.
 * Compiled and run by tests/test_device_gather.py. */
#include "devgather.h"
#include <stdio.h>
#include <stdlib.h>
/* the registry's dependencies, unused by the sort */
size_t pl_pool_shared_cap(void){return 0;}
size_t pl_page_size(void){return 4096;}
_Atomic uint32_t pl_process_generation; /* util.h's, without util.c */
void pl_mutex_reset_in_child(pthread_mutex_t *m){(void)m;}
int main(void){
  int64_t sizes[] = {1, 2, 63, 64, 65, 1000, 8192, 70000};
  srand(5); int bad = 0;
  for (int s = 0; s < 8; s++) for (int wide = 0; wide < 3; wide++) for (int desc = 0; desc < 2; desc++) {
    int64_t n = sizes[s]; int64_t *rows = malloc(n*8); pl_gather_pair *out = malloc(n*16);
    for (int64_t i=0;i<n;i++) { int64_t r = rand() % (wide==0 ? 50 : 1000000); rows[i] = wide==2 ? r * (INT64_C(1) << 40) : r; }
    pl_gather_sort(rows, n, desc, out);
    char *seen = calloc((size_t)n, 1);
    for (int64_t i=0;i<n;i++){ if (out[i].slot<0||out[i].slot>=n||seen[out[i].slot]) bad++; else seen[out[i].slot]=1;
      if (rows[out[i].slot]!=out[i].row) bad++;
      if (i){ int64_t a=out[i-1].row,b=out[i].row; if (desc? a<b : a>b) bad++; if (a==b && out[i-1].slot>out[i].slot) bad++; } }
    free(seen); free(rows); free(out);
  }
  /* edges: R rows of 24 bytes, rows [in0, in1) inside [lo, hi), the others edge items: a few
   * (40 rows, 3-37 inside), or more than the 64 the in-order fill keeps on its stack */
  enum { RMAX = 200, SPAN = 24, N = 600 };
  static char src[RMAX * SPAN], edge[RMAX * SPAN];
  for (int i = 0; i < RMAX * SPAN; i++) src[i] = (char)(i * 7 + 3);
  const int configs[2][3] = {{40, 3, 37}, {200, 100, 110}};
  for (int c = 0; c < 2; c++) for (int sorted = 0; sorted < 2; sorted++) for (int cap_short = 0; cap_short < 2; cap_short++) {
    const int R = configs[c][0], in0 = configs[c][1], in1 = configs[c][2];
    const char *lo = src + in0 * SPAN, *hi = src + in1 * SPAN;
    int64_t rows[N]; pl_gather_pair t[N];
    for (int i = 0; i < N; i++) rows[i] = rand() % R;
    int distinct = 0;
    for (int r = 0; r < R; r++) { int any = 0; for (int i = 0; i < N; i++) any |= rows[i] == r; if (any && (r < in0 || r >= in1)) distinct++; }
    int64_t cap = cap_short ? distinct - 1 : distinct, k;
    if (sorted) { pl_gather_sort(rows, N, 0, t); k = pl_gather_stage_edges(t, N, src, SPAN, SPAN, lo, hi, edge, cap); }
    else { k = pl_gather_fill_in_order(rows, N, t, src, SPAN, SPAN, lo, hi, edge, cap);
           for (int i = 0; k >= 0 && i < N; i++) if (t[i].slot != i) bad++; }
    if (cap_short) { if (k != -1) bad++; continue; }
    if (k != distinct) bad++;
    for (int i = 0; i < N; i++) {
      int64_t want = rows[t[i].slot];
      const char *item = t[i].row >= 0 ? src + t[i].row * SPAN : edge + (-1 - t[i].row) * SPAN;
      if (t[i].row >= 0 ? (t[i].row != want || want < in0 || want >= in1) : (-1 - t[i].row >= k)) { bad++; continue; }
      for (int b = 0; b < SPAN; b++) if (item[b] != src[want * SPAN + b]) { bad++; break; }
    }
  }
  printf("bad=%d\n", bad); return bad != 0;
}
