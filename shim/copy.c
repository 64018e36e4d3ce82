/* The copy engine: what is saved, cut into pieces that several lanes copy between device memory and
 * the image (or pinned memory kept for it), and the synchronization that comes before a copy.
 *
 * How it moves.  Gate closed and every context synchronized (within the command's timeout=, as the
 * pause: work that cannot finish gives the job back instead of holding it), the allocations are cut into chunks
 * that `lanes` threads take in turn; each lane owns two pinned staging buffers and two streams and
 * alternates between them, so one chunk's DMA overlaps the previous chunk's pwrite (or, restoring,
 * the next chunk's pread overlaps the current DMA), and lanes overlap each other.  Staging memory
 * is pinned before the gate closes, so pinning costs the job nothing.  A piece with pinned memory of
 * its own (the image mapped and pinned, direct=1, or the kept pool: kept.c) needs no staging and no
 * CPU copy: the DMA engine reads or writes it.
 *
 * Everything here calls the driver's own entry points (never the wrappers, which would wait at the
 * gate this code closed); staging buffers and streams are therefore not in the registry either. */
#include "dump_int.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

struct drv D;

int drv_load(void)
{
#define SYM(field, name) *(void **)&D.field = shim_driver_sym(name)
    SYM(ctx_set, "cuCtxSetCurrent");
    SYM(ctx_sync, "cuCtxSynchronize");
    SYM(stream_create, "cuStreamCreate");
    SYM(stream_destroy, "cuStreamDestroy_v2");
    SYM(stream_sync, "cuStreamSynchronize");
    SYM(host_alloc, "cuMemHostAlloc");
    SYM(host_free, "cuMemFreeHost");
    SYM(d2h, "cuMemcpyDtoHAsync_v2");
    SYM(h2d, "cuMemcpyHtoDAsync_v2");
    SYM(version, "cuDriverGetVersion");
    SYM(dev_name, "cuDeviceGetName");
    SYM(dev_uuid, "cuDeviceGetUuid");
    SYM(host_register, "cuMemHostRegister_v2");
    SYM(host_unregister, "cuMemHostUnregister");
#undef SYM
    return D.ctx_set && D.ctx_sync && D.stream_create && D.stream_destroy && D.stream_sync && D.host_alloc &&
           D.host_free && D.d2h && D.h2d;
}

/* ------------------------------------------------------------------------------------------------
 * What is saved: device memory the program can address.  Plain, pitched, stream-ordered and managed
 * allocations, and VMM mappings the program has made readable (the data of a cuMemCreate handle is
 * reached through its mappings; a handle mapped nowhere cannot be read and is counted as skipped). */

static int c_ctx(struct rec *r, void *arg)
{
    struct collect *c = arg;
    if (c->nctx < 64) {
        c->ctx_dev[c->nctx] = r->device;
        c->ctxs[c->nctx++] = r->key;
    }
    return 0;
}

static int c_alloc(struct rec *r, void *arg)
{
    struct collect *c = arg;
    if (r->type == R_PHYS) {
        c->skipped++; /* counted back out below for each mapping found */
        return 0;
    }
    if (r->type != R_MEM && !(r->type == R_MAP && (r->access & CU_MEM_ACCESS_FLAGS_PROT_READ)))
        return 0;
    if (c->n == c->cap) {
        int cap = c->cap ? c->cap * 2 : 64;
        struct item *v = realloc(c->v, (size_t)cap * sizeof *v);
        if (!v) {
            c->oom = 1;
            return 0;
        }
        c->v = v;
        c->cap = cap;
    }
    c->v[c->n++] = (struct item){.base = r->key, .size = r->size, .ctx = r->ctx, .device = r->device, .kind = r->kind,
                                 .reserved = r->type == R_MEM ? r->reserved : 0};
    if (r->type == R_MAP)
        c->skipped--;
    return 0;
}

static int by_base(const void *a, const void *b)
{
    const struct item *x = a, *y = b;
    return x->base < y->base ? -1 : x->base > y->base;
}

