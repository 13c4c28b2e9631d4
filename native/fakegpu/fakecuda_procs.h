/* cuGetProcAddress for the fake driver: {base name, entry point, since version,
 * per-thread-stream variant}.  The newest variant not newer than the caller's
 * cudaVersion wins; CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (2) selects
 * the _ptds/_ptsz variant where one exists.  Included by fakecuda.c. */

API cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);
API cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status);

struct proc_entry { const char *base; void *fn; int since; int pt; };

/* Like the real driver, cuGetProcAddress hands out internal entry points for some
 * calls: pointers no exported symbol names (dladdr cannot tell what they are), so
 * an interposer must choose its wrapper from the name, version and flags. */
#define LAUNCH_ARGS f, gx, gy, gz, bx, by, bz, shmem, s, params, extra
static CUresult internal_launch(LAUNCH_PARAMS) { return cuLaunchKernel(LAUNCH_ARGS); }
static CUresult internal_launch_ptsz(LAUNCH_PARAMS) { return cuLaunchKernel_ptsz(LAUNCH_ARGS); }
/* A newer driver's variant of cuLaunchKernel (same ABI here) for callers asking with a
 * version past CUDA 13.0: an interposer built from 13.0's headers cannot know it. */
static CUresult internal_launch_next(LAUNCH_PARAMS) { return cuLaunchKernel(LAUNCH_ARGS); }
static CUresult internal_getproc(const char *, void **, int, cuuint64_t);
static CUresult internal_getproc_v2(const char *, void **, int, cuuint64_t, int *);

