/* gputrace shim: the preloaded interposer.  Wrappers for the driver calls that submit work or change
 * GPU state, the quiesce gate in front of them, and the three ways a program finds the driver
 * (direct binding, dlsym, cuGetProcAddress) all leading to the wrappers.
 *
 * Constraints that shape this file:
 *   - It is LD_PRELOADed into arbitrary processes (C programs, any Python, `LD_BIND_NOW=1`), so it
 *     links only libc (+libdl/libpthread on old glibc): no libpython, no reference to any cu* symbol
 *     (the driver is reached through dlsym on its handle, found lazily).
 *   - A process that never calls the driver pays nothing: the first intercepted call does the
 *     one-time setup (thread slot, membarrier registration, control server).
 *   - The hot path (a gated call) is: a TLS load, a store to the thread's own slot, a compiler-only
 *     fence, a load of the gate word, the call, a store.  No locks, no atomic read-modify-write.
 */
#include "shim_int.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <link.h>
#include <fnmatch.h>
#include <linux/futex.h>
#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gputrace_shim.h"

#define UNPAREN(...) __VA_ARGS__
#define TLS __thread __attribute__((tls_model("initial-exec")))

/* ------------------------------------------------------------------------------------------------
 * Names, wrappers, and the driver's entry points behind them */

const char *const shim_fn_name[F_COUNT] = {
#define NAME(name, params, args) #name,
    SHIM_ALL(NAME)
#undef NAME
};

#define DECL(name, params, args) CUresult name params __attribute__((visibility("default")));
SHIM_ALL(DECL)
#undef DECL

static void *const g_wrap[F_COUNT] = {
#define ADDR(name, params, args) (void *)&name,
    SHIM_ALL(ADDR)
#undef ADDR
};

static void *_Atomic g_real[F_COUNT];
static CUresult (*_Atomic g_ctx_get_current)(CUcontext *);
static void *_Atomic g_libcuda;
static atomic_int g_resolved;
static TLS int t_resolving; /* this thread is inside resolve_all(): no recursion through dlsym */

static void *(*_Atomic real_dlsym)(void *, const char *);

void shim_log(const char *fmt, ...)
{
    char buf[512];
    int n = snprintf(buf, sizeof buf, "gputrace shim[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof buf - 2)
        n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(2, buf, (size_t)n);
    (void)w;
}

/* The real dlsym without private glibc symbols: dlvsym is not interposed, and asks the next object
 * for dlsym at the version a program built on this glibc would have bound. */
static void init_real_dlsym(void)
{
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !real_dlsym; i++)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (!real_dlsym) {
        shim_log("cannot find the real dlsym; aborting");
        abort(); /* nothing sensible can run without it */
    }
}

static void *libcuda_handle(void)
{
    void *h = atomic_load_explicit(&g_libcuda, memory_order_acquire);
    if (h)
        return h;
    const char *path = getenv("GPUTRACE_SHIM_LIBCUDA");
    if (path && *path)
        h = dlopen(path, RTLD_LAZY | RTLD_LOCAL);
    if (!h)
        h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
    if (!h) /* reached only from a wrapper the program called: it is about to use the driver */
        h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!h)
        return NULL;
    void *expected = NULL;
    if (!atomic_compare_exchange_strong(&g_libcuda, &expected, h))
        return expected; /* another thread won; our extra reference is harmless */
    return h;
}

/* Idempotent and lock-free: two threads resolving at once store the same pointers.  No lock, because
 * dlopen takes the loader lock and the driver's constructors may call dlsym (ours) in turn. */
static void resolve_all(void)
{
    if (atomic_load_explicit(&g_resolved, memory_order_acquire) || t_resolving)
        return;
    if (!real_dlsym)
        init_real_dlsym();
    t_resolving = 1;
    void *h = libcuda_handle();
    if (h) {
        for (int i = 0; i < F_COUNT; i++) {
            void *p = real_dlsym(h, shim_fn_name[i]);
            if (p == g_wrap[i])
                p = NULL; /* never call ourselves */
            atomic_store_explicit(&g_real[i], p, memory_order_relaxed);
        }
        atomic_store_explicit(&g_ctx_get_current, (CUresult(*)(CUcontext *))real_dlsym(h, "cuCtxGetCurrent"),
                              memory_order_relaxed);
        atomic_store_explicit(&g_resolved, 1, memory_order_release);
    }
    t_resolving = 0;
}

static __attribute__((noinline)) void *real_slow(int fn)
{
    resolve_all();
    return atomic_load_explicit(&g_real[fn], memory_order_relaxed);
}

static inline void *real_fast(int fn)
{
    void *p = atomic_load_explicit(&g_real[fn], memory_order_relaxed);
    return LIKELY(p != NULL) ? p : real_slow(fn);
}

void *shim_real(int fn) { return real_fast(fn); }

CUcontext shim_current_ctx(void)
{
    resolve_all();
    CUresult (*f)(CUcontext *) = atomic_load_explicit(&g_ctx_get_current, memory_order_relaxed);
    CUcontext c = NULL;
    if (!f || f(&c) != CUDA_SUCCESS)
        return NULL;
    return c;
}

static int fn_by_name(const char *name)
{
    for (int i = 0; i < F_COUNT; i++)
        if (!strcmp(shim_fn_name[i], name))
            return i;
    return -1;
}

