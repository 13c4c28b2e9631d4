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

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_FOUND 500

typedef int hipError_t;
typedef int hipMemcpyKind;
typedef int hipDriverProcAddressQueryResult;
typedef void *hipDeviceptr_t;
typedef struct ihipStream_t *hipStream_t;
typedef struct ihipModuleSymbol_t *hipFunction_t;
typedef struct ihipEvent_t *hipEvent_t;
typedef struct hipGraphExec *hipGraphExec_t;
typedef struct dim3 { uint32_t x, y, z; } dim3; /* passed by value */

#define hipErrorNotFound 500

#endif
