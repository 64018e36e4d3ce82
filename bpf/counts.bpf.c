/* Per (process, driver function): calls, paired call time and a log2 latency histogram, all kept in
 * the kernel. Attached through uprobe-multi links (or per-probe perf links) whose cookie carries the
 * function id and, in bit 32, whether this function is timed (its return probe is attached too).
 *
 * One source, two compilers (compat.h): bcc at run time, options as -D flags (GT_MAX_STATS,
 * GT_MAX_THREADS); or plain clang ahead of time with -DGT_BPF_OBJECT, into the object the wheel
 * carries, whose map sizes the loader sets (tracer/bpfobj.py). */
#include "compat.h"
#include "gputrace.h"

GT_MAP(hash, stats, struct gt_key, struct gt_stats, GT_MAX_STATS);
GT_MAP(lru_hash, threads, u32, struct gt_thread, GT_MAX_THREADS);
GT_MAP(array, errors, int, u64, GT_ERR_COUNT);
GT_MAP(array, config, int, struct gt_config, 1);
GT_MAP(array, seen, int, u64, 2);
GT_MAP(lru_hash, tstats, struct gt_tkey, struct gt_tstats, GT_MAX_TSTATS);
GT_LICENSE

/* The map operations the program makes, written out for each compiler (see compat.h). */
#ifndef GT_BPF_OBJECT
static __always_inline struct gt_stats *stats_lookup(struct gt_key *k) { return stats.lookup(k); }
static __always_inline void stats_insert(struct gt_key *k, struct gt_stats *v) { stats.insert(k, v); }
static __always_inline struct gt_thread *threads_lookup(u32 *k) { return threads.lookup(k); }
static __always_inline void threads_insert(u32 *k, struct gt_thread *v) { threads.insert(k, v); }
static __always_inline void threads_delete(u32 *k) { threads.delete(k); }
static __always_inline u64 *errors_lookup(u32 *k) { return errors.lookup(k); }
static __always_inline struct gt_config *config_lookup(u32 *k) { return config.lookup(k); }
static __always_inline u64 *seen_lookup(u32 *k) { return seen.lookup(k); }
static __always_inline struct gt_tstats *tstats_lookup(struct gt_tkey *k) { return tstats.lookup(k); }
static __always_inline void tstats_insert(struct gt_tkey *k, struct gt_tstats *v) { tstats.insert(k, v); }
#else
static __always_inline struct gt_stats *stats_lookup(struct gt_key *k) { return bpf_map_lookup_elem(&stats, k); }
static __always_inline void stats_insert(struct gt_key *k, struct gt_stats *v) { bpf_map_update_elem(&stats, k, v, BPF_NOEXIST); }
static __always_inline struct gt_thread *threads_lookup(u32 *k) { return bpf_map_lookup_elem(&threads, k); }
static __always_inline void threads_insert(u32 *k, struct gt_thread *v) { bpf_map_update_elem(&threads, k, v, BPF_NOEXIST); }
static __always_inline void threads_delete(u32 *k) { bpf_map_delete_elem(&threads, k); }
static __always_inline u64 *errors_lookup(u32 *k) { return bpf_map_lookup_elem(&errors, k); }
static __always_inline struct gt_config *config_lookup(u32 *k) { return bpf_map_lookup_elem(&config, k); }
static __always_inline u64 *seen_lookup(u32 *k) { return bpf_map_lookup_elem(&seen, k); }
static __always_inline struct gt_tstats *tstats_lookup(struct gt_tkey *k) { return bpf_map_lookup_elem(&tstats, k); }
static __always_inline void tstats_insert(struct gt_tkey *k, struct gt_tstats *v) { bpf_map_update_elem(&tstats, k, v, BPF_NOEXIST); }
#endif

static __always_inline void gt_error(u32 which)
{
    u64 *v = errors_lookup(&which);
    if (v)
        __sync_fetch_and_add(v, 1);
}

static __always_inline struct gt_stats *gt_stats_of(u32 tgid, u32 func)
{
    struct gt_key key = {.tgid = tgid, .func = func};
    struct gt_stats *s = stats_lookup(&key);
    if (s)
        return s;
    struct gt_stats zero = {};
    stats_insert(&key, &zero);
    s = stats_lookup(&key);
    if (!s)
        gt_error(GT_ERR_STATS_FULL);
    return s;
}

/* The calling thread's row for `func` (NULL where the map refuses one: its share is then lost, not
 * misattributed). */
static __always_inline struct gt_tstats *gt_tstats_of(u64 id, u32 func)
{
    struct gt_tkey key = {.tgid = id >> 32, .tid = (u32)id, .func = func};
    struct gt_tstats *s = tstats_lookup(&key);
    if (s)
        return s;
    struct gt_tstats zero = {};
    tstats_insert(&key, &zero);
    return tstats_lookup(&key);
}

