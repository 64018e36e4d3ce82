/* simcuda: a simulated CUDA driver (libcuda.so.1) for tests without a GPU.
 *
 * Exports the real driver API names and signatures, so a tracer sees the same symbols it would on a
 * real machine and programs written against cuda.h run unchanged.  The "GPU" is host memory and host
 * threads:
 *   - device memory is a PROT_NONE reservation at a fixed high address; allocations commit pieces of
 *     it, so device pointers are never valid host pointers and bad ones are caught;
 *   - every stream has a worker thread that runs the stream's operations in order; kernels are
 *     builtin host functions that occupy the stream for their configured duration (sleeping, not
 *     spinning: a GPU does not use the host's CPU), so synchronization really waits;
 *   - a module image is text: "SIMCUDA-MODULE\n" then lines "kernel NAME BUILTIN DURATION_NS".
 *
 * Rules that keep uprobe counts exact: an exported function never calls another exported one (they
 * share static implementations), and -fno-ipa-icf keeps identical bodies at distinct addresses.
 *
 * Environment, read by cuInit: SIMCUDA_KERNEL_NS (overrides every kernel's duration),
 * SIMCUDA_LAUNCH_NS (CPU busy-wait inside each launch call), SIMCUDA_MEM_BYTES (device memory,
 * default 16 GiB), SIMCUDA_DEVICES (device count, default 1), SIMCUDA_DEVICE (device mode: the
 * socket of a simcuda-device daemon that holds device memory outside the process; see device.c),
 * SIMCUDA_GROUP (ID:NRANKS:RANK: this process is a rank of a group whose collective kernels meet;
 * see "Collectives" below).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#pragma GCC visibility push(default)
#include "simcuda.h"
#pragma GCC visibility pop

#define DRIVER_VERSION 13000
#define MAX_DEVICES 8
#define CTX_STACK_MAX 64
#define PARAM_MAX 64
#define PAGE 4096UL
#define VMM_GRANULARITY (2UL << 20)
#ifndef ARENA_HINT
#define ARENA_HINT 0x200000000000UL /* 32 TiB: far from the heap, libraries and stacks */
#endif
#define PITCH_ALIGN 512UL

/* ------------------------------------------------------------------------------------------------
 * Global state.  One mutex guards every registry and queue; one condition variable is broadcast
 * whenever any operation completes, and every kind of waiting (stream, event, context, device) waits
 * on it.  The GPU work itself runs outside the lock. */

static pthread_mutex_t G = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t G_done = PTHREAD_COND_INITIALIZER;
static atomic_int g_init;   /* 0: not yet, 1: initialized, -1: a child forked after init (unusable) */
static long g_pending;      /* operations enqueued on any stream and not yet completed */

static struct {
    int kernel_ns_set;
    uint64_t kernel_ns;
    uint64_t launch_ns;
    uint64_t fail_copy_bytes; /* SIMCUDA_FAIL_COPY_BYTES: async copies of exactly this size fail (tests) */
    uint64_t no_ptx;          /* SIMCUDA_NO_PTX=1: PTX is refused, as by a driver too old to JIT it (tests) */
    size_t mem_bytes;
    int ndev;
} cfg;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void spin_ns(uint64_t ns)
{
    uint64_t end = now_ns() + ns;
    while (now_ns() < end)
        __builtin_ia32_pause();
}

