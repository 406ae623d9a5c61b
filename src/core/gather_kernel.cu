/* The device gather: rows of a source in registered (page-locked, mapped) host memory, read by
 * GPU threads straight into a batch's device block. Built by tools/gen_gather_kernels.py into
 * src/core/gather_kernel_image.h (cubins for every architecture family plus PTX for the JIT), which
 * backend_cuda.c loads at run time; setup.py never compiles this file. See Note [device gather]
 * in src/core/devgather.h for how the launch is set up.
 *
 * One thread moves one unit of V bytes (V = 16, 8, 4, 2 or 1: the widest that divides the
 * source's base address, its row stride and the item span, chosen by the host). Unit u of the
 * batch belongs to pair u / span_units of the table, so consecutive threads read consecutive
 * bytes of one row and then the next pair's row (for small rows the pairs are sorted by source
 * row: the next row in address order), and each row is written to the slot the pair names. Every thread keeps UNROLL loads in flight before it stores, which is what keeps
 * the PCIe link busy: host memory is microseconds away. Items that reach into the source's
 * first or last partial page, which is not registered (Note [registered sources] in
 * src/core/devgather.h), were copied by the host into the batch's staged area: a pair whose row is
 * -1 - k reads the k-th of them, at edge + k * span, where the table is (the batch's device
 * block, or the pinned region mapped for the device: Note [mapped tables] in
 * src/core/transfer.c). */

struct pl_pair {
    long long row;  /* source row (or window start); -1 - k: the k-th staged edge item */
    long long slot; /* position in the batch */
};

#ifndef UNROLL /* benchmarks/bench_gather_kernel.py compiles other values to compare */
#define UNROLL 4
#endif

template <typename V>
__device__ __forceinline__ void gather(char *__restrict__ dst, const pl_pair *__restrict__ table,
                                       const char *__restrict__ src, const char *__restrict__ edge,
                                       long long row_stride, unsigned long long span_units,
                                       unsigned long long total)
{
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long span_bytes = span_units * sizeof(V);
    for (unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         base < total; base += UNROLL * step) {
        V v[UNROLL];
        V *out[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            const unsigned long long u = base + k * step;
            out[k] = 0;
            if (u < total) {
                const unsigned long long i = u / span_units, c = u - i * span_units;
                const pl_pair p = table[i];
                const char *from = p.row >= 0 ? src + p.row * row_stride
                                              : edge + (unsigned long long)(-1 - p.row) * span_bytes;
                v[k] = reinterpret_cast<const V *>(from)[c];
                out[k] = reinterpret_cast<V *>(dst + (unsigned long long)p.slot * span_bytes) + c;
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; k++)
            if (out[k])
                *out[k] = v[k];
    }
}

#define PL_GATHER_KERNEL(name, V)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        name(char *dst, const pl_pair *table, const char *src, const char *edge,                   \
             long long row_stride, unsigned long long span_units, unsigned long long total)        \
    {                                                                                              \
        gather<V>(dst, table, src, edge, row_stride, span_units, total);                           \
    }

PL_GATHER_KERNEL(pl_gather_16, uint4)
PL_GATHER_KERNEL(pl_gather_8, uint2)
PL_GATHER_KERNEL(pl_gather_4, unsigned int)
PL_GATHER_KERNEL(pl_gather_2, unsigned short)
PL_GATHER_KERNEL(pl_gather_1, unsigned char)
