/* Streams and contexts seen at gated calls, and the drain that synchronises them.
 *
 * Every gated call records the stream it submits to (an explicit stream, the
 * legacy default stream or a per-thread default stream, with its CUDA context or
 * HIP device).  A drain synchronises each explicit stream that is not capturing
 * (captured calls do no device work; synchronising a capturing stream would
 * invalidate the capture), and the default streams through their context or
 * device when no capture is active.  No fixed limits: the sets grow as needed.
 */
#ifndef KREX_TRACK_H
#define KREX_TRACK_H

#include <stdint.h>

#define KREX_CTX_WIDE ((void *)~(uintptr_t)0) /* a call on several streams or devices */

/* Driver calls the drain uses, bound from the driver library itself. */
struct krex_cuda_calls {
    int (*ctx_get_current)(void **ctx);
    int (*ctx_push)(void *ctx);
    int (*ctx_pop)(void **ctx);
    int (*ctx_synchronize)(void);
    int (*stream_synchronize)(void *stream);
    int (*stream_is_capturing)(void *stream, int *status);
    int (*stream_get_ctx)(void *stream, void **ctx);
    int (*exchange_capture_mode)(int *mode);
};
struct krex_hip_calls {
    int (*get_device)(int *dev);
    int (*set_device)(int dev);
    int (*device_synchronize)(void);
    int (*stream_synchronize)(void *stream);
    int (*stream_is_capturing)(void *stream, int *status);
    int (*stream_get_device)(void *stream, int *dev);
    int (*exchange_capture_mode)(int *mode);
};

void krex_track_bind_cuda(const struct krex_cuda_calls *c);
void krex_track_bind_hip(const struct krex_hip_calls *c);
/* A gated call of `api` submits to `stream` (pt: a per-thread-default-stream variant). */
void krex_track(int api, void *stream, int pt);
/* Forget a destroyed stream or context (waits for a drain in progress). */
void krex_track_forget_stream(int api, void *stream);
void krex_track_forget_ctx(void *ctx);
/* A stream capture began (+1) or ended (-1) in this process. */
void krex_track_capture(int delta);
/* Synchronise everything recorded; KREX_DRAIN_OK or why not (gate.h).  Runs on the
 * drain thread only, which first switches itself to the relaxed capture mode, so
 * another thread's global-mode capture never makes its synchronisations illegal. */
int krex_track_drain(void);
/* In a forked child: nothing of the parent's is valid. */
void krex_track_reset(void);
/* Start time of a process (field 22 of /proc/PID/stat), 0 if gone (gate.c). */
uint64_t krex_start_time(uint32_t pid);

#endif