#define E(base, fn, since, pt) {#base, (void *)fn, since, pt}
static const struct proc_entry g_procs[] = {
    E(cuInit, cuInit, 2000, 0), E(cuDriverGetVersion, cuDriverGetVersion, 2020, 0),
    E(cuDeviceGet, cuDeviceGet, 2000, 0), E(cuDeviceGetCount, cuDeviceGetCount, 2000, 0),
    E(cuDeviceGetName, cuDeviceGetName, 2000, 0), E(cuDeviceGetAttribute, cuDeviceGetAttribute, 2000, 0),
    E(cuDeviceTotalMem, cuDeviceTotalMem_v2, 3020, 0), E(cuMemGetInfo, cuMemGetInfo_v2, 3020, 0),
    E(cuCtxCreate, cuCtxCreate_v2, 3020, 0), E(cuCtxCreate, cuCtxCreate_v3, 11040, 0),
    E(cuCtxCreate, cuCtxCreate_v4, 12050, 0), E(cuCtxDestroy, cuCtxDestroy_v2, 4000, 0),
    E(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, 7000, 0),
    E(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, 11000, 0),
    E(cuDevicePrimaryCtxGetState, cuDevicePrimaryCtxGetState, 7000, 0),
    E(cuDevicePrimaryCtxSetFlags, cuDevicePrimaryCtxSetFlags_v2, 11000, 0),
    E(cuCtxSetCurrent, cuCtxSetCurrent, 4000, 0), E(cuCtxGetCurrent, cuCtxGetCurrent, 4000, 0),
    E(cuCtxPushCurrent, cuCtxPushCurrent_v2, 4000, 0), E(cuCtxPopCurrent, cuCtxPopCurrent_v2, 4000, 0),
    E(cuCtxGetDevice, cuCtxGetDevice, 2000, 0), E(cuCtxSynchronize, cuCtxSynchronize, 2000, 0),
    E(cuStreamCreate, cuStreamCreate, 2000, 0), E(cuStreamCreateWithPriority, cuStreamCreateWithPriority, 5050, 0),
    E(cuStreamSynchronize, cuStreamSynchronize, 2000, 0), E(cuStreamSynchronize, cuStreamSynchronize_ptsz, 7000, 1),
    E(cuStreamQuery, cuStreamQuery, 2000, 0), E(cuStreamDestroy, cuStreamDestroy_v2, 4000, 0),
    E(cuModuleLoad, cuModuleLoad, 2000, 0), E(cuModuleLoadData, cuModuleLoadData, 2000, 0),
    E(cuModuleLoadDataEx, cuModuleLoadDataEx, 2010, 0), E(cuModuleUnload, cuModuleUnload, 2000, 0),
    E(cuModuleGetFunction, cuModuleGetFunction, 2000, 0),
    E(cuLaunchKernel, internal_launch, 4000, 0), E(cuLaunchKernel, internal_launch_ptsz, 7000, 1),
    E(cuLaunchKernel, internal_launch_next, 13010, 0),
    E(cuLaunchKernelEx, cuLaunchKernelEx, 11060, 0), E(cuLaunchKernelEx, cuLaunchKernelEx_ptsz, 11060, 1),
    E(cuLaunchHostFunc, cuLaunchHostFunc, 10000, 0), E(cuLaunchHostFunc, cuLaunchHostFunc_ptsz, 10000, 1),
    E(cuMemAlloc, cuMemAlloc_v2, 3020, 0), E(cuMemFree, cuMemFree_v2, 3020, 0),
    E(cuMemcpyHtoD, cuMemcpyHtoD_v2, 3020, 0), E(cuMemcpyHtoD, cuMemcpyHtoD_v2_ptds, 7000, 1),
    E(cuMemcpyDtoH, cuMemcpyDtoH_v2, 3020, 0), E(cuMemcpyDtoH, cuMemcpyDtoH_v2_ptds, 7000, 1),
    E(cuMemcpyDtoD, cuMemcpyDtoD_v2, 3020, 0), E(cuMemcpyDtoD, cuMemcpyDtoD_v2_ptds, 7000, 1),
    E(cuMemcpy, cuMemcpy, 4000, 0), E(cuMemcpy, cuMemcpy_ptds, 7000, 1),
    E(cuMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2, 3020, 0), E(cuMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2_ptsz, 7000, 1),
    E(cuMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2, 3020, 0), E(cuMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2_ptsz, 7000, 1),
    E(cuMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2, 3020, 0), E(cuMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2_ptsz, 7000, 1),
    E(cuMemcpyAsync, cuMemcpyAsync, 4000, 0), E(cuMemcpyAsync, cuMemcpyAsync_ptsz, 7000, 1),
    E(cuMemsetD8, cuMemsetD8_v2, 3020, 0), E(cuMemsetD8, cuMemsetD8_v2_ptds, 7000, 1),
    E(cuMemsetD8Async, cuMemsetD8Async, 3020, 0), E(cuMemsetD8Async, cuMemsetD8Async_ptsz, 7000, 1),
    E(cuMemsetD32, cuMemsetD32_v2, 3020, 0), E(cuMemsetD32, cuMemsetD32_v2_ptds, 7000, 1),
    E(cuMemsetD32Async, cuMemsetD32Async, 3020, 0), E(cuMemsetD32Async, cuMemsetD32Async_ptsz, 7000, 1),
    E(cuEventCreate, cuEventCreate, 2000, 0), E(cuEventRecord, cuEventRecord, 2000, 0),
    E(cuEventRecord, cuEventRecord_ptsz, 7000, 1), E(cuEventRecordWithFlags, cuEventRecordWithFlags, 11010, 0),
    E(cuEventSynchronize, cuEventSynchronize, 2000, 0), E(cuEventQuery, cuEventQuery, 2000, 0),
    E(cuEventDestroy, cuEventDestroy_v2, 4000, 0), E(cuEventElapsedTime, cuEventElapsedTime, 2000, 0),
    E(cuEventElapsedTime, cuEventElapsedTime_v2, 12080, 0),
    E(cuGetErrorString, cuGetErrorString, 6000, 0), E(cuGetErrorName, cuGetErrorName, 6000, 0),
    E(cuGetProcAddress, internal_getproc, 11030, 0), E(cuGetProcAddress, internal_getproc_v2, 12000, 0),
    E(cuStreamIsCapturing, cuStreamIsCapturing, 10000, 0), E(cuStreamGetCtx, cuStreamGetCtx, 9020, 0),
    E(cuThreadExchangeStreamCaptureMode, cuThreadExchangeStreamCaptureMode, 10010, 0),
    E(cuStreamBeginCapture, cuStreamBeginCapture_v2, 10010, 0), E(cuStreamEndCapture, cuStreamEndCapture, 10000, 0),
    E(cuGraphInstantiateWithFlags, cuGraphInstantiateWithFlags, 11040, 0),
    E(cuGraphLaunch, cuGraphLaunch, 10000, 0), E(cuGraphLaunch, cuGraphLaunch_ptsz, 10000, 1),
    E(cuGraphDestroy, cuGraphDestroy, 10000, 0), E(cuGraphExecDestroy, cuGraphExecDestroy, 10000, 0),
    E(cuCheckpointProcessLock, cuCheckpointProcessLock, 12080, 0),
    E(cuCheckpointProcessUnlock, cuCheckpointProcessUnlock, 12080, 0),
    E(cuCheckpointProcessGetState, cuCheckpointProcessGetState, 12080, 0),
};
#undef E

#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2
#define CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND 1

/* The entry point a driver of this version gives for (symbol, version, flags). */
static void *find_proc(const char *symbol, int version, uint64_t flags)
{
    int want_pt = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct proc_entry *best = NULL;
    for (size_t i = 0; i < sizeof(g_procs) / sizeof(*g_procs); i++) {
        const struct proc_entry *e = &g_procs[i];
        if (strcmp(e->base, symbol) != 0 || e->since > version || (e->pt && !want_pt))
            continue;
        if (!best || e->pt > best->pt || (e->pt == best->pt && e->since > best->since))
            best = e;
    }
    return best ? best->fn : NULL;
}

static CUresult get_proc(const char *symbol, void **pfn, int version, uint64_t flags, int *status)
{
    *pfn = find_proc(symbol, version, flags);
    if (status)
        *status = *pfn ? 0 : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

API cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    return get_proc(symbol, pfn, version, flags, NULL);
}

API cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status)
{
    return get_proc(symbol, pfn, version, flags, status);
}

static CUresult internal_getproc(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    return get_proc(symbol, pfn, version, flags, NULL);
}

static CUresult internal_getproc_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                    int *status)
{
    return get_proc(symbol, pfn, version, flags, status);
}