/* The config map's one value, read in place (a copy of it no longer fits the program's stack
 * beside a thread's frames); an array's index 0 is always there. */
static __always_inline struct gt_config *gt_config_at(void)
{
    u32 zero = 0;
    return config_lookup(&zero);
}

/* A call of the step function (struct gt_config): its time noted (user space arms a step window
 * just before the next is due); armed, it opens the window at the first call after arming and
 * closes it sync_steps calls later. */
static __always_inline void gt_step(u32 state)
{
    u32 zero = 0;
    struct gt_config *c = config_lookup(&zero);
    if (!c)
        return;
    u64 now = bpf_ktime_get_ns();
    u64 last = c->step_last_t;
    c->step_last_t = now;
    if (last && now > last) {
        u64 dt = (now - last) / 1000;
        c->gap_n += 1;
        c->gap_sum += dt;
        c->gap_sq += dt * dt;
    }
    if (state != GT_ARMED && state != GT_OPEN)
        return;
    __sync_fetch_and_add(&c->sync_calls, 1);
    u64 n = c->sync_calls;
    if (state == GT_ARMED) {
        c->sync_start = n;
        c->sync_t0 = now;
        c->open = GT_OPEN;
    } else if (c->sync_start && n >= c->sync_start + c->sync_steps) {
        c->open = GT_CLOSED;
        c->sync_end = n;
        c->sync_t1 = now;
    }
}

GT_UPROBE int gt_entry(struct pt_regs *ctx)
{
    u64 cookie = bpf_get_attach_cookie(ctx);
    u32 func = cookie & GT_COOKIE_FUNC_MASK;
    u64 id = bpf_get_current_pid_tgid();
    struct gt_config *cfg = gt_config_at();
    if (!cfg)
        return 0;
    u32 open = cfg->open;
    struct gt_stats *s = gt_stats_of(id >> 32, func);
    if (cookie & GT_COOKIE_KEPT) {
        /* Seen called, but called so rarely that counting every call costs less than sampling it
         * would tell: counted exactly, and not flagged as new (it is where user space wants it);
         * its hits are tallied apart (`seen` index 1), so that user space learns at once when
         * one of these turns hot and counting every call of it costs the job more than it may. */
        u32 one = 1;
        u64 *k = seen_lookup(&one);
        if (k)
            __sync_fetch_and_add(k, 1);
        if (s) {
            __sync_fetch_and_add(&s->watched, 1);
            /* In a window, its calls there: the window then stands for that many of the job's
             * calls of it, at its exact rate outside the windows, whatever the probes cost. */
            if (open == GT_OPEN)
                __sync_fetch_and_add(&s->kept_open, 1);
        }
        struct gt_tstats *ts = gt_tstats_of(id, func);
        if (ts)
            __sync_fetch_and_add(&ts->kept, 1);
        if (func == cfg->sync_func && (u32)(id >> 32) == cfg->sync_tgid)
            gt_step(cfg->sync_steps ? open : GT_CLOSED);
        return 0;
    }
    if (cookie & GT_COOKIE_WATCH) {
        /* A function no window probes, called: counted (exactly: the link stays attached) and
         * flagged, so user space moves it into the windows before it costs much. */
        u32 zero = 0;
        u64 *n = seen_lookup(&zero);
        if (n)
            __sync_fetch_and_add(n, 1);
        if (s)
            __sync_fetch_and_add(&s->watched, 1);
        return 0;
    }
    if (cookie & GT_COOKIE_MARKER) {
        /* One function probed alone just before a window and through it: its rate in that
         * reference span against its rate in the window is how much the window's probes slow
         * the target, measured rather than modelled. In the window its twin on the window's link
         * counts; while links attach or detach, it is a cost. */
        if (s && open == GT_OUTSIDE)
            __sync_fetch_and_add(&s->outside, 1);
        else if (s && (open == GT_CLOSED || open == GT_ARMED))
            __sync_fetch_and_add(&s->closed, 1);
        return 0;
    }
    if (open != GT_OPEN) {
        if (s)
            __sync_fetch_and_add(&s->closed, 1);
        return 0;
    }
    if (s)
        __sync_fetch_and_add(&s->calls, 1);
    struct gt_tstats *ts = gt_tstats_of(id, func);
    if (ts)
        __sync_fetch_and_add(&ts->calls, 1);
    u32 tid = (u32)id;
    u32 kind = (cookie & GT_COOKIE_STEPPED) ? 2 : 0;
    if (!(cookie & GT_COOKIE_TIMED)) {
        /* Counted only: still charge its probe to the timed call it is made from, if any. */
        struct gt_thread *p = threads_lookup(&tid);
        if (p && p->depth && p->gen == cfg->gen) {
            u32 top = (p->depth - 1) & (GT_MAX_DEPTH - 1);
            p->frames[top].inner_ns += cfg->hit_ns[kind & 3];
        }
        return 0;
    }

    u32 gen = cfg->gen;
    struct gt_thread *t = threads_lookup(&tid);
    if (!t) {
        struct gt_thread fresh = {.gen = gen};
        threads_insert(&tid, &fresh);
        t = threads_lookup(&tid);
        if (!t) {
            gt_error(GT_ERR_THREADS_FULL);
            return 0;
        }
    }
    if (t->gen != gen) {  /* frames from an earlier window can never be paired now */
        if (t->depth)
            gt_error(GT_ERR_STALE);
        t->depth = 0;
        t->over = 0;
        t->gen = gen;
    }
    u32 d = t->depth;
    if (d >= GT_MAX_DEPTH) {
        /* Untimed, but its return will come: remember it, or that return would pop a tracked frame. */
        gt_error(GT_ERR_DEPTH);
        t->over++;
        return 0;
    }
    d &= GT_MAX_DEPTH - 1;
    t->frames[d].func = func;
    t->frames[d].inner_ns = 0;
    t->frames[d].ts = bpf_ktime_get_ns();
    t->depth = d + 1;
    return 0;
}

