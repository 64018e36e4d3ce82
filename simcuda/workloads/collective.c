/* collective: a job of N ranks, one process each, that do a step of compute and one collective per
 * step, as a data-parallel training job over NCCL does: the target for gang checkpoint tests.
 *
 * The process started is the launcher: it forks --ranks N children (default 2) and never calls the
 * driver itself.  Each rank is a member of the group SIMCUDA_GROUP=<launcher pid>:N:RANK and holds,
 * in cuMemAlloc_v2 memory, a vector x of --words W u32 (default 1024), a step counter d (u32) and a
 * sum (u64).  Per step, on the null stream:
 *   step   lcg_u32(x, RANK + 1, W)                   compute, different on every rank
 *   count  inc_u32(d, 1)                             the device's own step counter
 *   ncclDevKernel_AllReduce_Sum_u32(x, W)            the collective: x summed over the ranks
 *   sum    sum_u32(x, W, sum)
 * then the sum and d are copied back (cuMemcpyDtoH_v2, which waits for the collective) and the rank
 * prints {"rank": R, "pid": P, "step": d, "sum": "<hex>"}.  The result of a step depends only on the
 * ranks' device memory before it, so a job whose device memory is rolled back to step d prints the
 * same sums from there on as a job that never was; ranks rolled back to different steps print other
 * sums.  --kernel-ns: the compute kernel's duration (default 2 ms); --steps S: steps per rank (default
 * 0: until stopped).
 *
 * The launcher prints {"launcher": PID, "group": ID, "ranks": [PID, ...]} first, then waits: "quit"
 * on its stdin (or, without --steps, its end) stops the ranks (SIGTERM); it exits once every rank has, with status 0 if
 * each exited 0 or was stopped so, 1 otherwise, and removes the group's file. */
#include "workload.h"

#include <poll.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/wait.h>

#define MAX_RANKS 16

static int rank_main(int rank, int words)
{
    char image[512];
    snprintf(image, sizeof image,
             "SIMCUDA-MODULE\nkernel step lcg_u32 %lld\nkernel count inc_u32 0\n"
             "kernel ncclDevKernel_AllReduce_Sum_u32 allreduce_u32 0\nkernel sum sum_u32 0\n",
             wl.kernel_ns);
    wl_start();
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction f_step, f_count, f_ar, f_sum;
    CU(cuInit, 0);
    CU(cuDeviceGet, &dev, 0);
    CU(cuDevicePrimaryCtxRetain, &ctx, dev);
    CU(cuCtxSetCurrent, ctx);
    CU(cuModuleLoadData, &mod, image);
    CU(cuModuleGetFunction, &f_step, mod, "step");
    CU(cuModuleGetFunction, &f_count, mod, "count");
    CU(cuModuleGetFunction, &f_ar, mod, "ncclDevKernel_AllReduce_Sum_u32");
    CU(cuModuleGetFunction, &f_sum, mod, "sum");

    CUdeviceptr x, d, sum;
    CU(cuMemAlloc_v2, &x, (size_t)words * 4);
    CU(cuMemAlloc_v2, &d, 4);
    CU(cuMemAlloc_v2, &sum, 8);
    uint32_t *h = malloc((size_t)words * 4);
    if (!h)
        wl_die("out of memory");
    for (int i = 0; i < words; i++)
        h[i] = (uint32_t)i * 7u + (uint32_t)rank * 1000003u;
    CU(cuMemcpyHtoD_v2, x, h, (size_t)words * 4);
    CU(cuMemsetD32_v2, d, 0, 1);
    free(h);

    uint32_t add = (uint32_t)rank + 1;
    uint64_t n = (uint64_t)words, one = 1;
    void *a_step[] = {&x, &add, &n}, *a_count[] = {&d, &one}, *a_ar[] = {&x, &n}, *a_sum[] = {&x, &n, &sum};
    for (long step = 0; wl.steps == 0 || step < wl.steps; step++) {
        CU(cuLaunchKernel, f_step, 1, 1, 1, 1, 1, 1, 0, NULL, a_step, NULL);
        CU(cuLaunchKernel, f_count, 1, 1, 1, 1, 1, 1, 0, NULL, a_count, NULL);
        CU(cuLaunchKernel, f_ar, 1, 1, 1, 1, 1, 1, 0, NULL, a_ar, NULL);
        CU(cuLaunchKernel, f_sum, 1, 1, 1, 1, 1, 1, 0, NULL, a_sum, NULL);
        uint64_t hs;
        uint32_t hd;
        CU(cuMemcpyDtoH_v2, &hs, sum, 8);
        CU(cuMemcpyDtoH_v2, &hd, d, 4);
        printf("{\"rank\": %d, \"pid\": %d, \"step\": %u, \"sum\": \"%016llx\"}\n", rank, (int)getpid(), hd,
               (unsigned long long)hs);
        fflush(stdout);
    }
    CU(cuMemFree_v2, x);
    CU(cuMemFree_v2, d);
    CU(cuMemFree_v2, sum);
    CU(cuModuleUnload, mod);
    CU(cuDevicePrimaryCtxRelease_v2, dev);
    return 0;
}

