/* A tar archive's regular files found by reading its headers in place: ImageLoader indexes
 * WebDataset shards with it (pinloader/_image_sources.py). No Python. */
#ifndef PL_TAR_INDEX_H
#define PL_TAR_INDEX_H

#include <stddef.h>
#include <stdint.h>

/* One regular file of the archive: its name, the prefix_len bytes at p + prefix_off then (when
 * prefix_len > 0) a '/' and the name_len bytes at p + name_off (a ustar header's name field, or
 * the pax or GNU long-name record that named it), and its data (size bytes at p + data_off). */
typedef struct pl_tar_member {
    int64_t prefix_off, prefix_len;
    int64_t name_off, name_len;
    int64_t data_off, size;
} pl_tar_member;

/* Calls add(ctx, &member) for each regular file of the n-byte archive at p, in order; stops at
 * the end-of-archive block (or the end of the bytes on a block boundary). Returns 0, -1 when
 * add returned nonzero, or 1 with *why set (static text) and *where the header's offset when
 * the archive is malformed (a bad checksum, a size that runs past the end, a bad pax record).
 * Reads only p[0, n). */
int pl_tar_scan(const unsigned char *p, size_t n, int (*add)(void *ctx, const pl_tar_member *m),
                void *ctx, const char **why, int64_t *where);

#endif
