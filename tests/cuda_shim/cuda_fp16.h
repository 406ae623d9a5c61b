/* The part of CUDA's cuda_fp16.h that src/core/image_kernel.cu uses, for its host emulation
 * (tests/image_kernel_emu.cpp): float to half with round-to-nearest-even, a NaN as CUDA's
 * canonical one (0x7fff). */
#ifndef PL_TEST_CUDA_FP16_H
#define PL_TEST_CUDA_FP16_H
#include <cstring>

struct __half {
    unsigned short bits;
};

static inline __half __float2half_rn(float f)
{
    unsigned int x;
    std::memcpy(&x, &f, 4);
    const unsigned int sign = (x >> 16) & 0x8000u;
    const unsigned int mag = x & 0x7fffffffu;
    __half h;
    if (mag > 0x7f800000u) { /* NaN: CUDA's canonical NaN */
        h.bits = 0x7fffu;
        return h;
    }
    if (mag >= 0x477ff000u) { /* rounds to at least 65520: infinity */
        h.bits = (unsigned short)(sign | 0x7c00u);
        return h;
    }
    if (mag < 0x38800000u) { /* below the smallest normal half: a subnormal, or zero */
        if (mag < 0x33000000u) { /* at most half the smallest subnormal: zero */
            h.bits = (unsigned short)sign;
            return h;
        }
        const int e = (int)(mag >> 23);
        const unsigned int m = (mag & 0x7fffffu) | 0x800000u;
        const int shift = 126 - e; /* 14 .. 24 */
        /* value = m * 2^(e - 150); in units of 2^-24, m * 2^(e - 126) */
        const unsigned int q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        const unsigned int r = q + (rem > half || (rem == half && (q & 1u)));
        h.bits = (unsigned short)(sign | r);
        return h;
    }
    /* normal: rebias the exponent, round the mantissa from 23 to 10 bits */
    const unsigned int e = ((mag >> 23) - 112u) << 10;
    const unsigned int m = mag & 0x7fffffu;
    unsigned int r = e | (m >> 13);
    const unsigned int rem = m & 0x1fffu;
    r += rem > 0x1000u || (rem == 0x1000u && (r & 1u));
    h.bits = (unsigned short)(sign | r);
    return h;
}

static inline unsigned short __half_as_ushort(__half h) { return h.bits; }

#endif
