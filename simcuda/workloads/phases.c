/* phases: a job whose driver calls change as it runs, and which says exactly when it made which.
 *
 *   phases --phase SPEC [--phase SPEC ...] [--log FILE] [--log-ms MS] [--wait-stdin] [--ready-fd FD]
 *          [--side NAME=HZ]
 *   SPEC = SECONDS:NAME=COUNT[,NAME=COUNT...][,spin=NS][,gpu=NS][,copywait=1]
 *
 * Each phase runs for SECONDS, in steps; a step makes COUNT calls of each NAME (interleaved), then
 * busy-waits spin=NS on the CPU (which sets the rate), then, with gpu=NS, launches a kernel of NS and
 * waits for it in cuStreamSynchronize (a job that waits for its GPU: its calls come in bursts), or
 * with copywait=1 in a synchronous cuMemcpyDtoH_v2 of 4 bytes (a job whose only wait is a copy).
 * NAMEs: getdev cuCtxGetDevice_v2, state cuDevicePrimaryCtxGetState, current cuCtxGetCurrent,
 * attr cuDeviceGetAttribute, capturing cuStreamIsCapturing, meminfo cuMemGetInfo_v2,
 * launch cuLaunchKernel (a kernel of 0 ns), event cuEventRecord, sync cuStreamSynchronize.
 * A function first called in a later phase is one the tracer has never seen called until then.
 *
 * --side NAME=HZ: a second thread calls NAME (one the phases do not) HZ times a second, paced by the
 * clock (it sleeps between calls), from the first phase to the last: a framework's runtime thread
 * whose calls go on at their own pace, however much the main thread is slowed.
 *
 * --log FILE: every --log-ms (default 1) the cumulative count of every function, with the time
 * (CLOCK_MONOTONIC, seconds), written at exit as one JSON object {"names": [...], "t": [...],
 * "counts": [[...], ...]} (one row per time): the exact calls in any span, for tests of a tracer.
 * Prints the usual report line at exit. SIGTERM ends the phases early, as if their time were up (the log
 * and the report still written): a bench ends a long job once it has what it needs. */
#include "workload.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>

static volatile sig_atomic_t stop_now;

static void on_term(int sig)
{
    (void)sig;
    stop_now = 1;
}

#define MAX_PHASES 16
#define MAX_ENTRIES 12

static const struct {
    const char *name;
    int api;
} names[] = {
    {"getdev", API_cuCtxGetDevice_v2},   {"state", API_cuDevicePrimaryCtxGetState},
    {"current", API_cuCtxGetCurrent},    {"attr", API_cuDeviceGetAttribute},
    {"capturing", API_cuStreamIsCapturing}, {"meminfo", API_cuMemGetInfo_v2},
    {"launch", API_cuLaunchKernel},      {"event", API_cuEventRecord},
    {"sync", API_cuStreamSynchronize},
};
#define N_NAMES (int)(sizeof names / sizeof names[0])

static struct phase {
    double seconds;
    long long spin_ns, gpu_ns, copywait;
    int n;
    int api[MAX_ENTRIES];
    long count[MAX_ENTRIES];
} phases[MAX_PHASES];
static int n_phases;

static void parse_phase(const char *spec)
{
    if (n_phases == MAX_PHASES)
        wl_die("at most %d phases", MAX_PHASES);
    struct phase *p = &phases[n_phases++];
    char *copy = strdup(spec), *save = NULL, *end;
    char *colon = strchr(copy, ':');
    if (!colon)
        wl_die("--phase %s: expected SECONDS:NAME=COUNT,...", spec);
    *colon = 0;
    p->seconds = strtod(copy, &end);
    if (*end || p->seconds <= 0)
        wl_die("--phase %s: bad seconds", spec);
    for (char *tok = strtok_r(colon + 1, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq)
            wl_die("--phase %s: %s is not NAME=COUNT", spec, tok);
        *eq = 0;
        long long v = strtoll(eq + 1, &end, 10);
        if (*end || v < 0)
            wl_die("--phase %s: bad count for %s", spec, tok);
        if (!strcmp(tok, "spin")) {
            p->spin_ns = v;
            continue;
        }
        if (!strcmp(tok, "gpu")) {
            p->gpu_ns = v;
            continue;
        }
        if (!strcmp(tok, "copywait")) {
            p->copywait = v;
            continue;
        }
        int k = 0;
        while (k < N_NAMES && strcmp(names[k].name, tok))
            k++;
        if (k == N_NAMES)
            wl_die("--phase %s: unknown function %s", spec, tok);
        if (p->n == MAX_ENTRIES)
            wl_die("--phase %s: too many functions", spec);
        p->api[p->n] = names[k].api;
        p->count[p->n++] = (long)v;
    }
    free(copy);
}

