/* gpu_bound: few long kernels and long synchronizations; the CPU mostly waits for the GPU.
 *
 * Per step: cuEventRecord, K x cuLaunchKernel (each --kernel-ns long), cuEventRecord,
 * cuStreamSynchronize, cuEventElapsedTime_v2.
 * Setup: cuInit, cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuModuleLoadData,
 * cuModuleGetFunction, cuStreamCreate, 2 cuEventCreate.
 * Teardown: 2 cuEventDestroy_v2, cuStreamDestroy_v2, cuModuleUnload, cuDevicePrimaryCtxRelease_v2.
 * Options: --steps N (default 5) | --seconds S, --kernels K (default 2), --kernel-ns NS (default
 * 20 ms), --launch-ns NS, --wait-stdin, --ready-fd FD, --dlopen, --ptsz, --cuda-version V.
 * Reports "gpu_ms": the GPU time the events measured, summed over steps. */
#include "workload.h"

int main(int argc, char **argv)
{
    wl.workload = "gpu_bound";
    wl.steps = 5;
    wl.kernels = 2;
    wl.kernel_ns = 20000000;
    wl_parse(argc, argv, WL_OPT_KERNELS);

    char image[256];
    snprintf(image, sizeof image, "SIMCUDA-MODULE\nkernel busy spin %lld\n", wl.kernel_ns);

    double t0 = wl_start();
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CUstream s;
    CUevent start, end;
    CU(cuInit, 0);
    CU(cuDeviceGet, &dev, 0);
    CU(cuDevicePrimaryCtxRetain, &ctx, dev);
    CU(cuCtxSetCurrent, ctx);
    CU(cuModuleLoadData, &mod, image);
    CU(cuModuleGetFunction, &fn, mod, "busy");
    CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
    CU(cuEventCreate, &start, CU_EVENT_DEFAULT);
    CU(cuEventCreate, &end, CU_EVENT_DEFAULT);

    double gpu_ms = 0;
    long step;
    for (step = 0; wl_more(step, t0); step++) {
        float ms;
        CU(cuEventRecord, start, s);
        for (long k = 0; k < wl.kernels; k++)
            CU(cuLaunchKernel, fn, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        CU(cuEventRecord, end, s);
        CU(cuStreamSynchronize, s);
        CU(cuEventElapsedTime_v2, &ms, start, end);
        gpu_ms += ms;
    }

    CU(cuEventDestroy_v2, start);
    CU(cuEventDestroy_v2, end);
    CU(cuStreamDestroy_v2, s);
    CU(cuModuleUnload, mod);
    CU(cuDevicePrimaryCtxRelease_v2, dev);

    char extra[128];
    snprintf(extra, sizeof extra, "\"kernels_per_step\": %ld, \"kernel_ns\": %lld, \"gpu_ms\": %.3f", wl.kernels,
             wl.kernel_ns, gpu_ms);
    wl_report(step, t0, extra);
    return 0;
}