static void sleep_until(uint64_t t)
{
    struct timespec ts = {(time_t)(t / 1000000000ULL), (long)(t % 1000000000ULL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

static uint64_t env_u64(const char *name, uint64_t dflt, int *set)
{
    const char *v = getenv(name);
    if (set)
        *set = 0;
    if (!v || !*v)
        return dflt;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    if (errno || *end) {
        fprintf(stderr, "simcuda: ignoring %s=%s (not a number)\n", name, v);
        return dflt;
    }
    if (set)
        *set = 1;
    return x;
}

/* ------------------------------------------------------------------------------------------------
 * Handle registry: the set of live handles and their types, so that a stale or made-up handle is
 * answered with an error instead of being dereferenced.  Open addressing with tombstones; G held. */

enum htype { H_NONE, H_CTX, H_STREAM, H_EVENT, H_MODULE, H_FUNC, H_LIBRARY, H_KERNEL, H_PHYS };
#define TOMB ((uintptr_t)1)

static struct {
    uintptr_t *key;
    unsigned char *type;
    size_t cap, used, live; /* used: live + tombstones */
} hs;

static size_t hs_slot(uintptr_t p, size_t cap)
{
    return (size_t)(((p >> 4) * 0x9E3779B97F4A7C15ULL) >> 17) & (cap - 1);
}

static int hs_add(const void *ptr, int type);

static int hs_grow(void)
{
    /* Mostly tombstones (handles created and destroyed in a loop): rehash at the same size. */
    size_t ncap = !hs.cap ? 256 : hs.live * 4 < hs.cap ? hs.cap : hs.cap * 2;
    uintptr_t *ok = hs.key;
    unsigned char *ot = hs.type;
    size_t ocap = hs.cap;
    hs.key = calloc(ncap, sizeof *hs.key);
    hs.type = calloc(ncap, 1);
    if (!hs.key || !hs.type) {
        free(hs.key);
        free(hs.type);
        hs.key = ok;
        hs.type = ot;
        return -1;
    }
    hs.cap = ncap;
    hs.used = hs.live = 0;
    for (size_t i = 0; i < ocap; i++)
        if (ok[i] > TOMB)
            hs_add((void *)ok[i], ot[i]);
    free(ok);
    free(ot);
    return 0;
}

static int hs_add(const void *ptr, int type)
{
    if ((hs.used + 1) * 2 > hs.cap && hs_grow())
        return -1;
    uintptr_t p = (uintptr_t)ptr;
    size_t i = hs_slot(p, hs.cap);
    while (hs.key[i] > TOMB)
        i = (i + 1) & (hs.cap - 1);
    if (hs.key[i] == 0)
        hs.used++;
    hs.live++;
    hs.key[i] = p;
    hs.type[i] = (unsigned char)type;
    return 0;
}

static int hs_type(const void *ptr)
{
    uintptr_t p = (uintptr_t)ptr;
    if (p <= TOMB || !hs.cap)
        return H_NONE;
    for (size_t i = hs_slot(p, hs.cap);; i = (i + 1) & (hs.cap - 1)) {
        if (hs.key[i] == p)
            return hs.type[i];
        if (hs.key[i] == 0)
            return H_NONE;
    }
}

static void hs_del(const void *ptr)
{
    uintptr_t p = (uintptr_t)ptr;
    if (p <= TOMB || !hs.cap)
        return;
    for (size_t i = hs_slot(p, hs.cap);; i = (i + 1) & (hs.cap - 1)) {
        if (hs.key[i] == p) {
            hs.key[i] = TOMB;
            hs.type[i] = H_NONE;
            hs.live--;
            return;
        }
        if (hs.key[i] == 0)
            return;
    }
}

/* ------------------------------------------------------------------------------------------------
 * Objects */

struct stream;

struct CUctx_st {
    int device;
    unsigned flags;
    int primary;
    int refs;             /* primary: retain count */
    atomic_int alive;
    long pending;         /* operations on this context's streams not yet completed */
    CUresult err;         /* asynchronous error, reported (and cleared) by cuCtxSynchronize */
    struct stream *streams;
    struct stream *null_stream;
};

enum opkind { OP_KERNEL, OP_COPY, OP_MEMSET, OP_RECORD, OP_WAIT, OP_FREE, OP_EXIT };
enum cpkind { CP_H2D, CP_D2H, CP_D2D };

struct CUevent_st {
    unsigned flags;
    int refs;             /* the handle + each pending operation + each waiter */
    int recorded;
    uint64_t rec_gen;     /* bumped by each cuEventRecord */
    uint64_t done_gen;    /* the newest record the GPU has passed */
    uint64_t ts_ns;
};

struct region;

struct op {
    struct op *next;
    int kind;
    uint64_t seq;
    uint64_t enq_ns;
    uint64_t dur_ns;
    int builtin;
    unsigned char params[PARAM_MAX];
    int cpkind;
    void *dst;
    const void *src;
    size_t n;
    void *staging;
    unsigned value;
    int elsize;
    struct CUevent_st *ev;
    uint64_t gen;
    struct region *region;
};

struct stream {
    struct CUctx_st *ctx;
    unsigned flags;
    int priority;
    int refs;             /* the handle (or the context, for the null stream) + worker + waiters */
    struct op *head, *tail;
    uint64_t submitted, completed;
    uint64_t vclock;      /* when the GPU finishes what this stream has run so far */
    uint64_t wake_at;     /* smallest sequence number a stream_wait waits for (UINT64_MAX: none) */
    CUresult err;
    pthread_cond_t work;
    struct stream *next;  /* in ctx->streams */
};

struct CUfunc_st {
    struct CUmod_st *mod;
    char *name;
    int builtin;
    uint64_t dur_ns;
};

struct CUkern_st {
    struct CUfunc_st *fn;
};

struct CUmod_st {
    struct CUctx_st *ctx;   /* NULL for a library */
    int is_library;
    int n;
    struct CUfunc_st **funcs;
    struct CUkern_st **kernels;
    struct CUmod_st *next;
};

struct region {
    struct region *next;
    uintptr_t base;
    size_t size;          /* address space taken, guard page included */
    size_t usable;        /* committed bytes */
    size_t req;           /* bytes asked for: the bounds that copies and kernels are checked against */
    int kind;             /* enum simcudaAllocKind */
    int pending_free;     /* cuMemFreeAsync enqueued: no new work may use it */
    int registered;       /* host memory of the program's, pinned by cuMemHostRegister_v2 */
    unsigned dev_id;      /* device mode: the simcuda-device allocation behind it (0: none) */
    struct CUctx_st *ctx;
};

struct phys {
    struct phys *next;
    int fd;
    size_t size;
    int device;
    int maps;
    int released;
    int retains;     /* cuMemRetainAllocationHandle: each needs a cuMemRelease of its own */
    unsigned dev_id; /* device mode: the simcuda-device allocation behind fd (0: a memfd) */
};

struct mapping {
    struct mapping *next;
    uintptr_t va;
    size_t size;
    struct phys *ph;
    size_t off;
    int access;
};

static struct CUctx_st *primary[MAX_DEVICES];
static struct CUmod_st *modules;
static struct region *regions;       /* inside the arena, sorted by base */
static struct region *host_regions;  /* pinned host memory */
static struct phys *physs;
static struct mapping *mappings;     /* sorted by va */
static uintptr_t arena_base;
static size_t arena_size;
static size_t mem_used;

static __thread struct CUctx_st *tls_stack[CTX_STACK_MAX];
static __thread int tls_depth;

static atomic_int g_locked; /* cuCheckpointProcessLock from another process (see the end of this file) */
static void ckpt_wait_unlocked(void);

/* Device mode (SIMCUDA_DEVICE=SOCKET, see simcuda/device.c): device memory comes from a daemon, as a
 * GPU's comes from the device, and the process holds a connection to it (its "/dev/nvidia*").
 * Without it, device memory is anonymous memory of the process itself. */
static int g_devfd = -1;
static char g_devpath[108];
static int dev_connect(void);
static int dev_get(size_t size, unsigned *id);
static void dev_put(unsigned id);

#define CHECK_INIT()                                                          \
    do {                                                                      \
        if (atomic_load_explicit(&g_init, memory_order_acquire) != 1)         \
            return CUDA_ERROR_NOT_INITIALIZED;                                \
        if (atomic_load_explicit(&g_locked, memory_order_acquire))            \
            ckpt_wait_unlocked();                                             \
    } while (0)

static CUresult cur_ctx(struct CUctx_st **out)
{
    struct CUctx_st *c = tls_depth ? tls_stack[tls_depth - 1] : NULL;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!atomic_load_explicit(&c->alive, memory_order_acquire))
        return c->primary ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_CONTEXT_IS_DESTROYED;
    *out = c;
    return CUDA_SUCCESS;
}

static int valid_device(CUdevice d)
{
    return d >= 0 && d < cfg.ndev;
}

static size_t round_up(size_t x, size_t a)
{
    return (x + a - 1) / a * a;
}

/* ------------------------------------------------------------------------------------------------
 * Builtin kernels.  Parameters are packed like CUDA's parameter buffer: each at its natural
 * alignment, in order. */

enum { K_SPIN, K_FILL_U32, K_ADD_F32, K_SCALE_F32, K_INC_U32, K_SUM_U32, K_LCG_U32, K_ALLREDUCE_U32, K_CHUNK_DIGEST,
       K_COUNT };

static const struct builtin {
    const char *name;
    int nparams;
    unsigned char psize[4];
} builtins[K_COUNT] = {
    [K_SPIN] = {"spin", 0, {0}},
    [K_FILL_U32] = {"fill_u32", 3, {8, 4, 8}},     /* (u32 *dst, u32 value, u64 n) */
    [K_ADD_F32] = {"add_f32", 4, {8, 8, 8, 8}},    /* (f32 *a, f32 *b, f32 *out, u64 n) */
    [K_SCALE_F32] = {"scale_f32", 3, {8, 4, 8}},   /* (f32 *x, f32 alpha, u64 n) */
    [K_INC_U32] = {"inc_u32", 2, {8, 8}},          /* (u32 *p, u64 n) */
    [K_SUM_U32] = {"sum_u32", 3, {8, 8, 8}},       /* (u32 *src, u64 n, u64 *out) */
    [K_LCG_U32] = {"lcg_u32", 3, {8, 4, 8}},       /* (u32 *x, u32 add, u64 n): x[i] = x[i]*1664525 + 1013904223 + add + i */
    [K_ALLREDUCE_U32] = {"allreduce_u32", 2, {8, 8}}, /* (u32 *buf, u64 n): in place, summed over the group's ranks */
    [K_CHUNK_DIGEST] = {"chunk_digest", 3, {8, 8, 8}}, /* (u64 *spans, u64 n, u64 *out): the shim's digest kernel */
};

/* The digest of one chunk, as shim/digest.cu defines it (and checkpointer/digest.py again). */
static uint64_t fmix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static void chunk_digest(const unsigned char *p, uint64_t len, uint64_t out[2])
{
    const uint64_t K1 = 0x9E3779B97F4A7C15ull, K2 = 0xC2B2AE3D27D4EB4Full, S1 = 0x243F6A8885A308D3ull,
                   S2 = 0x13198A2E03707344ull;
    uint64_t a = 0, b = 0, nw = (len + 7) / 8;
    for (uint64_t j = 0; j < nw; j++) {
        uint64_t v = 0;
        memcpy(&v, p + 8 * j, len - 8 * j < 8 ? len - 8 * j : 8);
        a += fmix64((v ^ S1) + K1 * (j + 1));
        b += fmix64((v ^ S2) + K2 * (j + 1));
    }
    out[0] = fmix64(a + len * K2);
    out[1] = fmix64(b ^ len);
}

/* ------------------------------------------------------------------------------------------------
 * Collectives.  A group of processes is named by SIMCUDA_GROUP=ID:NRANKS:RANK (read at cuInit); its
 * ranks meet in a shared file /dev/shm/simcuda-group-ID.  The allreduce_u32 kernel, as NCCL's
 * kernels do, completes only once every rank of the group has run its matching instance: the n-th
 * collective a process runs matches the n-th of every other rank.  It occupies its stream meanwhile
 * (the stream's worker waits in it, asleep), so synchronizing on that stream waits for the peers
 * too.  A peer that never comes leaves the stream waiting for good, as a real collective would
 * (NCCL's watchdog is no part of the driver).  Without a group, a collective is the identity. */

#define COLL_MAX_RANKS 16
#define COLL_MAX_WORDS (1u << 16)

struct coll_shm {
    _Atomic uint64_t arrive[COLL_MAX_RANKS]; /* the last collective each rank has put its data in for */
    _Atomic uint64_t depart[COLL_MAX_RANKS]; /* the last collective each rank has read everyone's data of */
    uint32_t data[COLL_MAX_RANKS][COLL_MAX_WORDS];
};

static struct {
    char id[64];
    int nranks, rank;
    struct coll_shm *shm;
    pthread_mutex_t mu;
    _Atomic uint64_t seq; /* collectives this process has run */
} coll = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void coll_config(void)
{
    const char *g = getenv("SIMCUDA_GROUP");
    char id[64];
    int n, r;
    coll.nranks = 0;
    if (!g || !*g)
        return;
    if (sscanf(g, "%63[A-Za-z0-9_.-]:%d:%d", id, &n, &r) != 3 || n < 1 || n > COLL_MAX_RANKS || r < 0 || r >= n) {
        fprintf(stderr, "simcuda: ignoring SIMCUDA_GROUP=%s (want ID:NRANKS:RANK, at most %d ranks)\n", g,
                COLL_MAX_RANKS);
        return;
    }
    snprintf(coll.id, sizeof coll.id, "%s", id);
    coll.nranks = n;
    coll.rank = r;
}

static struct coll_shm *coll_map(void)
{
    pthread_mutex_lock(&coll.mu);
    if (!coll.shm) {
        char path[128];
        snprintf(path, sizeof path, "/dev/shm/simcuda-group-%s", coll.id);
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size < sizeof(struct coll_shm) &&
            ftruncate(fd, sizeof(struct coll_shm)) != 0) {
            close(fd);
            fd = -1;
        }
        if (fd >= 0) {
            void *m = mmap(NULL, sizeof(struct coll_shm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
            if (m != MAP_FAILED)
                coll.shm = m;
        }
        if (!coll.shm)
            fprintf(stderr, "simcuda: cannot map the group file %s: %s\n", path, strerror(errno));
    }
    pthread_mutex_unlock(&coll.mu);
    return coll.shm;
}

/* Waits until every rank's counter in `v` has reached `seq` (asleep between looks). */
static void coll_wait(_Atomic uint64_t *v, uint64_t seq)
{
    long nap = 2000;
    for (;;) {
        int all = 1;
        for (int r = 0; r < coll.nranks && all; r++)
            all = atomic_load_explicit(&v[r], memory_order_acquire) >= seq;
        if (all)
            return;
        struct timespec ts = {0, nap};
        nanosleep(&ts, NULL);
        if (nap < 500000)
            nap *= 2;
    }
}

static void allreduce_u32(uint32_t *buf, uint64_t n)
{
    struct coll_shm *g = coll.nranks > 1 ? coll_map() : NULL;
    if (!g)
        return;
    uint64_t seq = atomic_fetch_add(&coll.seq, 1) + 1;
    memcpy(g->data[coll.rank], buf, n * 4);
    atomic_store_explicit(&g->arrive[coll.rank], seq, memory_order_release);
    coll_wait(g->arrive, seq);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t s = 0;
        for (int r = 0; r < coll.nranks; r++)
            s += g->data[r][i];
        buf[i] = s;
    }
    /* No rank overwrites its data for the next collective before every rank has read this one's. */
    atomic_store_explicit(&g->depart[coll.rank], seq, memory_order_release);
    coll_wait(g->depart, seq);
}

static size_t param_bytes(int b)
{
    size_t off = 0;
    for (int i = 0; i < builtins[b].nparams; i++)
        off = round_up(off, builtins[b].psize[i]) + builtins[b].psize[i];
    return off;
}

static uint64_t P64(const unsigned char *p, size_t off)
{
    uint64_t v;
    memcpy(&v, p + off, 8);
    return v;
}

static uint32_t P32(const unsigned char *p, size_t off)
{
    uint32_t v;
    memcpy(&v, p + off, 4);
    return v;
}

static int dev_range_ok(CUdeviceptr p, size_t n, int write, int allow_pending);

static int kernel_args_ok(int b, const unsigned char *pa, int allow_pending)
{
    uint64_t n;
    switch (b) {
    case K_FILL_U32:
        n = P64(pa, 16);
        return n <= SIZE_MAX / 4 && dev_range_ok(P64(pa, 0), n * 4, 1, allow_pending);
    case K_ADD_F32:
        n = P64(pa, 24);
        return n <= SIZE_MAX / 4 && dev_range_ok(P64(pa, 0), n * 4, 0, allow_pending) &&
               dev_range_ok(P64(pa, 8), n * 4, 0, allow_pending) && dev_range_ok(P64(pa, 16), n * 4, 1, allow_pending);
    case K_SCALE_F32:
        n = P64(pa, 16);
        return n <= SIZE_MAX / 4 && dev_range_ok(P64(pa, 0), n * 4, 1, allow_pending);
    case K_INC_U32:
        n = P64(pa, 8);
        return n <= SIZE_MAX / 4 && dev_range_ok(P64(pa, 0), n * 4, 1, allow_pending);
    case K_SUM_U32:
        n = P64(pa, 8);
        return n <= SIZE_MAX / 4 && dev_range_ok(P64(pa, 0), n * 4, 0, allow_pending) &&
               dev_range_ok(P64(pa, 16), 8, 1, allow_pending);
    case K_LCG_U32:
        n = P64(pa, 16);
        return n <= SIZE_MAX / 4 && dev_range_ok(P64(pa, 0), n * 4, 1, allow_pending);
    case K_ALLREDUCE_U32:
        n = P64(pa, 8);
        return n <= COLL_MAX_WORDS && dev_range_ok(P64(pa, 0), n * 4, 1, allow_pending);
    case K_CHUNK_DIGEST: {
        n = P64(pa, 8);
        if (n > SIZE_MAX / 16 || !dev_range_ok(P64(pa, 0), n * 16, 0, allow_pending) ||
            !dev_range_ok(P64(pa, 16), n * 16, 1, allow_pending))
            return 0;
        /* Each chunk it reads, too, once it runs (allow_pending: at launch the table may still be
         * on its way, copied on the same stream). */
        const uint64_t *sp = (const uint64_t *)(uintptr_t)P64(pa, 0);
        for (uint64_t i = 0; allow_pending && i < n; i++)
            if (!dev_range_ok(sp[2 * i], sp[2 * i + 1], 0, allow_pending))
                return 0;
        return 1;
    }
    default:
        return 1;
    }
}

static void kernel_run(int b, const unsigned char *pa)
{
    switch (b) {
    case K_FILL_U32: {
        uint32_t *d = (uint32_t *)(uintptr_t)P64(pa, 0), v = P32(pa, 8);
        for (uint64_t i = 0, n = P64(pa, 16); i < n; i++)
            d[i] = v;
        break;
    }
    case K_ADD_F32: {
        const float *a = (const float *)(uintptr_t)P64(pa, 0), *x = (const float *)(uintptr_t)P64(pa, 8);
        float *o = (float *)(uintptr_t)P64(pa, 16);
        for (uint64_t i = 0, n = P64(pa, 24); i < n; i++)
            o[i] = a[i] + x[i];
        break;
    }
    case K_SCALE_F32: {
        float *x = (float *)(uintptr_t)P64(pa, 0), alpha;
        uint32_t bits = P32(pa, 8);
        memcpy(&alpha, &bits, 4);
        for (uint64_t i = 0, n = P64(pa, 16); i < n; i++)
            x[i] *= alpha;
        break;
    }
    case K_INC_U32: {
        uint32_t *p = (uint32_t *)(uintptr_t)P64(pa, 0);
        for (uint64_t i = 0, n = P64(pa, 8); i < n; i++)
            p[i]++;
        break;
    }
    case K_SUM_U32: {
        const uint32_t *s = (const uint32_t *)(uintptr_t)P64(pa, 0);
        uint64_t sum = 0;
        for (uint64_t i = 0, n = P64(pa, 8); i < n; i++)
            sum += s[i];
        memcpy((void *)(uintptr_t)P64(pa, 16), &sum, 8);
        break;
    }
    case K_LCG_U32: {
        uint32_t *x = (uint32_t *)(uintptr_t)P64(pa, 0), add = P32(pa, 8);
        for (uint64_t i = 0, n = P64(pa, 16); i < n; i++)
            x[i] = x[i] * 1664525u + 1013904223u + add + (uint32_t)i;
        break;
    }
    case K_ALLREDUCE_U32:
        allreduce_u32((uint32_t *)(uintptr_t)P64(pa, 0), P64(pa, 8));
        break;
    case K_CHUNK_DIGEST: {
        const uint64_t *sp = (const uint64_t *)(uintptr_t)P64(pa, 0);
        uint64_t *out = (uint64_t *)(uintptr_t)P64(pa, 16);
        for (uint64_t i = 0, n = P64(pa, 8); i < n; i++)
            chunk_digest((const unsigned char *)(uintptr_t)sp[2 * i], sp[2 * i + 1], out + 2 * i);
        break;
    }
    default:
        break;
    }
}

/* ------------------------------------------------------------------------------------------------
 * Device memory: the arena and its registries (G held). */

static int arena_init(void)
{
    size_t want = cfg.mem_bytes * 4;
    if (want < (1UL << 30))
        want = 1UL << 30;
    want = round_up(want, VMM_GRANULARITY);
    for (; want >= cfg.mem_bytes && want >= VMM_GRANULARITY; want /= 2) {
        void *p = mmap((void *)ARENA_HINT, want, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
        if (p == MAP_FAILED)
            p = mmap((void *)ARENA_HINT, want, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p != MAP_FAILED) {
            /* The arena must be 2 MiB aligned so VMM granularity holds for its addresses. */
            uintptr_t b = round_up((uintptr_t)p, VMM_GRANULARITY);
            arena_base = b;
            arena_size = (uintptr_t)p + want - b;
            arena_size -= arena_size % VMM_GRANULARITY;
            return 0;
        }
    }
    return -1;
}

static int decommit(uintptr_t base, size_t size)
{
    return mmap((void *)base, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) ==
                   MAP_FAILED ? -1 : 0;
}

static int range_free(uintptr_t b, size_t size)
{
    if (b < arena_base || b + size > arena_base + arena_size || b + size < b)
        return 0;
    for (struct region *r = regions; r; r = r->next)
        if (b < r->base + r->size && r->base < b + size)
            return 0;
    return 1;
}

/* Takes address space: first fit, or exactly at `want` if it is free. */
static struct region *arena_take(size_t size, size_t align, uintptr_t want)
{
    uintptr_t b = 0;
    if (want && want % align == 0 && range_free(want, size)) {
        b = want;
    } else {
        uintptr_t cur = arena_base;
        for (struct region *r = regions;; r = r->next) {
            uintptr_t cand = round_up(cur, align);
            uintptr_t lim = r ? r->base : arena_base + arena_size;
            if (cand + size <= lim && cand + size > cand) {
                b = cand;
                break;
            }
            if (!r)
                return NULL;
            cur = r->base + r->size;
        }
    }
    struct region *n = calloc(1, sizeof *n);
    if (!n)
        return NULL;
    n->base = b;
    n->size = size;
    struct region **pp = &regions;
    while (*pp && (*pp)->base < b)
        pp = &(*pp)->next;
    n->next = *pp;
    *pp = n;
    return n;
}

static void region_unlink(struct region **list, struct region *r)
{
    for (struct region **pp = list; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            return;
        }
}

static int is_device_kind(int k)
{
    return k == SIMCUDA_ALLOC_DEVICE || k == SIMCUDA_ALLOC_PITCH || k == SIMCUDA_ALLOC_ASYNC;
}

static CUresult dev_alloc(CUdeviceptr *dptr, size_t bytes, int kind, struct CUctx_st *c)
{
    size_t usable = round_up(bytes, PAGE);
    if (usable < bytes || mem_used + usable > cfg.mem_bytes)
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* One PROT_NONE guard page after each allocation: an overrun faults instead of silently
     * writing into the neighbour. */
    struct region *r = arena_take(usable + PAGE, PAGE, 0);
    if (!r)
        return CUDA_ERROR_OUT_OF_MEMORY;
    unsigned id = 0;
    int fd = g_devpath[0] ? dev_get(usable, &id) : -1;
    if ((g_devpath[0] && fd < 0) ||
        mmap((void *)r->base, usable, PROT_READ | PROT_WRITE,
             fd >= 0 ? MAP_SHARED | MAP_FIXED : MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, fd, 0) ==
            MAP_FAILED) {
        if (fd >= 0) {
            close(fd);
            dev_put(id);
        }
        region_unlink(&regions, r);
        free(r);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (fd >= 0)
        close(fd); /* the mapping keeps the memory; the daemon keeps the file */
    r->dev_id = id;
    r->usable = usable;
    r->req = bytes;
    r->kind = kind;
    r->ctx = c;
    mem_used += usable;
    *dptr = r->base;
    return CUDA_SUCCESS;
}

static void dev_free(struct region *r)
{
    decommit(r->base, r->usable);
    dev_put(r->dev_id);
    mem_used -= r->usable;
    region_unlink(&regions, r);
    free(r);
}

static struct region *find_device_alloc(CUdeviceptr p)
{
    for (struct region *r = regions; r; r = r->next)
        if (r->base == p && is_device_kind(r->kind))
            return r;
    return NULL;
}

static int access_ok(int access, int write)
{
    return write ? access == CU_MEM_ACCESS_FLAGS_PROT_READWRITE : access != CU_MEM_ACCESS_FLAGS_PROT_NONE;
}

/* Is [p, p+n) device memory that may be used?  A plain allocation must contain it; VMM mappings
 * may cover it together. */
static int dev_range_ok(CUdeviceptr p, size_t n, int write, int allow_pending)
{
    if (n == 0)
        return 1;
    if (p < arena_base || p + n > arena_base + arena_size || p + n < p)
        return 0;
    for (struct region *r = regions; r && r->base <= p; r = r->next)
        if (is_device_kind(r->kind) && p + n <= r->base + r->req)
            return allow_pending || !r->pending_free;
    uintptr_t cur = p;
    for (struct mapping *m = mappings; m; m = m->next) {
        if (m->va + m->size <= cur)
            continue;
        if (m->va > cur || !access_ok(m->access, write))
            return 0;
        cur = m->va + m->size;
        if (cur >= p + n)
            return 1;
    }
    return 0;
}

static int in_arena(const void *h, size_t n)
{
    uintptr_t p = (uintptr_t)h;
    return p < arena_base + arena_size && p + (n ? n : 1) > arena_base;
}

static int is_pinned(const void *h, size_t n)
{
    uintptr_t p = (uintptr_t)h;
    for (struct region *r = host_regions; r; r = r->next)
        if (p >= r->base && p + n <= r->base + r->req)
            return 1;
    return 0;
}

static void phys_maybe_free(struct phys *ph)
{
    if (!ph->released || ph->maps)
        return;
    if (ph->fd >= 0)
        close(ph->fd);
    dev_put(ph->dev_id);
    mem_used -= ph->size;
    for (struct phys **pp = &physs; *pp; pp = &(*pp)->next)
        if (*pp == ph) {
            *pp = ph->next;
            break;
        }
    free(ph);
}

/* ------------------------------------------------------------------------------------------------
 * Streams and their workers */

static void event_unref(struct CUevent_st *e)
{
    if (--e->refs == 0)
        free(e);
}

static void stream_unref(struct stream *s)
{
    if (--s->refs == 0) {
        pthread_cond_destroy(&s->work);
        free(s);
    }
}

static void async_error(struct stream *s, CUresult r)
{
    s->err = r;
    s->ctx->err = r;
}

/* Runs one operation; G is held on entry and exit and released around the work itself. */
static void exec_op(struct stream *s, struct op *op)
{
    uint64_t start = op->enq_ns > s->vclock ? op->enq_ns : s->vclock;
    switch (op->kind) {
    case OP_KERNEL:
        if (!kernel_args_ok(op->builtin, op->params, 1)) {
            async_error(s, CUDA_ERROR_ILLEGAL_ADDRESS);
            break;
        }
        s->vclock = start + op->dur_ns;
        pthread_mutex_unlock(&G);
        kernel_run(op->builtin, op->params);
        if (now_ns() < start + op->dur_ns)
            sleep_until(start + op->dur_ns);
        pthread_mutex_lock(&G);
        break;
    case OP_COPY: {
        int ok = 1;
        if (op->cpkind != CP_H2D)
            ok = dev_range_ok((uintptr_t)op->src, op->n, 0, 1);
        if (op->cpkind != CP_D2H)
            ok = ok && dev_range_ok((uintptr_t)op->dst, op->n, 1, 1);
        if (!ok) {
            async_error(s, CUDA_ERROR_ILLEGAL_ADDRESS);
            break;
        }
        pthread_mutex_unlock(&G);
        if (op->n)
            memmove(op->dst, op->staging ? op->staging : op->src, op->n); /* device copies may overlap */
        uint64_t end = now_ns();
        pthread_mutex_lock(&G);
        s->vclock = end > start ? end : start;
        break;
    }
    case OP_MEMSET: {
        if (!dev_range_ok((uintptr_t)op->dst, op->n * op->elsize, 1, 1)) {
            async_error(s, CUDA_ERROR_ILLEGAL_ADDRESS);
            break;
        }
        pthread_mutex_unlock(&G);
        if (op->elsize == 1) {
            memset(op->dst, (int)op->value, op->n);
        } else {
            uint32_t *d = op->dst;
            for (size_t i = 0; i < op->n; i++)
                d[i] = op->value;
        }
        uint64_t end = now_ns();
        pthread_mutex_lock(&G);
        s->vclock = end > start ? end : start;
        break;
    }
    case OP_RECORD:
        s->vclock = start;
        if (op->gen > op->ev->done_gen) {
            op->ev->done_gen = op->gen;
            op->ev->ts_ns = start;
        }
        event_unref(op->ev);
        break;
    case OP_WAIT:
        while (op->ev->done_gen < op->gen)
            pthread_cond_wait(&G_done, &G);
        if (op->ev->ts_ns > s->vclock)
            s->vclock = op->ev->ts_ns;
        event_unref(op->ev);
        break;
    case OP_FREE:
        dev_free(op->region);
        break;
    default:
        break;
    }
}

static void *worker(void *arg)
{
    struct stream *s = arg;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); /* short kernels: wake near the deadline */
    pthread_mutex_lock(&G);
    for (;;) {
        while (!s->head)
            pthread_cond_wait(&s->work, &G);
        struct op *op = s->head;
        int exiting = op->kind == OP_EXIT;
        if (!exiting)
            exec_op(s, op);
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        s->completed = op->seq;
        if (!exiting) {
            s->ctx->pending--;
            g_pending--;
        }
        /* Wake waiters only when something they can wait for happened: the stream went idle
         * (stream, context and device waits), an event was passed, or a waited-for operation
         * finished.  Waking them after every operation costs two context switches each. */
        if (!s->head || op->kind == OP_RECORD || s->completed >= s->wake_at) {
            s->wake_at = UINT64_MAX;
            pthread_cond_broadcast(&G_done);
        }
        free(op->staging);
        free(op);
        if (exiting)
            break;
    }
    stream_unref(s);
    pthread_mutex_unlock(&G);
    return NULL;
}

static struct stream *stream_new(struct CUctx_st *c, unsigned flags, int priority)
{
    struct stream *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->ctx = c;
    s->flags = flags;
    s->priority = priority;
    s->refs = 2;
    s->wake_at = UINT64_MAX;
    pthread_cond_init(&s->work, NULL);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    /* The worker takes no signals: they belong to the application's threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    int rc = pthread_create(&t, &attr, worker, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc) {
        pthread_cond_destroy(&s->work);
        free(s);
        return NULL;
    }
    return s;
}

static void enqueue(struct stream *s, struct op *op)
{
    op->seq = ++s->submitted;
    op->enq_ns = now_ns();
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    if (op->kind != OP_EXIT) {
        s->ctx->pending++;
        g_pending++;
    }
    pthread_cond_signal(&s->work);
}

/* The worker finishes what is queued, then exits and frees the stream once unreferenced. */
static void stream_kill(struct stream *s)
{
    struct op *op = calloc(1, sizeof *op);
    if (!op)
        abort();
    op->kind = OP_EXIT;
    enqueue(s, op);
    stream_unref(s); /* the handle's reference */
}

/* NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD all mean the context's null stream here. */
static CUresult get_stream(CUstream h, struct CUctx_st *c, struct stream **out)
{
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        if (!c->null_stream && !(c->null_stream = stream_new(c, 0, 0)))
            return CUDA_ERROR_OUT_OF_MEMORY;
        *out = c->null_stream;
        return CUDA_SUCCESS;
    }
    if (hs_type(h) != H_STREAM)
        return CUDA_ERROR_INVALID_HANDLE;
    *out = (struct stream *)h;
    return CUDA_SUCCESS;
}

static CUresult stream_wait(struct stream *s, uint64_t seq)
{
    s->refs++;
    while (s->completed < seq) {
        if (seq < s->wake_at)
            s->wake_at = seq;
        pthread_cond_wait(&G_done, &G);
    }
    CUresult r = s->err;
    s->err = CUDA_SUCCESS;
    stream_unref(s);
    return r;
}

static void wait_device_idle(void)
{
    while (g_pending)
        pthread_cond_wait(&G_done, &G);
}

static void module_free(struct CUmod_st *m)
{
    for (struct CUmod_st **pp = &modules; *pp; pp = &(*pp)->next)
        if (*pp == m) {
            *pp = m->next;
            break;
        }
    hs_del(m);
    for (int i = 0; i < m->n; i++) {
        hs_del(m->funcs[i]);
        free(m->funcs[i]->name);
        free(m->funcs[i]);
        if (m->kernels) {
            hs_del(m->kernels[i]);
            free(m->kernels[i]);
        }
    }
    free(m->funcs);
    free(m->kernels);
    free(m);
}

/* Frees everything a context owns; its handle stays registered only if it is a primary context. */
static void ctx_teardown(struct CUctx_st *c)
{
    while (c->pending)
        pthread_cond_wait(&G_done, &G);
    while (c->streams) {
        struct stream *s = c->streams;
        c->streams = s->next;
        hs_del(s);
        stream_kill(s);
    }
    if (c->null_stream) {
        stream_kill(c->null_stream);
        c->null_stream = NULL;
    }
    for (struct region *r = regions, *nx; r; r = nx) {
        nx = r->next;
        if (r->ctx == c && is_device_kind(r->kind))
            dev_free(r);
    }
    for (struct region *r = host_regions, *nx; r; r = nx) {
        nx = r->next;
        if (r->ctx == c) {
            munmap((void *)r->base, r->usable);
            region_unlink(&host_regions, r);
            free(r);
        }
    }
    for (struct CUmod_st *m = modules, *nx; m; m = nx) {
        nx = m->next;
        if (m->ctx == c)
            module_free(m);
    }
    c->err = CUDA_SUCCESS;
    atomic_store_explicit(&c->alive, 0, memory_order_release);
}

/* ------------------------------------------------------------------------------------------------
 * Initialization, fork */

static void atfork_prepare(void) { pthread_mutex_lock(&G); }
static void atfork_parent(void) { pthread_mutex_unlock(&G); }

static void atfork_child(void)
{
    /* The stream workers did not survive the fork: like the real driver, refuse to go on in the
     * child rather than hang in the first synchronization. */
    if (atomic_load(&g_init) == 1)
        atomic_store(&g_init, -1);
    if (g_devfd >= 0) { /* the device belongs to the parent */
        close(g_devfd);
        g_devfd = -1;
    }
    tls_depth = 0;
    pthread_mutex_unlock(&G);
}

__attribute__((constructor)) static void simcuda_ctor(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

static void ckpt_serve(void);

CUresult cuInit(unsigned int Flags)
{
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    int st = atomic_load(&g_init);
    if (st == -1) {
        r = CUDA_ERROR_NOT_INITIALIZED;
    } else if (st == 0) {
        cfg.kernel_ns = env_u64("SIMCUDA_KERNEL_NS", 0, &cfg.kernel_ns_set);
        cfg.launch_ns = env_u64("SIMCUDA_LAUNCH_NS", 0, NULL);
        cfg.fail_copy_bytes = env_u64("SIMCUDA_FAIL_COPY_BYTES", 0, NULL);
        cfg.no_ptx = env_u64("SIMCUDA_NO_PTX", 0, NULL);
        cfg.mem_bytes = round_up(env_u64("SIMCUDA_MEM_BYTES", 16ULL << 30, NULL), VMM_GRANULARITY);
        cfg.ndev = (int)env_u64("SIMCUDA_DEVICES", 1, NULL);
        coll_config();
        if (cfg.ndev < 0 || cfg.ndev > MAX_DEVICES)
            cfg.ndev = 1;
        const char *dev = getenv("SIMCUDA_DEVICE");
        if (dev && *dev)
            snprintf(g_devpath, sizeof g_devpath, "%s", dev);
        if (cfg.ndev == 0) {
            r = CUDA_ERROR_NO_DEVICE;
        } else if (g_devpath[0] && dev_connect() != 0) {
            fprintf(stderr, "simcuda: cannot reach the device at SIMCUDA_DEVICE=%s: %s\n", g_devpath, strerror(errno));
            r = CUDA_ERROR_NO_DEVICE;
        } else if (cfg.mem_bytes == 0 || arena_init()) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            for (int d = 0; d < cfg.ndev && !r; d++) {
                primary[d] = calloc(1, sizeof *primary[d]);
                if (!primary[d] || hs_add(primary[d], H_CTX)) {
                    r = CUDA_ERROR_OUT_OF_MEMORY;
                    break;
                }
                primary[d]->device = d;
                primary[d]->primary = 1;
            }
            if (!r)
                atomic_store_explicit(&g_init, 1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&G);
    if (!r && st == 0)
        ckpt_serve();
    return r;
}

CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

static const struct {
    CUresult code;
    const char *name, *text;
} errtab[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT", "context already current"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "primary context active"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult err_lookup(CUresult error, const char **pStr, int text)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errtab / sizeof errtab[0]; i++)
        if (errtab[i].code == error) {
            *pStr = text ? errtab[i].text : errtab[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult error, const char **pStr) { return err_lookup(error, pStr, 0); }
CUresult cuGetErrorString(CUresult error, const char **pStr) { return err_lookup(error, pStr, 1); }

CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId)
{
    if (!ppExportTable || !pExportTableId)
        return CUDA_ERROR_INVALID_VALUE;
    *ppExportTable = NULL;
    return CUDA_ERROR_NOT_SUPPORTED; /* the runtime's private tables: simcuda has none */
}

/* ------------------------------------------------------------------------------------------------
 * Devices */

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CHECK_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count)
{
    CHECK_INIT();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = cfg.ndev;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CHECK_INIT();
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "SimCUDA Virtual GPU");
    return CUDA_SUCCESS;
}

static int attr_value(int a)
{
    switch (a) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: return 64;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: return 2147483647;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: return 65535;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: return 65535;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: return 49152;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: return 65536;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: return 2147483647;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: return 65536;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: return 1980000;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: return 512;
    case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP: return 1;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return 132;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: return 1;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: return 1;
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: return 1;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: return 2619000;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: return 5120;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: return 52428800;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: return 2048;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: return 2;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: return 1;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return 9;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return 0;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: return 233472;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: return 65536;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: return 1;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: return 232448;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: return 32;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: return 1;
    default: return 0;
    }
}

CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    CHECK_INIT();
    if (!pi || (int)attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *pi = attrib == CU_DEVICE_ATTRIBUTE_PCI_BUS_ID ? 0x18 + dev : attr_value(attrib);
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CHECK_INIT();
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = cfg.mem_bytes;
    return CUDA_SUCCESS;
}

static CUresult device_uuid(CUuuid *uuid, CUdevice dev)
{
    CHECK_INIT();
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    memcpy(uuid->bytes, "SIMCUDA-GPU-0000", 16);
    uuid->bytes[15] = (char)('0' + dev);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return device_uuid(uuid, dev); }
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return device_uuid(uuid, dev); }

/* ------------------------------------------------------------------------------------------------
 * Primary contexts and contexts */

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CHECK_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&G);
    struct CUctx_st *c = primary[dev];
    if (c->refs++ == 0)
        atomic_store_explicit(&c->alive, 1, memory_order_release);
    pthread_mutex_unlock(&G);
    *pctx = c;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CHECK_INIT();
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    struct CUctx_st *c = primary[dev];
    if (c->refs == 0)
        r = CUDA_ERROR_INVALID_CONTEXT;
    else if (--c->refs == 0)
        ctx_teardown(c);
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    CHECK_INIT();
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&G);
    *flags = primary[dev]->flags;
    *active = atomic_load(&primary[dev]->alive);
    pthread_mutex_unlock(&G);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    CHECK_INIT();
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (flags & ~CU_CTX_FLAGS_MASK)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G);
    primary[dev]->flags = flags;
    pthread_mutex_unlock(&G);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    CHECK_INIT();
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&G);
    struct CUctx_st *c = primary[dev];
    if (atomic_load(&c->alive))
        ctx_teardown(c);
    c->refs = 0;
    c->flags = 0;
    pthread_mutex_unlock(&G);
    return CUDA_SUCCESS;
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CHECK_INIT();
    if (!pctx || (flags & ~CU_CTX_FLAGS_MASK))
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (tls_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUctx_st *c = calloc(1, sizeof *c);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->device = dev;
    c->flags = flags;
    atomic_store(&c->alive, 1);
    pthread_mutex_lock(&G);
    int bad = hs_add(c, H_CTX);
    pthread_mutex_unlock(&G);
    if (bad) {
        free(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    tls_stack[tls_depth++] = c;
    *pctx = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CHECK_INIT();
    pthread_mutex_lock(&G);
    if (hs_type(ctx) != H_CTX || ctx->primary) {
        pthread_mutex_unlock(&G);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    hs_del(ctx);
    ctx_teardown(ctx);
    pthread_mutex_unlock(&G);
    /* The struct is never freed: other threads may still hold it as current, and must get
     * CUDA_ERROR_CONTEXT_IS_DESTROYED rather than read freed memory. */
    if (tls_depth && tls_stack[tls_depth - 1] == ctx)
        tls_depth--;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CHECK_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = tls_depth ? tls_stack[tls_depth - 1] : NULL;
    return CUDA_SUCCESS;
}

static CUresult check_ctx_handle(CUcontext ctx)
{
    pthread_mutex_lock(&G);
    int t = hs_type(ctx);
    pthread_mutex_unlock(&G);
    return t == H_CTX ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CHECK_INIT();
    if (!ctx) {
        if (tls_depth)
            tls_depth--;
        return CUDA_SUCCESS;
    }
    CUresult r = check_ctx_handle(ctx);
    if (r)
        return r;
    if (tls_depth)
        tls_stack[tls_depth - 1] = ctx;
    else
        tls_stack[tls_depth++] = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CHECK_INIT();
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_ctx_handle(ctx);
    if (r)
        return r;
    if (tls_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    tls_stack[tls_depth++] = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CHECK_INIT();
    if (!tls_depth)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *c = tls_stack[--tls_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device)
{
    CHECK_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    *device = c->device;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx)
{
    CHECK_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    if (ctx) {
        CUresult r = check_ctx_handle(ctx);
        if (r)
            return r;
        c = ctx;
    } else {
        CUresult r = cur_ctx(&c);
        if (r)
            return r;
    }
    *device = c->device;
    return CUDA_SUCCESS;
}

static CUresult ctx_sync(struct CUctx_st *c)
{
    pthread_mutex_lock(&G);
    while (c->pending)
        pthread_cond_wait(&G_done, &G);
    CUresult r = c->err;
    c->err = CUDA_SUCCESS;
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuCtxSynchronize(void)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    return r ? r : ctx_sync(c);
}

CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r;
    if (ctx) {
        if ((r = check_ctx_handle(ctx)))
            return r;
        c = ctx;
    } else if ((r = cur_ctx(&c))) {
        return r;
    }
    return ctx_sync(c);
}

/* ------------------------------------------------------------------------------------------------
 * Memory */

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!dptr || !bytesize)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G);
    r = dev_alloc(dptr, bytesize, SIMCUDA_ALLOC_DEVICE, c);
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!dptr || !pPitch || !WidthInBytes || !Height ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = round_up(WidthInBytes, PITCH_ALIGN);
    if (Height > SIZE_MAX / pitch)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&G);
    r = dev_alloc(dptr, pitch * Height, SIMCUDA_ALLOC_PITCH, c);
    pthread_mutex_unlock(&G);
    if (!r)
        *pPitch = pitch;
    return r;
}

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!dptr)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    /* Like cudaFree, freeing waits for the device: nothing queued may still use the memory. */
    wait_device_idle();
    struct region *reg = find_device_alloc(dptr);
    if (!reg || reg->pending_free)
        r = CUDA_ERROR_INVALID_VALUE;
    else
        dev_free(reg);
    pthread_mutex_unlock(&G);
    return r;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream h)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!dptr || !bytesize)
        return CUDA_ERROR_INVALID_VALUE;
    struct stream *s;
    pthread_mutex_lock(&G);
    if (!(r = get_stream(h, c, &s)))
        r = dev_alloc(dptr, bytesize, SIMCUDA_ALLOC_ASYNC, c);
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) { return alloc_async(dptr, bytesize, hStream); }

