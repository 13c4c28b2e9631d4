/* Minimal CUDA driver and HIP types: exactly the ABI the wrappers need.
 *
 * Handles are opaque pointers; structs passed by pointer stay incomplete.
 * tests/test_native.py compiles the hook tables against the toolkit's real
 * cuda.h to prove the signatures match.
 */
#ifndef KREX_CUTYPES_H
#define KREX_CUTYPES_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint32_t cuuint32_t;
typedef uint64_t cuuint64_t;
typedef unsigned long long CUdeviceptr;
typedef unsigned int CUdeviceptr_v1;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUarray_st *CUarray;
typedef struct CUgraphExec_st *CUgraphExec;
typedef void (*CUhostFn)(void *userData);
typedef struct CUlaunchConfig_st CUlaunchConfig;
typedef struct CUDA_LAUNCH_PARAMS_st CUDA_LAUNCH_PARAMS;
typedef struct CUDA_MEMCPY2D_st CUDA_MEMCPY2D;
typedef struct CUDA_MEMCPY2D_v1_st CUDA_MEMCPY2D_v1;
typedef struct CUDA_MEMCPY3D_st CUDA_MEMCPY3D;
typedef struct CUDA_MEMCPY3D_v1_st CUDA_MEMCPY3D_v1;
typedef struct CUDA_MEMCPY3D_PEER_st CUDA_MEMCPY3D_PEER;
typedef struct CUDA_MEMCPY3D_BATCH_OP_st CUDA_MEMCPY3D_BATCH_OP;
typedef struct CUmemcpyAttributes_st CUmemcpyAttributes;
typedef union CUstreamBatchMemOpParams_union CUstreamBatchMemOpParams;
typedef struct CUmemLocation_st { int type; int id; } CUmemLocation; /* passed by value */
typedef int CUdriverProcAddressQueryResult;
typedef int CUstreamCaptureMode;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUarrayMapInfo_st CUarrayMapInfo;
typedef struct CUextSemaphore_st *CUexternalSemaphore;
typedef struct CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS_st CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS;
typedef struct CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS_st CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphEdgeData_st CUgraphEdgeData;
typedef void (*CUstreamCallback)(CUstream hStream, CUresult status, void *userData);

/* The head of CUlaunchConfig and HIP_LAUNCH_CONFIG: where the stream is
 * (tests/test_native.py checks the offset against cuda.h). */
struct krex_launch_config_prefix {
    unsigned int grid[3], block[3], sharedMemBytes;
    void *hStream;
};

#ifndef CUDA_SUCCESS /* fakegpu/errors.h defines them too */
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_FOUND 500
#endif
#define KREX_ERR_INVALID_VALUE 1   /* CUDA_ERROR_INVALID_VALUE, hipErrorInvalidValue */
#define KREX_ERR_ILLEGAL_STATE 401 /* CUDA_ERROR_ILLEGAL_STATE, hipErrorIllegalState */

typedef int hipError_t;
typedef int hipMemcpyKind;
typedef int hipDriverProcAddressQueryResult;
typedef void *hipDeviceptr_t;
typedef struct ihipStream_t *hipStream_t;
typedef struct ihipModuleSymbol_t *hipFunction_t;
typedef struct ihipEvent_t *hipEvent_t;
typedef struct hipGraphExec *hipGraphExec_t;
typedef struct dim3 { uint32_t x, y, z; } dim3; /* passed by value */
typedef struct hipPitchedPtr { void *ptr; size_t pitch, xsize, ysize; } hipPitchedPtr; /* by value */
typedef struct hipExtent { size_t width, height, depth; } hipExtent;                    /* by value */
typedef struct hipArray hipArray;
struct hipMemcpy3DParms;
typedef const struct hipArray *hipArray_const_t;
typedef struct hip_Memcpy2D hip_Memcpy2D;
typedef struct HIP_MEMCPY3D HIP_MEMCPY3D;
typedef struct HIP_LAUNCH_CONFIG_st HIP_LAUNCH_CONFIG;
typedef struct hipLaunchParams_t hipLaunchParams;
typedef struct ihipGraph *hipGraph_t;
typedef struct ihipMemPoolHandle_t *hipMemPool_t;
typedef void *hipExternalSemaphore_t;
typedef struct hipExternalSemaphoreSignalParams_st hipExternalSemaphoreSignalParams;
typedef struct hipExternalSemaphoreWaitParams_st hipExternalSemaphoreWaitParams;
typedef int hipStreamCaptureMode;
typedef void (*hipHostFn_t)(void *userData);
typedef void (*hipStreamCallback_t)(hipStream_t stream, hipError_t status, void *userData);

#ifndef hipSuccess
#define hipSuccess 0
#define hipErrorNotFound 500
#endif

#endif
