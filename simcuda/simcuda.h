/* simcuda's own exports beside the CUDA driver API: helpers for tests and for the checkpointer.
 * None of these exist in the real libcuda; look them up with dlsym and fall back when missing. */
#ifndef SIMCUDA_H
#define SIMCUDA_H

#include "cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Busy-waits (on the CPU, in the calling thread) for `ns` nanoseconds of wall-clock time: a function
 * whose cost is known, for calibrating a tracer's per-probe overhead. */
void simcudaBusyWait(unsigned long long ns);

/* What a checkpointer needs to know about device memory. `base`/`size` are the range the program
 * asked for (pitch * height for pitched memory); for VMM mappings `handle` and `offset` say what is
 * mapped.  Allocations of one context are listed in address order. */
enum simcudaAllocKind {
    SIMCUDA_ALLOC_DEVICE = 1,     /* cuMemAlloc_v2 */
    SIMCUDA_ALLOC_PITCH = 2,      /* cuMemAllocPitch_v2 */
    SIMCUDA_ALLOC_ASYNC = 3,      /* cuMemAllocAsync */
    SIMCUDA_ALLOC_HOST = 4,       /* cuMemAllocHost_v2 / cuMemHostAlloc (pinned host memory) */
    SIMCUDA_ALLOC_VA_RESERVE = 5, /* cuMemAddressReserve: address space only */
    SIMCUDA_ALLOC_VMM_PHYS = 6,   /* cuMemCreate: backing memory, base = 0 */
    SIMCUDA_ALLOC_VMM_MAP = 7     /* cuMemMap: a mapped piece of a reservation */
};
typedef struct simcudaAllocation {
    unsigned long long base;
    unsigned long long size;
    int kind;
    int device;
    CUcontext ctx;                       /* NULL for VMM objects and host memory */
    CUmemGenericAllocationHandle handle; /* VMM_PHYS and VMM_MAP */
    unsigned long long offset;           /* VMM_MAP: offset into the handle */
    int access;                          /* VMM_MAP: CUmemAccess_flags set by cuMemSetAccess */
    int reserved;
} simcudaAllocation;

/* Copies up to `max` records into `out` (may be NULL with max 0) and returns how many exist. */
int simcudaListAllocations(simcudaAllocation *out, int max);

/* The device address range simcuda reserves for device memory. */
void simcudaArena(unsigned long long *base, unsigned long long *size);

#ifdef __cplusplus
}
#endif
#endif