/* Memory pools: a handle per pool, and a default one per device. What an allocation from a pool
 * gets is what cuMemAllocAsync gives (simcuda keeps no pool of freed memory: a free gives it back
 * once the stream reaches it, as a pool whose release threshold is 0 does at a synchronization). */
struct CUmemPoolHandle_st {
    int dev;
    int is_default;
};
static struct CUmemPoolHandle_st default_pools[64];

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    CHECK_INIT();
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev) || dev >= 64)
        return CUDA_ERROR_INVALID_DEVICE;
    default_pools[dev] = (struct CUmemPoolHandle_st){dev, 1};
    *pool = &default_pools[dev];
    return CUDA_SUCCESS;
}

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    CHECK_INIT();
    if (!pool || !props || props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(props->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->dev = props->location.id;
    *pool = p;
    return CUDA_SUCCESS;
}

CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    CHECK_INIT();
    if (!pool || pool->is_default)
        return CUDA_ERROR_INVALID_VALUE;
    free(pool);
    return CUDA_SUCCESS;
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    return alloc_async(dptr, bytesize, hStream);
}
/* CUDA arrays (textures' memory): opaque to kernels here; only their size is accounted. */
struct CUarray_st {
    size_t bytes;
};

CUresult cuArrayCreate_v2(CUarray *ph, const CUDA_ARRAY_DESCRIPTOR *d)
{
    CHECK_INIT();
    if (!ph || !d || !d->Width || !d->NumChannels ||
        (d->Format != CU_AD_FORMAT_UNSIGNED_INT8 && d->Format != CU_AD_FORMAT_FLOAT))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUarray_st *a = calloc(1, sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    a->bytes = d->Width * (d->Height ? d->Height : 1) * d->NumChannels * (d->Format == CU_AD_FORMAT_FLOAT ? 4 : 1);
    pthread_mutex_lock(&G);
    mem_used += a->bytes;
    pthread_mutex_unlock(&G);
    *ph = a;
    return CUDA_SUCCESS;
}

CUresult cuArrayDestroy(CUarray a)
{
    CHECK_INIT();
    if (!a)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G);
    mem_used -= a->bytes;
    pthread_mutex_unlock(&G);
    free(a);
    return CUDA_SUCCESS;
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    return cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream ? hStream : CU_STREAM_PER_THREAD);
}
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) { return alloc_async(dptr, bytesize, hStream ? hStream : CU_STREAM_PER_THREAD); }

