/* worker: a job whose driver calls are made by a worker thread that idles between requests, as a
 * framework's runtime thread does (XLA's): the main thread does CPU work (--work-ns of spin a request),
 * then hands the request to the worker and goes on with the next; the worker pushes the context,
 * makes --launches cuLaunchKernel calls (each --launch-ns of CPU in the driver), pops the context and
 * sleeps until the next request. One request may wait while the worker serves another (a queue of
 * one): the main thread waits for the worker only where the worker falls behind.
 *
 *   worker [--steps N | --seconds S] [--work-ns NS] [--launches N] [--launch-ns NS] [--kernel-ns NS]
 *          [--sync] [--hold]
 *
 * --sync: the main thread waits for each request to be served before its next (the worker's calls on
 * the job's critical path). --hold: hold point 1 after setup, 2 after the last request. A step is a
 * request. Prints the usual report line at exit, with "per_step" counts. */
#include "workload.h"

#include <pthread.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static long posted, served; /* requests handed over, and served */
static int done;
static CUcontext ctx;
static CUfunction fn;
static long launches = 8;
static CUdeviceptr buf;

static void spin_ns(long long ns)
{
    double until = wl_now() + ns * 1e-9;
    while (wl_now() < until)
        ;
}

static void *serve(void *arg)
{
    (void)arg;
    unsigned long long n = 1;
    void *params[] = {&buf, &n};
    for (;;) {
        pthread_mutex_lock(&mu);
        while (served == posted && !done)
            pthread_cond_wait(&cv, &mu);
        if (served == posted && done) {
            pthread_mutex_unlock(&mu);
            return NULL;
        }
        pthread_mutex_unlock(&mu);
        CUcontext popped;
        CU(cuCtxPushCurrent_v2, ctx);
        for (long i = 0; i < launches; i++)
            CU(cuLaunchKernel, fn, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
        CU(cuCtxPopCurrent_v2, &popped);
        pthread_mutex_lock(&mu);
        served++;
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
    }
}

int main(int argc, char **argv)
{
    wl.workload = "worker";
    wl.steps = 1000;
    wl.kernel_ns = 1000;
    wl.default_launch_ns = 2000;
    long long work_ns = 200000;
    int sync = 0;
    /* The options of this workload alone, taken out before the common ones are parsed. */
    for (int i = 1; i < argc;) {
        int take = 0;
        if (!strcmp(argv[i], "--work-ns") && i + 1 < argc) {
            work_ns = (long long)wl_num("--work-ns", argv[i + 1], 0);
            take = 2;
        } else if (!strcmp(argv[i], "--launches") && i + 1 < argc) {
            launches = (long)wl_num("--launches", argv[i + 1], 0);
            take = 2;
        } else if (!strcmp(argv[i], "--sync")) {
            sync = 1;
            take = 1;
        }
        if (take) {
            memmove(argv + i, argv + i + take, (size_t)(argc - i - take + 1) * sizeof *argv);
            argc -= take;
        } else {
            i++;
        }
    }
    wl_parse(argc, argv, 0);

    char image[128];
    snprintf(image, sizeof image, "SIMCUDA-MODULE\nkernel inc inc_u32 %lld\n", wl.kernel_ns);
    double t0 = wl_start();
    CUdevice dev;
    CUmodule mod;
    CU(cuInit, 0);
    CU(cuDeviceGet, &dev, 0);
    CU(cuDevicePrimaryCtxRetain, &ctx, dev);
    CU(cuCtxSetCurrent, ctx);
    CU(cuModuleLoadData, &mod, image);
    CU(cuModuleGetFunction, &fn, mod, "inc");
    CU(cuMemAlloc_v2, &buf, 4);
    CU(cuMemsetD32_v2, buf, 0, 1);
    wl_hold(1, "");
    pthread_t th;
    if (pthread_create(&th, NULL, serve, NULL))
        wl_die("pthread_create failed");
    t0 = wl_now();
    long step;
    for (step = 0; wl_more(step, t0); step++) {
        spin_ns(work_ns);
        pthread_mutex_lock(&mu);
        while (posted - served >= 2)
            pthread_cond_wait(&cv, &mu); /* one being served and one waiting: the queue is full */
        posted++;
        pthread_cond_broadcast(&cv);
        if (sync)
            while (served != posted)
                pthread_cond_wait(&cv, &mu);
        pthread_mutex_unlock(&mu);
    }
    pthread_mutex_lock(&mu);
    done = 1;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    pthread_join(th, NULL);
    CU(cuStreamSynchronize, NULL);
    uint32_t host;
    CU(cuMemcpyDtoH_v2, &host, buf, sizeof host);
    int ok = host == (uint32_t)(step * launches);
    CU(cuMemFree_v2, buf);
    CU(cuModuleUnload, mod);
    CU(cuDevicePrimaryCtxRelease_v2, dev);
    wl_hold(2, "");
    char extra[512];
    snprintf(extra, sizeof extra, "\"check\": \"%s\", \"per_step\": {\"%s\": %ld, \"%s\": 1, \"%s\": 1}",
             ok ? "ok" : "mismatch", wl_name[API_cuLaunchKernel], launches, wl_name[API_cuCtxPushCurrent_v2],
             wl_name[API_cuCtxPopCurrent_v2]);
    wl_report(step, t0, extra);
    if (!ok)
        fprintf(stderr, "worker: device buffer is %u, expected %ld\n", host, step * launches);
    return ok ? 0 : 1;
}
