/* The driver functions the shim intercepts, as X-macros: X(name, (parameters), (arguments)).
 *
 * SHIM_SUBMIT: calls that put work on the GPU.  Gated (a paused process cannot issue them), counted,
 *              otherwise passed straight through.
 * SHIM_STATE:  calls that create or destroy GPU state.  Gated and counted, and each has a pre_NAME and a
 *              post_NAME hook in hooks.c that keeps the registry in step with the driver.
 * SHIM_PROC:   cuGetProcAddress and _v2: not gated; they hand out the shim's wrappers in place of the
 *              driver's entry points.
 * SHIM_SYNC, SHIM_QUERY, SHIM_PASS_STATE: synchronizations, the getters frameworks call most, and
 *              the current-context setter: not gated, not counted, wrapped only so that the emulated
 *              layer (emulate.c) can add its cost to them too; otherwise a load and a jump.
 *
 * Everything else (cuGetExportTable, rarer getters, ...) is not exported by the shim at all, so it
 * reaches the driver with no added cost; why that is safe for checkpointing is explained above
 * gate_enter() in shim.c.
 *
 * The prototypes come from the driver API header; a wrapper whose parameters disagree with the
 * header does not compile. */
#ifndef GPUTRACE_SHIM_API_H
#define GPUTRACE_SHIM_API_H

#include "cuda_driver.h"

#define SHIM_LAUNCH_PARAMS                                                                                       \
    (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,          \
     unsigned int bz, unsigned int shmem, CUstream hStream, void **kp, void **extra)
#define SHIM_LAUNCH_ARGS (f, gx, gy, gz, bx, by, bz, shmem, hStream, kp, extra)

/* The kernel launches: submissions whose kernel (`f`) may be a collective (see SHIM_LOOKUP). */
#define SHIM_LAUNCH(X)                                                                                           \
    X(cuLaunchKernel, SHIM_LAUNCH_PARAMS, SHIM_LAUNCH_ARGS)                                                      \
    X(cuLaunchKernel_ptsz, SHIM_LAUNCH_PARAMS, SHIM_LAUNCH_ARGS)                                                 \
    X(cuLaunchKernelEx, (const CUlaunchConfig *c, CUfunction f, void **kp, void **extra), (c, f, kp, extra))    \
    X(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *c, CUfunction f, void **kp, void **extra), (c, f, kp, extra)) \
    X(cuLaunchCooperativeKernel, (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,               \
                                  unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,         \
                                  CUstream hStream, void **kp), (f, gx, gy, gz, bx, by, bz, shmem, hStream, kp)) \
    X(cuLaunchCooperativeKernel_ptsz, (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,          \
                                       unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,    \
                                       CUstream hStream, void **kp), (f, gx, gy, gz, bx, by, bz, shmem, hStream, kp))

