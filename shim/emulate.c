/* The emulated layer: a set busy CPU cost added to every intercepted call of chosen classes or
 * functions, switched at run time over the control socket (`emulate`).  A user feels a heavier
 * layer's cost on a canary job before rolling it out, and the tracer's audit ("a layer of c ns a
 * call would slow this job between X and Y") is checked against the slowdown it causes, in one
 * process.
 *
 * Off (the default), a wrapper pays one relaxed load of g_emul_on.  On, each selected call spins on
 * the monotonic clock (vDSO) for the set time on the calling thread, reading it in a plain loop, before the driver call, inside
 * the gate, as a layer's bookkeeping would; the count of slowed calls is one relaxed add.
 *
 * Classes are the tracer's (tracer/classify.py): SHIM_SUBMIT is submission, SHIM_STATE and
 * SHIM_PASS_STATE state, SHIM_SYNC synchronization, SHIM_QUERY query; a test holds the two
 * classifications to each other. */
#include "shim_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { C_SUBMISSION = 1, C_SYNC = 2, C_STATE = 4, C_QUERY = 8 };
static const char *const class_names[] = {"submission", "synchronization", "state", "query"};

static const unsigned char fn_class[F_COUNT] = {
#define CLS_SUB(name, params, args) [F_##name] = C_SUBMISSION,
#define CLS_STATE(name, params, args) [F_##name] = C_STATE,
#define CLS_SYNC(name, params, args) [F_##name] = C_SYNC,
#define CLS_QUERY(name, params, args) [F_##name] = C_QUERY,
    SHIM_SUBMIT(CLS_SUB) SHIM_STATE(CLS_STATE) SHIM_PASS_STATE(CLS_STATE) SHIM_SYNC(CLS_SYNC) SHIM_QUERY(CLS_QUERY)
#undef CLS_SUB
#undef CLS_STATE
#undef CLS_SYNC
#undef CLS_QUERY
};

/* `layer=shim`: the functions the shim gates and counts (SHIM_SUBMIT, SHIM_STATE), where its own work
 * is done; the tracer's audit reads the same lists for its `shim` preset (shim/layer.py). */
static const unsigned char fn_gated[F_COUNT] = {
#define GATED(name, params, args) [F_##name] = 1,
    SHIM_SUBMIT(GATED) SHIM_STATE(GATED)
#undef GATED
};

atomic_int g_emul_on;
static _Atomic unsigned char g_sel[F_COUNT];
static _Atomic long long g_cost_ns;
static _Atomic unsigned long long g_slowed;
static _Atomic unsigned long long g_spent_ns; /* time the spins took, first clock read to last */
/* The driver's own time in the calls slowed (from the spin's end to the call's return), and how many
 * of them returned: whether the layer changes what the calls themselves cost (cost=0 gives the same
 * figure with no spin, to compare). */
static _Atomic unsigned long long g_driver_ns;
static _Atomic unsigned long long g_driver_calls;
static _Atomic long long g_since_ns;

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

long long emul_spin(int fn)
{
    if (!atomic_load_explicit(&g_sel[fn], memory_order_relaxed))
        return 0;
    long long cost = atomic_load_explicit(&g_cost_ns, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_slowed, 1, memory_order_relaxed);
    long long t0 = now_ns(), until = t0 + cost, t;
    /* No `pause` in the loop: in a virtual machine a run of them makes the CPU exit to the
     * hypervisor (pause-loop exiting), whose cost lands on the job beyond the set time (seen on
     * the H200's VM: 10 us spins slowed a job 1.25x what they should). */
    while ((t = now_ns()) < until)
        ;
    /* What the spin took, not what it was set to: a clock read's granularity, a preemption or
     * the hypervisor can make it longer, and the audit is checked against the real cost. */
    atomic_fetch_add_explicit(&g_spent_ns, (unsigned long long)(t - t0), memory_order_relaxed);
    return t;
}

void emul_after(long long since)
{
    long long t = now_ns();
    atomic_fetch_add_explicit(&g_driver_ns, (unsigned long long)(t > since ? t - since : 0), memory_order_relaxed);
    atomic_fetch_add_explicit(&g_driver_calls, 1, memory_order_relaxed);
}

static int class_of_name(const char *s, size_t n)
{
    for (int c = 0; c < 4; c++)
        if (strlen(class_names[c]) == n && !strncmp(class_names[c], s, n))
            return 1 << c;
    if (n == 4 && !strncmp(s, "sync", 4))
        return C_SYNC;
    return 0;
}

static int fn_of_name(const char *s, size_t n)
{
    for (int i = 0; i < F_COUNT; i++)
        if (fn_class[i] && strlen(shim_fn_name[i]) == n && !strncmp(shim_fn_name[i], s, n))
            return i;
    return -1;
}