/* The live allocations, in address order, each with a context to copy it in. */
int collect(struct collect *c)
{
    memset(c, 0, sizeof *c);
    reg_scan(R_CTX, c_ctx, c);
    reg_scan(0, c_alloc, c);
    if (c->oom)
        return -1;
    if (c->skipped < 0)
        c->skipped = 0;
    qsort(c->v, (size_t)c->n, sizeof *c->v, by_base);
    for (int i = 0; i < c->n; i++)
        if (!c->v[i].ctx)
            for (int k = 0; k < c->nctx; k++)
                if (c->ctx_dev[k] == c->v[i].device) {
                    c->v[i].ctx = c->ctxs[k];
                    break;
                }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * The copy engine */

/* Cuts what is to be copied of the items into pieces of at most `chunk` bytes: all of each, or
 * (held non-NULL) the runs of chunks of `dchunk` bytes whose held[] is set, each item's in turn. */
struct piece *cut(const struct item *v, int n, size_t chunk, const unsigned char *held, uint64_t dchunk,
                  const uint64_t *pre_off, char *pre_base, size_t *np)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += (v[i].size + chunk - 1) / chunk + (held ? (v[i].size + dchunk - 1) / dchunk : 0);
    struct piece *p = calloc(total ? total : 1, sizeof *p);
    if (!p)
        return NULL;
    size_t k = 0, d = 0;
    for (int i = 0; i < n; i++) {
        uint64_t at = 0;
        while (at < v[i].size) {
            uint64_t end = v[i].size; /* the run [at, end) */
            char *host = NULL; /* where the run's chunks were read in before the freeze (consecutive there) */
            if (held) {
                for (; at < v[i].size && !held[d]; at += dchunk)
                    d++;
                if (at >= v[i].size)
                    break;
                if (pre_off && pre_off[d] != UINT64_MAX)
                    host = pre_base + pre_off[d];
                for (end = at; end < v[i].size && held[d]; end += dchunk) {
                    if (host && (pre_off[d] == UINT64_MAX || pre_base + pre_off[d] != host + (end - at)))
                        host = NULL; /* (never: a restore's differing chunks are all held, all read in) */
                    d++;
                }
                end = end < v[i].size ? end : v[i].size;
            }
            for (uint64_t o = at; o < end; o += chunk)
                p[k++] = (struct piece){.dev = v[i].base + o, .off = v[i].off + o,
                                        .len = end - o < chunk ? end - o : chunk, .ctx = v[i].ctx,
                                        .host = host ? host + (o - at) : NULL};
            at = end;
        }
    }
    *np = k;
    return p;
}

struct job {
    int restore, fd;
    char *map; /* direct=1: the image mapped and registered with the driver; copies go straight to it */
    struct piece *p;
    size_t np;
    size_t chunk;
    atomic_size_t next;
    atomic_int failed;
    char err[160];
    pthread_mutex_t err_mu;
};

