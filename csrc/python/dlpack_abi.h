// The parts of the DLPack ABI (v1.x) that mhakit's Python extension reads: tensors, managed tensors, and the C
// exchange table a producer type publishes as `__dlpack_c_exchange_api__`. Declared here from the specification's
// struct layouts, so the extension needs no third-party header; field order and types are the ABI and must not
// change.
#pragma once

#include <stddef.h>
#include <stdint.h>

typedef struct mhk_DLPackVersion {
    uint32_t major;
    uint32_t minor;
} mhk_DLPackVersion;

enum { mhk_kDLCPU = 1, mhk_kDLCUDA = 2, mhk_kDLCUDAHost = 3, mhk_kDLCUDAManaged = 13 };
enum { mhk_kDLInt = 0, mhk_kDLUInt = 1, mhk_kDLFloat = 2, mhk_kDLBfloat = 4 };

typedef struct mhk_DLDevice {
    int32_t device_type;
    int32_t device_id;
} mhk_DLDevice;

typedef struct mhk_DLDataType {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} mhk_DLDataType;

typedef struct mhk_DLTensor {
    void* data;
    mhk_DLDevice device;
    int32_t ndim;
    mhk_DLDataType dtype;
    int64_t* shape;
    int64_t* strides;  // NULL: compact row-major
    uint64_t byte_offset;
} mhk_DLTensor;

typedef struct mhk_DLManagedTensor {
    mhk_DLTensor dl_tensor;
    void* manager_ctx;
    void (*deleter)(struct mhk_DLManagedTensor* self);
} mhk_DLManagedTensor;

#define MHK_DLPACK_FLAG_READ_ONLY 1ULL

typedef struct mhk_DLManagedTensorVersioned {
    mhk_DLPackVersion version;
    void* manager_ctx;
    void (*deleter)(struct mhk_DLManagedTensorVersioned* self);
    uint64_t flags;
    mhk_DLTensor dl_tensor;
} mhk_DLManagedTensorVersioned;

// The C exchange table (DLPack 1.2+): one static instance per producer framework, reached from the tensor's type.
typedef struct mhk_DLPackExchangeAPIHeader {
    mhk_DLPackVersion version;
    struct mhk_DLPackExchangeAPIHeader* prev_api;
} mhk_DLPackExchangeAPIHeader;

typedef struct mhk_DLPackExchangeAPI {
    mhk_DLPackExchangeAPIHeader header;
    int (*managed_tensor_allocator)(mhk_DLTensor* prototype, mhk_DLManagedTensorVersioned** out, void* error_ctx,
                                    void (*set_error)(void* error_ctx, const char* kind, const char* message));
    int (*managed_tensor_from_py_object_no_sync)(void* py_object, mhk_DLManagedTensorVersioned** out);
    int (*managed_tensor_to_py_object_no_sync)(mhk_DLManagedTensorVersioned* tensor, void** out_py_object);
    int (*dltensor_from_py_object_no_sync)(void* py_object, mhk_DLTensor* out);  // may be NULL
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_current_stream);
} mhk_DLPackExchangeAPI;