/* The other submissions: copies, memsets, events, host functions, graphs. */
#define SHIM_SUBMIT_REST(X)                                                                                      \
    X(cuMemcpyHtoD_v2, (CUdeviceptr d, const void *s, size_t n), (d, s, n))                                      \
    X(cuMemcpyHtoD_v2_ptds, (CUdeviceptr d, const void *s, size_t n), (d, s, n))                                 \
    X(cuMemcpyDtoH_v2, (void *d, CUdeviceptr s, size_t n), (d, s, n))                                            \
    X(cuMemcpyDtoH_v2_ptds, (void *d, CUdeviceptr s, size_t n), (d, s, n))                                       \
    X(cuMemcpyDtoD_v2, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                      \
    X(cuMemcpyDtoD_v2_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                 \
    X(cuMemcpyHtoDAsync_v2, (CUdeviceptr d, const void *s, size_t n, CUstream h), (d, s, n, h))                  \
    X(cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr d, const void *s, size_t n, CUstream h), (d, s, n, h))             \
    X(cuMemcpyDtoHAsync_v2, (void *d, CUdeviceptr s, size_t n, CUstream h), (d, s, n, h))                        \
    X(cuMemcpyDtoHAsync_v2_ptsz, (void *d, CUdeviceptr s, size_t n, CUstream h), (d, s, n, h))                   \
    X(cuMemcpyDtoDAsync_v2, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h), (d, s, n, h))                  \
    X(cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h), (d, s, n, h))             \
    X(cuMemsetD8_v2, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))                                      \
    X(cuMemsetD8_v2_ptds, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))                                 \
    X(cuMemsetD32_v2, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))                                      \
    X(cuMemsetD32_v2_ptds, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))                                 \
    X(cuMemsetD8Async, (CUdeviceptr d, unsigned char v, size_t n, CUstream h), (d, v, n, h))                     \
    X(cuMemsetD8Async_ptsz, (CUdeviceptr d, unsigned char v, size_t n, CUstream h), (d, v, n, h))                \
    X(cuMemsetD32Async, (CUdeviceptr d, unsigned int v, size_t n, CUstream h), (d, v, n, h))                     \
    X(cuMemsetD32Async_ptsz, (CUdeviceptr d, unsigned int v, size_t n, CUstream h), (d, v, n, h))                \
    X(cuEventRecord, (CUevent e, CUstream h), (e, h))                                                            \
    X(cuEventRecord_ptsz, (CUevent e, CUstream h), (e, h))                                                       \
    X(cuStreamWaitEvent, (CUstream h, CUevent e, unsigned int fl), (h, e, fl))                                   \
    X(cuStreamWaitEvent_ptsz, (CUstream h, CUevent e, unsigned int fl), (h, e, fl))                              \
    X(cuMemcpy, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                             \
    X(cuMemcpy_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                        \
    X(cuMemcpyAsync, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h), (d, s, n, h))                         \
    X(cuMemcpyAsync_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h), (d, s, n, h))                    \
    X(cuMemcpyPeerAsync, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream h),       \
      (d, dc, s, sc, n, h))                                                                                      \
    X(cuMemcpyPeerAsync_ptsz, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream h),  \
      (d, dc, s, sc, n, h))                                                                                      \
    X(cuMemcpy2D_v2, (const CUDA_MEMCPY2D *c), (c))                                                              \
    X(cuMemcpy2D_v2_ptds, (const CUDA_MEMCPY2D *c), (c))                                                         \
    X(cuMemcpy2DAsync_v2, (const CUDA_MEMCPY2D *c, CUstream h), (c, h))                                          \
    X(cuMemcpy2DAsync_v2_ptsz, (const CUDA_MEMCPY2D *c, CUstream h), (c, h))                                     \
    X(cuMemcpy3D_v2, (const CUDA_MEMCPY3D *c), (c))                                                              \
    X(cuMemcpy3D_v2_ptds, (const CUDA_MEMCPY3D *c), (c))                                                         \
    X(cuMemcpy3DAsync_v2, (const CUDA_MEMCPY3D *c, CUstream h), (c, h))                                          \
    X(cuMemcpy3DAsync_v2_ptsz, (const CUDA_MEMCPY3D *c, CUstream h), (c, h))                                     \
    X(cuMemsetD16_v2, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))                                    \
    X(cuMemsetD16_v2_ptds, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))                               \
    X(cuMemsetD16Async, (CUdeviceptr d, unsigned short v, size_t n, CUstream h), (d, v, n, h))                   \
    X(cuMemsetD16Async_ptsz, (CUdeviceptr d, unsigned short v, size_t n, CUstream h), (d, v, n, h))              \
    X(cuLaunchHostFunc, (CUstream h, CUhostFn fn, void *ud), (h, fn, ud))                                        \
    X(cuLaunchHostFunc_ptsz, (CUstream h, CUhostFn fn, void *ud), (h, fn, ud))                                   \
    X(cuGraphLaunch, (CUgraphExec g, CUstream h), (g, h))                                                        \
    X(cuGraphLaunch_ptsz, (CUgraphExec g, CUstream h), (g, h))                                                   \
    X(cuEventRecordWithFlags, (CUevent e, CUstream h, unsigned int fl), (e, h, fl))                              \
    X(cuEventRecordWithFlags_ptsz, (CUevent e, CUstream h, unsigned int fl), (e, h, fl))

