/* Calibration targets: functions that do (almost) nothing, called in a timed loop, so that what a
 * probe hit costs on this host is measured as the difference between probed and unprobed loops.
 *
 * x86 uprobes emulate a few first instructions (push of a register, branches, ret, nop) and
 * single-step every other one out of line, which costs another trap: two targets, one of each kind,
 * so each probed function's bias can be taken from the kind its first instruction is. */
#include <stdint.h>
#include <time.h>

__asm__(
    ".text\n"
    ".globl gt_calib_emulated\n.type gt_calib_emulated,@function\n"
    "gt_calib_emulated:\n  push %rbp\n  pop %rbp\n  ret\n"
    ".size gt_calib_emulated, .-gt_calib_emulated\n"
    ".globl gt_calib_stepped\n.type gt_calib_stepped,@function\n"
    "gt_calib_stepped:\n  mov %rdi, %rax\n  ret\n"
    ".size gt_calib_stepped, .-gt_calib_stepped\n");

void gt_calib_emulated(void);
void gt_calib_stepped(void);

static uint64_t run(void (*volatile target)(void), uint64_t n)
{
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (uint64_t i = 0; i < n; i++)
        target();
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (uint64_t)(b.tv_sec - a.tv_sec) * 1000000000ull + (uint64_t)(b.tv_nsec - a.tv_nsec);
}

/* Called through a volatile pointer so the compiler can neither inline nor elide the calls. */
__attribute__((visibility("default"))) uint64_t gt_calib_loop(int which, uint64_t n)
{
    return run(which ? gt_calib_stepped : gt_calib_emulated, n);
}
