/* Shared between the shim's translation units; nothing here is exported. */
#ifndef GPUTRACE_SHIM_INT_H
#define GPUTRACE_SHIM_INT_H

#define _GNU_SOURCE
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "shim_api.h"

#pragma GCC visibility push(default)
#include "gputrace_shim.h"
#pragma GCC visibility pop

#define HIDDEN __attribute__((visibility("hidden")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---- shim.c */
HIDDEN extern const char *const shim_fn_name[F_COUNT];
HIDDEN void *shim_real(int fn);                        /* driver entry point, resolved on demand */
HIDDEN void *shim_driver_sym(const char *name);        /* any driver function by name (never a wrapper) */
HIDDEN CUcontext shim_current_ctx(void);              /* the calling thread's current context */
HIDDEN unsigned long long shim_calls(int fn);
HIDDEN char *shim_status_alloc(size_t *len);             /* the status JSON, malloc'ed; NULL: no memory */
HIDDEN void shim_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
HIDDEN int shim_spawn_detached(void *(*fn)(void *), void *arg, size_t stack);

/* ---- registry.c */
enum rec_type { R_CTX = 1, R_MEM, R_HOST, R_VA, R_PHYS, R_MAP, R_MODULE, R_LIBRARY, R_STREAM, R_EVENT, R_NTYPES };
/* Allocation kinds: simcuda.h's numbering (1-7), so tests compare the two directly; then kinds simcuda lacks. */
enum alloc_kind { K_DEVICE = 1, K_PITCH, K_ASYNC, K_HOST, K_VA_RESERVE, K_VMM_PHYS, K_VMM_MAP, K_MANAGED, K_HOST_REGISTERED };

#define REC_ACC 8
struct rec {
    struct rec *next;
    int type;
    int kind;
    uint64_t key; /* the handle, or the base address */
    uint64_t size;
    uint64_t ctx;
    uint64_t handle; /* VMM: the generic allocation handle */
    uint64_t offset; /* VMM map: offset into the handle */
    int device;
    int refs;    /* primary contexts: retains; R_PHYS: cuMemRetainAllocationHandle's, each released once more */
    int primary;
    int access;  /* VMM map: CUmemAccess_flags */
    unsigned flags;
    int priority;
    void *image; /* modules and libraries: a private copy of the image */
    size_t image_len;
    char *path;  /* cuModuleLoad: the file */
    uint64_t reserved; /* R_MEM served through the VMM API (vmm.c): bytes reserved and mapped; else 0 */
    int suspended;     /* ... and its backing released by `suspend` (the address stays reserved); for the
                        * program's own R_PHYS and R_MAP: released or unmapped by `suspend` */
    /* The program's own VMM memory, what `unsuspend` needs to make it again.  R_PHYS: `key` is the
     * handle the program holds, `handle` the driver's (they differ once a suspension recreated it). */
    CUmemAllocationProp prop;     /* R_PHYS: as given to cuMemCreate */
    CUmemAccessDesc acc[REC_ACC]; /* R_MAP: the program's last cuMemSetAccess covering it */
    int nacc;                     /* ... how many (-1: more than REC_ACC, not kept) */
    int exported;                 /* R_PHYS: cuMemExportToShareableHandle (another process may hold it) */
};

/* What a state wrapper's pre hook hands its post hook: a record taken out before a free. */
struct hold {
    int found;
    struct rec rec;
};

HIDDEN void reg_put(const struct rec *r);                       /* insert or replace (takes image/path) */
HIDDEN int reg_take(int type, uint64_t key, struct rec *out);   /* remove; 1 if it was there */
HIDDEN int reg_get(int type, uint64_t key, struct rec *out);    /* copy (image/path not owned) */
/* Calls fn on the record of `type` and `key` under its shard's lock (fn may change it); 1 if it was there. */
HIDDEN int reg_update(int type, uint64_t key, void (*fn)(struct rec *, void *), void *arg);
HIDDEN void reg_release(struct rec *r);                         /* free what a taken record owns */
/* Calls fn on each record of `type` (0: all) under its shard's lock; fn returns 1 to remove it. */
HIDDEN void reg_scan(int type, int (*fn)(struct rec *, void *), void *arg);
HIDDEN size_t reg_copy_image(int type, uint64_t key, void *buf, size_t len);
HIDDEN void reg_atfork_prepare(void);
HIDDEN void reg_atfork_release(void);

struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
};
HIDDEN void sb_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
HIDDEN void reg_json(struct sbuf *b);

/* ---- emulate.c: the emulated layer */
HIDDEN extern atomic_int g_emul_on;
HIDDEN long long emul_spin(int fn);
HIDDEN void emul_after(long long since);
/* Before a wrapped call: its spin, where the layer is on and selects it; returns when the spin ended
 * (0 where it did not run), which the wrapper hands to emul_done after the driver's call returns. */
static inline long long emul(int fn)
{
    if (UNLIKELY(atomic_load_explicit(&g_emul_on, memory_order_relaxed)))
        return emul_spin(fn);
    return 0;
}
/* After it: the driver's own time for that call (whether a layer before a call changes what the call
 * itself costs: a launch made once the GPU has caught up may take the driver longer). */
static inline void emul_done(long long since)
{
    if (UNLIKELY(since != 0))
        emul_after(since);
}
HIDDEN char *emul_command(const char *args); /* the control command's reply, malloc'ed */
HIDDEN void emul_status(struct sbuf *b);     /* its part of the status JSON */


