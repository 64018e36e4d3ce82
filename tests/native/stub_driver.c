/* A stand-in driver for the wrapped functions simcuda lacks (declared in shim/cuda_driver.h): each records its name
 * and arguments (as 64-bit words) and succeeds, so a test can check that the shim's wrapper passed
 * every argument through unchanged and recorded what it should.  cuGetProcAddress_v2 knows just
 * these functions (a _ptsz/_ptds variant where one exists); cuCtxGetCurrent reports a fixed context. */
#include <stdint.h>
#include <string.h>

#include "cuda_driver.h"

#define EXPORT __attribute__((visibility("default")))
EXPORT char stub_fn[64];
EXPORT unsigned long long stub_args[12];
EXPORT int stub_nargs;

static void rec(const char *fn, int n, ...)
{
    __builtin_va_list ap;
    __builtin_va_start(ap, n);
    strncpy(stub_fn, fn, sizeof stub_fn - 1);
    for (int i = 0; i < n; i++)
        stub_args[i] = __builtin_va_arg(ap, unsigned long long);
    stub_nargs = n;
    __builtin_va_end(ap);
}
#define U(x) ((unsigned long long)(uintptr_t)(x))

EXPORT CUresult cuCtxGetCurrent(CUcontext *c) { *c = (CUcontext)0xC0C0; return CUDA_SUCCESS; }

#define COPY(name) EXPORT CUresult name(CUdeviceptr d, CUdeviceptr s, size_t n) { rec(#name, 3, U(d), U(s), U(n)); return 0; }
COPY(cuMemcpy) COPY(cuMemcpy_ptds)
#define COPYA(name) EXPORT CUresult name(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { rec(#name, 4, U(d), U(s), U(n), U(h)); return 0; }
COPYA(cuMemcpyAsync) COPYA(cuMemcpyAsync_ptsz)
#define PEER(name) EXPORT CUresult name(CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream h) \
    { rec(#name, 6, U(d), U(dc), U(s), U(sc), U(n), U(h)); return 0; }
PEER(cuMemcpyPeerAsync) PEER(cuMemcpyPeerAsync_ptsz)
#define C2(name, T) EXPORT CUresult name(const T *c) { rec(#name, 1, U(c)); return 0; }
#define C2A(name, T) EXPORT CUresult name(const T *c, CUstream h) { rec(#name, 2, U(c), U(h)); return 0; }
C2(cuMemcpy2D_v2, CUDA_MEMCPY2D) C2(cuMemcpy2D_v2_ptds, CUDA_MEMCPY2D) C2A(cuMemcpy2DAsync_v2, CUDA_MEMCPY2D)
C2A(cuMemcpy2DAsync_v2_ptsz, CUDA_MEMCPY2D) C2(cuMemcpy3D_v2, CUDA_MEMCPY3D) C2(cuMemcpy3D_v2_ptds, CUDA_MEMCPY3D)
C2A(cuMemcpy3DAsync_v2, CUDA_MEMCPY3D) C2A(cuMemcpy3DAsync_v2_ptsz, CUDA_MEMCPY3D)
#define SET(name) EXPORT CUresult name(CUdeviceptr d, unsigned short v, size_t n) { rec(#name, 3, U(d), U(v), U(n)); return 0; }
#define SETA(name) EXPORT CUresult name(CUdeviceptr d, unsigned short v, size_t n, CUstream h) { rec(#name, 4, U(d), U(v), U(n), U(h)); return 0; }
SET(cuMemsetD16_v2) SET(cuMemsetD16_v2_ptds) SETA(cuMemsetD16Async) SETA(cuMemsetD16Async_ptsz)
#define COOP(name) EXPORT CUresult name(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, \
    unsigned bz, unsigned sh, CUstream h, void **kp) { rec(#name, 10, U(f), U(gx), U(gy), U(gz), U(bx), U(by), U(bz), U(sh), U(h), U(kp)); return 0; }
COOP(cuLaunchCooperativeKernel) COOP(cuLaunchCooperativeKernel_ptsz)
#define HOSTFN(name) EXPORT CUresult name(CUstream h, CUhostFn fn, void *ud) { rec(#name, 3, U(h), U(fn), U(ud)); return 0; }
HOSTFN(cuLaunchHostFunc) HOSTFN(cuLaunchHostFunc_ptsz)
#define GRAPH(name) EXPORT CUresult name(CUgraphExec g, CUstream h) { rec(#name, 2, U(g), U(h)); return 0; }
GRAPH(cuGraphLaunch) GRAPH(cuGraphLaunch_ptsz)
#define RECF(name) EXPORT CUresult name(CUevent e, CUstream h, unsigned fl) { rec(#name, 3, U(e), U(h), U(fl)); return 0; }
RECF(cuEventRecordWithFlags) RECF(cuEventRecordWithFlags_ptsz)

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *d, size_t n, unsigned fl) { *d = 0x7000000000ull; rec("cuMemAllocManaged", 3, U(d), U(n), U(fl)); return 0; }
EXPORT CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned fl) { rec("cuMemHostRegister_v2", 3, U(p), U(n), U(fl)); return 0; }
EXPORT CUresult cuMemHostUnregister(void *p) { rec("cuMemHostUnregister", 1, U(p)); return 0; }
EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *img, unsigned n, CUjit_option *o, void **v)
{ *m = (CUmodule)0xA0A0; rec("cuModuleLoadDataEx", 5, U(m), U(img), U(n), U(o), U(v)); return 0; }
EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fb) { *m = (CUmodule)0xB0B0; rec("cuModuleLoadFatBinary", 2, U(m), U(fb)); return 0; }
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *l, const char *path, CUjit_option *jo, void **jv, unsigned nj,
                                      CUlibraryOption *lo, void **lv, unsigned nl)
{ *l = (CUlibrary)0xD0D0; rec("cuLibraryLoadFromFile", 8, U(l), U(path), U(jo), U(jv), U(nj), U(lo), U(lv), U(nl)); return 0; }

static const struct { const char *name; void *fn, *pt; } table[] = {
    {"cuMemcpyAsync", (void *)cuMemcpyAsync, (void *)cuMemcpyAsync_ptsz},
    {"cuLaunchCooperativeKernel", (void *)cuLaunchCooperativeKernel, (void *)cuLaunchCooperativeKernel_ptsz},
    {"cuGraphLaunch", (void *)cuGraphLaunch, (void *)cuGraphLaunch_ptsz},
    {"cuMemAllocManaged", (void *)cuMemAllocManaged, NULL},
};

EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *st)
{
    (void)ver;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(sym, table[i].name)) {
            *pfn = (flags & 2) && table[i].pt ? table[i].pt : table[i].fn;
            if (st)
                *st = CU_GET_PROC_ADDRESS_SUCCESS;
            return CUDA_SUCCESS;
        }
    *pfn = NULL;
    if (st)
        *st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}
