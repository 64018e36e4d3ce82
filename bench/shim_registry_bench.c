/* shim_registry_bench: the shim's registry alone, as a state call uses it.  Each of T threads records
 * and removes its own objects (reg_put then reg_take, as an allocation and its free do) and looks up
 * absent ones (reg_take of a handle never recorded, as a free of unknown memory does), timing N of
 * each.  Compiled together with shim/registry.c.  Prints one JSON object.
 * Usage: shim_registry_bench [N] [THREADS...] */
#include "shim_int.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void shim_log(const char *fmt, ...) { (void)fmt; }

static long n_ops = 200000;

struct arg {
    int id, nthreads;
    double pair_ns, miss_ns;
};

static pthread_barrier_t start;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static void *run(void *p)
{
    struct arg *a = p;
    struct rec r = {.type = R_MEM, .kind = K_DEVICE, .size = 1 << 20}, out;
    uint64_t base = 0x200000000000ull + ((uint64_t)a->id << 36);
    pthread_barrier_wait(&start);
    double t0 = now();
    for (long i = 0; i < n_ops; i++) {
        r.key = base + ((uint64_t)i << 12);
        reg_put(&r);
        reg_take(R_MEM, r.key, &out);
    }
    double t1 = now();
    for (long i = 0; i < n_ops; i++)
        reg_take(R_MEM, base + ((uint64_t)i << 12) + 8, &out);
    double t2 = now();
    a->pair_ns = (t1 - t0) / n_ops;
    a->miss_ns = (t2 - t1) / n_ops;
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        n_ops = atol(argv[1]);
    int counts[16] = {1, 2, 4, 8}, ncounts = 4;
    if (argc > 2) {
        ncounts = 0;
        for (int i = 2; i < argc && ncounts < 16; i++)
            counts[ncounts++] = atoi(argv[i]);
    }
    /* 256 records stay in the table throughout, like a job's live allocations. */
    for (int i = 0; i < 256; i++) {
        struct rec r = {.type = R_MEM, .kind = K_DEVICE, .key = 0x100000000000ull + ((uint64_t)i << 20), .size = 1};
        reg_put(&r);
    }
    printf("{\"ops_per_thread\": %ld, \"live_records\": 256, \"threads\": [", n_ops);
    for (int c = 0; c < ncounts; c++) {
        int t = counts[c];
        pthread_t th[64];
        struct arg a[64];
        pthread_barrier_init(&start, NULL, (unsigned)t);
        for (int i = 0; i < t; i++) {
            a[i] = (struct arg){.id = i, .nthreads = t};
            pthread_create(&th[i], NULL, run, &a[i]);
        }
        double pair = 0, miss = 0;
        for (int i = 0; i < t; i++) {
            pthread_join(th[i], NULL);
            pair += a[i].pair_ns / t;
            miss += a[i].miss_ns / t;
        }
        pthread_barrier_destroy(&start);
        printf("%s{\"threads\": %d, \"put_take_pair_ns\": %.1f, \"lookup_miss_ns\": %.1f}", c ? ", " : "", t, pair,
               miss);
    }
    printf("]}\n");
    return 0;
}
