/* fakegpu's error codes: the one place they are defined.
 *
 * The values are the CUDA driver's (cuda.h CUresult) and HIP's (hipError_t),
 * which agree for every code fakegpu returns.  The server answers with these
 * codes; the fake libcuda.so.1 and libamdhip64.so pass them on unchanged.
 */
#ifndef KREX_FAKEGPU_ERRORS_H
#define KREX_FAKEGPU_ERRORS_H

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_LAUNCH_FAILED 719 /* sticky: the context is unusable */
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901
#define CUDA_ERROR_TIMEOUT 909

#define hipSuccess CUDA_SUCCESS
#define hipErrorInvalidValue CUDA_ERROR_INVALID_VALUE
#define hipErrorOutOfMemory CUDA_ERROR_OUT_OF_MEMORY
#define hipErrorNotInitialized CUDA_ERROR_NOT_INITIALIZED
#define hipErrorNoDevice CUDA_ERROR_NO_DEVICE
#define hipErrorInvalidDevice CUDA_ERROR_INVALID_DEVICE
#define hipErrorNotFound CUDA_ERROR_NOT_FOUND

#endif