static CUresult free_async(CUdeviceptr dptr, CUstream h)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    struct op *op = calloc(1, sizeof *op);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct stream *s;
    pthread_mutex_lock(&G);
    struct region *reg = find_device_alloc(dptr);
    if (!reg || reg->pending_free) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else if (!(r = get_stream(h, c, &s))) {
        reg->pending_free = 1;
        op->kind = OP_FREE;
        op->region = reg;
        enqueue(s, op);
        op = NULL;
    }
    pthread_mutex_unlock(&G);
    free(op);
    return r;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream ? hStream : CU_STREAM_PER_THREAD); }

static CUresult host_alloc(void **pp, size_t bytesize, unsigned int flags)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!pp || !bytesize || (flags & ~7u))
        return CUDA_ERROR_INVALID_VALUE;
    size_t usable = round_up(bytesize, PAGE);
    void *p = mmap(NULL, usable, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct region *reg = calloc(1, sizeof *reg);
    if (!reg) {
        munmap(p, usable);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    reg->base = (uintptr_t)p;
    reg->size = reg->usable = usable;
    reg->req = bytesize;
    reg->kind = SIMCUDA_ALLOC_HOST;
    reg->ctx = c;
    pthread_mutex_lock(&G);
    reg->next = host_regions;
    host_regions = reg;
    pthread_mutex_unlock(&G);
    *pp = p;
    return CUDA_SUCCESS;
}

CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) { return host_alloc(pp, bytesize, 0); }
CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) { return host_alloc(pp, bytesize, Flags); }

CUresult cuMemFreeHost(void *p)
{
    CHECK_INIT();
    struct region *reg;
    pthread_mutex_lock(&G);
    wait_device_idle(); /* a queued async copy may still read or write it */
    for (reg = host_regions; reg && (reg->base != (uintptr_t)p || reg->registered); reg = reg->next)
        ;
    if (reg)
        region_unlink(&host_regions, reg);
    pthread_mutex_unlock(&G);
    if (!reg)
        return CUDA_ERROR_INVALID_VALUE;
    munmap((void *)reg->base, reg->usable);
    free(reg);
    return CUDA_SUCCESS;
}

/* The program's own memory made "pinned": copies to and from it run asynchronously. */
CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!p || !bytesize || (Flags & ~0xFu) || in_arena(p, bytesize))
        return CUDA_ERROR_INVALID_VALUE;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    /* Pinning faults every page in, as the real driver's does: copies to it later take no faults. */
    uintptr_t a = (uintptr_t)p & ~(PAGE - 1);
    madvise((void *)a, round_up((uintptr_t)p + bytesize - a, PAGE), MADV_POPULATE_WRITE);
    struct region *reg = calloc(1, sizeof *reg);
    if (!reg)
        return CUDA_ERROR_OUT_OF_MEMORY;
    reg->base = (uintptr_t)p;
    reg->size = reg->usable = bytesize;
    reg->req = bytesize;
    reg->kind = SIMCUDA_ALLOC_HOST;
    reg->registered = 1;
    reg->ctx = c;
    pthread_mutex_lock(&G);
    for (struct region *o = host_regions; o; o = o->next)
        if ((uintptr_t)p < o->base + o->req && o->base < (uintptr_t)p + bytesize)
            r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    if (!r) {
        reg->next = host_regions;
        host_regions = reg;
    }
    pthread_mutex_unlock(&G);
    if (r)
        free(reg);
    return r;
}

CUresult cuMemHostUnregister(void *p)
{
    CHECK_INIT();
    struct region *reg;
    pthread_mutex_lock(&G);
    wait_device_idle(); /* a queued async copy may still use it */
    for (reg = host_regions; reg && (reg->base != (uintptr_t)p || !reg->registered); reg = reg->next)
        ;
    if (reg)
        region_unlink(&host_regions, reg);
    pthread_mutex_unlock(&G);
    if (!reg)
        return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    free(reg);
    return CUDA_SUCCESS;
}

static size_t ckpt_freed_bytes(void);

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!free_bytes || !total)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G);
    *free_bytes = cfg.mem_bytes - mem_used + ckpt_freed_bytes();
    *total = cfg.mem_bytes;
    pthread_mutex_unlock(&G);
    return CUDA_SUCCESS;
}

/* Copies: `sync` ones wait for completion; async ones return at once, except where the real driver
 * is synchronous too (device to pageable host memory).  Host memory that is not pinned is staged
 * at the call for host-to-device copies, so the caller may reuse its buffer on return. */
static CUresult copy_impl(int kind, void *dst, const void *src, size_t n, CUstream h, int async)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (n && (!dst || !src))
        return CUDA_ERROR_INVALID_VALUE;
    if (async && cfg.fail_copy_bytes && n == cfg.fail_copy_bytes) /* an injected driver error */
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    struct op *op = calloc(1, sizeof *op);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    op->kind = OP_COPY;
    op->cpkind = kind;
    op->dst = dst;
    op->src = src;
    op->n = n;
    struct stream *s;
    int wait = !async;
    pthread_mutex_lock(&G);
    int ok = 1;
    if (kind == CP_H2D)
        ok = !in_arena(src, n);
    else
        ok = dev_range_ok((uintptr_t)src, n, 0, 0);
    if (kind == CP_D2H)
        ok = ok && !in_arena(dst, n);
    else
        ok = ok && dev_range_ok((uintptr_t)dst, n, 1, 0);
    if (!ok) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else if (!(r = get_stream(h, c, &s))) {
        if (async && kind == CP_D2H && !is_pinned(dst, n))
            wait = 1;
        if (async && kind == CP_H2D && n && !is_pinned(src, n)) {
            if ((op->staging = malloc(n)))
                memcpy(op->staging, src, n);
            else
                wait = 1;
        }
        enqueue(s, op);
        uint64_t seq = op->seq;
        op = NULL;
        if (wait)
            r = stream_wait(s, seq);
    }
    pthread_mutex_unlock(&G);
    free(op);
    return r;
}