#define SHIM_STATE(X)                                                                                            \
    X(cuDevicePrimaryCtxRetain, (CUcontext *pctx, CUdevice dev), (pctx, dev))                                    \
    X(cuDevicePrimaryCtxRelease_v2, (CUdevice dev), (dev))                                                       \
    X(cuDevicePrimaryCtxReset_v2, (CUdevice dev), (dev))                                                         \
    X(cuCtxCreate_v2, (CUcontext *pctx, unsigned int flags, CUdevice dev), (pctx, flags, dev))                   \
    X(cuCtxDestroy_v2, (CUcontext ctx), (ctx))                                                                   \
    X(cuMemAlloc_v2, (CUdeviceptr *dptr, size_t bytes), (dptr, bytes))                                          \
    X(cuMemAllocPitch_v2, (CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elsize),  \
      (dptr, pitch, width, height, elsize))                                                                      \
    X(cuMemFree_v2, (CUdeviceptr dptr), (dptr))                                                                  \
    X(cuMemAllocAsync, (CUdeviceptr *dptr, size_t bytes, CUstream h), (dptr, bytes, h))                          \
    X(cuMemAllocAsync_ptsz, (CUdeviceptr *dptr, size_t bytes, CUstream h), (dptr, bytes, h))                     \
    X(cuMemAllocFromPoolAsync, (CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream h), (dptr, bytes, pool, h)) \
    X(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream h), (dptr, bytes, pool, h)) \
    X(cuArrayCreate_v2, (CUarray *ph, const CUDA_ARRAY_DESCRIPTOR *d), (ph, d))                                 \
    X(cuArray3DCreate_v2, (CUarray *ph, const CUDA_ARRAY3D_DESCRIPTOR *d), (ph, d))                             \
    X(cuArrayDestroy, (CUarray a), (a))                                                                          \
    X(cuMipmappedArrayCreate, (CUmipmappedArray *ph, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int n), (ph, d, n)) \
    X(cuMipmappedArrayDestroy, (CUmipmappedArray a), (a))                                                        \
    X(cuIpcOpenMemHandle_v2, (CUdeviceptr *pd, CUipcMemHandle hd, unsigned int flags), (pd, hd, flags))          \
    X(cuIpcCloseMemHandle, (CUdeviceptr d), (d))                                                                 \
    X(cuMemPoolImportPointer, (CUdeviceptr *pd, CUmemoryPool pool, CUmemPoolPtrExportData *sd), (pd, pool, sd)) \
    X(cuMemFreeAsync, (CUdeviceptr dptr, CUstream h), (dptr, h))                                                 \
    X(cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream h), (dptr, h))                                            \
    X(cuMemAllocHost_v2, (void **pp, size_t bytes), (pp, bytes))                                                 \
    X(cuMemHostAlloc, (void **pp, size_t bytes, unsigned int flags), (pp, bytes, flags))                         \
    X(cuMemFreeHost, (void *p), (p))                                                                             \
    X(cuMemAddressReserve, (CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long fl), \
      (ptr, size, align, addr, fl))                                                                              \
    X(cuMemAddressFree, (CUdeviceptr ptr, size_t size), (ptr, size))                                             \
    X(cuMemCreate, (CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,               \
                    unsigned long long fl), (h, size, prop, fl))                                                 \
    X(cuMemRelease, (CUmemGenericAllocationHandle h), (h))                                                       \
    X(cuMemMap, (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,                    \
                 unsigned long long fl), (ptr, size, offset, h, fl))                                             \
    X(cuMemUnmap, (CUdeviceptr ptr, size_t size), (ptr, size))                                                   \
    X(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count),                 \
      (ptr, size, desc, count))                                                                                  \
    X(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle *h, void *addr), (h, addr))                     \
    X(cuMemExportToShareableHandle, (void *sh, CUmemGenericAllocationHandle h, CUmemAllocationHandleType t,       \
                                     unsigned long long fl), (sh, h, t, fl))                                     \
    X(cuStreamCreate, (CUstream *ph, unsigned int flags), (ph, flags))                                           \
    X(cuStreamCreateWithPriority, (CUstream *ph, unsigned int flags, int prio), (ph, flags, prio))              \
    X(cuStreamDestroy_v2, (CUstream h), (h))                                                                     \
    X(cuEventCreate, (CUevent *ph, unsigned int flags), (ph, flags))                                             \
    X(cuEventDestroy_v2, (CUevent h), (h))                                                                       \
    X(cuModuleLoadData, (CUmodule *pm, const void *image), (pm, image))                                          \
    X(cuModuleLoad, (CUmodule *pm, const char *fname), (pm, fname))                                              \
    X(cuModuleUnload, (CUmodule m), (m))                                                                         \
    X(cuLibraryLoadData, (CUlibrary *pl, const void *code, CUjit_option *jo, void **jv, unsigned int nj,          \
                          CUlibraryOption *lo, void **lv, unsigned int nl), (pl, code, jo, jv, nj, lo, lv, nl))  \
    X(cuLibraryUnload, (CUlibrary l), (l))                                                                       \
    X(cuMemAllocManaged, (CUdeviceptr *dptr, size_t bytes, unsigned int flags), (dptr, bytes, flags))           \
    X(cuMemHostRegister_v2, (void *p, size_t bytes, unsigned int flags), (p, bytes, flags))                      \
    X(cuMemHostUnregister, (void *p), (p))                                                                       \
    X(cuModuleLoadDataEx, (CUmodule *pm, const void *image, unsigned int n, CUjit_option *o, void **v),          \
      (pm, image, n, o, v))                                                                                      \
    X(cuModuleLoadFatBinary, (CUmodule *pm, const void *fatbin), (pm, fatbin))                                   \
    X(cuLibraryLoadFromFile, (CUlibrary *pl, const char *path, CUjit_option *jo, void **jv, unsigned int nj,     \
                              CUlibraryOption *lo, void **lv, unsigned int nl), (pl, path, jo, jv, nj, lo, lv, nl))