void *shim_driver_sym(const char *name)
{
    resolve_all();
    if (!real_dlsym)
        init_real_dlsym();
    void *h = libcuda_handle();
    void *p = h ? real_dlsym(h, name) : NULL;
    int fn = fn_by_name(name);
    return fn >= 0 && p == g_wrap[fn] ? NULL : p;
}

/* The wrapper standing for the driver entry point p, or p itself when it is not one we wrap. */
static void *wrapper_for(void *p)
{
    if (!p)
        return p;
    resolve_all();
    for (int i = 0; i < F_COUNT; i++)
        if (atomic_load_explicit(&g_real[i], memory_order_relaxed) == p)
            return g_wrap[i];
    return p;
}

/* ------------------------------------------------------------------------------------------------
 * Threads' slots and the gate
 *
 * Each thread that makes a gated call owns a slot (cache-line aligned, so threads never share a
 * line).  `busy` is the thread's nesting depth in gated calls, written only by its owner with plain
 * stores.  The pauser closes the gate, issues a process-wide memory barrier (membarrier(2)), then
 * waits for every slot's `busy` to read 0.  The barrier makes the classic store-load handshake work
 * without a fence on the hot path: either the calling thread's store to `busy` is visible to the
 * pauser, or the thread's load of the gate comes after the barrier and sees it closed.  Where
 * membarrier is missing, the hot path falls back to a full fence.
 *
 * Deadlock freedom: a thread that finds the gate closed marks itself not busy *before* it waits, so
 * it never holds up a pause, whatever locks of its own (the GIL, an allocator mutex) it holds; the
 * pauser (the control thread) takes no lock of the program's.  Calls already in flight may still
 * wait for something a gated thread holds, so a pause gives up after its timeout and reopens the
 * gate instead of waiting forever.  A thread already inside a gated call (depth > 0: the driver
 * calling back into an exported function) is never stopped again.
 *
 * Which calls are gated, and why the rest do not matter: a checkpoint needs (a) no new work on the
 * GPU and (b) a registry that matches the driver.  Only the SHIM_SUBMIT calls put work on the GPU and
 * only the SHIM_STATE calls change what the registry tracks, so gating exactly those gives both.
 * Everything else is a query (attributes, occupancy, pointer and context getters), a
 * synchronization (which only waits for work already submitted, which the checkpointer drains
 * anyway) or current-context bookkeeping that is per-thread and recorded with each object.  Letting
 * those run while paused changes nothing a checkpoint captures, and keeps them at native cost.
 * A driver function that submits work and is not in SHIM_SUBMIT would bypass the gate: the list has
 * to grow with what the checkpointer supports (graphs, 2D/3D copies, managed memory). */

struct slot {
    atomic_int busy;
    atomic_int used;
    int shared; /* the overflow slot: many threads, atomic updates */
    _Atomic unsigned long long calls[F_COUNT];
} __attribute__((aligned(64)));

#define MAX_SLOTS 1024
static struct slot g_slots[MAX_SLOTS];
static struct slot g_overflow = {.shared = 1};
static atomic_int g_nslots;
static atomic_int g_gate;    /* 1: closed */
static int g_suspended;      /* under g_pause_mu: the gate is closed for a suspension (gate_suspend) */
static atomic_int g_waiting; /* threads waiting at the closed gate */
static int g_fence = 1;      /* 0 once membarrier is registered */
static int g_membarrier;
static pthread_mutex_t g_pause_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_key_t g_key;
static TLS struct slot *t_slot;
static TLS int t_depth;

static void slot_release(void *arg)
{
    struct slot *s = arg;
    /* Destructors of other libraries may still call the driver on this thread: send them to the
     * shared slot, which a new thread can never own. */
    t_slot = &g_overflow;
    if (s && s != &g_overflow)
        atomic_store_explicit(&s->used, 0, memory_order_release);
}

static void coll_atfork_child(void);
static void atfork_prepare(void) { reg_atfork_prepare(); }
static void atfork_parent(void) { reg_atfork_release(); }

static void atfork_child(void)
{
    reg_atfork_release();
    /* Only the forking thread survives: every other slot is free and idle. */
    int n = atomic_load(&g_nslots);
    for (int i = 0; i < n; i++) {
        if (&g_slots[i] == t_slot && t_depth)
            continue;
        atomic_store(&g_slots[i].busy, 0);
        atomic_store(&g_slots[i].used, 0);
    }
    atomic_store(&g_overflow.busy, t_slot == &g_overflow ? t_depth : 0);
    if (!t_depth) /* the next call claims a slot again, and that starts the child's own server */
        t_slot = NULL;
    atomic_store(&g_gate, 0);
    atomic_store(&g_waiting, 0);
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_pause_mu = fresh;
    coll_atfork_child();
    control_atfork_child();
}