#define HPTR(p) ((void *)(uintptr_t)(p))
#define PTSZ(h) ((h) ? (h) : CU_STREAM_PER_THREAD)

CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { return copy_impl(CP_H2D, HPTR(d), s, n, NULL, 0); }
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void *s, size_t n) { return copy_impl(CP_H2D, HPTR(d), s, n, CU_STREAM_PER_THREAD, 0); }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { return copy_impl(CP_D2H, d, HPTR(s), n, NULL, 0); }
CUresult cuMemcpyDtoH_v2_ptds(void *d, CUdeviceptr s, size_t n) { return copy_impl(CP_D2H, d, HPTR(s), n, CU_STREAM_PER_THREAD, 0); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy_impl(CP_D2D, HPTR(d), HPTR(s), n, NULL, 0); }
CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy_impl(CP_D2D, HPTR(d), HPTR(s), n, CU_STREAM_PER_THREAD, 0); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, CUstream h) { return copy_impl(CP_H2D, HPTR(d), s, n, h, 1); }
CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void *s, size_t n, CUstream h) { return copy_impl(CP_H2D, HPTR(d), s, n, PTSZ(h), 1); }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, CUstream h) { return copy_impl(CP_D2H, d, HPTR(s), n, h, 1); }
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *d, CUdeviceptr s, size_t n, CUstream h) { return copy_impl(CP_D2H, d, HPTR(s), n, PTSZ(h), 1); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { return copy_impl(CP_D2D, HPTR(d), HPTR(s), n, h, 1); }
CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { return copy_impl(CP_D2D, HPTR(d), HPTR(s), n, PTSZ(h), 1); }

/* Memsets are asynchronous with respect to the host, as on the real driver for device memory. */
static CUresult memset_impl(CUdeviceptr d, unsigned value, int elsize, size_t n, CUstream h)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if ((elsize == 4 && d % 4) || n > SIZE_MAX / (size_t)elsize)
        return CUDA_ERROR_INVALID_VALUE;
    struct op *op = calloc(1, sizeof *op);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    op->kind = OP_MEMSET;
    op->dst = HPTR(d);
    op->n = n;
    op->elsize = elsize;
    op->value = value;
    struct stream *s;
    pthread_mutex_lock(&G);
    if (!dev_range_ok(d, n * elsize, 1, 0)) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else if (!(r = get_stream(h, c, &s))) {
        enqueue(s, op);
        op = NULL;
    }
    pthread_mutex_unlock(&G);
    free(op);
    return r;
}

CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char uc, size_t n) { return memset_impl(d, uc, 1, n, NULL); }
CUresult cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char uc, size_t n) { return memset_impl(d, uc, 1, n, CU_STREAM_PER_THREAD); }
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int ui, size_t n) { return memset_impl(d, ui, 4, n, NULL); }
CUresult cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int ui, size_t n) { return memset_impl(d, ui, 4, n, CU_STREAM_PER_THREAD); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char uc, size_t n, CUstream h) { return memset_impl(d, uc, 1, n, h); }
CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char uc, size_t n, CUstream h) { return memset_impl(d, uc, 1, n, PTSZ(h)); }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int ui, size_t n, CUstream h) { return memset_impl(d, ui, 4, n, h); }
CUresult cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int ui, size_t n, CUstream h) { return memset_impl(d, ui, 4, n, PTSZ(h)); }

/* ------------------------------------------------------------------------------------------------
 * Virtual memory management: handles are memfds, so one handle mapped at two addresses shows the
 * same bytes at both, as on the GPU. */

static int prop_ok(const CUmemAllocationProp *prop)
{
    return prop && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
           valid_device(prop->location.id) &&
           (prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_NONE ||
            prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option)
{
    CHECK_INIT();
    if (!granularity || !prop_ok(prop) ||
        (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags)
{
    CHECK_INIT();
    if (!handle || !prop_ok(prop) || flags || !size || size % VMM_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    struct phys *ph = calloc(1, sizeof *ph);
    if (!ph)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    if (mem_used + size > cfg.mem_bytes) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        ph->fd = g_devpath[0] ? dev_get(size, &ph->dev_id) : memfd_create("simcuda-vmm", MFD_CLOEXEC);
        if (ph->fd < 0 || ftruncate(ph->fd, (off_t)size) || hs_add(ph, H_PHYS)) {
            if (ph->fd >= 0)
                close(ph->fd);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            ph->size = size;
            ph->device = prop->location.id;
            ph->next = physs;
            physs = ph;
            mem_used += size;
            *handle = (uintptr_t)ph;
            ph = NULL;
        }
    }
    pthread_mutex_unlock(&G);
    free(ph);
    return r;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CHECK_INIT();
    struct phys *ph = (struct phys *)(uintptr_t)handle;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    if (hs_type(ph) != H_PHYS) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else if (ph->retains) {
        ph->retains--;
    } else {
        /* Released memory lives on until its last mapping goes. */
        hs_del(ph);
        ph->released = 1;
        phys_maybe_free(ph);
    }
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle)
{
    CHECK_INIT();
    struct phys *ph = (struct phys *)(uintptr_t)handle;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G);
    if (prop && hs_type(ph) == H_PHYS) {
        memset(prop, 0, sizeof *prop);
        prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = ph->device;
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&G);
    return r;
}

/* The handle of the allocation mapped at `addr`, one more reference to it (released handles too,
 * as long as they are mapped: the handle is valid again until released once more). */
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    CHECK_INIT();
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G);
    for (struct mapping *m = mappings; m; m = m->next)
        if ((uintptr_t)addr >= m->va && (uintptr_t)addr < m->va + m->size) {
            struct phys *ph = m->ph;
            if (!ph->released) {
                ph->retains++;
                r = CUDA_SUCCESS;
            } else if (!hs_add(ph, H_PHYS)) {
                ph->released = 0;
                r = CUDA_SUCCESS;
            } else {
                r = CUDA_ERROR_OUT_OF_MEMORY;
            }
            if (!r)
                *handle = (uintptr_t)ph;
            break;
        }
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags)
{
    CHECK_INIT();
    if (!ptr || flags || !size || size % VMM_GRANULARITY || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    if (alignment < VMM_GRANULARITY)
        alignment = VMM_GRANULARITY;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    struct region *reg = arena_take(size, alignment, addr);
    if (!reg) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        reg->kind = SIMCUDA_ALLOC_VA_RESERVE;
        reg->usable = reg->req = size;
        *ptr = reg->base;
    }
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    CHECK_INIT();
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G);
    for (struct region *reg = regions; reg; reg = reg->next) {
        if (reg->base != ptr || reg->kind != SIMCUDA_ALLOC_VA_RESERVE || reg->size != size)
            continue;
        int mapped = 0;
        for (struct mapping *m = mappings; m; m = m->next)
            mapped |= m->va >= reg->base && m->va < reg->base + reg->size;
        if (!mapped) {
            region_unlink(&regions, reg);
            free(reg);
            r = CUDA_SUCCESS;
        }
        break;
    }
    pthread_mutex_unlock(&G);
    return r;
}

static struct region *reservation_of(uintptr_t p, size_t size)
{
    for (struct region *reg = regions; reg; reg = reg->next)
        if (reg->kind == SIMCUDA_ALLOC_VA_RESERVE && p >= reg->base && p + size <= reg->base + reg->size &&
            p + size > p)
            return reg;
    return NULL;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags)
{
    CHECK_INIT();
    if (flags || !size || size % VMM_GRANULARITY || offset % VMM_GRANULARITY || ptr % VMM_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    struct phys *ph = (struct phys *)(uintptr_t)handle;
    struct mapping *nm = calloc(1, sizeof *nm);
    if (!nm)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G);
    if (hs_type(ph) == H_PHYS && offset + size <= ph->size && offset + size > offset && reservation_of(ptr, size)) {
        struct mapping **pp = &mappings;
        int overlap = 0;
        for (struct mapping *m = mappings; m; m = m->next)
            overlap |= ptr < m->va + m->size && m->va < ptr + size;
        if (!overlap) {
            /* Mapped but inaccessible until cuMemSetAccess, as on the GPU. */
            if (mmap(HPTR(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, ph->fd, (off_t)offset) == MAP_FAILED) {
                r = CUDA_ERROR_OUT_OF_MEMORY;
            } else {
                nm->va = ptr;
                nm->size = size;
                nm->ph = ph;
                nm->off = offset;
                while (*pp && (*pp)->va < ptr)
                    pp = &(*pp)->next;
                nm->next = *pp;
                *pp = nm;
                nm = NULL;
                ph->maps++;
                r = CUDA_SUCCESS;
            }
        }
    }
    pthread_mutex_unlock(&G);
    free(nm);
    return r;
}

/* The mappings that exactly tile [ptr, ptr+size), or NULL (first one returned, count in *n). */
static struct mapping *tiling(uintptr_t ptr, size_t size, int *n)
{
    struct mapping *first = NULL;
    uintptr_t cur = ptr;
    *n = 0;
    for (struct mapping *m = mappings; m && cur < ptr + size; m = m->next) {
        if (m->va + m->size <= ptr)
            continue;
        if (m->va != cur)
            return NULL;
        if (!first)
            first = m;
        cur += m->size;
        (*n)++;
    }
    return cur == ptr + size ? first : NULL;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    CHECK_INIT();
    if (!desc || !count || !size)
        return CUDA_ERROR_INVALID_VALUE;
    int access = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_device(desc[i].location.id))
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
        if ((int)desc[i].flags > access)
            access = desc[i].flags; /* every simulated device sees the same host memory */
    }
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    int n;
    pthread_mutex_lock(&G);
    struct mapping *m = tiling(ptr, size, &n);
    if (m) {
        int prot = access == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
                   : access == CU_MEM_ACCESS_FLAGS_PROT_READ   ? PROT_READ
                                                               : PROT_NONE;
        if (mprotect(HPTR(ptr), size, prot) == 0) {
            for (int i = 0; i < n; i++, m = m->next)
                m->access = access;
            r = CUDA_SUCCESS;
        } else {
            r = CUDA_ERROR_UNKNOWN;
        }
    }
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CHECK_INIT();
    if (!size)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    int n;
    pthread_mutex_lock(&G);
    wait_device_idle(); /* queued work may still use the range */
    struct mapping *m = tiling(ptr, size, &n);
    if (m) {
        decommit(ptr, size);
        struct mapping **pp = &mappings;
        while (*pp != m)
            pp = &(*pp)->next;
        for (int i = 0; i < n; i++) {
            struct mapping *x = *pp;
            *pp = x->next;
            x->ph->maps--;
            phys_maybe_free(x->ph);
            free(x);
        }
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&G);
    return r;
}

/* ------------------------------------------------------------------------------------------------
 * Streams and events */

static CUresult stream_create(CUstream *ph, unsigned flags, int priority)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!ph || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G);
    struct stream *s = stream_new(c, flags, priority);
    if (!s || hs_add(s, H_STREAM)) {
        if (s)
            stream_kill(s);
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        s->next = c->streams;
        c->streams = s;
        *ph = (CUstream)s;
    }
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) { return stream_create(phStream, Flags, 0); }

CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    /* Priorities 0 (lowest) to -5 (greatest), clamped like the real driver. */
    return stream_create(phStream, flags, priority > 0 ? 0 : priority < -5 ? -5 : priority);
}

CUresult cuStreamDestroy_v2(CUstream hStream)
{
    CHECK_INIT();
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    struct stream *s = (struct stream *)hStream;
    if (hs_type(s) != H_STREAM) {
        r = CUDA_ERROR_INVALID_HANDLE;
    } else {
        for (struct stream **pp = &s->ctx->streams; *pp; pp = &(*pp)->next)
            if (*pp == s) {
                *pp = s->next;
                break;
            }
        hs_del(s);
        stream_kill(s); /* its queued work still runs, as on the GPU */
    }
    pthread_mutex_unlock(&G);
    return r;
}

static CUresult stream_sync(CUstream h)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    struct stream *s;
    pthread_mutex_lock(&G);
    if (!(r = get_stream(h, c, &s)))
        r = stream_wait(s, s->submitted);
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuStreamSynchronize(CUstream hStream) { return stream_sync(hStream); }
CUresult cuStreamSynchronize_ptsz(CUstream hStream) { return stream_sync(PTSZ(hStream)); }

static CUresult stream_query(CUstream h)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    struct stream *s;
    pthread_mutex_lock(&G);
    if (!(r = get_stream(h, c, &s))) {
        if (s->completed < s->submitted)
            r = CUDA_ERROR_NOT_READY;
        else if ((r = s->err))
            s->err = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuStreamQuery(CUstream hStream) { return stream_query(hStream); }
CUresult cuStreamQuery_ptsz(CUstream hStream) { return stream_query(PTSZ(hStream)); }

static CUresult stream_is_capturing(CUstream h, CUstreamCaptureStatus *st)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!st)
        return CUDA_ERROR_INVALID_VALUE;
    struct stream *s;
    pthread_mutex_lock(&G);
    r = get_stream(h, c, &s);
    pthread_mutex_unlock(&G);
    if (!r)
        *st = CU_STREAM_CAPTURE_STATUS_NONE; /* graphs are not simulated */
    return r;
}

CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *s) { return stream_is_capturing(hStream, s); }
CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *s) { return stream_is_capturing(PTSZ(hStream), s); }

static CUresult stream_wait_event(CUstream h, CUevent ev, unsigned flags)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (flags & ~1u)
        return CUDA_ERROR_INVALID_VALUE;
    struct op *op = calloc(1, sizeof *op);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct stream *s;
    pthread_mutex_lock(&G);
    if (hs_type(ev) != H_EVENT) {
        r = CUDA_ERROR_INVALID_HANDLE;
    } else if (!(r = get_stream(h, c, &s)) && ev->recorded && ev->done_gen < ev->rec_gen) {
        op->kind = OP_WAIT;
        op->ev = ev;
        op->gen = ev->rec_gen;
        ev->refs++;
        enqueue(s, op);
        op = NULL;
    }
    pthread_mutex_unlock(&G);
    free(op);
    return r;
}