static void job_fail(struct job *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void job_fail(struct job *j, const char *fmt, ...)
{
    pthread_mutex_lock(&j->err_mu);
    if (!atomic_exchange(&j->failed, 1)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(j->err, sizeof j->err, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&j->err_mu);
}

/* A lane's driver call; on failure the job fails with what was called, and the lane stops. */
#define DRV(call, what, ...)                                                                                     \
    do {                                                                                                         \
        CUresult r_ = (call);                                                                                    \
        if (r_ != CUDA_SUCCESS) {                                                                                \
            job_fail(j, "driver: " what " failed: CUresult %d", ##__VA_ARGS__, (int)r_);                          \
            return -1;                                                                                           \
        }                                                                                                        \
    } while (0)

#define NONE ((size_t)-1)

/* One piece's copy queued on stream s, between the device and `host` (pinned), in the job's direction. */
static int copy_async(struct job *j, const struct piece *p, void *host, CUstream s)
{
    if (j->restore)
        DRV(D.h2d((CUdeviceptr)p->dev, host, p->len, s), "cuMemcpyHtoDAsync(%#llx, %llu)",
            (unsigned long long)p->dev, (unsigned long long)p->len);
    else
        DRV(D.d2h(host, (CUdeviceptr)p->dev, p->len, s), "cuMemcpyDtoHAsync(%#llx, %llu)",
            (unsigned long long)p->dev, (unsigned long long)p->len);
    return 0;
}

/* Stream s caught up (when there is one) and, dumping, the piece its buffer holds (*pend) written into
 * the image: the buffer is free again. */
static int lane_settle(struct lane *L, CUstream s, size_t *pend, void *buf)
{
    struct job *j = L->j;
    if (s)
        DRV(D.stream_sync(s), "cuStreamSynchronize");
    if (*pend != NONE) {
        struct piece *q = &j->p[*pend];
        int e = io_all(0, j->fd, buf, q->len, q->off);
        if (e) {
            job_fail(j, "writing the image: %s", strerror(e));
            return -1;
        }
        *pend = NONE;
    }
    return 0;
}

/* The lane's streams made again in context `ctx` (its pieces come in context order). */
static int lane_enter(struct job *j, CUstream *s, uint64_t ctx)
{
    for (int k = 0; k < 2; k++)
        if (s[k]) {
            D.stream_destroy(s[k]);
            s[k] = NULL;
        }
    DRV(D.ctx_set((CUcontext)(uintptr_t)ctx), "cuCtxSetCurrent");
    DRV(D.stream_create(&s[0], CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    DRV(D.stream_create(&s[1], CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    return 0;
}

/* Piece i through buffer b: restoring, read into it once its last upload is done, then uploaded;
 * dumping, downloaded into it (once the piece it held is written), while the other buffer's piece is
 * written out. */
static int lane_staged(struct lane *L, CUstream *s, int b, size_t i, size_t *pend)
{
    struct job *j = L->j;
    struct piece *p = &j->p[i];
    if (j->restore) {
        DRV(D.stream_sync(s[b]), "cuStreamSynchronize"); /* buf[b]'s last upload is done */
        int e = io_all(1, j->fd, L->buf[b], p->len, p->off);
        if (e) {
            job_fail(j, "reading the image: %s", e == EIO ? "file too short" : strerror(e));
            return -1;
        }
        return copy_async(j, p, L->buf[b], s[b]);
    }
    if (pend[b] != NONE && lane_settle(L, s[b], &pend[b], L->buf[b])) /* buf[b] still holds a piece not written yet */
        return -1;
    if (copy_async(j, p, L->buf[b], s[b]))
        return -1;
    pend[b] = i;
    int o = b ^ 1; /* meanwhile, write out the other buffer */
    if (pend[o] != NONE && lane_settle(L, s[o], &pend[o], L->buf[o]))
        return -1;
    return 0;
}

static void *lane_run(void *arg)
{
    struct lane *L = arg;
    struct job *j = L->j;
    CUstream s[2] = {NULL, NULL};
    uint64_t ctx = 0;
    size_t pend[2] = {NONE, NONE}; /* dump: piece whose data sits in buf[b] */
    int b = 0;
    for (;;) {
        size_t i = atomic_load(&j->failed) ? j->np : atomic_fetch_add(&j->next, 1);
        int done = i >= j->np;
        if (done || j->p[i].ctx != ctx) {
            /* Drain what this lane has in flight before it leaves or changes context. */
            if (lane_settle(L, s[0], &pend[0], L->buf[0]) || lane_settle(L, s[1], &pend[1], L->buf[1]) || done)
                break;
            ctx = j->p[i].ctx;
            if (lane_enter(j, s, ctx))
                break;
        }
        struct piece *p = &j->p[i];
        int e = p->host || j->map /* no staging, no CPU copy: the DMA engine reads or writes pinned memory */
                    ? copy_async(j, p, p->host ? p->host : j->map + p->off, s[b])
                    : lane_staged(L, s, b, i, pend);
        if (e)
            break;
        b ^= 1;
    }
    for (int k = 0; k < 2; k++)
        if (s[k]) {
            D.stream_sync(s[k]); /* never free a buffer a copy still uses */
            D.stream_destroy(s[k]);
        }
    D.ctx_set(NULL);
    return NULL;
}

/* Runs the job on `nl` lanes whose buffers are already pinned. */
static void job_run(struct job *j, struct lane *L, int nl)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the lanes inherit it: signals belong to the program */
    int started = 0;
    for (int i = 0; i < nl; i++) {
        L[i].j = j;
        if (pthread_create(&L[i].t, NULL, lane_run, &L[i]) != 0)
            break;
        started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!started) {
        job_fail(j, "cannot start copy threads");
        return;
    }
    for (int i = 0; i < started; i++)
        pthread_join(L[i].t, NULL);
}

/* Every lane copies its share of the pieces, in the direction `restore` says. Returns whether all did. */
int run_copy(struct op *op, int restore)
{
    struct job j = {.restore = restore, .fd = op->fd, .map = op->map, .p = op->pieces, .np = op->np,
                    .chunk = op->o.chunk};
    pthread_mutex_init(&j.err_mu, NULL);
    if (op->np)
        job_run(&j, op->L, op->nl < (int)op->np ? op->nl : (int)op->np);
    pthread_mutex_destroy(&j.err_mu);
    if (atomic_load(&j.failed)) {
        snprintf(op->err, sizeof op->err, "%s", j.err);
        return -1;
    }
    return 0;
}

/* direct=1: the image file mapped shared and registered (pinned) with the driver, before the gate
 * closes: pinning takes time the job does not wait for, and the copies inside the freeze then move
 * at the bus's speed with no CPU copy.  NULL when the driver cannot (the staging path is used). */
char *direct_map(int fd, uint64_t len, uint64_t ctx)
{
    if (!D.host_register || !D.host_unregister || !len)
        return NULL;
    void *m = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
        return NULL;
    D.ctx_set((CUcontext)(uintptr_t)ctx);
    CUresult r = D.host_register(m, (size_t)len, CU_MEMHOSTALLOC_PORTABLE /* = CU_MEMHOSTREGISTER_PORTABLE */);
    D.ctx_set(NULL);
    if (r != CUDA_SUCCESS) {
        munmap(m, (size_t)len);
        return NULL;
    }
    return m;
}

void direct_unmap(char *m, uint64_t len, uint64_t ctx)
{
    D.ctx_set((CUcontext)(uintptr_t)ctx);
    D.host_unregister(m); /* waits for copies still using it */
    D.ctx_set(NULL);
    munmap(m, (size_t)len);
}

/* Synchronizes every context the registry knows: work submitted before the gate closed finishes. */
static int sync_all(const struct collect *c, char *err, size_t errlen)
{
    for (int k = 0; k < c->nctx; k++) {
        CUresult r = D.ctx_set((CUcontext)(uintptr_t)c->ctxs[k]);
        if (r == CUDA_SUCCESS)
            r = D.ctx_sync();
        if (r != CUDA_SUCCESS) {
            snprintf(err, errlen, "driver: synchronizing context %#llx failed: CUresult %d",
                     (unsigned long long)c->ctxs[k], (int)r);
            D.ctx_set(NULL);
            return -1;
        }
    }
    D.ctx_set(NULL);
    return 0;
}

/* A bounded sync_all, for `drain`: the contexts are synchronized on a thread of its own while the
 * control thread waits up to the timeout.  A synchronization that does not return in time (work
 * that waits on another process, a collective whose peer is stopped) is left to end by itself on
 * that thread, which then exits; until it has, another drain is refused, so there is never more
 * than one such thread. */
struct sync_job {
    struct collect c;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, rc, refs;
    char err[160];
};

static atomic_int g_sync_running;

static void sync_job_unref(struct sync_job *j)
{
    pthread_mutex_lock(&j->mu);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) {
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
        free(j->c.v);
        free(j);
    }
}

static void *sync_run(void *arg)
{
    struct sync_job *j = arg;
    int rc = sync_all(&j->c, j->err, sizeof j->err);
    /* Free for the next one before the waiter hears it is done: a request right after this one
     * (a gang restore after its checkpoint) must not find it still running because this thread
     * was preempted between the two. */
    atomic_store(&g_sync_running, 0);
    pthread_mutex_lock(&j->mu);
    j->rc = rc;
    j->done = 1;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    sync_job_unref(j);
    return NULL;
}

const char *sync_bounded(const struct collect *c, int timeout_ms, uint64_t *ns)
{
    static char err[200];
    uint64_t t0 = now_ns();
    *ns = 0;
    int zero = 0;
    if (!atomic_compare_exchange_strong(&g_sync_running, &zero, 1))
        return "an earlier synchronization of this process has not returned yet";
    struct sync_job *j = calloc(1, sizeof *j);
    if (j) {
        j->c = *c;
        j->c.v = NULL; /* only the contexts are needed */
        j->c.n = j->c.cap = 0;
    }
    if (!j) {
        atomic_store(&g_sync_running, 0);
        return "out of memory";
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    j->refs = 2;
    int e = shim_spawn_detached(sync_run, j, 0);
    if (e) {
        j->refs = 1;
        sync_job_unref(j);
        atomic_store(&g_sync_running, 0);
        return "cannot start the synchronizing thread";
    }
    uint64_t end = t0 + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms) * 1000000u;
    struct timespec dl = {(time_t)(end / 1000000000u), (long)(end % 1000000000u)};
    const char *out = NULL;
    pthread_mutex_lock(&j->mu);
    while (!j->done)
        if (pthread_cond_timedwait(&j->cv, &j->mu, &dl) == ETIMEDOUT)
            break;
    if (!j->done)
        out = "timeout";
    else if (j->rc) {
        snprintf(err, sizeof err, "%s", j->err);
        out = err;
    }
    pthread_mutex_unlock(&j->mu);
    sync_job_unref(j);
    *ns = now_ns() - t0;
    return out;
}

const char *dump_sync(int timeout_ms, uint64_t *ns)
{
    *ns = 0;
    if (!drv_load())
        return "the driver lacks a function the synchronization needs";
    struct collect c;
    if (collect(&c) != 0) {
        free(c.v);
        return "out of memory";
    }
    const char *e = sync_bounded(&c, timeout_ms, ns);
    free(c.v);
    return e;
}