static struct {
    double *t;
    unsigned long *counts; /* rows of API_COUNT */
    size_t n, cap;
    double every, next;
} logbuf;

static void log_now(double now)
{
    if (!logbuf.every || now < logbuf.next)
        return;
    logbuf.next = now + logbuf.every;
    if (logbuf.n == logbuf.cap) {
        logbuf.cap = logbuf.cap ? 2 * logbuf.cap : 4096;
        logbuf.t = realloc(logbuf.t, logbuf.cap * sizeof *logbuf.t);
        logbuf.counts = realloc(logbuf.counts, logbuf.cap * API_COUNT * sizeof *logbuf.counts);
        if (!logbuf.t || !logbuf.counts)
            wl_die("out of memory");
    }
    logbuf.t[logbuf.n] = now;
    memcpy(logbuf.counts + logbuf.n * API_COUNT, wl_count, sizeof wl_count);
    logbuf.n++;
}

static void write_log(const char *path)
{
    FILE *f = fopen(path, "w");
    if (!f)
        wl_die("--log %s: %s", path, strerror(errno));
    int used[API_COUNT], n_used = 0;
    for (int i = 0; i < API_COUNT; i++)
        if (wl_count[i])
            used[n_used++] = i;
    fprintf(f, "{\"names\": [");
    for (int k = 0; k < n_used; k++)
        fprintf(f, "%s\"%s\"", k ? ", " : "", wl_name[used[k]]);
    fprintf(f, "], \"t\": [");
    for (size_t r = 0; r < logbuf.n; r++)
        fprintf(f, "%s%.6f", r ? ", " : "", logbuf.t[r]);
    fprintf(f, "], \"counts\": [");
    for (size_t r = 0; r < logbuf.n; r++) {
        fprintf(f, "%s[", r ? ", " : "");
        for (int k = 0; k < n_used; k++)
            fprintf(f, "%s%lu", k ? ", " : "", logbuf.counts[r * API_COUNT + used[k]]);
        fprintf(f, "]");
    }
    fprintf(f, "]}\n");
    if (fclose(f))
        wl_die("--log %s: %s", path, strerror(errno));
}

static struct {
    int api;
    double hz;
    volatile int done;
    CUcontext ctx;
    CUdevice dev;
} side = {.api = -1};

static int api_of(const char *name)
{
    for (int k = 0; k < N_NAMES; k++)
        if (!strcmp(names[k].name, name))
            return names[k].api;
    wl_die("unknown function %s", name);
    return -1;
}

static void call_one(int api, CUdevice dev, CUstream s, CUfunction nop, CUevent ev);

