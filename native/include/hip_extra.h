/* HIP entry points newer than the ROCm headers the hook table is generated from.
 *
 * native/tools/gen_hip_hooks.py reads Debian's libamdhip64-dev headers (ROCm
 * 5.2.3), then this file for what ROCm added later.  Each declaration is written
 * from AMD's HIP API reference for the ROCm version named beside it (the ABI of
 * an exported C function never changes once released).  Included only after the
 * system headers, so a newer ROCm's own declarations must agree with these
 * (tests/test_native.py compiles the table against whatever headers are present).
 */
#ifndef KREX_HIP_EXTRA_H
#define KREX_HIP_EXTRA_H

/* ROCm 6.2: driver-style launch configuration (same layout as CUlaunchConfig). */
typedef struct HIP_LAUNCH_ATTRIBUTE_st HIP_LAUNCH_ATTRIBUTE;
typedef struct HIP_LAUNCH_CONFIG_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    hipStream_t hStream;
    HIP_LAUNCH_ATTRIBUTE *attrs;
    unsigned int numAttrs;
} HIP_LAUNCH_CONFIG;
typedef int hipDriverProcAddressQueryResult; /* ROCm 6.2 enum */

/* ROCm 6.0 */
hipError_t hipModuleLaunchCooperativeKernel(hipFunction_t f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, hipStream_t stream, void **kernelParams);
hipError_t hipGraphUpload(hipGraphExec_t graphExec, hipStream_t stream);
/* ROCm 6.2 */
hipError_t hipGetProcAddress(const char *symbol, void **pfn, int hipVersion, uint64_t flags, hipDriverProcAddressQueryResult *symbolStatus);
/* ROCm 6.3 */
hipError_t hipDrvLaunchKernelEx(const HIP_LAUNCH_CONFIG *config, hipFunction_t f, void **params, void **extra);
/* ROCm 6.x per-thread-default-stream variants (same signatures as their bases) */
hipError_t hipGraphLaunch_spt(hipGraphExec_t graphExec, hipStream_t stream);
hipError_t hipLaunchHostFunc_spt(hipStream_t stream, hipHostFn_t fn, void *userData);
hipError_t hipStreamBeginCapture_spt(hipStream_t stream, hipStreamCaptureMode mode);
hipError_t hipStreamEndCapture_spt(hipStream_t stream, hipGraph_t *pGraph);

#endif
