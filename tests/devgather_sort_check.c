/* The pair-table sort of the device gather (pl_gather_sort, src/core/devgather.c) against its
 * contract on every path it has (few pairs, packed keys, wide offsets), both directions:
 * every slot once, each row its slot's, rows in order, ties by slot. Compiled and run by
 * tests/test_device_gather.py. */
#include "devgather.h"
#include <stdio.h>
#include <stdlib.h>
/* the registry's dependencies, unused by the sort */
size_t pl_pool_shared_cap(void){return 0;}
size_t pl_page_size(void){return 4096;}
uint32_t pl_generation(void){return 0;}
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
  printf("bad=%d\n", bad); return bad != 0;
}
