// The C++ job of bench/frameworks_gpu.py: built with `nvcc -cudart static`, so the runtime is inside
// the executable and libcuda is the only CUDA library the process maps.  Each step: 16 small kernel
// launches, one async copy, one stream synchronize.  Counter file as in bench/framework_jobs.py.
//   usage: framework_job COUNTER [SECONDS]   (0 or absent: until killed)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

__global__ void inc(float *x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] += 1.0f;
}

static double now()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    double seconds = argc > 2 ? atof(argv[2]) : 0;
    int fd = open(argv[1], O_RDWR | O_CREAT, 0644);
    if (fd < 0 || ftruncate(fd, 16) != 0)
        return 1;
    char *m = (char *)mmap(nullptr, 16, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int n = 1 << 16;
    float *d, *e;
    cudaStream_t s;
    if (cudaMalloc(&d, n * sizeof(float)) || cudaMalloc(&e, n * sizeof(float)) || cudaStreamCreate(&s)) {
        fprintf(stderr, "framework_job: CUDA set-up failed\n");
        return 1;
    }
    for (int w = 0; w < 20; w++)
        inc<<<n / 256, 256, 0, s>>>(d, n);
    cudaStreamSynchronize(s);
    printf("ready\n");
    fflush(stdout);
    uint64_t steps = 0;
    double t0 = now();
    while (seconds <= 0 || now() - t0 < seconds) {
        for (int k = 0; k < 16; k++)
            inc<<<n / 256, 256, 0, s>>>(d, n);
        cudaMemcpyAsync(e, d, n * sizeof(float), cudaMemcpyDeviceToDevice, s);
        cudaStreamSynchronize(s);
        steps++;
        double t = now();
        memcpy(m, &steps, 8);
        memcpy(m + 8, &t, 8);
    }
    return 0;
}
