/* gputrace shim: the control functions the preloaded object exports beside its driver wrappers.
 *
 * Python binds these with cffi in ABI mode (ffi.cdef of the declarations below, ffi.dlopen of the
 * built object): the object itself links no libpython.  Everything between the BEGIN/END markers
 * must stay plain declarations cffi can parse. */
#ifndef GPUTRACE_SHIM_H
#define GPUTRACE_SHIM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif
/* BEGIN CDEF */
/* Schema version of the status JSON. */
int gputrace_shim_schema(void);
/* Close the gate: new gated calls wait at the API boundary; waits up to timeout_ms for calls in
 * flight to leave.  0: paused; -1: calls still in flight at the timeout (the gate is reopened);
 * -2: already paused. */
int gputrace_shim_pause(int timeout_ms);
/* Reopen the gate.  0: resumed; -1: was not paused. */
int gputrace_shim_resume(void);
int gputrace_shim_paused(void);
/* Threads inside a gated call right now, and threads waiting at a closed gate. */
int gputrace_shim_in_flight(void);
int gputrace_shim_waiting(void);
/* Writes the status JSON (NUL-terminated when it fits) and returns its length without the NUL. */
size_t gputrace_shim_status_json(char *buf, size_t len);
/* Calls made through the wrapper `name` so far (-1: not a wrapper of the shim). */
long long gputrace_shim_calls(const char *name);
/* The driver's own entry point behind the wrapper `name` (NULL when unknown or absent): what a
 * checkpointer calls while the gate is closed. */
void *gputrace_shim_real(const char *name);
/* Copies up to `len` bytes of the image a module or library was loaded from; returns its size, or
 * 0 when `handle` is no module (kind 0) or library (kind 1) the shim knows. */
size_t gputrace_shim_module_image(int kind, unsigned long long handle, void *buf, size_t len);
/* The control socket's path ("" until the server runs); start the server now instead of at the
 * first intercepted call.  0: serving; -1: not serving (the reason went to stderr). */
const char *gputrace_shim_socket_path(void);
int gputrace_shim_serve(void);
/* END CDEF */
#ifdef __cplusplus
}
#endif
#endif