static long take_opt(int *argc, char **argv, const char *name, long dflt)
{
    for (int i = 1; i + 1 < *argc; i++)
        if (!strcmp(argv[i], name)) {
            char *end;
            long v = strtol(argv[i + 1], &end, 10);
            if (*end || v < 1) {
                fprintf(stderr, "collective: %s needs a positive integer\n", name);
                exit(2);
            }
            memmove(argv + i, argv + i + 2, (size_t)(*argc - i - 1) * sizeof *argv);
            *argc -= 2;
            return v;
        }
    return dflt;
}

int main(int argc, char **argv)
{
    wl.workload = "collective";
    wl.steps = 0;
    wl.kernel_ns = 2000000;
    long ranks = take_opt(&argc, argv, "--ranks", 2);
    long words = take_opt(&argc, argv, "--words", 1024);
    if (ranks > MAX_RANKS || words > 65536) {
        fprintf(stderr, "collective: at most %d ranks and 65536 words\n", MAX_RANKS);
        return 2;
    }
    wl_parse(argc, argv, 0);

    char group[32];
    snprintf(group, sizeof group, "%d", (int)getpid());
    pid_t pids[MAX_RANKS];
    fflush(stdout);
    /* The ranks start stepping only once the launcher's line is out (its write end closed): else a
     * rank's first step line could come before it on the shared stdout (seen in the tests). */
    int go[2];
    if (pipe(go) != 0)
        wl_die("pipe: %s", strerror(errno));
    for (int r = 0; r < ranks; r++) {
        pid_t p = fork();
        if (p < 0)
            wl_die("fork: %s", strerror(errno));
        if (p == 0) {
            char g[64], c;
            snprintf(g, sizeof g, "%s:%ld:%d", group, ranks, r);
            setenv("SIMCUDA_GROUP", g, 1);
            prctl(PR_SET_PDEATHSIG, SIGTERM); /* a launcher killed takes its ranks with it */
            close(go[1]);
            while (read(go[0], &c, 1) < 0 && errno == EINTR)
                ;
            close(go[0]);
            exit(rank_main(r, (int)words));
        }
        pids[r] = p;
    }
    close(go[0]);
    printf("{\"launcher\": %d, \"group\": \"%s\", \"ranks\": [", (int)getpid(), group);
    for (int r = 0; r < ranks; r++)
        printf("%s%d", r ? ", " : "", (int)pids[r]);
    printf("]}\n");
    fflush(stdout);
    close(go[1]);

    int left = (int)ranks, bad = 0, stopping = 0, eof = 0;
    while (left > 0) {
        struct pollfd pf = {.fd = 0, .events = POLLIN};
        if (!stopping && !eof && poll(&pf, 1, 100) > 0) {
            char line[64];
            int got = fgets(line, sizeof line, stdin) != NULL;
            eof = !got && wl.steps; /* with --steps, the ranks end by themselves */
            if ((!got && !wl.steps) || (got && !strncmp(line, "quit", 4))) {
                stopping = 1;
                for (int r = 0; r < ranks; r++)
                    kill(pids[r], SIGTERM);
            }
        } else if (stopping || eof) {
            struct timespec ts = {0, 10000000};
            nanosleep(&ts, NULL);
        }
        int st;
        pid_t p;
        while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
            left--;
            if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0) && !(stopping && WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM))
                bad = 1;
        }
    }
    char path[96];
    snprintf(path, sizeof path, "/dev/shm/simcuda-group-%s", group);
    unlink(path);
    return bad;
}
