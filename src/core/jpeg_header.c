/* See jpeg_header.h. The walk is pinloader/_image_ops.py's jpeg_info, which the tests compare it
 * with: markers after SOI, each with a big-endian length that covers itself, fill bytes (0xFF)
 * skipped, the standalone markers (TEM, RST0..7) without a length. */
#include "jpeg_header.h"

static int is_sof(unsigned m)
{
    return m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
}

int pl_jpeg_header(const unsigned char *p, size_t n, int *h, int *w, int *c)
{
    if (!p || n < 4 || p[0] != 0xFF || p[1] != 0xD8)
        return -1;
    size_t i = 2;
    while (i + 4 <= n) {
        if (p[i] != 0xFF)
            return -1;
        unsigned m = p[i + 1];
        if (m == 0xFF) { /* a fill byte */
            i += 1;
            continue;
        }
        if (m == 0x01 || (m >= 0xD0 && m <= 0xD7)) {
            i += 2;
            continue;
        }
        if (m == 0xD9 || m == 0xDA)
            return -1; /* the end, or a scan, before any frame header */
        size_t seg = ((size_t)p[i + 2] << 8) | p[i + 3];
        if (is_sof(m)) {
            if (i + 10 > n || seg < 8)
                return -1;
            int hh = (p[i + 5] << 8) | p[i + 6];
            int ww = (p[i + 7] << 8) | p[i + 8];
            if (hh == 0 || ww == 0)
                return -1;
            *h = hh;
            *w = ww;
            *c = p[i + 9];
            return 0;
        }
        if (seg < 2)
            return -1;
        i += 2 + seg; /* i < n and seg < 65536: no overflow */
    }
    return -1;
}

/* Note [truncated JPEGs]
 * nvJPEG's decoders accept a file cut short and fill the missing blocks, so a truncated file
 * would train as a grey-bottomed image without a word. A complete JPEG ends with the EOI marker
 * (FF D9), and the entropy-coded data can never hold FF D9 (a data byte FF is always followed
 * by 00 or a restart marker D0-D7), so a file whose last bytes hold no FF D9 was cut inside its
 * data, or has something appended after the image (some cameras append a preview or a video).
 * The GPU cannot tell which; such a sample gets PL_JPEG_NO_END (jpeg_cuda.h) and the caller decodes it
 * on the host, whose decoder reports a truncation as an error and ignores appended data. The search
 * covers the last END_WINDOW bytes, which also allows for padding after EOI. */
enum { END_WINDOW = 4096 };

int pl_jpeg_has_end_marker(const unsigned char *p, size_t n)
{
    size_t lo = n > END_WINDOW ? n - END_WINDOW : 0;
    for (size_t i = n; i >= lo + 2; i--)
        if (p[i - 2] == 0xFF && p[i - 1] == 0xD9)
            return 1;
    return 0;
}
