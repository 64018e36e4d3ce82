/* Keys and values shared by the BPF programs (counts.bpf.c) and user space (tracer/bpfprog.py), the
 * one definition of both: user space reads the GT_* numbers and enum gt_error from this file, and the
 * map layouts from the types its loader builds from these structs (bcc from the C, the precompiled
 * object's loader from its BTF), checked field by field at load. */
#ifndef GPUTRACE_H
#define GPUTRACE_H

#define GT_HIST_SLOTS 40          /* slot 0: 0 ns; slot k: [2^(k-1), 2^k) ns (bcc bpf_log2l); the last is open */
#define GT_MAX_DEPTH 8            /* nested driver calls tracked per thread (a power of two) */
#define GT_COOKIE_FUNC_MASK 0xffffffffULL
#define GT_COOKIE_TIMED (1ULL << 32) /* entry probe pushes a timestamp; a return probe will pop it */
#define GT_COOKIE_MARKER (1ULL << 33) /* the marker's own link: counts only between windows */
#define GT_COOKIE_STEPPED (1ULL << 34) /* the probed instruction is single-stepped: the dearer hit */
#define GT_COOKIE_WATCH (1ULL << 35)  /* the watch link: functions not yet seen called, probed all the time */
#define GT_COOKIE_KEPT (1ULL << 36)   /* on the watch link for good: called, but cheap enough to count every call */

#ifndef GT_MAX_STATS
#define GT_MAX_STATS 16384        /* (process, function) pairs */
#endif
#ifndef GT_MAX_THREADS
#define GT_MAX_THREADS 16384      /* threads inside a timed call at once */
#endif

struct gt_key {
    u32 tgid;
    u32 func;                     /* the cookie's low 32 bits: a function id chosen by user space */
};

struct gt_stats {
    u64 calls;                    /* entry hits */
    u64 timed;                    /* returns paired with their entry */
    u64 total_ns;                 /* inclusive time of the paired calls */
    u64 outer_ns;                 /* the part spent in calls made outside any other traced call */
    u64 nested;                   /* paired calls made from inside another traced call */
    u64 closed;                   /* entry hits while counting was closed (attach and detach edges) */
    u64 outside;                  /* entry hits between windows (the marker's unperturbed count) */
    u64 watched;                  /* entry hits on the watch link, whatever the counting state */
    u64 kept_open;                /* of those of a kept function, the hits while a window was open: the
                                   * window's reference, counted exactly (tracer/estimator.py) */
    u64 hist[GT_HIST_SLOTS];
};

/* Per thread and function: who makes the calls (the audit's slack per calling thread). Counted in
 * windows and on the kept link only (where `stats` counts calls), never the watch link's first calls. */
#ifndef GT_MAX_TSTATS
#define GT_MAX_TSTATS 16384       /* (thread, function) pairs; least recently used go first */
#endif

struct gt_tkey {
    u32 tgid;
    u32 tid;
    u32 func;
    u32 pad;
};

struct gt_tstats {
    u64 calls;                    /* entry hits in windows */
    u64 kept;                     /* entry hits on the kept link (counted every call) */
    u64 outer_ns;                 /* paired time of the calls made outside any other traced call */
};

struct gt_frame {
    u64 ts;
    u64 inner_ns;                 /* probe time of the traced calls made inside this one */
    u32 func;
    u32 pad;
};

struct gt_thread {
    u32 depth;
    u32 gen;                      /* attach generation the frames belong to */
    u32 over;                     /* timed calls in flight above GT_MAX_DEPTH: their returns pair with nothing */
    u32 pad;
    struct gt_frame frames[GT_MAX_DEPTH];
};

/* Indexes into the `errors` array: things that went wrong, counted instead of corrupting stats. */
enum gt_error {
    GT_ERR_STATS_FULL = 0,        /* no room for a new (process, function) pair */
    GT_ERR_THREADS_FULL,          /* no room for a new thread's frame stack */
    GT_ERR_DEPTH,                 /* nesting deeper than GT_MAX_DEPTH: that call goes untimed */
    GT_ERR_UNPAIRED,              /* a return with no matching entry (attached mid-call, lost frame) */
    GT_ERR_STALE,                 /* frames dropped: left by a previous window or a dead thread */
    GT_ERR_COUNT,
};

/* Index 0 of the `seen` array: hits on the watch link, all processes together. User space polls it
 * (one lookup) to learn at once that a function it was not probing in windows has been called.
 * Index 1: hits of the kept functions (on the watch link for good, counted every call). */


/* Index 0 of the `config` array. Links take milliseconds to attach and tens to detach, with
 * probes live for an unknown part of it; user space opens counting once the links are in place and
 * closes it before detaching, so the counted span is known to the microsecond. */
struct gt_config {
    u32 gen;                      /* attach generation: frames of older ones are dropped */
    u32 open;                     /* GT_CLOSED, GT_OPEN (count into calls) or GT_OUTSIDE */
    /* Calibrated cost of a hit, by kind: [emulated, stepped] x [counted, timed]. A call's measured
     * time includes the probes of the traced calls inside it; these are taken back out. */
    u64 hit_ns[4];
    /* A step window (GT_ARMED): the window's links are attached, and it opens at the next call of
     * sync_func in process sync_tgid (a kept function, counted every call: the job's step) and
     * closes sync_steps calls of it later, so that it counts whole steps, whatever the job's pace
     * or what its probes cost it. The program bumps sync_calls at each such call and records the
     * count and the time at which it opened and closed; user space reads them after. The opening
     * and closing tests read the count after adding to it, so two threads calling it at once move
     * an edge by a call, never lose one: the steps counted are end - start. */
    u32 sync_func;
    u32 sync_tgid;
    u64 sync_steps;
    u64 sync_calls;
    u64 sync_start;
    u64 sync_end;
    u64 sync_t0;
    u64 sync_t1;
    u64 step_last_t;              /* the last call of sync_func (in sync_tgid), armed or not: when to arm */
    /* The gaps between its calls (microseconds): count, sum and sum of squares. A job's step is
     * called at regular intervals; a function called in a burst a step is not, and whole numbers
     * of its calls are no whole steps. */
    u64 gap_n;
    u64 gap_sum;
    u64 gap_sq;
};

#define GT_CLOSED 0               /* links attaching or detaching: hits are a cost, not a sample */
#define GT_OPEN 1                 /* a window: hits are counted and timed */
#define GT_OUTSIDE 2              /* between windows: the marker's link counts into `outside` */
#define GT_ARMED 3                /* a step window's links attached: closed until its step function's next call */

#endif