static void state_json(struct sbuf *b)
{
    int on = atomic_load(&g_emul_on);
    sb_printf(b, "\"emulate\": {\"on\": %s, \"cost_ns\": %lld, \"calls_slowed\": %llu, \"spent_ns\": %llu, "
              "\"driver_ns\": %llu, \"driver_calls\": %llu, \"functions\": [",
              on ? "true" : "false", on ? atomic_load(&g_cost_ns) : 0, atomic_load(&g_slowed), atomic_load(&g_spent_ns),
              atomic_load(&g_driver_ns), atomic_load(&g_driver_calls));
    int first = 1;
    for (int i = 0; on && i < F_COUNT; i++)
        if (atomic_load(&g_sel[i])) {
            sb_printf(b, "%s\"%s\"", first ? "" : ", ", shim_fn_name[i]);
            first = 0;
        }
    sb_printf(b, "]}");
}

void emul_status(struct sbuf *b) { state_json(b); }

static char *finish(struct sbuf *b)
{
    sb_printf(b, "\n");
    if (b->oom) {
        free(b->p);
        return NULL;
    }
    return b->p;
}

static char *error(const char *msg, const char *arg, size_t n)
{
    struct sbuf b = {0};
    sb_printf(&b, "{\"ok\": false, \"error\": \"%s", msg);
    if (arg)
        sb_printf(&b, ": %.*s", (int)(n > 100 ? 100 : n), arg);
    sb_printf(&b, "\"}");
    return finish(&b);
}

/* What an `emulate` command sets. */
struct setting {
    long long cost;
    int classes, chosen; /* chosen: functions named, or the shim's layer */
    unsigned char sel[F_COUNT];
};

/* One word of an `emulate` command (n bytes at p): cost=NS, classes=a,b, functions=x,y or layer=shim,
 * into the setting being made.  0, or -1 with the error reply (NULL: out of memory) in *err. */
static int parse_word(const char *p, size_t n, struct setting *st, char **err)
{
    if (n > 5 && !strncmp(p, "cost=", 5)) {
        char *e;
        st->cost = strtoll(p + 5, &e, 10);
        if (e != p + n || st->cost < 0 || st->cost > 1000000000ll) {
            *err = error("cost= takes nanoseconds (0 to 1e9)", p, n);
            return -1;
        }
    } else if (n > 8 && !strncmp(p, "classes=", 8)) {
        for (const char *q = p + 8; q < p + n;) {
            const char *c = memchr(q, ',', (size_t)(p + n - q));
            size_t m = c ? (size_t)(c - q) : (size_t)(p + n - q);
            int k = class_of_name(q, m);
            if (!k) {
                *err = error("unknown class (submission, synchronization, state, query)", q, m);
                return -1;
            }
            st->classes |= k;
            q += m + (c != NULL);
        }
    } else if (n > 10 && !strncmp(p, "functions=", 10)) {
        for (const char *q = p + 10; q < p + n;) {
            const char *c = memchr(q, ',', (size_t)(p + n - q));
            size_t m = c ? (size_t)(c - q) : (size_t)(p + n - q);
            int f = fn_of_name(q, m);
            if (f < 0) {
                *err = error("the shim does not wrap this function", q, m);
                return -1;
            }
            st->sel[f] = 1;
            st->chosen = 1;
            q += m + (c != NULL);
        }
    } else if (n == 10 && !strncmp(p, "layer=shim", 10)) {
        for (int i = 0; i < F_COUNT; i++)
            st->sel[i] |= fn_gated[i];
        st->chosen = 1;
    } else {
        *err = error("expected off, or cost=NS with classes=, functions= and/or layer=shim", p, n);
        return -1;
    }
    return 0;
}

/* The setting in force from now on, its counts started again. */
static void emul_set(const struct setting *st)
{
    atomic_store(&g_emul_on, 0);
    atomic_store(&g_cost_ns, st->cost);
    for (int i = 0; i < F_COUNT; i++)
        atomic_store(&g_sel[i], st->sel[i] || (fn_class[i] & st->classes) ? 1 : 0);
    atomic_store(&g_slowed, 0);
    atomic_store(&g_spent_ns, 0);
    atomic_store(&g_driver_ns, 0);
    atomic_store(&g_driver_calls, 0);
    atomic_store(&g_since_ns, now_ns());
    atomic_store(&g_emul_on, 1);
}

/* Parses "off" or "cost=NS classes=a,b functions=x,y layer=shim" (any of the last three, at least one). */
char *emul_command(const char *args)
{
    while (*args == ' ')
        args++;
    if (!strcmp(args, "off")) {
        atomic_store(&g_emul_on, 0);
        for (int i = 0; i < F_COUNT; i++)
            atomic_store(&g_sel[i], 0);
    } else if (*args) {
        struct setting st = {.cost = -1};
        for (const char *p = args; *p;) {
            const char *end = strchr(p, ' ');
            size_t n = end ? (size_t)(end - p) : strlen(p);
            char *err;
            if (parse_word(p, n, &st, &err))
                return err;
            p += n;
            while (*p == ' ')
                p++;
        }
        if (st.cost < 0 || (!st.classes && !st.chosen))
            return error("give cost=NS and classes=, functions= or layer=shim", NULL, 0);
        emul_set(&st);
    }
    struct sbuf b = {0};
    sb_printf(&b, "{\"ok\": true, ");
    state_json(&b);
    long long since = atomic_load(&g_since_ns);
    sb_printf(&b, ", \"since_s\": %.3f}", since && atomic_load(&g_emul_on) ? (now_ns() - since) / 1e9 : 0.0);
    return finish(&b);
}