static void process_init(void)
{
    if (syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0) {
        g_membarrier = 1;
        __atomic_store_n(&g_fence, 0, __ATOMIC_RELEASE);
    }
    pthread_key_create(&g_key, slot_release);
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

static __attribute__((noinline)) struct slot *slot_claim(void)
{
    pthread_once(&g_once, process_init);
    control_start(); /* once per process: an atomic check after that */
    struct slot *s = NULL;
    while (!s) {
        int n = atomic_load(&g_nslots);
        for (int i = 0; i < n && !s; i++) {
            int zero = 0;
            if (atomic_load_explicit(&g_slots[i].used, memory_order_relaxed) == 0 &&
                atomic_compare_exchange_strong(&g_slots[i].used, &zero, 1))
                s = &g_slots[i];
        }
        if (s)
            break;
        int i = atomic_fetch_add(&g_nslots, 1);
        if (i >= MAX_SLOTS) {
            atomic_fetch_sub(&g_nslots, 1);
            s = &g_overflow;
            break;
        }
        /* Taken by compare-and-swap too: a thread scanning the slots sees this one as soon as
         * g_nslots counts it, still unused, and would own it alongside (two threads on one slot
         * lose counts, and the pauser could miss one of them in a call: seen as lost launch counts
         * under pause/resume with 16 threads). Lost to such a thread: look again. */
        int zero = 0;
        if (atomic_compare_exchange_strong(&g_slots[i].used, &zero, 1))
            s = &g_slots[i];
    }
    t_slot = s;
    if (s != &g_overflow)
        pthread_setspecific(g_key, s);
    return s;
}

static inline struct slot *my_slot(void)
{
    struct slot *s = t_slot;
    return LIKELY(s != NULL) ? s : slot_claim();
}

static inline void slot_count(struct slot *s, int fn)
{
    if (LIKELY(!s->shared))
        atomic_store_explicit(&s->calls[fn], atomic_load_explicit(&s->calls[fn], memory_order_relaxed) + 1,
                              memory_order_relaxed);
    else
        atomic_fetch_add_explicit(&s->calls[fn], 1, memory_order_relaxed);
}

static inline void set_busy(struct slot *s, int on)
{
    if (LIKELY(!s->shared))
        atomic_store_explicit(&s->busy, on, on ? memory_order_relaxed : memory_order_release);
    else if (on)
        atomic_fetch_add_explicit(&s->busy, 1, memory_order_relaxed);
    else
        atomic_fetch_sub_explicit(&s->busy, 1, memory_order_release);
}

static void futex(atomic_int *addr, int op, int val)
{
    syscall(SYS_futex, (int *)addr, op, val, NULL, NULL, 0);
}

/* g_gate: 0 open, 1 closed, 2 advancing: open to everything but a collective launch past
 * g_coll_target (gate_advance); the launch that reaches the target closes it. */
#define GATE_CLOSED 1
#define GATE_ADVANCING 2

static __attribute__((noinline)) void gate_wait(struct slot *s)
{
    if (atomic_load_explicit(&g_gate, memory_order_acquire) == GATE_ADVANCING)
        return; /* only collectives wait while advancing; this call is none */
    atomic_fetch_add(&g_waiting, 1);
    do {
        set_busy(s, 0); /* first of all: never hold up the pauser while we wait */
        while (atomic_load_explicit(&g_gate, memory_order_acquire) == GATE_CLOSED)
            futex(&g_gate, FUTEX_WAIT_PRIVATE, GATE_CLOSED);
        set_busy(s, 1);
        atomic_thread_fence(memory_order_seq_cst); /* slow path: a real fence, membarrier or not */
    } while (atomic_load_explicit(&g_gate, memory_order_relaxed) == GATE_CLOSED);
    atomic_fetch_sub(&g_waiting, 1);
}

static inline struct slot *gate_enter(int fn)
{
    struct slot *s = my_slot();
    if (LIKELY(t_depth++ == 0)) {
        set_busy(s, 1);
        if (UNLIKELY(__atomic_load_n(&g_fence, __ATOMIC_RELAXED)))
            atomic_thread_fence(memory_order_seq_cst);
        else
            atomic_signal_fence(memory_order_seq_cst); /* the pauser's membarrier is the other half */
        if (UNLIKELY(atomic_load_explicit(&g_gate, memory_order_relaxed)))
            gate_wait(s);
    }
    slot_count(s, fn);
    return s;
}

static inline void gate_leave(struct slot *s)
{
    if (LIKELY(--t_depth == 0))
        set_busy(s, 0);
}

/* ------------------------------------------------------------------------------------------------
 * Collectives: stopping every process of a job at the same one.
 *
 * A collective (an NCCL kernel) completes only once every rank of its group has launched its
 * matching instance, so a rank whose gate closed before a launch its peers have made holds them,
 * and any of their calls waiting on that collective, for as long as it is closed: no drain of the
 * peers can end.  The shim therefore counts the collectives each process launches (kernels looked
 * up by a collective's name: SHIM_LOOKUP), and a job is stopped in two moves (checkpointer/gang.py):
 * every rank's gate closes wherever the rank is (gate_close: only launches of collectives in
 * flight are waited for, which never wait on a peer), then each rank behind the furthest one is let
 * run up to the same count (gate_advance: everything passes but a collective past the target; the
 * launch that reaches it closes the gate again).  Then every collective launched anywhere has been
 * launched everywhere, and the calls in flight can drain.
 *
 * The cost for a job without collectives: a relaxed load of g_ncoll_fn in each launch. */

#define MAX_COLL_FNS 256
static void *_Atomic g_coll_fn[MAX_COLL_FNS]; /* handles of collective kernels (CUfunction or CUkernel) */
static atomic_int g_ncoll_fn;
static atomic_ullong g_coll_launched; /* collective launches that passed the gate */
static atomic_ullong g_coll_target;   /* while advancing: where the gate closes again */
static atomic_int g_coll_busy;        /* threads inside a collective launch's gate check */
static pthread_mutex_t g_coll_mu = PTHREAD_MUTEX_INITIALIZER;
static char *g_coll_patterns; /* comma-separated fnmatch patterns, from $GPUTRACE_SHIM_COLLECTIVES */
static int g_coll_patterns_read;

#define DEFAULT_COLLECTIVES "ncclDevKernel_*,ncclKernel_*"

static int coll_name(const char *name)
{
    if (!name)
        return 0;
    pthread_mutex_lock(&g_coll_mu);
    if (!g_coll_patterns_read) {
        const char *e = getenv("GPUTRACE_SHIM_COLLECTIVES");
        g_coll_patterns = strdup(e && *e ? e : DEFAULT_COLLECTIVES);
        g_coll_patterns_read = 1;
    }
    int hit = 0;
    if (g_coll_patterns) {
        char buf[512];
        snprintf(buf, sizeof buf, "%s", g_coll_patterns);
        for (char *save = NULL, *w = strtok_r(buf, ",", &save); w && !hit; w = strtok_r(NULL, ",", &save))
            hit = fnmatch(w, name, 0) == 0;
    }
    pthread_mutex_unlock(&g_coll_mu);
    return hit;
}

static void coll_note(void *handle)
{
    if (!handle)
        return;
    pthread_mutex_lock(&g_coll_mu);
    int n = atomic_load(&g_ncoll_fn), seen = 0;
    for (int i = 0; i < n && !seen; i++)
        seen = atomic_load_explicit(&g_coll_fn[i], memory_order_relaxed) == handle;
    if (!seen && n < MAX_COLL_FNS) {
        atomic_store_explicit(&g_coll_fn[n], handle, memory_order_relaxed);
        atomic_store_explicit(&g_ncoll_fn, n + 1, memory_order_release);
    } else if (!seen) {
        shim_log("more than %d collective kernels: the rest are not counted", MAX_COLL_FNS);
    }
    pthread_mutex_unlock(&g_coll_mu);
}

/* A child is a process of its own: it has launched nothing yet (the kernels noted stay noted). */
static void coll_atfork_child(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_coll_mu = fresh;
    atomic_store(&g_coll_launched, 0);
    atomic_store(&g_coll_busy, 0);
}

static int coll_is(const void *f)
{
    int n = atomic_load_explicit(&g_ncoll_fn, memory_order_acquire);
    for (int i = 0; i < n; i++)
        if (atomic_load_explicit(&g_coll_fn[i], memory_order_relaxed) == f)
            return 1;
    return 0;
}

/* gate_enter for a collective launch: counted once it has passed the gate; while advancing, it
 * passes only below the target, and the one that reaches it closes the gate. */
static __attribute__((noinline)) struct slot *coll_enter(int fn)
{
    struct slot *s = my_slot();
    if (t_depth++ == 0) {
        set_busy(s, 1);
        for (;;) {
            atomic_fetch_add(&g_coll_busy, 1); /* seq_cst, as the closer's store and load */
            int g = atomic_load(&g_gate);
            if (g == 0) {
                atomic_fetch_add(&g_coll_launched, 1);
                atomic_fetch_sub(&g_coll_busy, 1);
                break;
            }
            if (g == GATE_ADVANCING) {
                unsigned long long c = atomic_load(&g_coll_launched), t = atomic_load(&g_coll_target);
                if (c < t && atomic_compare_exchange_strong(&g_coll_launched, &c, c + 1)) {
                    if (c + 1 >= t) {
                        int adv = GATE_ADVANCING;
                        atomic_compare_exchange_strong(&g_gate, &adv, GATE_CLOSED);
                    }
                    atomic_fetch_sub(&g_coll_busy, 1);
                    break;
                }
                if (c < t) { /* another thread counted meanwhile: look again */
                    atomic_fetch_sub(&g_coll_busy, 1);
                    continue;
                }
            }
            atomic_fetch_sub(&g_coll_busy, 1);
            atomic_fetch_add(&g_waiting, 1);
            set_busy(s, 0);
            struct timespec nap = {0, 10000000}; /* the gate may change 2 -> 1 without a wake: look again */
            while (atomic_load(&g_gate) == g)
                syscall(SYS_futex, (int *)&g_gate, FUTEX_WAIT_PRIVATE, g, &nap, NULL, 0);
            set_busy(s, 1);
            atomic_fetch_sub(&g_waiting, 1);
        }
    }
    slot_count(s, fn);
    return s;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int busy_threads(void)
{
    int n = atomic_load(&g_nslots), busy = 0;
    for (int i = 0; i < n; i++)
        busy += atomic_load_explicit(&g_slots[i].busy, memory_order_acquire) != 0 && &g_slots[i] != t_slot;
    busy += atomic_load_explicit(&g_overflow.busy, memory_order_acquire);
    return busy;
}

/* A detached thread of the shim's, with every signal blocked (signals belong to the program); `stack`
 * 0 for the default size.  pthread_create's error, 0 on success. */
int shim_spawn_detached(void *(*fn)(void *), void *arg, size_t stack)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (stack)
        pthread_attr_setstacksize(&at, stack);
    pthread_t t;
    int e = pthread_create(&t, &at, fn, arg);
    pthread_attr_destroy(&at);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return e;
}

static int coll_busy(void) { return atomic_load(&g_coll_busy); }

/* Closes the gate (to `state`) and waits, up to the timeout, until `busy()` reads 0: the calls that
 * must leave before the gate counts as closed.  0: closed; -1: still busy at the timeout (the gate
 * is reopened); -2: already closed.  Returns with g_pause_mu released. */
static int close_gate(int state, int timeout_ms, int (*busy)(void))
{
    pthread_mutex_lock(&g_pause_mu);
    if (atomic_load(&g_gate)) {
        pthread_mutex_unlock(&g_pause_mu);
        return -2;
    }
    atomic_store(&g_gate, state);
    if (g_membarrier && syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0) {
        /* Cannot happen once registered; if it does, no hot-path store is known to be visible. */
        __atomic_store_n(&g_fence, 1, __ATOMIC_SEQ_CST);
        shim_log("membarrier failed (%s); falling back to fences", strerror(errno));
        g_membarrier = 0;
    }
    atomic_thread_fence(memory_order_seq_cst);
    uint64_t deadline = mono_ns() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms) * 1000000u;
    long nap_ns = 1000;
    while (busy() > 0) {
        if (mono_ns() >= deadline) {
            atomic_store(&g_gate, 0);
            futex(&g_gate, FUTEX_WAKE_PRIVATE, INT_MAX);
            pthread_mutex_unlock(&g_pause_mu);
            return -1;
        }
        struct timespec ts = {0, nap_ns};
        nanosleep(&ts, NULL);
        if (nap_ns < 1000000)
            nap_ns *= 2;
    }
    pthread_mutex_unlock(&g_pause_mu);
    return 0;
}