/* ---- gate (shim.c) */
HIDDEN int gate_paused(void);
HIDDEN void gate_suspend(void);   /* the closed gate stays closed for a suspension, whoever asks to resume */
HIDDEN void gate_unsuspend(void); /* the suspension ends and the gate reopens */
HIDDEN int gate_suspended(void);  /* between a suspend and its unsuspend */
/* A job of several processes stopped at the same collective (shim.c, "Collectives"). */
HIDDEN int gate_close(int timeout_ms, unsigned long long *count);
HIDDEN int gate_advance(unsigned long long target, int timeout_ms, unsigned long long *count);
HIDDEN int gate_drain(int timeout_ms);
HIDDEN unsigned long long gate_collectives(void);
HIDDEN int gate_collective_kernels(void);
HIDDEN int gate_advancing(void);
HIDDEN const char *dump_sync(int timeout_ms, uint64_t *ns); /* every context synchronized, bounded (copy.c) */

/* ---- dump.c and its family (dump_int.h): the `dump`, `restore`, `suspend` and `unsuspend` commands.  `args` is
 * the rest of the command line, `fd` a file passed with it (-1: none; taken over), `have_pause` whether the
 * caller's connection already holds the gate.  Returns the JSON reply, malloc'ed (NULL: out of memory). */
enum dump_mode { M_DUMP, M_RESTORE, M_SUSPEND, M_UNSUSPEND };
HIDDEN char *dump_command(int mode, char *args, int fd, int have_pause, int conn, size_t *len);
HIDDEN void dump_unstage(int conn); /* drops a command `conn` staged (-1: whoever staged it) */
HIDDEN char *dump_writeback_command(char *args, size_t *len); /* a streamed dump's next deferred chunks written (dump.c) */
HIDDEN void dump_writeback_finish(void); /* ... all of them, now: before any command that may touch the pool */
HIDDEN void dump_writeback_drop(int conn); /* ... none of them: `conn` closed, no one reads that image */
HIDDEN const char *dump_rehome(int fd); /* NULL: the suspended image now lives in fd (taken over; suspend.c) */
HIDDEN char *dump_digest(char *args, int fd, int have_pause, size_t *len); /* the live memory's digests into fd (changed.c) */
HIDDEN char *dump_release_command(size_t *len); /* what is kept between commands (pinned pool, digester) freed (kept.c) */
HIDDEN char *suspend_prepare_command(size_t *len); /* a suspension's kept image made ahead (suspend.c) */
HIDDEN void dump_release(struct sbuf *b);
HIDDEN void dump_kept_json(struct sbuf *b); /* its part of the status JSON */

/* ---- vmm.c: cuMemAlloc_v2 through the VMM API when GPUTRACE_SHIM_VMM=1, so `suspend` can release
 * an allocation's memory and `unsuspend` map new memory at the same address. */
HIDDEN int vmm_enabled(void);
HIDDEN CUresult vmm_release(struct rec *r); /* unmap and release the backing; the address stays */
HIDDEN CUresult vmm_remap(struct rec *r);   /* new backing at r->key; updates r->handle */
/* The program's own VMM objects (R_PHYS, R_MAP), for `suspend` / `unsuspend` (suspend.c). */
/* Device memory the shim does not carry, held now (CUDA arrays, memory imported from another process):
 * a checkpoint refuses while any is (dump.c), naming the first call that made one. */
HIDDEN extern atomic_int untracked_held;
HIDDEN extern const char *_Atomic untracked_what;
HIDDEN extern atomic_int vmm_pending; /* stream-ordered frees not yet given back */
HIDDEN int vmm_reap(int wait); /* gives back stream-ordered frees the stream has reached (all: wait); pending left */
HIDDEN int vmm_api(void);                          /* the driver has the VMM API (loaded once) */
HIDDEN CUresult vmm_own_unmap(const struct rec *m);
HIDDEN CUresult vmm_own_release(const struct rec *p);
HIDDEN CUresult vmm_own_create(struct rec *p);     /* new driver handle in p->handle */
HIDDEN CUresult vmm_own_map(const struct rec *m, uint64_t driver_handle, int writable);
HIDDEN CUresult vmm_own_access(const struct rec *m); /* the program's own access descriptors */
HIDDEN void vmm_translating(void);                 /* from now on program handles may differ from the driver's */
HIDDEN uint64_t vmm_retained(uint64_t driver_handle); /* cuMemRetainAllocationHandle: the program's value */
/* The driver's handle for the program's `h` in *drv; 1 (with *prop filled, when given) if the allocation
 * is suspended and has none. */
HIDDEN int vmm_translate_handle(uint64_t h, uint64_t *drv, CUmemAllocationProp *prop);

/* ---- digest.c: digests of device memory chunks, computed on the device (shim/digest.cu) */
struct dg_span {
    uint64_t ptr, len, ctx; /* one chunk: where, how long, the context its allocation belongs to */
};
struct digester;
/* Loads the kernel and makes scratch for up to caps[i] chunks in each context ctxs[i] (before the
 * gate closes).  NULL, with why filled, where the device or the driver cannot. */
HIDDEN struct digester *dg_open(const uint64_t *ctxs, const size_t *caps, int nctx, char *why, size_t wl);
/* Whether d (NULL: none was made) has scratch for the n chunks of s: each in a context it was made in,
 * no more there than it holds.  0 where the process allocated after it was made (nothing is run). */
HIDDEN int dg_covers(const struct digester *d, const struct dg_span *s, size_t n);
/* The digests of n chunks, 2 words each, in the chunks' order, into out; NULL, or why not (where
 * !dg_covers, before anything runs). */
HIDDEN const char *dg_run(struct digester *d, const struct dg_span *s, size_t n, uint64_t *out, uint64_t *ns,
                          char *why, size_t wl);
HIDDEN void dg_close(struct digester *d);

/* ---- control.c */
HIDDEN void control_start(void);     /* once per process (and again in a forked child) */
HIDDEN void control_atfork_child(void);
HIDDEN const char *control_path(void);

#define SCHEMA 1

#endif