CUresult cuStreamWaitEvent(CUstream h, CUevent e, unsigned int f) { return stream_wait_event(h, e, f); }
CUresult cuStreamWaitEvent_ptsz(CUstream h, CUevent e, unsigned int f) { return stream_wait_event(PTSZ(h), e, f); }

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!phEvent || (Flags & ~7u))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->flags = Flags;
    e->refs = 1;
    pthread_mutex_lock(&G);
    int bad = hs_add(e, H_EVENT);
    pthread_mutex_unlock(&G);
    if (bad) {
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *phEvent = e;
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent hEvent)
{
    CHECK_INIT();
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    if (hs_type(hEvent) != H_EVENT) {
        r = CUDA_ERROR_INVALID_HANDLE;
    } else {
        hs_del(hEvent);
        event_unref(hEvent);
    }
    pthread_mutex_unlock(&G);
    return r;
}

static CUresult event_record(CUevent ev, CUstream h)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    struct op *op = calloc(1, sizeof *op);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct stream *s;
    pthread_mutex_lock(&G);
    if (hs_type(ev) != H_EVENT) {
        r = CUDA_ERROR_INVALID_HANDLE;
    } else if (!(r = get_stream(h, c, &s))) {
        op->kind = OP_RECORD;
        op->ev = ev;
        op->gen = ++ev->rec_gen;
        ev->recorded = 1;
        ev->refs++;
        enqueue(s, op);
        op = NULL;
    }
    pthread_mutex_unlock(&G);
    free(op);
    return r;
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream); }
CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) { return event_record(hEvent, PTSZ(hStream)); }

CUresult cuEventSynchronize(CUevent ev)
{
    CHECK_INIT();
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    if (hs_type(ev) != H_EVENT) {
        r = CUDA_ERROR_INVALID_HANDLE;
    } else {
        uint64_t gen = ev->rec_gen;
        ev->refs++;
        while (ev->done_gen < gen)
            pthread_cond_wait(&G_done, &G);
        event_unref(ev);
    }
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuEventQuery(CUevent ev)
{
    CHECK_INIT();
    CUresult r;
    pthread_mutex_lock(&G);
    if (hs_type(ev) != H_EVENT)
        r = CUDA_ERROR_INVALID_HANDLE;
    else
        r = ev->done_gen < ev->rec_gen ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
    pthread_mutex_unlock(&G);
    return r;
}

static CUresult elapsed(float *ms, CUevent a, CUevent b)
{
    CHECK_INIT();
    if (!ms)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    if (hs_type(a) != H_EVENT || hs_type(b) != H_EVENT || !a->recorded || !b->recorded ||
        ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING))
        r = CUDA_ERROR_INVALID_HANDLE;
    else if (a->done_gen < a->rec_gen || b->done_gen < b->rec_gen)
        r = CUDA_ERROR_NOT_READY;
    else
        *ms = (float)(((double)b->ts_ns - (double)a->ts_ns) / 1e6);
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) { return elapsed(ms, a, b); }
CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) { return elapsed(ms, a, b); }

/* ------------------------------------------------------------------------------------------------
 * Modules, libraries, kernels */

static int builtin_by_name(const char *s)
{
    for (int i = 0; i < K_COUNT; i++)
        if (!strcmp(builtins[i].name, s))
            return i;
    char *end;
    long v = strtol(s, &end, 10);
    return (*s && !*end && v >= 0 && v < K_COUNT) ? (int)v : -1;
}

#define MODULE_MAGIC "SIMCUDA-MODULE\n"

/* Parses the text image into a module (not yet registered).  G not held. */
/* PTX the simulator runs: an entry it knows by name, run by its C definition here (one module, one
 * function).  The shim's digest kernel is the only one. */
static const struct {
    const char *entry;
    int builtin;
} known_ptx[] = {{"gputrace_chunk_digest", K_CHUNK_DIGEST}};

static CUresult parse_ptx(const char *image, struct CUmod_st **out)
{
    if (cfg.no_ptx)
        return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    for (size_t i = 0; i < sizeof known_ptx / sizeof *known_ptx; i++) {
        char want[96];
        snprintf(want, sizeof want, ".entry %s(", known_ptx[i].entry);
        if (!strstr(image, want))
            continue;
        struct CUmod_st *m = calloc(1, sizeof *m);
        struct CUfunc_st *f = calloc(1, sizeof *f);
        struct CUfunc_st **fs = calloc(1, sizeof *fs);
        char *name = strdup(known_ptx[i].entry);
        if (!m || !f || !fs || !name) {
            free(m), free(f), free(fs), free(name);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        f->mod = m;
        f->name = name;
        f->builtin = known_ptx[i].builtin;
        fs[0] = f;
        m->funcs = fs;
        m->n = 1;
        *out = m;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_IMAGE; /* PTX of a kernel the simulator cannot run */
}

static CUresult parse_image(const char *image, struct CUmod_st **out)
{
    if (image && strncmp(image, MODULE_MAGIC, strlen(MODULE_MAGIC)) && strstr(image, ".version ") &&
        strstr(image, ".target "))
        return parse_ptx(image, out);
    if (!image || strncmp(image, MODULE_MAGIC, strlen(MODULE_MAGIC)))
        return CUDA_ERROR_INVALID_IMAGE;
    char *text = strdup(image + strlen(MODULE_MAGIC));
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!text || !m) {
        free(text);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = CUDA_SUCCESS;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line && !r; line = strtok_r(NULL, "\n", &save)) {
        char *words[5], *ws = NULL;
        int nw = 0;
        for (char *w = strtok_r(line, " \t\r", &ws); w && nw < 5; w = strtok_r(NULL, " \t\r", &ws))
            words[nw++] = w;
        if (nw == 0 || words[0][0] == '#')
            continue;
        char *end = NULL;
        unsigned long long dur = nw == 4 ? strtoull(words[3], &end, 10) : 0;
        int b = nw == 4 ? builtin_by_name(words[2]) : -1;
        if (strcmp(words[0], "kernel") || nw != 4 || !end || *end || words[3][0] == '-' || b < 0) {
            r = CUDA_ERROR_INVALID_IMAGE;
            break;
        }
        struct CUfunc_st **nf = realloc(m->funcs, (m->n + 1) * sizeof *nf);
        struct CUfunc_st *f = calloc(1, sizeof *f);
        if (nf)
            m->funcs = nf;
        if (!nf || !f || !(f->name = strdup(words[1]))) {
            free(f);
            r = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        f->mod = m;
        f->builtin = b;
        f->dur_ns = dur;
        m->funcs[m->n++] = f;
    }
    free(text);
    if (r) {
        for (int i = 0; i < m->n; i++) {
            free(m->funcs[i]->name);
            free(m->funcs[i]);
        }
        free(m->funcs);
        free(m);
        return r;
    }
    *out = m;
    return CUDA_SUCCESS;
}

/* Registers a parsed module and its functions (and kernels, for a library). */
static CUresult module_register(struct CUmod_st *m, struct CUctx_st *c, int library)
{
    m->ctx = c;
    m->is_library = library;
    if (library && !(m->kernels = calloc(m->n ? m->n : 1, sizeof *m->kernels)))
        goto oom;
    for (int i = 0; library && i < m->n; i++) {
        if (!(m->kernels[i] = calloc(1, sizeof **m->kernels)))
            goto oom;
        m->kernels[i]->fn = m->funcs[i];
    }
    pthread_mutex_lock(&G);
    m->next = modules;
    modules = m;
    int bad = hs_add(m, library ? H_LIBRARY : H_MODULE);
    for (int i = 0; i < m->n; i++) {
        bad |= hs_add(m->funcs[i], H_FUNC);
        if (library)
            bad |= hs_add(m->kernels[i], H_KERNEL);
    }
    if (bad)
        module_free(m);
    pthread_mutex_unlock(&G);
    return bad ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
oom:
    pthread_mutex_lock(&G);
    module_free(m);
    pthread_mutex_unlock(&G);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUmod_st *m;
    if ((r = parse_image(image, &m)) || (r = module_register(m, c, 0)))
        return r;
    *module = m;
    return CUDA_SUCCESS;
}

CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!module || !fname)
        return CUDA_ERROR_INVALID_VALUE;
    FILE *f = fopen(fname, "rb");
    if (!f)
        return CUDA_ERROR_FILE_NOT_FOUND;
    char *buf = NULL;
    size_t len = 0, cap = 0, got;
    do {
        if (len + 4096 + 1 > cap) {
            char *nb = realloc(buf, cap = 2 * cap + 8192);
            if (!nb) {
                free(buf);
                fclose(f);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            buf = nb;
        }
        got = fread(buf + len, 1, 4096, f);
        len += got;
    } while (got > 0);
    fclose(f);
    buf[len] = 0;
    struct CUmod_st *m;
    r = parse_image(buf, &m);
    free(buf);
    if (r || (r = module_register(m, c, 0)))
        return r;
    *module = m;
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule hmod)
{
    CHECK_INIT();
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    if (hs_type(hmod) != H_MODULE)
        r = CUDA_ERROR_INVALID_HANDLE;
    else
        module_free(hmod);
    pthread_mutex_unlock(&G);
    return r;
}

static CUresult find_func(struct CUmod_st *m, int type, const char *name, struct CUfunc_st **f, struct CUkern_st **k)
{
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&G);
    if (hs_type(m) != type) {
        r = CUDA_ERROR_INVALID_HANDLE;
    } else {
        for (int i = 0; i < m->n; i++)
            if (!strcmp(m->funcs[i]->name, name)) {
                if (f)
                    *f = m->funcs[i];
                if (k)
                    *k = m->kernels[i];
                r = CUDA_SUCCESS;
                break;
            }
    }
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    CHECK_INIT();
    if (!hfunc)
        return CUDA_ERROR_INVALID_VALUE;
    return find_func(hmod, H_MODULE, name, hfunc, NULL);
}

CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
                           unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions)
{
    CHECK_INIT();
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)libraryOptions;
    (void)libraryOptionValues;
    if (!library || !code || (numJitOptions && !jitOptions) || (numLibraryOptions && !libraryOptions))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUmod_st *m;
    CUresult r;
    if ((r = parse_image(code, &m)) || (r = module_register(m, NULL, 1)))
        return r;
    *library = (CUlibrary)m;
    return CUDA_SUCCESS;
}

CUresult cuLibraryUnload(CUlibrary library)
{
    CHECK_INIT();
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&G);
    if (hs_type(library) != H_LIBRARY)
        r = CUDA_ERROR_INVALID_HANDLE;
    else
        module_free((struct CUmod_st *)library);
    pthread_mutex_unlock(&G);
    return r;
}

CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    CHECK_INIT();
    if (!pKernel)
        return CUDA_ERROR_INVALID_VALUE;
    return find_func((struct CUmod_st *)library, H_LIBRARY, name, NULL, pKernel);
}

CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    CHECK_INIT();
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G);
    if (hs_type(kernel) != H_KERNEL)
        r = CUDA_ERROR_INVALID_HANDLE;
    else
        *pFunc = kernel->fn;
    pthread_mutex_unlock(&G);
    return r;
}

static CUresult check_func(CUfunction f)
{
    pthread_mutex_lock(&G);
    int t = hs_type(f);
    pthread_mutex_unlock(&G);
    return t == H_FUNC ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc)
{
    CHECK_INIT();
    if (!pi || (int)attrib < 0 || attrib >= CU_FUNC_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_func(hfunc);
    if (r)
        return r;
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = 32; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION: *pi = 90; break;
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *pi = 90; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *pi = 49152; break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *pi = -1; break;
    default: *pi = 0; break;
    }
    return CUDA_SUCCESS;
}

static int blocks_per_sm(int block)
{
    int b = 2048 / block;
    return b > 32 ? 32 : b;
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func, int blockSize,
                                                     size_t dynamicSMemSize)
{
    CHECK_INIT();
    if (!numBlocks || blockSize <= 0 || blockSize > 1024 || dynamicSMemSize > 232448)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_func(func);
    if (!r)
        *numBlocks = blocks_per_sm(blockSize);
    return r;
}

CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                          CUoccupancyB2DSize blockSizeToDynamicSMemSize, size_t dynamicSMemSize,
                                          int blockSizeLimit)
{
    CHECK_INIT();
    if (!minGridSize || !blockSize || blockSizeLimit < 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_func(func);
    if (r)
        return r;
    int b = blockSizeLimit && blockSizeLimit < 1024 ? blockSizeLimit : 1024;
    if (blockSizeToDynamicSMemSize)
        (void)blockSizeToDynamicSMemSize(b);
    (void)dynamicSMemSize;
    *blockSize = b;
    *minGridSize = blocks_per_sm(b) * attr_value(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    return CUDA_SUCCESS;
}

/* Copies the arguments now (a launch captures them), from kernelParams or from an `extra` buffer. */
static CUresult pack_params(int b, void **kp, void **extra, unsigned char *out)
{
    size_t need = param_bytes(b);
    if (kp && extra)
        return CUDA_ERROR_INVALID_VALUE;
    if (extra) {
        void *buf = NULL;
        size_t size = 0;
        int have_size = 0;
        for (int i = 0; extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
            if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER)
                buf = extra[i + 1];
            else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1])
                size = *(size_t *)extra[i + 1], have_size = 1;
            else
                return CUDA_ERROR_INVALID_VALUE;
        }
        if (need && (!buf || !have_size || size < need))
            return CUDA_ERROR_INVALID_VALUE;
        if (need)
            memcpy(out, buf, need);
        return CUDA_SUCCESS;
    }
    if (need && !kp)
        return CUDA_ERROR_INVALID_VALUE;
    size_t off = 0;
    for (int i = 0; i < builtins[b].nparams; i++) {
        size_t sz = builtins[b].psize[i];
        off = round_up(off, sz);
        if (!kp[i])
            return CUDA_ERROR_INVALID_VALUE;
        memcpy(out + off, kp[i], sz);
        off += sz;
    }
    return CUDA_SUCCESS;
}