int gputrace_shim_pause(int timeout_ms)
{
    return close_gate(1, timeout_ms, busy_threads);
}

/* Closes the gate without waiting for the calls in flight (they may wait on a peer that is itself
 * stopped), only for collective launches in their gate check, which never wait; *count is then the
 * collectives this process has launched, final while the gate stays closed.  0: closed; -1: a
 * collective launch still in its check at the timeout (the gate is reopened); -2: already closed. */
int gate_close(int timeout_ms, unsigned long long *count)
{
    int r = close_gate(GATE_CLOSED, timeout_ms, coll_busy);
    if (r == 0)
        *count = atomic_load(&g_coll_launched);
    return r;
}

/* With the gate closed: lets the process run until it has launched `target` collectives, then the
 * gate is closed again.  0: there (*count == target); -1: not there at the timeout (the gate is
 * closed again, *count says where the process stopped); -3: the gate was not closed. */
int gate_advance(unsigned long long target, int timeout_ms, unsigned long long *count)
{
    pthread_mutex_lock(&g_pause_mu);
    if (atomic_load(&g_gate) != GATE_CLOSED || g_suspended) {
        pthread_mutex_unlock(&g_pause_mu);
        return -3;
    }
    if (atomic_load(&g_coll_launched) >= target) {
        *count = atomic_load(&g_coll_launched);
        pthread_mutex_unlock(&g_pause_mu);
        return 0;
    }
    atomic_store(&g_coll_target, target);
    atomic_store(&g_gate, GATE_ADVANCING);
    futex(&g_gate, FUTEX_WAKE_PRIVATE, INT_MAX);
    pthread_mutex_unlock(&g_pause_mu);
    uint64_t deadline = mono_ns() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms) * 1000000u;
    long nap_ns = 1000;
    int r = 0;
    while (atomic_load(&g_gate) == GATE_ADVANCING) {
        if (mono_ns() >= deadline) {
            pthread_mutex_lock(&g_pause_mu);
            int adv = GATE_ADVANCING;
            atomic_compare_exchange_strong(&g_gate, &adv, GATE_CLOSED);
            pthread_mutex_unlock(&g_pause_mu);
            r = atomic_load(&g_coll_launched) >= target ? 0 : -1;
            break;
        }
        struct timespec ts = {0, nap_ns};
        nanosleep(&ts, NULL);
        if (nap_ns < 1000000)
            nap_ns *= 2;
    }
    if (g_membarrier)
        syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0); /* as a pause: calls after this are seen */
    atomic_thread_fence(memory_order_seq_cst);
    *count = atomic_load(&g_coll_launched);
    return r;
}

