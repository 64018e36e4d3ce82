/* The chunk digest the shim computes on the GPU (shim/digest.c says what it is for).
 *
 * The PTX the shim loads, shim/digest_ptx.h, is made from this file on a machine with nvcc by
 *     scripts/gen-digest-ptx
 * (nvcc -ptx -arch=compute_75, its .version lowered so that older drivers JIT it too), and committed:
 * the shim is built where there is no CUDA toolkit.
 *
 * Definition (the same in simcuda/libcuda.c, which runs it for the tests, and in
 * checkpointer/digest.py), for a chunk of `len` bytes:
 *     words w_j, j = 0 .. ceil(len/8)-1: the chunk's bytes as little-endian u64, the last zero-padded
 *     a = sum_j fmix64((w_j ^ S1) + K1 * (j + 1))   (mod 2^64)
 *     b = sum_j fmix64((w_j ^ S2) + K2 * (j + 1))
 *     digest = (fmix64(a + len * K2), fmix64(b ^ len))
 * fmix64 is MurmurHash3's finalizer (a bijection with full avalanche).  The sums make the result
 * independent of the order in which threads add their terms, and j in each term makes it depend on
 * where each word is. */
#include <stdint.h>

#define K1 0x9E3779B97F4A7C15ull
#define K2 0xC2B2AE3D27D4EB4Full
#define S1 0x243F6A8885A308D3ull
#define S2 0x13198A2E03707344ull
#define THREADS 256

__device__ __forceinline__ uint64_t fmix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

/* One block per chunk.  spans: n pairs {device address (8-byte aligned), length in bytes};
 * out: n pairs {digest a, digest b}. */
extern "C" __global__ void __launch_bounds__(THREADS) gputrace_chunk_digest(const uint64_t *spans, uint64_t n,
                                                                            uint64_t *out)
{
    const uint64_t c = blockIdx.x;
    if (c >= n)
        return;
    const uint64_t len = spans[2 * c + 1];
    const uint64_t *w = (const uint64_t *)spans[2 * c];
    const uint64_t words = len / 8;
    uint64_t a = 0, b = 0;
#pragma unroll 4
    for (uint64_t j = threadIdx.x; j < words; j += THREADS) {
        const uint64_t v = __ldg(w + j);
        a += fmix64((v ^ S1) + K1 * (j + 1));
        b += fmix64((v ^ S2) + K2 * (j + 1));
    }
    if (threadIdx.x == 0 && (len & 7)) {
        const unsigned char *t = (const unsigned char *)(w + words);
        uint64_t v = 0;
        for (unsigned k = 0; k < (unsigned)(len & 7); k++)
            v |= (uint64_t)t[k] << (8 * k);
        a += fmix64((v ^ S1) + K1 * (words + 1));
        b += fmix64((v ^ S2) + K2 * (words + 1));
    }
    __shared__ uint64_t sa[THREADS], sb[THREADS];
    sa[threadIdx.x] = a;
    sb[threadIdx.x] = b;
    __syncthreads();
    for (unsigned s = THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            sa[threadIdx.x] += sa[threadIdx.x + s];
            sb[threadIdx.x] += sb[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[2 * c] = fmix64(sa[0] + len * K2);
        out[2 * c + 1] = fmix64(sb[0] ^ len);
    }
}