static CUresult launch_impl(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shmem, CUstream h, void **kp, void **extra)
{
    CHECK_INIT();
    if (cfg.launch_ns)
        spin_ns(cfg.launch_ns); /* the host-side cost of a launch, on the caller's CPU */
    struct CUctx_st *c;
    CUresult r = cur_ctx(&c);
    if (r)
        return r;
    if (!gx || !gy || !gz || !bx || !by || !bz || bz > 64 || (uint64_t)bx * by * bz > 1024 || gy > 65535 ||
        gz > 65535 || shmem > 232448)
        return CUDA_ERROR_INVALID_VALUE;
    struct op *op = calloc(1, sizeof *op);
    if (!op)
        return CUDA_ERROR_OUT_OF_MEMORY;
    op->kind = OP_KERNEL;
    struct stream *s;
    pthread_mutex_lock(&G);
    if (hs_type(f) != H_FUNC) {
        r = CUDA_ERROR_INVALID_HANDLE;
    } else if (!(r = pack_params(f->builtin, kp, extra, op->params))) {
        if (!kernel_args_ok(f->builtin, op->params, 0)) {
            r = CUDA_ERROR_INVALID_VALUE;
        } else if (!(r = get_stream(h, c, &s))) {
            op->builtin = f->builtin;
            op->dur_ns = cfg.kernel_ns_set ? cfg.kernel_ns : f->dur_ns;
            enqueue(s, op);
            op = NULL;
        }
    }
    pthread_mutex_unlock(&G);
    free(op);
    return r;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    return launch_impl(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                       kernelParams, extra);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                             unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                             unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    return launch_impl(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                       PTSZ(hStream), kernelParams, extra);
}

static CUresult launch_ex(const CUlaunchConfig *cfgp, CUfunction f, void **kp, void **extra, int ptsz)
{
    if (!cfgp || (cfgp->numAttrs && !cfgp->attrs)) {
        CHECK_INIT();
        return CUDA_ERROR_INVALID_VALUE;
    }
    return launch_impl(f, cfgp->gridDimX, cfgp->gridDimY, cfgp->gridDimZ, cfgp->blockDimX, cfgp->blockDimY,
                       cfgp->blockDimZ, cfgp->sharedMemBytes, ptsz ? PTSZ(cfgp->hStream) : cfgp->hStream, kp, extra);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    return launch_ex(config, f, kernelParams, extra, 0);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    return launch_ex(config, f, kernelParams, extra, 1);
}

/* ------------------------------------------------------------------------------------------------
 * cuGetProcAddress: base names, each with the versions that exist and the CUDA version that
 * introduced each; the newest one not newer than the caller's version wins, and the per-thread
 * default stream flag picks the _ptsz/_ptds variant where there is one. */

static const struct procent {
    const char *name;
    int since;
    void *fn;
    void *ptsz;
} proctab[] = {
#define P(base, since, sym) {#base, since, (void *)&sym, NULL}
#define PT(base, since, sym, psym) {#base, since, (void *)&sym, (void *)&psym}
    P(cuInit, 2000, cuInit),
    P(cuDriverGetVersion, 2020, cuDriverGetVersion),
    P(cuGetErrorName, 6000, cuGetErrorName),
    P(cuGetErrorString, 6000, cuGetErrorString),
    P(cuGetProcAddress, 11030, cuGetProcAddress),
    P(cuGetProcAddress, 12000, cuGetProcAddress_v2),
    P(cuGetExportTable, 3000, cuGetExportTable),
    P(cuDeviceGet, 2000, cuDeviceGet),
    P(cuDeviceGetCount, 2000, cuDeviceGetCount),
    P(cuDeviceGetName, 2000, cuDeviceGetName),
    P(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute),
    P(cuDeviceTotalMem, 3020, cuDeviceTotalMem_v2),
    P(cuDeviceGetUuid, 9020, cuDeviceGetUuid),
    P(cuDeviceGetUuid, 11040, cuDeviceGetUuid_v2),
    P(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain),
    P(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease_v2),
    P(cuDevicePrimaryCtxGetState, 7000, cuDevicePrimaryCtxGetState),
    P(cuDevicePrimaryCtxSetFlags, 11000, cuDevicePrimaryCtxSetFlags_v2),
    P(cuDevicePrimaryCtxReset, 11000, cuDevicePrimaryCtxReset_v2),
    P(cuCtxCreate, 3020, cuCtxCreate_v2),
    P(cuCtxDestroy, 4000, cuCtxDestroy_v2),
    P(cuCtxGetCurrent, 4000, cuCtxGetCurrent),
    P(cuCtxSetCurrent, 4000, cuCtxSetCurrent),
    P(cuCtxGetDevice, 2000, cuCtxGetDevice),
    P(cuCtxGetDevice, 13000, cuCtxGetDevice_v2),
    P(cuCtxPushCurrent, 4000, cuCtxPushCurrent_v2),
    P(cuCtxPopCurrent, 4000, cuCtxPopCurrent_v2),
    P(cuCtxSynchronize, 2000, cuCtxSynchronize),
    P(cuCtxSynchronize, 13000, cuCtxSynchronize_v2),
    P(cuMemAlloc, 3020, cuMemAlloc_v2),
    P(cuMemFree, 3020, cuMemFree_v2),
    P(cuMemAllocPitch, 3020, cuMemAllocPitch_v2),
    P(cuArrayCreate, 3020, cuArrayCreate_v2),
    P(cuArrayDestroy, 2000, cuArrayDestroy),
    P(cuMemAllocHost, 3020, cuMemAllocHost_v2),
    P(cuMemHostAlloc, 2020, cuMemHostAlloc),
    P(cuMemFreeHost, 2000, cuMemFreeHost),
    PT(cuMemAllocAsync, 11020, cuMemAllocAsync, cuMemAllocAsync_ptsz),
    PT(cuMemFreeAsync, 11020, cuMemFreeAsync, cuMemFreeAsync_ptsz),
    PT(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz),
    P(cuMemPoolCreate, 11020, cuMemPoolCreate),
    P(cuMemPoolDestroy, 11020, cuMemPoolDestroy),
    P(cuDeviceGetDefaultMemPool, 11020, cuDeviceGetDefaultMemPool),
    P(cuMemGetInfo, 3020, cuMemGetInfo_v2),
    PT(cuMemcpyHtoD, 3020, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds),
    PT(cuMemcpyDtoH, 3020, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds),
    PT(cuMemcpyDtoD, 3020, cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds),
    PT(cuMemcpyHtoDAsync, 3020, cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz),
    PT(cuMemcpyDtoHAsync, 3020, cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz),
    PT(cuMemcpyDtoDAsync, 3020, cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz),
    PT(cuMemsetD8, 3020, cuMemsetD8_v2, cuMemsetD8_v2_ptds),
    PT(cuMemsetD32, 3020, cuMemsetD32_v2, cuMemsetD32_v2_ptds),
    PT(cuMemsetD8Async, 3020, cuMemsetD8Async, cuMemsetD8Async_ptsz),
    PT(cuMemsetD32Async, 3020, cuMemsetD32Async, cuMemsetD32Async_ptsz),
    P(cuMemAddressReserve, 10020, cuMemAddressReserve),
    P(cuMemAddressFree, 10020, cuMemAddressFree),
    P(cuMemCreate, 10020, cuMemCreate),
    P(cuMemRelease, 10020, cuMemRelease),
    P(cuMemRetainAllocationHandle, 11000, cuMemRetainAllocationHandle),
    P(cuMemGetAllocationPropertiesFromHandle, 10020, cuMemGetAllocationPropertiesFromHandle),
    P(cuMemMap, 10020, cuMemMap),
    P(cuMemUnmap, 10020, cuMemUnmap),
    P(cuMemSetAccess, 10020, cuMemSetAccess),
    P(cuMemGetAllocationGranularity, 10020, cuMemGetAllocationGranularity),
    P(cuStreamCreate, 2000, cuStreamCreate),
    P(cuStreamCreateWithPriority, 5050, cuStreamCreateWithPriority),
    P(cuStreamDestroy, 4000, cuStreamDestroy_v2),
    PT(cuStreamSynchronize, 2000, cuStreamSynchronize, cuStreamSynchronize_ptsz),
    PT(cuStreamQuery, 2000, cuStreamQuery, cuStreamQuery_ptsz),
    PT(cuStreamIsCapturing, 10000, cuStreamIsCapturing, cuStreamIsCapturing_ptsz),
    PT(cuStreamWaitEvent, 3020, cuStreamWaitEvent, cuStreamWaitEvent_ptsz),
    P(cuEventCreate, 2000, cuEventCreate),
    P(cuEventDestroy, 4000, cuEventDestroy_v2),
    PT(cuEventRecord, 2000, cuEventRecord, cuEventRecord_ptsz),
    P(cuEventSynchronize, 2000, cuEventSynchronize),
    P(cuEventQuery, 2000, cuEventQuery),
    P(cuEventElapsedTime, 2000, cuEventElapsedTime),
    P(cuEventElapsedTime, 12080, cuEventElapsedTime_v2),
    P(cuModuleLoadData, 2000, cuModuleLoadData),
    P(cuModuleLoad, 2000, cuModuleLoad),
    P(cuModuleUnload, 2000, cuModuleUnload),
    P(cuModuleGetFunction, 2000, cuModuleGetFunction),
    P(cuLibraryLoadData, 12000, cuLibraryLoadData),
    P(cuLibraryUnload, 12000, cuLibraryUnload),
    P(cuLibraryGetKernel, 12000, cuLibraryGetKernel),
    P(cuKernelGetFunction, 12000, cuKernelGetFunction),
    P(cuFuncGetAttribute, 2020, cuFuncGetAttribute),
    P(cuOccupancyMaxActiveBlocksPerMultiprocessor, 6050, cuOccupancyMaxActiveBlocksPerMultiprocessor),
    P(cuOccupancyMaxPotentialBlockSize, 6050, cuOccupancyMaxPotentialBlockSize),
    PT(cuLaunchKernel, 4000, cuLaunchKernel, cuLaunchKernel_ptsz),
    PT(cuLaunchKernelEx, 11060, cuLaunchKernelEx, cuLaunchKernelEx_ptsz),
#undef P
#undef PT
};

static CUresult proc_address(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn || (flags & ~(cuuint64_t)3))
        return CUDA_ERROR_INVALID_VALUE;
    const struct procent *best = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof proctab / sizeof proctab[0]; i++) {
        if (strcmp(proctab[i].name, symbol))
            continue;
        known = 1;
        if (proctab[i].since <= cudaVersion && (!best || proctab[i].since > best->since))
            best = &proctab[i];
    }
    *pfn = NULL;
    if (!best) {
        if (status)
            *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best->ptsz ? best->ptsz : best->fn;
    if (status)
        *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return proc_address(symbol, pfn, cudaVersion, flags, NULL);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus)
{
    return proc_address(symbol, pfn, cudaVersion, flags, symbolStatus);
}

/* ------------------------------------------------------------------------------------------------
 * simcuda's own exports */

void simcudaBusyWait(unsigned long long ns)
{
    spin_ns(ns);
}

void simcudaArena(unsigned long long *base, unsigned long long *size)
{
    pthread_mutex_lock(&G);
    if (base)
        *base = arena_base;
    if (size)
        *size = arena_size;
    pthread_mutex_unlock(&G);
}

int simcudaListAllocations(simcudaAllocation *out, int max)
{
    int n = 0;
    pthread_mutex_lock(&G);
#define EMIT(...)                                                  \
    do {                                                           \
        if (out && n < max)                                        \
            out[n] = (simcudaAllocation){__VA_ARGS__};             \
        n++;                                                       \
    } while (0)
    for (struct region *r = regions; r; r = r->next)
        if (!r->pending_free)
            EMIT(.base = r->base, .size = r->req, .kind = r->kind, .device = r->ctx ? r->ctx->device : 0,
                 .ctx = r->ctx);
    for (struct region *r = host_regions; r; r = r->next)
        EMIT(.base = r->base, .size = r->req, .kind = SIMCUDA_ALLOC_HOST, .ctx = r->ctx);
    for (struct phys *p = physs; p; p = p->next)
        EMIT(.base = 0, .size = p->size, .kind = SIMCUDA_ALLOC_VMM_PHYS, .device = p->device,
             .handle = (uintptr_t)p);
    for (struct mapping *m = mappings; m; m = m->next)
        EMIT(.base = m->va, .size = m->size, .kind = SIMCUDA_ALLOC_VMM_MAP, .device = m->ph->device,
             .handle = (uintptr_t)m->ph, .offset = m->off, .access = m->access);
#undef EMIT
    pthread_mutex_unlock(&G);
    return n;
}

/* ------------------------------------------------------------------------------------------------
 * cuCheckpointProcess*: the driver's own process checkpoint, driven from another process by pid.
 *
 * Each initialized simcuda process serves an abstract Unix socket "@simcuda-ckpt-<pid>" (no file,
 * gone with the process) from one thread; the cuCheckpointProcess* calls of another process send it
 * one command each.  lock: every driver call of the process waits at its entry (CHECK_INIT) and the
 * work already queued is drained, or CUDA_ERROR_NOT_READY at the timeout; checkpoint: the data of
 * every device allocation and VMM handle is copied to host memory and the device memory given
 * back (cuMemGetInfo shows it free); restore: the reverse; unlock: calls run again.  A call already
 * past its entry when the lock is taken may still finish during it (the real driver has no such
 * window); the tests lock processes that are idle or waiting on stdin. */

#include <dirent.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <linux/falloc.h>

static pthread_mutex_t LK = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t LK_cv = PTHREAD_COND_INITIALIZER;
static int g_ckpt_state; /* CUprocessState, under G */
static size_t g_ckpt_freed;
static struct saved {
    struct saved *next;
    void *data;
    size_t n;
    struct region *r; /* or */
    struct phys *ph;
} *g_saved;

static size_t ckpt_freed_bytes(void) { return g_ckpt_freed; }

static void ckpt_wait_unlocked(void)
{
    pthread_mutex_lock(&LK);
    while (atomic_load(&g_locked))
        pthread_cond_wait(&LK_cv, &LK);
    pthread_mutex_unlock(&LK);
}

static void ckpt_set_locked(int on)
{
    pthread_mutex_lock(&LK);
    atomic_store(&g_locked, on);
    pthread_cond_broadcast(&LK_cv);
    pthread_mutex_unlock(&LK);
}