/* With the gate closed: waits up to timeout_ms for the calls in flight to leave.  0: none left. */
int gate_drain(int timeout_ms)
{
    uint64_t deadline = mono_ns() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms) * 1000000u;
    long nap_ns = 1000;
    while (busy_threads() > 0) {
        if (mono_ns() >= deadline)
            return -1;
        struct timespec ts = {0, nap_ns};
        nanosleep(&ts, NULL);
        if (nap_ns < 1000000)
            nap_ns *= 2;
    }
    return 0;
}

unsigned long long gate_collectives(void) { return atomic_load(&g_coll_launched); }
int gate_collective_kernels(void) { return atomic_load(&g_ncoll_fn); }
int gate_advancing(void) { return atomic_load(&g_gate) == GATE_ADVANCING; }

int gputrace_shim_resume(void)
{
    pthread_mutex_lock(&g_pause_mu);
    if (g_suspended) { /* only unsuspend reopens a suspension's gate: the job's memory is off the GPU */
        pthread_mutex_unlock(&g_pause_mu);
        return -3;
    }
    int was = atomic_exchange(&g_gate, 0);
    futex(&g_gate, FUTEX_WAKE_PRIVATE, INT_MAX);
    pthread_mutex_unlock(&g_pause_mu);
    return was ? 0 : -1;
}

