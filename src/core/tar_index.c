/* See tar_index.h. POSIX ustar headers, with the two extensions WebDataset writers use: pax
 * extended headers ('x', and Solaris tar's 'X', as tarfile reads them: "path" and "size"
 * records for the next member; global 'g' headers are skipped) and GNU long names ('L'). Sizes are octal, or GNU base-256 when the field's first
 * byte has its high bit set. Every header's checksum is verified, as tarfile does. */
#include "tar_index.h"

#include <string.h>

enum { BLOCK = 512 };

/* An octal (or base-256) number field; -1 if malformed. */
static int64_t number(const unsigned char *f, size_t len)
{
    if (f[0] & 0x80) { /* base-256, big-endian, the first byte's high bit a marker */
        if (f[0] != 0x80)
            return -1; /* negative, or too large */
        int64_t v = 0;
        for (size_t i = 1; i < len; i++) {
            if (v > (INT64_MAX >> 8))
                return -1;
            v = (v << 8) | f[i];
        }
        return v;
    }
    size_t i = 0;
    while (i < len && (f[i] == ' ' || f[i] == 0))
        i++;
    int64_t v = 0;
    int digits = 0;
    for (; i < len && f[i] >= '0' && f[i] <= '7'; i++, digits++) {
        if (v > (INT64_MAX >> 3))
            return -1;
        v = v * 8 + (f[i] - '0');
    }
    for (; i < len; i++)
        if (f[i] != ' ' && f[i] != 0)
            return -1;
    return digits ? v : 0;
}

static int checksum_ok(const unsigned char *h)
{
    int64_t want = number(h + 148, 8);
    int64_t u = 0, s = 0;
    for (int i = 0; i < BLOCK; i++) {
        unsigned c = (i >= 148 && i < 156) ? ' ' : h[i];
        u += c;
        s += (signed char)c; /* some old writers summed signed bytes */
    }
    return want >= 0 && (want == u || want == s);
}

static int all_zero(const unsigned char *h)
{
    for (int i = 0; i < BLOCK; i++)
        if (h[i])
            return 0;
    return 1;
}

/* The pax records of an 'x' header's data: "path" and "size" override the next member's. */
static int pax(const unsigned char *d, int64_t len, int64_t base, int64_t *name_off, int64_t *name_len,
               int64_t *size)
{
    int64_t i = 0;
    while (i < len) {
        int64_t rlen = 0, j = i;
        while (j < len && d[j] >= '0' && d[j] <= '9') {
            if (rlen > (INT64_MAX / 10) - 10)
                return -1;
            rlen = rlen * 10 + (d[j] - '0');
            j++;
        }
        if (j == i || j >= len || d[j] != ' ' || rlen <= j - i + 1 || rlen > len - i)
            return -1;
        int64_t end = i + rlen; /* the record's last byte is its newline */
        if (d[end - 1] != '\n')
            return -1;
        int64_t k = j + 1, eq = k;
        while (eq < end - 1 && d[eq] != '=')
            eq++;
        if (eq >= end - 1)
            return -1;
        int64_t vlen = end - 1 - (eq + 1);
        if (eq - k == 4 && memcmp(d + k, "path", 4) == 0) {
            *name_off = base + eq + 1;
            *name_len = vlen;
        } else if (eq - k == 4 && memcmp(d + k, "size", 4) == 0) {
            int64_t v = 0;
            if (vlen <= 0 || vlen > 18)
                return -1;
            for (int64_t t = eq + 1; t < end - 1; t++) {
                if (d[t] < '0' || d[t] > '9')
                    return -1;
                v = v * 10 + (d[t] - '0');
            }
            *size = v;
        }
        i = end;
    }
    return 0;
}

int pl_tar_scan(const unsigned char *p, size_t n, int (*add)(void *ctx, const pl_tar_member *m),
                void *ctx, const char **why, int64_t *where)
{
    int64_t pos = 0, end = (int64_t)n;
    int64_t next_name_off = -1, next_name_len = 0, next_size = -1;
    while (pos + BLOCK <= end) {
        const unsigned char *h = p + pos;
        *where = pos;
        if (all_zero(h))
            return 0; /* the end-of-archive block */
        if (!checksum_ok(h)) {
            *why = "a header's checksum does not match (not a tar archive, or a damaged one)";
            return 1;
        }
        int64_t size = number(h + 124, 12);
        if (size < 0) {
            *why = "a header's size field is malformed";
            return 1;
        }
        unsigned type = h[156];
        int own = (int)strnlen((const char *)h, 100);
        /* A pax size is the next member's, not that of another extension header between them.
         * Links, devices, FIFOs and directories (and, as tarfile reads old archives, a type-0
         * member whose name ends in '/') have no data blocks, whatever their size field says. */
        int ext = type == 'x' || type == 'X' || type == 'L' || type == 'g' || type == 'K';
        int no_data = (type >= '1' && type <= '6') || (type == 0 && own > 0 && h[own - 1] == '/');
        if (next_size >= 0 && !ext)
            size = next_size;
        if (no_data)
            size = 0;
        int64_t data = pos + BLOCK;
        if (size > end - data) {
            *why = "a member's data runs past the end of the archive (a truncated tar)";
            return 1;
        }
        /* In a chain of extension headers before one member, the first to name it (or to size
         * it) wins, as in tarfile, which WebDataset's readers use. */
        if (type == 'x' || type == 'X') {
            int64_t off = -1, len = 0, sz = -1;
            if (pax(p + data, size, data, &off, &len, &sz) < 0) {
                *why = "a pax extended header is malformed";
                return 1;
            }
            if (next_name_off < 0 && off >= 0) {
                next_name_off = off;
                next_name_len = len;
            }
            if (next_size < 0)
                next_size = sz;
        } else if (type == 'L') {
            /* a C string whose NUL the size counts (GNU tar and tarfile write it so; tarfile
             * reads an unterminated one on to its block's end, GNU tar stops at the size) */
            int64_t l = (int64_t)strnlen((const char *)p + data, (size_t)size);
            if (l == size) {
                *why = "a GNU long name is not NUL-terminated within its size";
                return 1;
            }
            if (next_name_off < 0) {
                next_name_off = data;
                next_name_len = l;
            }
        } else if (type == 'g' || type == 'K') {
            /* global pax headers and GNU long link names: nothing for the files' index */
        } else {
            if ((type == '0' || type == 0 || type == '7') && !no_data) {
                pl_tar_member m = {.data_off = data, .size = size};
                if (next_name_off >= 0) {
                    m.name_off = next_name_off;
                    m.name_len = next_name_len;
                } else {
                    m.name_off = pos;
                    m.name_len = own;
                    if (memcmp(h + 257, "ustar", 5) == 0 && h[262] == 0) { /* POSIX: a prefix */
                        m.prefix_off = pos + 345;
                        m.prefix_len = (int64_t)strnlen((const char *)h + 345, 155);
                    }
                }
                if (add(ctx, &m))
                    return -1;
            }
            next_name_off = -1;
            next_name_len = 0;
            next_size = -1;
        }
        int64_t blocks = (size + BLOCK - 1) / BLOCK;
        pos = data + blocks * BLOCK;
    }
    *where = pos;
    if (pos < end) {
        *why = "the archive ends inside a header (a truncated tar)";
        return 1;
    }
    if (next_name_off >= 0 || next_size >= 0) {
        *why = "the archive ends after an extended header, before its member (a truncated tar)";
        return 1;
    }
    return 0;
}