GT_UPROBE int gt_return(struct pt_regs *ctx)
{
    u64 now = bpf_ktime_get_ns();
    u32 func = bpf_get_attach_cookie(ctx) & GT_COOKIE_FUNC_MASK;
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct gt_thread *t = threads_lookup(&tid);
    struct gt_config *cfg = gt_config_at();
    if (!t || t->depth == 0 || !cfg || t->gen != cfg->gen) {
        /* Still a hit the target paid for (a return link's edge): a cost, like a closed entry. */
        gt_error(GT_ERR_UNPAIRED);
        struct gt_stats *c = gt_stats_of(id >> 32, func);
        if (c)
            __sync_fetch_and_add(&c->closed, 1);
        return 0;
    }
    if (t->over) {  /* the return of a call too deep to track (calls return innermost first) */
        t->over--;
        return 0;
    }
    /* The return belongs to the innermost frame of this function: frames above it lost their
     * returns (a longjmp out of a callback, say) and are dropped rather than paired wrongly. */
    u32 d = t->depth;
    int found = -1;
#pragma unroll
    for (int i = GT_MAX_DEPTH - 1; i >= 0; i--) {
        if (found < 0 && (u32)i < d && t->frames[i].func == func)
            found = i;
    }
    if (found < 0) {
        gt_error(GT_ERR_UNPAIRED);
        return 0;
    }
    if ((u32)found + 1 != d)
        gt_error(GT_ERR_STALE);
    u32 f = (u32)found & (GT_MAX_DEPTH - 1);
    u64 delta = now - t->frames[f].ts;
    u64 inner = t->frames[f].inner_ns;
    delta = delta > inner ? delta - inner : 0;
    t->depth = f;
    if (f > 0) {  /* this call's probes, and those inside it, ran inside its caller's timed call */
        u32 kind = (bpf_get_attach_cookie(ctx) & GT_COOKIE_STEPPED) ? 3 : 1;
        u32 up = (f - 1) & (GT_MAX_DEPTH - 1);
        t->frames[up].inner_ns += inner + cfg->hit_ns[kind & 3];
    }

    struct gt_stats *s = gt_stats_of(id >> 32, func);
    if (!s)
        return 0;
    __sync_fetch_and_add(&s->timed, 1);
    __sync_fetch_and_add(&s->total_ns, delta);
    if (f == 0) {
        __sync_fetch_and_add(&s->outer_ns, delta);
        struct gt_tstats *ts = gt_tstats_of(id, func);
        if (ts)
            __sync_fetch_and_add(&ts->outer_ns, delta);
    } else
        __sync_fetch_and_add(&s->nested, 1);
    u32 slot = bpf_log2l(delta);
    if (slot >= GT_HIST_SLOTS)
        slot = GT_HIST_SLOTS - 1;
    __sync_fetch_and_add(&s->hist[slot], 1);
    return 0;
}

/* A thread that dies inside a timed call leaves its frames behind; a new thread that reuses the id
 * must not inherit them. Raw tracepoint: needs no tracefs. */
GT_RAW_TRACEPOINT(sched_process_exit)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    threads_delete(&tid);
    return 0;
}