/* A suspension holds the gate: closed by whoever began it, it stays closed, whatever a client's
 * resume or a closing connection asks, until gate_unsuspend. */
void gate_suspend(void)
{
    pthread_mutex_lock(&g_pause_mu);
    g_suspended = 1;
    pthread_mutex_unlock(&g_pause_mu);
}

void gate_unsuspend(void)
{
    pthread_mutex_lock(&g_pause_mu);
    g_suspended = 0;
    pthread_mutex_unlock(&g_pause_mu);
    gputrace_shim_resume();
}

int gate_suspended(void)
{
    pthread_mutex_lock(&g_pause_mu);
    int s = g_suspended;
    pthread_mutex_unlock(&g_pause_mu);
    return s;
}

int gate_paused(void) { return atomic_load(&g_gate); }
int gputrace_shim_paused(void) { return atomic_load(&g_gate); }
int gputrace_shim_in_flight(void) { return busy_threads(); }
int gputrace_shim_waiting(void) { return atomic_load(&g_waiting); }
int gputrace_shim_schema(void) { return SCHEMA; }

int gputrace_shim_serve(void)
{
    my_slot();
    control_start();
    return *control_path() ? 0 : -1;
}

const char *gputrace_shim_socket_path(void) { return control_path(); }

unsigned long long shim_calls(int fn)
{
    unsigned long long n = atomic_load_explicit(&g_overflow.calls[fn], memory_order_relaxed);
    int ns = atomic_load(&g_nslots);
    for (int i = 0; i < ns; i++)
        n += atomic_load_explicit(&g_slots[i].calls[fn], memory_order_relaxed);
    return n;
}

long long gputrace_shim_calls(const char *name)
{
    int fn = name ? fn_by_name(name) : -1;
    return fn < 0 ? -1 : (long long)shim_calls(fn);
}

void *gputrace_shim_real(const char *name)
{
    int fn = name ? fn_by_name(name) : -1;
    return fn < 0 ? NULL : shim_real(fn);
}

/* ------------------------------------------------------------------------------------------------
 * The wrappers */

#define HOOKS(name, params, args)                                                                                \
    HIDDEN void pre_##name(struct hold *hold_, UNPAREN params);                                                      \
    HIDDEN void post_##name(CUresult r_, struct hold *hold_, UNPAREN params);                                        \
    HIDDEN int alt_##name(CUresult *r_, struct hold *hold_, UNPAREN params) __attribute__((weak));
SHIM_STATE(HOOKS)
#undef HOOKS