#define SHIM_SYNC(X)                                                                                             \
    X(cuStreamSynchronize, (CUstream h), (h))                                                                    \
    X(cuStreamSynchronize_ptsz, (CUstream h), (h))                                                               \
    X(cuCtxSynchronize, (void), ())                                                                              \
    X(cuEventSynchronize, (CUevent e), (e))

#define SHIM_QUERY(X)                                                                                            \
    X(cuCtxGetDevice, (CUdevice *d), (d))                                                                        \
    X(cuCtxGetDevice_v2, (CUdevice *d, CUcontext c), (d, c))                                                     \
    X(cuCtxGetCurrent, (CUcontext *pc), (pc))                                                                    \
    X(cuDevicePrimaryCtxGetState, (CUdevice dev, unsigned int *fl, int *active), (dev, fl, active))             \
    X(cuDeviceGetAttribute, (int *pi, CUdevice_attribute a, CUdevice dev), (pi, a, dev))                         \
    X(cuStreamIsCapturing, (CUstream h, CUstreamCaptureStatus *st), (h, st))                                     \
    X(cuStreamIsCapturing_ptsz, (CUstream h, CUstreamCaptureStatus *st), (h, st))                                \
    X(cuStreamQuery, (CUstream h), (h))                                                                          \
    X(cuStreamQuery_ptsz, (CUstream h), (h))                                                                     \
    X(cuEventQuery, (CUevent e), (e))                                                                            \
    X(cuKernelGetFunction, (CUfunction *pf, CUkernel k), (pf, k))                                                \
    X(cuKernelGetAttribute, (int *pi, CUfunction_attribute a, CUkernel k, CUdevice dev), (pi, a, k, dev))        \
    X(cuFuncGetAttribute, (int *pi, CUfunction_attribute a, CUfunction f), (pi, a, f))                           \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor, (int *n, CUfunction f, int bs, size_t sm), (n, f, bs, sm))    \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags, (int *n, CUfunction f, int bs, size_t sm,            \
                                                              unsigned int fl), (n, f, bs, sm, fl))

#define SHIM_PASS_STATE(X) X(cuCtxSetCurrent, (CUcontext c), (c))

#define SHIM_SUBMIT(X) SHIM_LAUNCH(X) SHIM_SUBMIT_REST(X)

/* SHIM_LOOKUP: where a program gets its kernels by name.  Not gated, not counted; the wrappers note
 * the handles of kernels whose names are collectives' (NCCL's, or $GPUTRACE_SHIM_COLLECTIVES), so
 * that a job of several processes can be stopped at the same collective in each (shim.c). */
#define SHIM_LOOKUP(X)                                                                                           \
    X(cuModuleGetFunction, (CUfunction *pf, CUmodule m, const char *name), (pf, m, name))                        \
    X(cuLibraryGetKernel, (CUkernel *pk, CUlibrary l, const char *name), (pk, l, name))

/* SHIM_HANDLE: getters that take a VMM handle.  Not gated, not counted; once a suspension has made a
 * program's allocation again the handle the program holds is translated to the driver's (vmm.c). */
#define SHIM_HANDLE(X)                                                                                           \
    X(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp *prop, CUmemGenericAllocationHandle h),       \
      (prop, h))

#define SHIM_PASS(X) SHIM_SYNC(X) SHIM_QUERY(X) SHIM_PASS_STATE(X)

#define SHIM_PROC(X)                                                                                             \
    X(cuGetProcAddress, (const char *sym, void **pfn, int ver, cuuint64_t flags), (sym, pfn, ver, flags))        \
    X(cuGetProcAddress_v2, (const char *sym, void **pfn, int ver, cuuint64_t flags,                              \
                            CUdriverProcAddressQueryResult *st), (sym, pfn, ver, flags, st))

#define SHIM_ALL(X) SHIM_SUBMIT(X) SHIM_STATE(X) SHIM_PASS(X) SHIM_LOOKUP(X) SHIM_HANDLE(X) SHIM_PROC(X)

enum shim_fn {
#define SHIM_ENUM(name, params, args) F_##name,
    SHIM_ALL(SHIM_ENUM)
#undef SHIM_ENUM
    F_COUNT
};

#endif