static void *side_thread(void *arg)
{
    (void)arg;
    CU(cuCtxSetCurrent, side.ctx);
    CUevent ev;
    CU(cuEventCreate, &ev, 0);
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    long long step = (long long)(1e9 / side.hz);
    while (!side.done && !stop_now) {
        call_one(side.api, side.dev, NULL, NULL, ev);
        next.tv_nsec += step;
        while (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec++;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    CU(cuEventDestroy_v2, ev);
    return NULL;
}

static void spin(long long ns)
{
    if (ns <= 0)
        return;
    double until = wl_now() + ns / 1e9;
    while (wl_now() < until)
        ;
}

int main(int argc, char **argv)
{
    wl.workload = "phases";
    const char *log_path = NULL;
    double log_ms = 1.0;
    int out = 1;
    for (int i = 1; i < argc; i++) { /* our own options, taken out before the common parser sees them */
        if (!strcmp(argv[i], "--phase") && i + 1 < argc)
            parse_phase(argv[++i]);
        else if (!strcmp(argv[i], "--log") && i + 1 < argc)
            log_path = argv[++i];
        else if (!strcmp(argv[i], "--log-ms") && i + 1 < argc)
            log_ms = atof(argv[++i]);
        else if (!strcmp(argv[i], "--side") && i + 1 < argc) {
            char *spec = strdup(argv[++i]), *eq = strchr(spec, '=');
            if (!eq)
                wl_die("--side %s: expected NAME=HZ", spec);
            *eq = 0;
            side.api = api_of(spec);
            side.hz = atof(eq + 1);
            if (side.hz <= 0 || side.api == API_cuLaunchKernel || side.api == API_cuStreamSynchronize)
                wl_die("--side: a getter or cuEventRecord at a rate above 0");
            free(spec);
        }
        else
            argv[out++] = argv[i];
    }
    argc = out;
    wl_parse(argc, argv, 0);
    if (!n_phases)
        wl_die("give at least one --phase");
    logbuf.every = log_path ? log_ms / 1000.0 : 0;
    struct sigaction sa = {.sa_handler = on_term};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);

    double t0 = wl_start();
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction nop, wait;
    CUstream s = NULL;
    CUevent ev;
    char image[256];
    long long gpu_ns = 0;
    for (int k = 0; k < n_phases; k++)
        gpu_ns = phases[k].gpu_ns > gpu_ns ? phases[k].gpu_ns : gpu_ns;
    snprintf(image, sizeof image, "SIMCUDA-MODULE\nkernel nop spin 0\nkernel wait spin %lld\n", gpu_ns);
    CU(cuInit, 0);
    CU(cuDeviceGet, &dev, 0);
    CU(cuDevicePrimaryCtxRetain, &ctx, dev);
    CU(cuCtxSetCurrent, ctx);
    CU(cuModuleLoadData, &mod, image);
    CU(cuModuleGetFunction, &nop, mod, "nop");
    CU(cuModuleGetFunction, &wait, mod, "wait");
    CU(cuEventCreate, &ev, 0);
    CUdeviceptr word;
    CU(cuMemAlloc_v2, &word, 4);
    uint32_t host_word;
    long steps = 0;
    pthread_t side_tid;
    if (side.api >= 0) {
        side.ctx = ctx;
        side.dev = dev;
        if (pthread_create(&side_tid, NULL, side_thread, NULL))
            wl_die("pthread_create failed");
    }
    double start = wl_now();
    log_now(start);
    for (int k = 0; k < n_phases && !stop_now; k++) {
        struct phase *p = &phases[k];
        double until = (k ? wl_now() : start) + p->seconds;
        long most = 0;
        for (int e = 0; e < p->n; e++)
            most = p->count[e] > most ? p->count[e] : most;
        while (wl_now() < until && !stop_now) {
            for (long i = 0; i < most; i++) {
                for (int e = 0; e < p->n; e++) {
                    if (p->count[e] <= i)
                        continue;
                    call_one(p->api[e], dev, s, nop, ev);
                    log_now(wl_now());
                }
            }
            spin(p->spin_ns);
            if (p->gpu_ns) {
                CU(cuLaunchKernel, wait, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
                if (p->copywait)
                    CU(cuMemcpyDtoH_v2, &host_word, word, 4); /* waits for the kernel before it */
                else
                    CU(cuStreamSynchronize, s);
            }
            steps++;
            log_now(wl_now());
        }
    }
    if (side.api >= 0) {
        side.done = 1;
        pthread_join(side_tid, NULL);
    }
    CU(cuStreamSynchronize, s);
    logbuf.next = 0;
    log_now(wl_now());
    CU(cuMemFree_v2, word);
    CU(cuEventDestroy_v2, ev);
    CU(cuModuleUnload, mod);
    CU(cuDevicePrimaryCtxRelease_v2, dev);
    if (log_path)
        write_log(log_path);
    wl_report(steps, t0, NULL);
    return 0;
}

static void call_one(int api, CUdevice dev, CUstream s, CUfunction nop, CUevent ev)
{
    CUdevice d;
    CUcontext c;
    unsigned flags;
    int active, v;
    CUstreamCaptureStatus cs;
    size_t fr, tot;
    switch (api) {
    case API_cuCtxGetDevice_v2: CU(cuCtxGetDevice_v2, &d, NULL); break;
    case API_cuDevicePrimaryCtxGetState: CU(cuDevicePrimaryCtxGetState, dev, &flags, &active); break;
    case API_cuCtxGetCurrent: CU(cuCtxGetCurrent, &c); break;
    case API_cuDeviceGetAttribute: CU(cuDeviceGetAttribute, &v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev); break;
    case API_cuStreamIsCapturing: CU(cuStreamIsCapturing, s, &cs); break;
    case API_cuMemGetInfo_v2: CU(cuMemGetInfo_v2, &fr, &tot); break;
    case API_cuLaunchKernel: CU(cuLaunchKernel, nop, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL); break;
    case API_cuEventRecord: CU(cuEventRecord, ev, s); break;
    case API_cuStreamSynchronize: CU(cuStreamSynchronize, s); break;
    }
}