/* A launch: a collective's (its kernel noted by SHIM_LOOKUP) is counted; see coll_enter. */
#define LAUNCH_WRAPPER(name, params, args)                                                                       \
    CUresult name params                                                                                         \
    {                                                                                                            \
        int coll_ = UNLIKELY(atomic_load_explicit(&g_ncoll_fn, memory_order_relaxed) != 0) && coll_is((void *)f); \
        struct slot *s_ = UNLIKELY(coll_) ? coll_enter(F_##name) : gate_enter(F_##name);                         \
        long long e_ = emul(F_##name);                                                                           \
        __typeof__(&name) f_ = (__typeof__(&name))real_fast(F_##name);                                           \
        CUresult r_ = LIKELY(f_ != NULL) ? f_ args : CUDA_ERROR_NOT_FOUND;                                       \
        emul_done(e_);                                                                                           \
        gate_leave(s_);                                                                                          \
        return r_;                                                                                               \
    }
SHIM_LAUNCH(LAUNCH_WRAPPER)
#undef LAUNCH_WRAPPER

#define SUBMIT_WRAPPER(name, params, args)                                                                       \
    CUresult name params                                                                                         \
    {                                                                                                            \
        struct slot *s_ = gate_enter(F_##name);                                                                  \
        long long e_ = emul(F_##name);                                                                           \
        __typeof__(&name) f_ = (__typeof__(&name))real_fast(F_##name);                                           \
        CUresult r_ = LIKELY(f_ != NULL) ? f_ args : CUDA_ERROR_NOT_FOUND;                                       \
        emul_done(e_);                                                                                           \
        gate_leave(s_);                                                                                          \
        return r_;                                                                                               \
    }
SHIM_SUBMIT_REST(SUBMIT_WRAPPER)
#undef SUBMIT_WRAPPER

/* The registry changes inside the gated section, so once a pause has drained the calls in flight the
 * registry matches the driver exactly. */
#define STATE_WRAPPER(name, params, args)                                                                        \
    CUresult name params                                                                                         \
    {                                                                                                            \
        struct slot *s_ = gate_enter(F_##name);                                                                  \
        long long e_ = emul(F_##name);                                                                           \
        __typeof__(&name) f_ = (__typeof__(&name))real_fast(F_##name);                                           \
        struct hold h_;                                                                                          \
        h_.found = 0;                                                                                            \
        pre_##name(&h_, UNPAREN args);                                                                           \
        CUresult r_;                                                                                             \
        if (!alt_##name || !alt_##name(&r_, &h_, UNPAREN args)) /* an alternative implementation (hooks.c) */    \
            r_ = LIKELY(f_ != NULL) ? f_ args : CUDA_ERROR_NOT_FOUND;                                            \
        emul_done(e_);                                                                                           \
        post_##name(r_, &h_, UNPAREN args);                                                                      \
        gate_leave(s_);                                                                                          \
        return r_;                                                                                               \
    }
SHIM_STATE(STATE_WRAPPER)
#undef STATE_WRAPPER

/* Not gated, not counted: the emulated layer's cost, then the driver (shim_api.h, SHIM_PASS). */
#define PASS_WRAPPER(name, params, args)                                                                         \
    CUresult name params                                                                                         \
    {                                                                                                            \
        long long e_ = emul(F_##name);                                                                           \
        __typeof__(&name) f_ = (__typeof__(&name))real_fast(F_##name);                                           \
        CUresult r_ = LIKELY(f_ != NULL) ? f_ args : CUDA_ERROR_NOT_FOUND;                                       \
        emul_done(e_);                                                                                           \
        return r_;                                                                                               \
    }
SHIM_QUERY(PASS_WRAPPER)
SHIM_PASS_STATE(PASS_WRAPPER)
#undef PASS_WRAPPER

/* The synchronizations: as above, and once the stream (or the context) has caught up, the memory
 * of stream-ordered frees it has reached is given back (vmm.c), as the driver's pool does. */
#define SYNC_WRAPPER(name, params, args)                                                                         \
    CUresult name params                                                                                         \
    {                                                                                                            \
        long long e_ = emul(F_##name);                                                                           \
        __typeof__(&name) f_ = (__typeof__(&name))real_fast(F_##name);                                           \
        CUresult r_ = LIKELY(f_ != NULL) ? f_ args : CUDA_ERROR_NOT_FOUND;                                       \
        emul_done(e_);                                                                                           \
        if (UNLIKELY(atomic_load_explicit(&vmm_pending, memory_order_relaxed)))                                  \
            vmm_reap(0);                                                                                         \
        return r_;                                                                                               \
    }
SHIM_SYNC(SYNC_WRAPPER)
#undef SYNC_WRAPPER

/* Kernels by name: not gated, not counted; a collective's handle is noted. */
CUresult cuModuleGetFunction(CUfunction *pf, CUmodule m, const char *name)
{
    __typeof__(&cuModuleGetFunction) f_ = (__typeof__(&cuModuleGetFunction))real_fast(F_cuModuleGetFunction);
    CUresult r = LIKELY(f_ != NULL) ? f_(pf, m, name) : CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS && pf && coll_name(name))
        coll_note((void *)*pf);
    return r;
}

CUresult cuLibraryGetKernel(CUkernel *pk, CUlibrary l, const char *name)
{
    __typeof__(&cuLibraryGetKernel) f_ = (__typeof__(&cuLibraryGetKernel))real_fast(F_cuLibraryGetKernel);
    CUresult r = LIKELY(f_ != NULL) ? f_(pk, l, name) : CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS && pk && coll_name(name))
        coll_note((void *)*pk); /* launched as a CUfunction by cast, as CUDA 12 allows */
    return r;
}

/* A handle the program holds, for the driver: its own unless a suspension made the allocation again
 * (vmm.c).  While suspended the allocation has no driver handle: the properties it was made with are
 * the answer. */
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    __typeof__(&cuMemGetAllocationPropertiesFromHandle) f_ =
        (__typeof__(&cuMemGetAllocationPropertiesFromHandle))real_fast(F_cuMemGetAllocationPropertiesFromHandle);
    uint64_t drv = h;
    if (UNLIKELY(vmm_translate_handle(h, &drv, prop)))
        return CUDA_SUCCESS;
    return LIKELY(f_ != NULL) ? f_(prop, drv) : CUDA_ERROR_NOT_FOUND;
}

/* cuGetProcAddress hands out our wrapper wherever the driver hands out an entry point we wrap: the
 * driver has already applied the requested version and the per-thread-stream flag, so mapping its
 * answer back (cuLaunchKernel_ptsz -> our cuLaunchKernel_ptsz) honors both.  Its own entry point maps
 * to our cuGetProcAddress wrappers the same way. */
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags)
{
    slot_count(my_slot(), F_cuGetProcAddress);
    __typeof__(&cuGetProcAddress) f = (__typeof__(&cuGetProcAddress))shim_real(F_cuGetProcAddress);
    if (!f)
        return CUDA_ERROR_NOT_FOUND;
    CUresult r = f(sym, pfn, ver, flags);
    if (r == CUDA_SUCCESS && pfn)
        *pfn = wrapper_for(*pfn);
    return r;
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *st)
{
    slot_count(my_slot(), F_cuGetProcAddress_v2);
    __typeof__(&cuGetProcAddress_v2) f = (__typeof__(&cuGetProcAddress_v2))shim_real(F_cuGetProcAddress_v2);
    if (!f)
        return CUDA_ERROR_NOT_FOUND;
    CUresult r = f(sym, pfn, ver, flags, st);
    if (r == CUDA_SUCCESS && pfn)
        *pfn = wrapper_for(*pfn);
    return r;
}

/* ------------------------------------------------------------------------------------------------
 * dlsym: a program that dlopens the driver and looks functions up by name gets the wrappers. */

/* RTLD_NEXT means "after the caller", and glibc finds the caller from the return address, which
 * would now be this file.  So search the link map after the caller's object ourselves. */
static void *next_after(const void *caller, const char *name)
{
    Dl_info ci;
    struct link_map *lm = NULL;
    if (!dladdr1(caller, &ci, (void **)&lm, RTLD_DL_LINKMAP) || !lm)
        return real_dlsym(RTLD_NEXT, name); /* a caller in no object (JIT code): search after the shim,
                                             * which is loaded right after the program */
    for (struct link_map *m = lm->l_next; m; m = m->l_next) {
        void *h = dlopen(m->l_name && m->l_name[0] ? m->l_name : NULL, RTLD_LAZY | RTLD_NOLOAD);
        if (!h)
            continue;
        void *p = real_dlsym(h, name);
        dlclose(h);
        Dl_info pi;
        struct link_map *pm = NULL;
        if (p && dladdr1(p, &pi, (void **)&pm, RTLD_DL_LINKMAP) && pm == m)
            return p;
    }
    return NULL;
}

/* Returns NULL the way dlsym does: with dlerror() set (callers such as ctypes format it), by asking a
 * handle that lacks the name (the driver's, else libc's). */
static void *not_found(const char *name)
{
    void *h = atomic_load(&g_libcuda);
    if (!h)
        h = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    if (h)
        (void)real_dlsym(h, name);
    return NULL;
}

__attribute__((visibility("default"))) void *dlsym(void *restrict handle, const char *restrict name)
{
    if (UNLIKELY(!real_dlsym))
        init_real_dlsym();
    if (handle == RTLD_NEXT)
        return next_after(__builtin_return_address(0), name);
    void *p = real_dlsym(handle, name);
    if (!p || name[0] != 'c' || name[1] != 'u' || t_resolving)
        return p;
    int fn = fn_by_name(name);
    if (fn < 0)
        return p;
    if (p == g_wrap[fn]) /* a global lookup found the wrapper: only if the driver has the function */
        return shim_real(fn) ? p : not_found(name);
    return shim_real(fn) == p ? g_wrap[fn] : p; /* another library's cu* name: not ours to wrap */
}

/* ------------------------------------------------------------------------------------------------
 * Status */

static void sb_json_str(struct sbuf *b, const char *s)
{
    sb_printf(b, "\"");
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            sb_printf(b, "\\%c", c);
        else if (c < 0x20)
            sb_printf(b, "\\u%04x", c);
        else
            sb_printf(b, "%c", c);
    }
    sb_printf(b, "\"");
}

char *shim_status_alloc(size_t *len)
{
    struct sbuf b = {0};
    int nthreads = atomic_load(&g_nslots);
    int used = 0;
    for (int i = 0; i < nthreads; i++)
        used += atomic_load(&g_slots[i].used) != 0;
    const char *driver = "";
    Dl_info di;
    void *any = atomic_load(&g_real[F_cuGetProcAddress]);
    if (any && dladdr(any, &di) && di.dli_fname)
        driver = di.dli_fname;
    sb_printf(&b, "{\"schema\": %d, \"pid\": %d, \"paused\": %s, \"suspended\": %s, \"in_flight\": %d, \"waiting\": %d, "
                  "\"threads\": %d, \"membarrier\": %s, \"collectives\": %llu, \"collective_kernels\": %d, "
                  "\"advancing\": %s, \"driver\": ",
              SCHEMA, (int)getpid(), gate_paused() ? "true" : "false", gate_suspended() ? "true" : "false",
              busy_threads(), atomic_load(&g_waiting), used, g_membarrier ? "true" : "false",
              (unsigned long long)atomic_load(&g_coll_launched), atomic_load(&g_ncoll_fn),
              atomic_load(&g_gate) == GATE_ADVANCING ? "true" : "false");
    sb_json_str(&b, driver);
    sb_printf(&b, ", \"socket\": ");
    sb_json_str(&b, control_path());
    sb_printf(&b, ", \"calls\": {");
    int first = 1;
    for (int i = 0; i < F_COUNT; i++) {
        unsigned long long n = shim_calls(i);
        if (n) {
            sb_printf(&b, "%s\"%s\": %llu", first ? "" : ", ", shim_fn_name[i], n);
            first = 0;
        }
    }
    sb_printf(&b, "}, ");
    emul_status(&b);
    sb_printf(&b, ", ");
    dump_kept_json(&b);
    sb_printf(&b, ", ");
    reg_json(&b);
    sb_printf(&b, "}");
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}

size_t gputrace_shim_status_json(char *buf, size_t len)
{
    size_t n = 0;
    char *p = shim_status_alloc(&n);
    if (buf && len) {
        size_t c = n < len - 1 ? n : len - 1;
        if (c)
            memcpy(buf, p, c);
        buf[c] = 0;
    }
    free(p);
    return n;
}