static int ckpt_save(void *src, size_t n, struct region *r, struct phys *ph)
{
    struct saved *v = calloc(1, sizeof *v);
    if (!v || !(v->data = malloc(n ? n : 1))) {
        free(v);
        return -1;
    }
    if (r)
        memcpy(v->data, src, n);
    else if (pread(ph->fd, v->data, n, 0) != (ssize_t)n) {
        free(v->data);
        free(v);
        return -1;
    }
    v->n = n, v->r = r, v->ph = ph;
    v->next = g_saved;
    g_saved = v;
    return 0;
}

/* Device mode, checkpoint: the device memory behind a saved allocation goes back to the device and
 * its addresses stay reserved (PROT_NONE), so nothing of the device is mapped any more. */
static void ckpt_drop(struct saved *v)
{
    if (v->r) {
        decommit(v->r->base, v->r->usable);
        v->r->dev_id = 0;
        return;
    }
    for (struct mapping *m = mappings; m; m = m->next)
        if (m->ph == v->ph)
            decommit(m->va, m->size);
    if (v->ph->fd >= 0)
        close(v->ph->fd);
    v->ph->fd = -1;
    v->ph->dev_id = 0;
}

static int access_prot(int access)
{
    return access == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
           : access == CU_MEM_ACCESS_FLAGS_PROT_READ   ? PROT_READ
                                                       : PROT_NONE;
}

/* Device mode, restore: new device memory at the same addresses (and the same VMM mappings). */
static int ckpt_bring_back(struct saved *v)
{
    unsigned id;
    if (v->r) {
        int fd = dev_get(v->r->usable, &id);
        if (fd < 0)
            return -1;
        void *p = mmap((void *)v->r->base, v->r->usable, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) {
            dev_put(id);
            return -1;
        }
        v->r->dev_id = id;
        return 0;
    }
    int fd = dev_get(v->ph->size, &id);
    if (fd < 0)
        return -1;
    v->ph->fd = fd, v->ph->dev_id = id;
    for (struct mapping *m = mappings; m; m = m->next)
        if (m->ph == v->ph &&
            mmap((void *)m->va, m->size, access_prot(m->access), MAP_SHARED | MAP_FIXED, fd, (off_t)m->off) == MAP_FAILED)
            return -1;
    return 0;
}

static int g_ckpt_tid; /* the thread that serves the checkpoint calls: cuCheckpointProcessGetRestoreThreadId */
#define CKPT_THREAD_NAME "simcuda-ckpt" /* its name (comm), by which that call finds it in a stopped process */

/* Restore's GPU pairs, "OLDHEX:NEWHEX,..." (32 hex digits each): every old UUID must be a device of
 * this process and every new one a device there is.  All simulated devices share one memory, so a
 * valid mapping moves nothing. */
static int ckpt_pairs_ok(const char *pairs)
{
    while (pairs && *pairs) {
        for (int side = 0; side < 2; side++) {
            unsigned char u[16];
            for (int i = 0; i < 16; i++)
                if (sscanf(pairs + 2 * i, "%2hhx", &u[i]) != 1)
                    return 0;
            pairs += 32;
            int found = 0;
            for (int d = 0; d < cfg.ndev && !found; d++) {
                char want[16];
                memcpy(want, "SIMCUDA-GPU-0000", 16);
                want[15] = (char)('0' + d);
                found = !memcmp(want, u, 16);
            }
            if (!found || *pairs != (side ? ',' : ':'))
                return 0;
            pairs++;
        }
    }
    return 1;
}

/* Under G.  Returns a CUresult (state, tid: the value). */
static int ckpt_do(const char *cmd, unsigned timeout_ms, const char *pairs)
{
    if (!strcmp(cmd, "state"))
        return g_ckpt_state;
    if (!strcmp(cmd, "tid"))
        return g_ckpt_tid;
    if (!strcmp(cmd, "lock")) {
        if (g_ckpt_state != CU_PROCESS_STATE_RUNNING)
            return CUDA_ERROR_ILLEGAL_STATE;
        ckpt_set_locked(1);
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_sec += timeout_ms / 1000;
        dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
        if (dl.tv_nsec >= 1000000000) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000;
        }
        while (g_pending)
            if (pthread_cond_timedwait(&G_done, &G, &dl) == ETIMEDOUT && g_pending) {
                ckpt_set_locked(0);
                return CUDA_ERROR_NOT_READY;
            }
        g_ckpt_state = CU_PROCESS_STATE_LOCKED;
        return CUDA_SUCCESS;
    }
    if (!strcmp(cmd, "checkpoint")) {
        if (g_ckpt_state != CU_PROCESS_STATE_LOCKED)
            return CUDA_ERROR_ILLEGAL_STATE;
        int bad = 0;
        for (struct region *r = regions; r && !bad; r = r->next)
            if (is_device_kind(r->kind) && r->usable)
                bad = ckpt_save((void *)r->base, r->usable, r, NULL);
        for (struct phys *ph = physs; ph && !bad; ph = ph->next)
            bad = ckpt_save(NULL, ph->size, NULL, ph);
        if (bad) {
            while (g_saved) {
                struct saved *v = g_saved;
                g_saved = v->next;
                free(v->data);
                free(v);
            }
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        for (struct saved *v = g_saved; v; v = v->next) { /* give the memory back */
            if (g_devpath[0])
                ckpt_drop(v);
            else if (v->r)
                madvise((void *)v->r->base, v->n, MADV_DONTNEED);
            else
                fallocate(v->ph->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)v->n);
            g_ckpt_freed += v->n;
        }
        if (g_devfd >= 0) { /* device mode: no descriptor of the device is left (the daemon frees it all) */
            close(g_devfd);
            g_devfd = -1;
        }
        g_ckpt_state = CU_PROCESS_STATE_CHECKPOINTED;
        return CUDA_SUCCESS;
    }
    if (!strcmp(cmd, "restore")) {
        if (g_ckpt_state != CU_PROCESS_STATE_CHECKPOINTED)
            return CUDA_ERROR_ILLEGAL_STATE;
        if (!ckpt_pairs_ok(pairs))
            return CUDA_ERROR_INVALID_VALUE;
        if (g_devpath[0] && g_devfd < 0 && dev_connect() != 0)
            return CUDA_ERROR_NO_DEVICE; /* still checkpointed, nothing lost: restore may be tried again */
        while (g_saved) {
            struct saved *v = g_saved;
            g_saved = v->next;
            if (g_devpath[0] && ckpt_bring_back(v) != 0)
                g_ckpt_state = CU_PROCESS_STATE_FAILED;
            else if (v->r)
                memcpy((void *)v->r->base, v->data, v->n);
            else if (pwrite(v->ph->fd, v->data, v->n, 0) != (ssize_t)v->n)
                g_ckpt_state = CU_PROCESS_STATE_FAILED;
            free(v->data);
            free(v);
        }
        g_ckpt_freed = 0;
        if (g_ckpt_state == CU_PROCESS_STATE_FAILED)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g_ckpt_state = CU_PROCESS_STATE_LOCKED;
        return CUDA_SUCCESS;
    }
    if (!strcmp(cmd, "unlock")) {
        if (g_ckpt_state != CU_PROCESS_STATE_LOCKED)
            return CUDA_ERROR_ILLEGAL_STATE;
        g_ckpt_state = CU_PROCESS_STATE_RUNNING;
        ckpt_set_locked(0);
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

static socklen_t ckpt_addr(struct sockaddr_un *sa, int pid)
{
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    int n = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1, "simcuda-ckpt-%d", pid);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static void *ckpt_thread(void *arg)
{
    int lfd = (int)(intptr_t)arg;
    pthread_mutex_lock(&G);
    g_ckpt_tid = (int)gettid();
    pthread_mutex_unlock(&G);
    pthread_setname_np(pthread_self(), CKPT_THREAD_NAME);
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            return NULL;
        }
        struct ucred cr;
        socklen_t len = sizeof cr;
        char line[1024] = "";
        ssize_t n = 0;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0 && (cr.uid == 0 || cr.uid == geteuid()))
            n = recv(fd, line, sizeof line - 1, 0);
        if (n > 0) {
            line[n] = 0;
            char cmd[16] = "", pairs[960] = "";
            unsigned ms = 0;
            sscanf(line, "%15s %u %959s", cmd, &ms, pairs);
            pthread_mutex_lock(&G);
            int r = ckpt_do(cmd, ms, pairs);
            pthread_mutex_unlock(&G);
            char out[16];
            int k = snprintf(out, sizeof out, "%d\n", r);
            if (send(fd, out, (size_t)k, MSG_NOSIGNAL) < 0) { /* the caller is gone: nothing to tell */
            }
        }
        close(fd);
    }
}

static void ckpt_serve(void)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa;
    socklen_t len = ckpt_addr(&sa, (int)getpid());
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, len) != 0 || listen(fd, 4) != 0) {
        if (fd >= 0)
            close(fd);
        return; /* no checkpoint API for this process; everything else works */
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, ckpt_thread, (void *)(intptr_t)fd) != 0)
        close(fd);
    pthread_attr_destroy(&at);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static CUresult ckpt_call_pairs(int pid, const char *cmd, unsigned ms, int *value, const char *pairs);
static CUresult ckpt_call(int pid, const char *cmd, unsigned ms, int *value)
{
    return ckpt_call_pairs(pid, cmd, ms, value, "");
}

static CUresult ckpt_call_pairs(int pid, const char *cmd, unsigned ms, int *value, const char *pairs)
{
    if (pid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa;
    socklen_t len = ckpt_addr(&sa, pid);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (connect(fd, (struct sockaddr *)&sa, len) != 0) {
        close(fd);
        return CUDA_ERROR_INVALID_VALUE; /* no such CUDA process */
    }
    char line[1024], out[16] = "";
    int k = snprintf(line, sizeof line, "%s %u %s\n", cmd, ms, pairs);
    ssize_t n = send(fd, line, (size_t)k, MSG_NOSIGNAL) == k ? recv(fd, out, sizeof out - 1, MSG_WAITALL) : -1;
    close(fd);
    if (n <= 0)
        return CUDA_ERROR_INVALID_VALUE; /* the process went away */
    out[n] = 0;
    int v = atoi(out);
    if (value) {
        *value = v;
        return CUDA_SUCCESS;
    }
    return (CUresult)v;
}

CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
    int v = 0;
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = ckpt_call(pid, "state", 0, &v);
    if (!r)
        *state = (CUprocessState)v;
    return r;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    int v = 0;
    if (!tid)
        return CUDA_ERROR_INVALID_VALUE;
    /* As the real driver, answered for a process that is stopped (CRIU restores it so): its serving
     * thread by name, without asking it. */
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/task", pid);
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) && !v) {
            char path[128], name[32] = "";
            if (e->d_name[0] == '.')
                continue;
            snprintf(path, sizeof path, "%s/%s/comm", dir, e->d_name);
            FILE *f = fopen(path, "re");
            if (f) {
                if (fgets(name, sizeof name, f) && !strncmp(name, CKPT_THREAD_NAME "\n", sizeof CKPT_THREAD_NAME))
                    v = atoi(e->d_name);
                fclose(f);
            }
        }
        closedir(d);
        if (v) {
            *tid = v;
            return CUDA_SUCCESS;
        }
    }
    CUresult r = ckpt_call(pid, "tid", 0, &v);
    if (!r)
        *tid = v;
    return r;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    return ckpt_call(pid, "lock", args && args->timeoutMs ? args->timeoutMs : 0xFFFFFFFFu / 2, NULL);
}
CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    (void)args;
    return ckpt_call(pid, "checkpoint", 0, NULL);
}
CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    char pairs[960] = "";
    if (args && args->gpuPairsCount) {
        if (!args->gpuPairs || args->gpuPairsCount > 14)
            return CUDA_ERROR_INVALID_VALUE;
        size_t n = 0;
        for (unsigned i = 0; i < args->gpuPairsCount; i++) {
            const unsigned char *o = (const unsigned char *)args->gpuPairs[i].oldUuid.bytes;
            const unsigned char *w = (const unsigned char *)args->gpuPairs[i].newUuid.bytes;
            for (int b = 0; b < 16; b++)
                n += (size_t)snprintf(pairs + n, sizeof pairs - n, "%02x", o[b]);
            pairs[n++] = ':';
            for (int b = 0; b < 16; b++)
                n += (size_t)snprintf(pairs + n, sizeof pairs - n, "%02x", w[b]);
            pairs[n++] = ',';
            pairs[n] = 0;
        }
    }
    return ckpt_call_pairs(pid, "restore", 0, NULL, pairs);
}
CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    (void)args;
    return ckpt_call(pid, "unlock", 0, NULL);
}

/* ------------------------------------------------------------------------------------------------
 * Device mode: the client side of simcuda-device (device.c).  G held, or during cuInit. */

static int dev_connect(void)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", g_devpath);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    g_devfd = fd;
    return 0;
}

/* One request, one line back (and a descriptor where the daemon attaches one).  Returns the number
 * after "ok", or -1. */
static long dev_request(const char *req, int *fd_out)
{
    if (g_devfd < 0)
        return -1;
    if (send(g_devfd, req, strlen(req), MSG_NOSIGNAL) != (ssize_t)strlen(req))
        return -1;
    char line[64];
    size_t got = 0;
    if (fd_out)
        *fd_out = -1;
    while (got < sizeof line - 1 && (got == 0 || line[got - 1] != '\n')) {
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } u;
        struct iovec iov = {line + got, 1}; /* a byte at a time: never read past the reply */
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
        ssize_t n = recvmsg(g_devfd, &m, MSG_CMSG_CLOEXEC);
        if (n <= 0)
            return -1;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && fd_out)
                memcpy(fd_out, CMSG_DATA(c), sizeof(int));
        got += (size_t)n;
    }
    line[got] = 0;
    unsigned long v;
    if (sscanf(line, "ok %lu", &v) != 1) {
        if (fd_out && *fd_out >= 0)
            close(*fd_out);
        return -1;
    }
    return (long)v;
}

static int dev_get(size_t size, unsigned *id)
{
    char req[48];
    int fd;
    snprintf(req, sizeof req, "alloc %zu\n", size);
    long v = dev_request(req, &fd);
    if (v <= 0 || fd < 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    *id = (unsigned)v;
    return fd;
}

static void dev_put(unsigned id)
{
    if (!id || g_devfd < 0)
        return;
    char req[32];
    snprintf(req, sizeof req, "free %u\n", id);
    dev_request(req, NULL);
}
