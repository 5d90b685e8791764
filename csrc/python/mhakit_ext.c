// _mhakit_ext: the per-call path of mhakit's Python API in C.
//
// mhakit.api calls fwd() / bwd() with the user's arrays and the options it has already normalised (layout, mask
// kind and window, scale, dtype override). This file reads every array (the producer's DLPack C exchange table
// where its type publishes one, else __dlpack__ parsed here), takes the producer's current stream unless the caller
// named one, allocates outputs through the producer's allocator (a torch caller gets torch tensors) or through a
// Python callback, fills the C argument struct of csrc/include/mha_*.h and calls the library through function
// pointers resolved once per (api, device, dtype, head dims, mode, mask class). The library's own validation is the
// authority on argument rules; its negative return codes become Python exceptions carrying its sentence.
//
// Anything this path does not handle (host arrays, __cuda_array_interface__-only producers, host cu_seqlens,
// mismatched shapes or dtypes, empty problems, unusual stream objects) returns NotImplemented *before* anything
// touches the GPU, and mhakit.api then runs its Python path, which gives the documented one-sentence error or does
// the slower work. So both paths always agree on errors.
//
// Plain C against Python.h, csrc/python/dlpack_abi.h and the public mhakit headers; the CUDA driver is reached
// through dlopen("libcuda.so.1") (context switch when the call's device is not current, stream ordering, the
// backward's workspace), so the extension links nothing but libc and libdl.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dlpack_abi.h"
#include "mha_bwd.h"
#include "mha_fwd.h"

#define MAXD 4
#define NOT_HANDLED 0
#define HANDLED 1
#define FAILED (-1)

// ---------------------------------------------------------------------------------------------------------------
// Python callbacks (set once by configure())
// ---------------------------------------------------------------------------------------------------------------

static PyObject* g_resolve;     // (api, device, kind, hdim_q, hdim_v, mode, masked) -> (run, last_error, ws) | None
static PyObject* g_allocate;    // (device, shape, storage, stream, stream object) -> array with .ptr
static PyObject* g_make_error;  // (code, message) -> exception instance
static PyObject* g_cuda_error;  // (message) -> exception instance (no driver / a driver call failed)

static PyObject* s_dlpack;         // "__dlpack__"
static PyObject* s_dlpack_device;  // "__dlpack_device__"
static PyObject* s_kwnames_full;   // ("stream", "max_version")
static PyObject* s_kwnames_stream; // ("stream",)
static PyObject* s_version_1_0;    // (1, 0)

static int raise_from(PyObject* factory, PyObject* args) {
    PyObject* exc = args ? PyObject_CallObject(factory, args) : NULL;
    Py_XDECREF(args);
    if (exc == NULL) return FAILED;  // the factory raised
    PyErr_SetObject((PyObject*)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return FAILED;
}

static int cuda_fail(const char* what) { return raise_from(g_cuda_error, Py_BuildValue("(s)", what)); }

// ---------------------------------------------------------------------------------------------------------------
// The CUDA driver, through dlopen
// ---------------------------------------------------------------------------------------------------------------

typedef int CUresult;
typedef void* CUcontext;
typedef int CUdevice;
typedef void* CUstream;
typedef void* CUevent;
typedef unsigned long long CUdeviceptr;

static struct {
    int state;  // 0 not tried, 1 loaded, -1 unavailable
    CUresult (*ctx_get_current)(CUcontext*);
    CUresult (*ctx_get_device)(CUdevice*);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*primary_ctx_retain)(CUcontext*, CUdevice);
    CUresult (*device_get)(CUdevice*, int);
    CUresult (*event_create)(CUevent*, unsigned);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*stream_wait_event)(CUstream, CUevent, unsigned);
    CUresult (*event_destroy)(CUevent);
    CUresult (*mem_alloc_async)(CUdeviceptr*, size_t, CUstream);
    CUresult (*stream_is_capturing)(CUstream, int*);
} drv;

static int driver_load(void) {
    if (drv.state == 1) return 0;
    if (drv.state == -1) return cuda_fail("no usable NVIDIA GPU in this process: libcuda.so.1 could not be loaded");
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    const struct { void** slot; const char* name; } syms[] = {
        {(void**)&drv.ctx_get_current, "cuCtxGetCurrent"},
        {(void**)&drv.ctx_get_device, "cuCtxGetDevice"},
        {(void**)&drv.ctx_set_current, "cuCtxSetCurrent"},
        {(void**)&drv.primary_ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void**)&drv.device_get, "cuDeviceGet"},
        {(void**)&drv.event_create, "cuEventCreate"},
        {(void**)&drv.event_record, "cuEventRecord"},
        {(void**)&drv.stream_wait_event, "cuStreamWaitEvent"},
        {(void**)&drv.event_destroy, "cuEventDestroy_v2"},
        {(void**)&drv.mem_alloc_async, "cuMemAllocAsync"},
        {(void**)&drv.stream_is_capturing, "cuStreamIsCapturing"},
    };
    for (size_t i = 0; h != NULL && i < sizeof(syms) / sizeof(syms[0]); ++i)
        if ((*syms[i].slot = dlsym(h, syms[i].name)) == NULL) h = NULL;
    drv.state = h ? 1 : -1;
    return driver_load();
}

#define MAX_DEVICES 64
static CUcontext g_primary[MAX_DEVICES];

typedef struct {
    int switched;
    CUcontext previous;
} DeviceScope;

// Makes `device` current on this thread unless a context of that device already is (the usual case: the producer
// framework made it current). The library's CUDA runtime then works in that context.
static int device_enter(int device, DeviceScope* scope) {
    scope->switched = 0;
    if (driver_load() != 0) return FAILED;
    CUcontext cur = NULL;
    if (drv.ctx_get_current(&cur) != 0) return cuda_fail("cuCtxGetCurrent failed");
    if (cur != NULL) {
        CUdevice d = -1;
        if (drv.ctx_get_device(&d) == 0 && d == device) return 0;
    }
    if (device < 0 || device >= MAX_DEVICES) return cuda_fail("device ordinal out of range");
    if (g_primary[device] == NULL) {
        CUdevice dev;
        CUcontext ctx = NULL;
        if (drv.device_get(&dev, device) != 0 || drv.primary_ctx_retain(&ctx, dev) != 0)
            return cuda_fail("cannot retain the primary context of the call's device");
        g_primary[device] = ctx;
    }
    if (drv.ctx_set_current(g_primary[device]) != 0) return cuda_fail("cuCtxSetCurrent failed");
    scope->switched = 1;
    scope->previous = cur;
    return 0;
}

static void device_exit(const DeviceScope* scope) {
    if (scope->switched) drv.ctx_set_current(scope->previous);
}

// Whether `stream` is being captured; 0 where no driver can be loaded (the call fails later, with its sentence).
static int stream_capturing(int64_t stream) {
    if (stream == 0 || stream == 1 || stream == 2) return 0;  // the default streams cannot be captured
    if (drv.state == 0 && driver_load() != 0) PyErr_Clear();
    int status = 0;
    if (drv.state != 1 || drv.stream_is_capturing((CUstream)(intptr_t)stream, &status) != 0) return 0;
    return status != 0;
}

static int same_stream(int64_t a, int64_t b) { return a == b || ((a == 0 || a == 1) && (b == 0 || b == 1)); }

// Work queued later on `consumer` waits for the work queued so far on `producer`.
static int order_streams(int64_t producer, int64_t consumer) {
    if (same_stream(producer, consumer)) return 0;
    CUevent ev = NULL;
    if (drv.event_create(&ev, 2 /* CU_EVENT_DISABLE_TIMING */) != 0) return cuda_fail("cuEventCreate failed");
    const int ok = drv.event_record(ev, (CUstream)(intptr_t)producer) == 0 &&
                   drv.stream_wait_event((CUstream)(intptr_t)consumer, ev, 0) == 0;
    drv.event_destroy(ev);
    return ok ? 0 : cuda_fail("ordering the call's stream after the producer's stream failed");
}

// Scratch of the backward (its workspace) and of mha_fwd_kvcache (its split accumulators): one grow-only buffer per
// device, stream-ordered. A buffer that is outgrown is kept (never
// freed): a CUDA graph captured earlier may still address it. With doubling growth the retired buffers together
// stay smaller than the live one. The order between uses on different streams goes through an event recorded after
// each use, never through the stream of the last use: that stream may have been destroyed since.
static struct {
    CUdeviceptr ptr;
    size_t size;
    int64_t stream;  // the stream of the last use outside a capture
    CUevent done;    // recorded on that stream after the last use (NULL before the first)
} g_workspace[MAX_DEVICES];

static int workspace_get(int device, size_t need, int64_t stream, void** out) {
    if (device < 0 || device >= MAX_DEVICES) return cuda_fail("device ordinal out of range");
    int capturing = 0;
    drv.stream_is_capturing((CUstream)(intptr_t)stream, &capturing);
    if (need > g_workspace[device].size) {
        if (capturing)
            return raise_from(g_make_error,
                              Py_BuildValue("(is)", MHAKIT_ERROR_INVALID_ARGS,
                                            "mhakit's scratch buffer (the backward's workspace, mha_fwd_kvcache's "
                                            "split accumulators) must grow, which is not possible inside a CUDA "
                                            "graph capture; run the same call once before capturing it"));
        size_t size = g_workspace[device].size * 2;
        if (size < need) size = need;
        size = (size + (1u << 20) - 1) & ~(size_t)((1u << 20) - 1);
        CUdeviceptr ptr = 0;
        if (drv.mem_alloc_async(&ptr, size, (CUstream)(intptr_t)stream) != 0)
            return cuda_fail("cuMemAllocAsync of mhakit's scratch buffer failed (out of device memory?)");
        g_workspace[device].ptr = ptr;
        g_workspace[device].size = size;
    } else if (!capturing && g_workspace[device].done != NULL && !same_stream(g_workspace[device].stream, stream)) {
        if (drv.stream_wait_event((CUstream)(intptr_t)stream, g_workspace[device].done, 0) != 0)
            return cuda_fail("ordering the call's stream after the last use of mhakit's scratch buffer failed");
    }
    *out = (void*)(uintptr_t)g_workspace[device].ptr;
    return 0;
}

// After a launch that used the workspace on `stream` (outside a capture): later uses on other streams wait for it.
static int workspace_used(int device, int64_t stream) {
    if (stream_capturing(stream)) return 0;
    if (g_workspace[device].done == NULL &&
        drv.event_create(&g_workspace[device].done, 2 /* CU_EVENT_DISABLE_TIMING */) != 0) {
        g_workspace[device].done = NULL;
        return cuda_fail("cuEventCreate failed");
    }
    if (drv.event_record(g_workspace[device].done, (CUstream)(intptr_t)stream) != 0)
        return cuda_fail("recording the last use of mhakit's scratch buffer failed");
    g_workspace[device].stream = stream;
    return 0;
}

// The forward's tile counters: a persistent Hopper instance (catalogue `persistent`) takes its work tiles from a
// counter in the call's workspace, which each call tags anew (kernels/common/tile_scheduler.h: no zeroing). One
// buffer per (device, stream), allocated on that stream at its first use and never freed (a graph may address it),
// so that calls on different streams never share one.
// Inside a capture, and past the table's size, the call gets none and runs the one-tile grid (correct, not as fast): a
// graph replayed on another stream beside eager calls on the capture stream would share that stream's counter.
// Every 16-bit forward call gets the buffer (kCounterBytes); instances without a persistent grid ignore it.
#define MAX_COUNTERS 16
enum { kCounterBytes = 256 };
static struct {
    int64_t stream;
    CUdeviceptr ptr;
} g_counters[MAX_DEVICES][MAX_COUNTERS];

static void* fwd_counter(int device, int64_t stream) {
    if (device < 0 || device >= MAX_DEVICES || stream_capturing(stream)) return NULL;
    for (int i = 0; i < MAX_COUNTERS; ++i) {
        if (g_counters[device][i].ptr == 0) {
            CUdeviceptr ptr = 0;
            if (drv.mem_alloc_async(&ptr, kCounterBytes, (CUstream)(intptr_t)stream) != 0) return NULL;
            g_counters[device][i].stream = stream;
            g_counters[device][i].ptr = ptr;
        }
        if (same_stream(g_counters[device][i].stream, stream)) return (void*)(uintptr_t)g_counters[device][i].ptr;
    }
    return NULL;
}

// ---------------------------------------------------------------------------------------------------------------
// Reading arrays
// ---------------------------------------------------------------------------------------------------------------

typedef struct {
    uintptr_t ptr;
    int ndim;
    int64_t shape[MAXD];
    int64_t strides[MAXD];
    uint8_t code, bits;
    int dev_type, dev_id;
    int readonly;
    PyObject* capsule;                      // owned; released after the call
    mhk_DLManagedTensorVersioned* managed;  // deleted after the call
    const mhk_DLPackExchangeAPI* api;       // the producer's exchange table, if it has one
    PyObject* object;                       // borrowed: the array itself
} View;

static void view_release(View* v) {
    Py_CLEAR(v->capsule);
    if (v->managed != NULL && v->managed->deleter != NULL) v->managed->deleter(v->managed);
    v->managed = NULL;
}

#define API_CACHE 16
static struct {
    PyTypeObject* type;
    const mhk_DLPackExchangeAPI* api;
} g_api_cache[API_CACHE];
static int g_api_cached;

static const mhk_DLPackExchangeAPI* exchange_api_of(PyTypeObject* type) {
    for (int i = 0; i < g_api_cached; ++i)
        if (g_api_cache[i].type == type) return g_api_cache[i].api;
    const mhk_DLPackExchangeAPI* api = NULL;
    PyObject* attr = PyObject_GetAttrString((PyObject*)type, "__dlpack_c_exchange_api__");
    if (attr != NULL) {
        if (PyCapsule_CheckExact(attr))
            api = (const mhk_DLPackExchangeAPI*)PyCapsule_GetPointer(attr, PyCapsule_GetName(attr));
        else if (PyLong_Check(attr))
            api = (const mhk_DLPackExchangeAPI*)PyLong_AsVoidPtr(attr);
        Py_DECREF(attr);
    }
    if (PyErr_Occurred()) PyErr_Clear();
    if (api != NULL && (api->header.version.major != 1 || api->current_work_stream == NULL ||
                        (api->dltensor_from_py_object_no_sync == NULL &&
                         api->managed_tensor_from_py_object_no_sync == NULL)))
        api = NULL;
    if (g_api_cached < API_CACHE) {  // the table lives as long as the process; the type is kept alive with it
        Py_INCREF(type);
        g_api_cache[g_api_cached].type = type;
        g_api_cache[g_api_cached].api = api;
        ++g_api_cached;
    }
    return api;
}

static int view_from_dltensor(View* v, const mhk_DLTensor* t) {
    if (t->ndim < 0 || t->ndim > MAXD || t->dtype.lanes != 1) return NOT_HANDLED;
    v->ndim = t->ndim;
    int64_t acc = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
        v->shape[i] = t->shape[i];
        v->strides[i] = t->strides ? t->strides[i] : acc;
        acc *= t->shape[i] > 1 ? t->shape[i] : 1;
    }
    v->code = t->dtype.code;
    v->bits = t->dtype.bits;
    v->dev_type = t->device.device_type;
    v->dev_id = t->device.device_id;
    v->ptr = (uintptr_t)t->data + (uintptr_t)t->byte_offset;
    return HANDLED;
}

static int on_cuda(int dev_type) { return dev_type == mhk_kDLCUDA || dev_type == mhk_kDLCUDAManaged; }

// Reads `obj`. `stream` is the call's stream, handed to __dlpack__ so that the producer orders its pending work
// before it (the exchange table does no ordering: the caller orders against the producer's current stream).
static int view_read(PyObject* obj, int64_t stream, View* v) {
    memset(v, 0, sizeof(*v));
    v->object = obj;
    const mhk_DLPackExchangeAPI* api = exchange_api_of(Py_TYPE(obj));
    if (api != NULL) {
        v->api = api;
        if (api->dltensor_from_py_object_no_sync != NULL) {
            mhk_DLTensor t;
            if (api->dltensor_from_py_object_no_sync(obj, &t) != 0) {
                PyErr_Clear();
                return NOT_HANDLED;
            }
            return view_from_dltensor(v, &t);
        }
        mhk_DLManagedTensorVersioned* mt = NULL;
        if (api->managed_tensor_from_py_object_no_sync(obj, &mt) != 0 || mt == NULL) {
            PyErr_Clear();
            return NOT_HANDLED;
        }
        v->managed = mt;
        v->readonly = (mt->flags & MHK_DLPACK_FLAG_READ_ONLY) != 0;
        return view_from_dltensor(v, &mt->dl_tensor);
    }
    // __dlpack__: ask the device first (a host array is the Python path's to refuse), then export on our stream.
    PyObject* dev = PyObject_CallMethodNoArgs(obj, s_dlpack_device);
    if (dev == NULL) {
        PyErr_Clear();
        return NOT_HANDLED;
    }
    long dev_type = -1;
    if (PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2) dev_type = PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
    Py_DECREF(dev);
    if (PyErr_Occurred()) PyErr_Clear();
    if (!on_cuda((int)dev_type)) return NOT_HANDLED;
    // DLPack spells the legacy stream 1; -1 asks for no synchronisation, which a stream being captured into a CUDA
    // graph needs (an event recorded outside the capture would invalidate it: the caller orders a capture).
    PyObject* dl_stream = PyLong_FromLongLong(stream == -1 ? -1 : (stream == 0 ? 1 : stream));
    if (dl_stream == NULL) return FAILED;
    PyObject* args[3] = {obj, dl_stream, s_version_1_0};
    PyObject* capsule = PyObject_VectorcallMethod(s_dlpack, args, 1, s_kwnames_full);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {  // a producer older than DLPack 1.0's keywords
        PyErr_Clear();
        capsule = PyObject_VectorcallMethod(s_dlpack, args, 1, s_kwnames_stream);
    }
    Py_DECREF(dl_stream);
    if (capsule == NULL) {
        PyErr_Clear();
        return NOT_HANDLED;
    }
    v->capsule = capsule;
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        mhk_DLManagedTensorVersioned* mt = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (mt->version.major != 1) return NOT_HANDLED;
        v->readonly = (mt->flags & MHK_DLPACK_FLAG_READ_ONLY) != 0;
        return view_from_dltensor(v, &mt->dl_tensor);
    }
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        mhk_DLManagedTensor* mt = PyCapsule_GetPointer(capsule, "dltensor");
        return view_from_dltensor(v, &mt->dl_tensor);
    }
    return NOT_HANDLED;
}

// ---------------------------------------------------------------------------------------------------------------
// Element types and layouts
// ---------------------------------------------------------------------------------------------------------------

// The kernel dtype of q's storage: float16 -> fp16, bfloat16 -> bf16, 16-bit integers with a 16-bit override; -1
// otherwise (fp8 inputs take the Python path).
static int kernel_dtype(const View* v, int override) {
    if (v->bits != 16) return -1;
    if (v->code == mhk_kDLFloat) return override < 0 || override == MHAKIT_DTYPE_FP16 ? MHAKIT_DTYPE_FP16 : -1;
    if (v->code == mhk_kDLBfloat) return override < 0 || override == MHAKIT_DTYPE_BF16 ? MHAKIT_DTYPE_BF16 : -1;
    if (v->code == mhk_kDLInt || v->code == mhk_kDLUInt)  // (an fp8 override goes to the Python path)
        return override == MHAKIT_DTYPE_FP16 || override == MHAKIT_DTYPE_BF16 ? override : -1;
    return -1;
}

static int same_storage(const View* a, const View* b) { return a->code == b->code && a->bits == b->bits; }
static int is_f32(const View* v) { return v->code == mhk_kDLFloat && v->bits == 32; }

static int64_t numel(const View* v) {
    int64_t n = 1;
    for (int i = 0; i < v->ndim; ++i) n *= v->shape[i];
    return n;
}

static int fits_int(int64_t x) { return x >= 0 && x <= INT32_MAX; }

// Head dim contiguous (an empty array may report any strides, as CuPy does).
static int head_contiguous(const View* v) { return v->strides[v->ndim - 1] == 1 || numel(v) == 0; }

// An element stride as the C API takes it: the stride of a size-1 axis is never used for addressing, so it is
// normalised (a row stride to the padded head dim, so that the fast family's alignment guard holds).
static int api_stride(int64_t s, int64_t extent, int64_t row_align, int64_t* out) {
    if (extent <= 1) {
        *out = row_align && (s <= 0 || s % 8) ? (row_align + 7) / 8 * 8 : (s > 0 ? s : 0);
        return 1;
    }
    if (s < 0) return 0;
    *out = s;
    return 1;
}

enum { LAYOUT_BSHD = 0, LAYOUT_BHSD = 1, LAYOUT_PACKED = 2 };

// (batch, head, row) element strides of a [batch, heads, rows, hdim] tensor in the call's layout
// (packed: [tokens, heads, hdim], batch stride 0).
static int layout_strides(const View* v, int layout, int64_t heads, int64_t rows, int64_t hdim, int64_t out[3]) {
    if (layout == LAYOUT_PACKED) {
        out[0] = 0;
        return api_stride(v->strides[1], heads, 0, &out[1]) && api_stride(v->strides[0], rows, hdim, &out[2]);
    }
    const int head_axis = layout == LAYOUT_BSHD ? 2 : 1, row_axis = layout == LAYOUT_BSHD ? 1 : 2;
    return api_stride(v->strides[0], v->shape[0], 0, &out[0]) &&
           api_stride(v->strides[head_axis], heads, 0, &out[1]) &&
           api_stride(v->strides[row_axis], rows, hdim, &out[2]);
}

// (batch, head) element strides of an LSE [batch, heads, rows] (group mode: [heads, tokens], batch stride 0).
static int lse_strides(const View* lse, int group, int64_t b, int64_t heads, int64_t out[2]) {
    if (group) {
        out[0] = 0;
        return api_stride(lse->strides[0], heads, 0, &out[1]);
    }
    return api_stride(lse->strides[0], b, 0, &out[0]) && api_stride(lse->strides[1], heads, 0, &out[1]);
}

// The shape of a [batch, heads, rows, hdim] tensor in the call's layout; returns its ndim.
static int layout_shape(int layout, int64_t b, int64_t heads, int64_t rows, int64_t hdim, int64_t shape[MAXD]) {
    if (layout == LAYOUT_PACKED) {
        shape[0] = rows, shape[1] = heads, shape[2] = hdim;
        return 3;
    }
    shape[0] = b, shape[1] = layout == LAYOUT_BSHD ? rows : heads, shape[2] = layout == LAYOUT_BSHD ? heads : rows;
    shape[3] = hdim;
    return 4;
}

static int has_shape(const View* v, int ndim, const int64_t* shape) {
    if (v->ndim != ndim) return 0;
    for (int i = 0; i < ndim; ++i)
        if (v->shape[i] != shape[i]) return 0;
    return 1;
}

// ---------------------------------------------------------------------------------------------------------------
// One call: its arrays, device, stream and outputs
// ---------------------------------------------------------------------------------------------------------------

#define MAX_ARRAYS 16

typedef struct {
    View views[MAX_ARRAYS];
    int nviews;
    int device;
    int64_t stream;
    int stream_given;
    PyObject* stream_obj;     // borrowed: the caller's stream= (None when not given)
    int64_t producer_stream;  // the exchange producer's current stream (ordered before ours when they differ)
    int has_producer_stream;
    int capturing;            // the caller's stream is being captured into a CUDA graph
    int override;
} Call;

// Releasing a capsule may run its producer's Python destructor: keep a pending exception across it.
static void call_release(Call* c) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    for (int i = 0; i < c->nviews; ++i) view_release(&c->views[i]);
    c->nviews = 0;
    PyErr_Restore(type, value, traceback);
}

static int parse_stream(PyObject* s, int64_t* out) {
    PyObject* value = NULL;
    if (PyLong_CheckExact(s)) {
        value = s;
        Py_INCREF(value);
    } else if (!PyBool_Check(s) && !PyFloat_Check(s) && !PyUnicode_Check(s)) {
        value = PyObject_GetAttrString(s, "cuda_stream");  // torch.cuda.Stream
        if (value == NULL) {
            PyErr_Clear();
            value = PyObject_GetAttrString(s, "ptr");  // cupy.cuda.Stream
        }
        if (value == NULL) PyErr_Clear();
        if (value != NULL && !PyLong_Check(value)) Py_CLEAR(value);
    }
    if (value == NULL) return NOT_HANDLED;
    const long long x = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (x < 0 || PyErr_Occurred()) {
        PyErr_Clear();
        return NOT_HANDLED;
    }
    *out = x;
    return HANDLED;
}

static int call_init(Call* c, PyObject* stream, PyObject* override) {
    memset(c, 0, sizeof(*c));
    c->device = -1;
    c->stream_obj = Py_None;
    c->override = override == Py_None ? -1 : (int)PyLong_AsLong(override);
    if (stream != Py_None) {
        if (parse_stream(stream, &c->stream) != HANDLED) return NOT_HANDLED;
        c->stream_given = 1;
        c->stream_obj = stream;
        c->capturing = stream_capturing(c->stream);
    }
    return HANDLED;
}

// Reads one array (None -> NULL). All arrays of a call must be CUDA arrays of one device. The first array decides
// the stream when none was given: the producer's current stream if it publishes an exchange table, else the legacy
// default stream (as before, for producers reached through __dlpack__).
static int call_read(Call* c, PyObject* obj, View** out) {
    *out = NULL;
    if (obj == Py_None) return HANDLED;
    if (c->nviews == MAX_ARRAYS) return NOT_HANDLED;
    View* v = &c->views[c->nviews];
    const int rc = view_read(obj, c->capturing ? -1 : c->stream, v);
    ++c->nviews;  // released with the call whatever happened
    if (rc != HANDLED) return rc;
    if (!on_cuda(v->dev_type) || v->ndim < 1) return NOT_HANDLED;
    if (c->device < 0) c->device = v->dev_id;
    else if (v->dev_id != c->device) return NOT_HANDLED;
    if (v->api != NULL && !c->has_producer_stream) {
        void* s = NULL;
        if (v->api->current_work_stream(mhk_kDLCUDA, v->dev_id, &s) != 0) {
            PyErr_Clear();
            return NOT_HANDLED;
        }
        c->producer_stream = (int64_t)(intptr_t)s;
        c->has_producer_stream = 1;
        if (!c->stream_given) c->stream = c->producer_stream, c->capturing = stream_capturing(c->stream);
    }
    *out = v;
    return HANDLED;
}

typedef struct {
    const char* message;
} AllocError;

static void alloc_set_error(void* ctx, const char* kind, const char* message) {
    (void)kind;
    ((AllocError*)ctx)->message = message;
}

// A new output: through the exchange table of `like`'s producer (its allocator: a torch caller gets a torch
// tensor), else through mhakit's Python allocator (a mhakit.DeviceArray on the call's stream).
static int call_allocate(Call* c, const View* like, int ndim, const int64_t* shape, uint8_t code, uint8_t bits,
                         PyObject** out_obj, View** out_view) {
    *out_obj = NULL;
    *out_view = NULL;
    if (c->nviews == MAX_ARRAYS) return NOT_HANDLED;
    View* v = &c->views[c->nviews];
    memset(v, 0, sizeof(*v));
    if (like->api != NULL && like->api->managed_tensor_allocator != NULL &&
        like->api->managed_tensor_to_py_object_no_sync != NULL) {
        int64_t shp[MAXD];
        memcpy(shp, shape, sizeof(int64_t) * ndim);
        mhk_DLTensor proto;
        memset(&proto, 0, sizeof(proto));
        proto.device.device_type = like->dev_type;
        proto.device.device_id = c->device;
        proto.ndim = ndim;
        proto.dtype.code = code;
        proto.dtype.bits = bits;
        proto.dtype.lanes = 1;
        proto.shape = shp;
        AllocError err = {NULL};
        mhk_DLManagedTensorVersioned* mt = NULL;
        if (like->api->managed_tensor_allocator(&proto, &mt, &err, alloc_set_error) != 0 || mt == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_MemoryError, "allocating an output of the call failed: %s",
                             err.message ? err.message : "the array library's allocator refused");
            return FAILED;
        }
        if (view_from_dltensor(v, &mt->dl_tensor) != HANDLED) {
            mt->deleter(mt);
            return NOT_HANDLED;
        }
        void* obj = NULL;
        if (like->api->managed_tensor_to_py_object_no_sync(mt, &obj) != 0) return FAILED;  // ownership was stolen
        *out_obj = (PyObject*)obj;
    } else {
        PyObject* tuple = PyTuple_New(ndim);
        if (tuple == NULL) return FAILED;
        for (int i = 0; i < ndim; ++i) PyTuple_SET_ITEM(tuple, i, PyLong_FromLongLong(shape[i]));
        const char* storage = code == mhk_kDLFloat ? (bits == 32 ? "float32" : "float16")
                              : code == mhk_kDLBfloat ? "bfloat16" : (code == mhk_kDLInt ? "int16" : "uint16");
        PyObject* obj = PyObject_CallFunction(g_allocate, "iOsLO", c->device, tuple, storage, (long long)c->stream,
                                              c->stream_obj);
        Py_DECREF(tuple);
        if (obj == NULL) return FAILED;
        PyObject* ptr = PyObject_GetAttrString(obj, "ptr");
        if (ptr == NULL) {
            Py_DECREF(obj);
            return FAILED;
        }
        v->ptr = (uintptr_t)PyLong_AsUnsignedLongLongMask(ptr);
        Py_DECREF(ptr);
        v->ndim = ndim;
        int64_t acc = 1;
        for (int i = ndim - 1; i >= 0; --i) v->shape[i] = shape[i], v->strides[i] = acc, acc *= shape[i] > 1 ? shape[i] : 1;
        v->code = code, v->bits = bits, v->dev_type = mhk_kDLCUDA, v->dev_id = c->device;
        *out_obj = obj;
    }
    ++c->nviews;
    *out_view = v;
    return HANDLED;
}

// ---------------------------------------------------------------------------------------------------------------
// The libraries: entry points resolved once per call signature
// ---------------------------------------------------------------------------------------------------------------

typedef float (*fwd_fn)(const mhakit_fwd_args*, const mhakit_stream_config*);
typedef float (*bwd_fn)(const mhakit_bwd_args*, const mhakit_stream_config*);
typedef size_t (*ws_fn)(const mhakit_bwd_args*);
typedef const char* (*err_fn)(void);
typedef float (*splitkv_fn)(const mhakit_fwd_splitkv_args*, const mhakit_stream_config*);
typedef float (*acc_fn)(const mhakit_fwd_splitkv_args*, size_t*, size_t*, int*);

enum { API_FWD = 0, API_BWD = 1, API_SPLITKV = 2 };
static const char* const k_api_names[] = {"fwd", "bwd", "splitkv"};

typedef struct {
    int api, device, dtype, hdim_q, hdim_v, group, masked, mods;  // mods: the score modifiers (mhakit_score_mod bits)
    void* run;
    err_fn last_error;
    void* aux;  // bwd: the workspace size (ws_fn); splitkv: the accumulator size (acc_fn)
} Library;

#define MAX_LIBS 128
static Library g_libs[MAX_LIBS];
static int g_nlibs;

// NULL with NotImplemented semantics (*handled = 0) when mhakit.jit says the head dims are not served.
static const Library* library_for(int api, int device, int dtype, int hdim_q, int hdim_v, int group, int masked,
                                  int mods, int* rc) {
    for (int i = 0; i < g_nlibs; ++i) {
        const Library* l = &g_libs[i];
        if (l->api == api && l->device == device && l->dtype == dtype && l->hdim_q == hdim_q &&
            l->hdim_v == hdim_v && l->group == group && l->masked == masked && l->mods == mods) {
            *rc = HANDLED;
            return l;
        }
    }
    PyObject* r = PyObject_CallFunction(g_resolve, "sisiisOi", k_api_names[api], device,
                                        dtype == MHAKIT_DTYPE_BF16 ? "bf16" : "fp16", hdim_q, hdim_v,
                                        group ? "group" : "batch", masked ? Py_True : Py_False, mods);
    if (r == NULL) {
        *rc = FAILED;
        return NULL;
    }
    if (r == Py_None) {
        Py_DECREF(r);
        *rc = NOT_HANDLED;
        return NULL;
    }
    unsigned long long run = 0, err = 0, ws = 0;
    const int ok = PyArg_ParseTuple(r, "KKK", &run, &err, &ws);
    Py_DECREF(r);
    if (!ok || run == 0 || err == 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "mhakit: the library resolver returned no entry points");
        *rc = FAILED;
        return NULL;
    }
    Library l = {api, device, dtype, hdim_q, hdim_v, group, masked, mods, (void*)(uintptr_t)run,
                 (err_fn)(uintptr_t)err, (void*)(uintptr_t)ws};
    *rc = HANDLED;
    if (g_nlibs < MAX_LIBS) {
        g_libs[g_nlibs] = l;
        return &g_libs[g_nlibs++];
    }
    static Library spill;  // more signatures than slots: serve this one uncached
    spill = l;
    return &spill;
}

static int library_error(const Library* lib, float code) {
    const char* msg = lib->last_error();
    return raise_from(g_make_error, Py_BuildValue("(is)", (int)lrintf(code), msg ? msg : ""));
}

static void flush_log(int log_level) {
    if (log_level > 0) fflush(stdout);
}

// ---------------------------------------------------------------------------------------------------------------
// Shared argument reading: q, k, v of batch or packed layout
// ---------------------------------------------------------------------------------------------------------------

typedef struct {
    View *q, *k, *v;
    int layout, dtype;
    int64_t b, sq, sk, hq, hk, d, dv;  // packed: b = number of sequences, sq / sk = total tokens
    int64_t qs[3], ks[3], vs[3];
    View *cu_q, *cu_k;
    int max_q, max_k;
} Inputs;

static int read_inputs(Call* c, Inputs* in, PyObject* const* args /* q, k, v */, int layout, PyObject* cu_q,
                       PyObject* cu_k, PyObject* max_q, PyObject* max_k) {
    int rc;
    in->layout = layout;
    if ((rc = call_read(c, args[0], &in->q)) != HANDLED || (rc = call_read(c, args[1], &in->k)) != HANDLED ||
        (rc = call_read(c, args[2], &in->v)) != HANDLED)
        return rc;
    if (in->q == NULL || in->k == NULL || in->v == NULL) return NOT_HANDLED;
    const int ndim = layout == LAYOUT_PACKED ? 3 : 4;
    if (in->q->ndim != ndim || in->k->ndim != ndim || in->v->ndim != ndim) return NOT_HANDLED;
    in->dtype = kernel_dtype(in->q, c->override);
    if (in->dtype < 0 || !same_storage(in->q, in->k) || !same_storage(in->q, in->v)) return NOT_HANDLED;
    const int64_t *q = in->q->shape, *k = in->k->shape, *v = in->v->shape;
    if (layout == LAYOUT_PACKED) {
        in->sq = q[0], in->hq = q[1], in->d = q[2], in->sk = k[0], in->hk = k[1], in->dv = v[2];
        if (k[2] != in->d || v[0] != in->sk || v[1] != in->hk) return NOT_HANDLED;
    } else {
        const int s = layout == LAYOUT_BSHD ? 1 : 2, h = layout == LAYOUT_BSHD ? 2 : 1;
        in->b = q[0], in->sq = q[s], in->hq = q[h], in->d = q[3], in->sk = k[s], in->hk = k[h], in->dv = v[3];
        if (k[0] != in->b || v[0] != in->b || k[3] != in->d || v[s] != in->sk || v[h] != in->hk) return NOT_HANDLED;
    }
    if (in->hk < 1 || in->hq % in->hk || in->hq < 1 || !fits_int(in->b) || !fits_int(in->sq) || !fits_int(in->sk) ||
        !fits_int(in->hq) || !fits_int(in->d) || !fits_int(in->dv))
        return NOT_HANDLED;
    if (!head_contiguous(in->q) || !head_contiguous(in->k) || !head_contiguous(in->v)) return NOT_HANDLED;
    if (!layout_strides(in->q, layout, in->hq, in->sq, in->d, in->qs) ||
        !layout_strides(in->k, layout, in->hk, in->sk, in->d, in->ks) ||
        !layout_strides(in->v, layout, in->hk, in->sk, in->dv, in->vs))
        return NOT_HANDLED;
    if (layout != LAYOUT_PACKED) return HANDLED;
    // Group mode: device cu_seqlens (int32, contiguous, batch+1 each); host offsets are the Python path's.
    if ((rc = call_read(c, cu_q, &in->cu_q)) != HANDLED || (rc = call_read(c, cu_k, &in->cu_k)) != HANDLED) return rc;
    if (in->cu_q == NULL || in->cu_k == NULL) return NOT_HANDLED;
    for (View** cu = &in->cu_q; cu <= &in->cu_k; ++cu) {
        const View* s = *cu;
        if (s->ndim != 1 || s->shape[0] < 2 || s->code != mhk_kDLInt || s->bits != 32 || s->strides[0] != 1)
            return NOT_HANDLED;
    }
    if (in->cu_q->shape[0] != in->cu_k->shape[0] || !fits_int(in->cu_q->shape[0])) return NOT_HANDLED;
    in->b = in->cu_q->shape[0] - 1;
    long long mq = PyLong_CheckExact(max_q) ? PyLong_AsLongLong(max_q) : -1;
    long long mk = max_k == NULL ? 0 : (PyLong_CheckExact(max_k) ? PyLong_AsLongLong(max_k) : -1);
    if (PyErr_Occurred()) PyErr_Clear(), mq = -1;
    if (mq < 0 || mk < 0 || mq > INT32_MAX || mk > INT32_MAX) return NOT_HANDLED;
    in->max_q = (int)mq, in->max_k = (int)mk;
    return HANDLED;
}

// A caller's output: writable, of the expected shape and of `like`'s storage, head dim contiguous.
static int check_output(const View* o, int ndim, const int64_t* shape, const View* like) {
    return !o->readonly && has_shape(o, ndim, shape) && same_storage(o, like) && head_contiguous(o);
}

// The LSE of a call: [batch, heads, rows], in group mode [heads, tokens]; returns its ndim.
static int lse_shape_of(const Inputs* in, int64_t shape[MAXD]) {
    if (in->layout == LAYOUT_PACKED) {
        shape[0] = in->hq, shape[1] = in->sq;
        return 2;
    }
    shape[0] = in->b, shape[1] = in->hq, shape[2] = in->sq;
    return 3;
}

// An LSE array as the C API addresses it: that shape, fp32, rows contiguous (the API has no row stride).
static int lse_readable(const View* lse, int ndim, const int64_t* shape, int64_t rows) {
    return has_shape(lse, ndim, shape) && is_f32(lse) && (rows <= 1 || lse->strides[ndim - 1] == 1);
}

static int read_scale(PyObject* scale, int64_t d, float* out) {
    if (scale == Py_None) {
        *out = (float)(1.0 / sqrt((double)d));
        return HANDLED;
    }
    if (!PyFloat_CheckExact(scale) && !PyLong_CheckExact(scale)) return NOT_HANDLED;
    const double s = PyFloat_AsDouble(scale);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return NOT_HANDLED;
    }
    if (!isfinite(s) || s <= 0) return NOT_HANDLED;
    *out = (float)s;
    return HANDLED;
}

// What both directions take besides arrays: the call (stream, dtype override), the layout code, the mask (type,
// left, right) and one bool flag (forward: return_lse, backward: deterministic).
typedef struct {
    int layout, mask_type, left, right, flag;
} Options;

static int begin_call(Call* c, Options* o, PyObject* stream, PyObject* override, PyObject* const* layout_and_mask,
                      PyObject* flag) {
    int rc = call_init(c, stream, override);
    if (rc != HANDLED || (flag != Py_True && flag != Py_False)) return NOT_HANDLED;
    o->flag = flag == Py_True;
    o->layout = (int)PyLong_AsLong(layout_and_mask[0]);
    o->mask_type = (int)PyLong_AsLong(layout_and_mask[1]);
    o->left = (int)PyLong_AsLong(layout_and_mask[2]);
    o->right = (int)PyLong_AsLong(layout_and_mask[3]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return NOT_HANDLED;
    }
    return o->layout >= 0 && o->layout <= 2 ? HANDLED : NOT_HANDLED;
}

// The stream and device work shared by both directions, around the library call.
static int enter_call(Call* c, DeviceScope* scope) {
    if (device_enter(c->device, scope) != 0) return FAILED;
    if (c->stream_given && c->has_producer_stream && !c->capturing &&
        order_streams(c->producer_stream, c->stream) != 0) {
        device_exit(scope);
        return FAILED;
    }
    return 0;
}

// The call's stream configuration (its log level is the call's last argument), and its device made current (the
// producer's stream ordered before a given one, as enter_call does).
static int prepare_launch(Call* c, PyObject* log_level, mhakit_stream_config* sc, DeviceScope* scope) {
    const int level = (int)PyLong_AsLong(log_level);
    if (level == -1 && PyErr_Occurred()) return FAILED;
    const mhakit_stream_config config = {(void*)(intptr_t)c->stream, 0, level, 0, 1, 1};
    *sc = config;
    return enter_call(c, scope) != 0 ? FAILED : 0;
}

// The outputs of a forward call (O, and LSE when given or wanted): the caller's `out` / `lse_out` (a new reference to
// each; their views already read into *ov / *lv) or new arrays allocated like `like` (O in its storage, LSE fp32).
static int fwd_outputs(Call* c, const View* like, PyObject* out, PyObject* lse_out, int o_ndim, const int64_t* o_shape,
                       int lse_ndim, const int64_t* lse_shape, int want_lse, View** ov, View** lv, PyObject** o_obj,
                       PyObject** lse_obj) {
    int rc;
    if (*ov == NULL) {
        if ((rc = call_allocate(c, like, o_ndim, o_shape, like->code, like->bits, o_obj, ov)) != HANDLED) return rc;
    } else {
        *o_obj = Py_NewRef(out);
    }
    if (*lv == NULL && want_lse) {
        if ((rc = call_allocate(c, like, lse_ndim, lse_shape, mhk_kDLFloat, 32, lse_obj, lv)) != HANDLED) return rc;
    } else if (*lv != NULL) {
        *lse_obj = Py_NewRef(lse_out);
    }
    return HANDLED;
}

// What a forward call returns: O, or (O, LSE) with return_lse.
static PyObject* fwd_result(PyObject* o_obj, PyObject* lse_obj, int return_lse) {
    return return_lse ? PyTuple_Pack(2, o_obj, lse_obj ? lse_obj : Py_None) : Py_NewRef(o_obj);
}

// ---------------------------------------------------------------------------------------------------------------
// Score modifiers: mods is None or (softcap, alibi_slopes, bias, sink[, dbias, dsink]) as mhakit.api passes them;
// what this path does not take (a varlen bias, shapes or dtypes the Python path refuses) goes back to Python.
// ---------------------------------------------------------------------------------------------------------------

typedef struct {
    float softcap;
    int bias_type, bias_fp32;
    uintptr_t bias, sink, dbias, dsink;
    int64_t bias_s[3], dbias_s[3];  // batch, head, row strides (elements)
} Mods;

static int read_mods(Call* c, PyObject* mods, const Inputs* in, int group, Mods* m) {
    memset(m, 0, sizeof(*m));
    if (mods == Py_None) return HANDLED;
    if (!PyTuple_CheckExact(mods)) return NOT_HANDLED;
    const Py_ssize_t n = PyTuple_GET_SIZE(mods);
    if (n != 4 && n != 6) return NOT_HANDLED;
    PyObject* cap = PyTuple_GET_ITEM(mods, 0);
    if (cap != Py_None) {
        if (!PyFloat_CheckExact(cap) && !PyLong_CheckExact(cap)) return NOT_HANDLED;
        const double v = PyFloat_AsDouble(cap);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return NOT_HANDLED;
        }
        if (!isfinite(v) || v < 0) return NOT_HANDLED;
        m->softcap = (float)v;
    }
    View *al = NULL, *bi = NULL, *sk = NULL, *db = NULL, *ds = NULL;
    int rc;
    if ((rc = call_read(c, PyTuple_GET_ITEM(mods, 1), &al)) != HANDLED ||
        (rc = call_read(c, PyTuple_GET_ITEM(mods, 2), &bi)) != HANDLED ||
        (rc = call_read(c, PyTuple_GET_ITEM(mods, 3), &sk)) != HANDLED)
        return rc;
    if (n == 6 && ((rc = call_read(c, PyTuple_GET_ITEM(mods, 4), &db)) != HANDLED ||
                   (rc = call_read(c, PyTuple_GET_ITEM(mods, 5), &ds)) != HANDLED))
        return rc;
    if (al != NULL && bi != NULL) return NOT_HANDLED;
    if (al != NULL) {  // float32 [h] or [b, h]
        const int two = al->ndim == 2;
        if (!is_f32(al) || al->ndim > 2 || al->shape[al->ndim - 1] != in->hq || (two && al->shape[0] != in->b))
            return NOT_HANDLED;
        m->bias_type = MHAKIT_BIAS_ALIBI, m->bias_fp32 = 1, m->bias = al->ptr;
        m->bias_s[0] = two && in->b > 1 ? al->strides[0] : 0;
        m->bias_s[1] = in->hq > 1 ? al->strides[al->ndim - 1] : 0;
    }
    if (bi != NULL) {  // [b|1, h|1, s_q, s_k], float32 or q's dtype, keys contiguous; batch mode only here
        if (group || bi->ndim != 4 || (bi->shape[0] != 1 && bi->shape[0] != in->b) ||
            (bi->shape[1] != 1 && bi->shape[1] != in->hq) || bi->shape[2] != in->sq || bi->shape[3] != in->sk ||
            (!is_f32(bi) && !same_storage(bi, in->q)) || (in->sk > 1 && bi->strides[3] != 1))
            return NOT_HANDLED;
        m->bias_type = MHAKIT_BIAS_ELEMENTWISE, m->bias_fp32 = is_f32(bi), m->bias = bi->ptr;
        for (int i = 0; i < 3; ++i) m->bias_s[i] = bi->shape[i] == 1 ? 0 : bi->strides[i];
    }
    if (sk != NULL) {
        if (!is_f32(sk) || sk->ndim != 1 || sk->shape[0] != in->hq || (in->hq > 1 && sk->strides[0] != 1))
            return NOT_HANDLED;
        m->sink = sk->ptr;
    }
    if (db != NULL) {  // [b, h, s_q, s_k] in the bias's dtype
        if (bi == NULL || db->readonly || db->ndim != 4 || db->shape[0] != in->b || db->shape[1] != in->hq ||
            db->shape[2] != in->sq || db->shape[3] != in->sk || !same_storage(db, bi) ||
            (in->sk > 1 && db->strides[3] != 1))
            return NOT_HANDLED;
        m->dbias = db->ptr;
        for (int i = 0; i < 3; ++i) m->dbias_s[i] = db->strides[i];
    }
    if (ds != NULL) {
        if (sk == NULL || ds->readonly || !is_f32(ds) || ds->ndim != 1 || ds->shape[0] != in->hq ||
            (in->hq > 1 && ds->strides[0] != 1))
            return NOT_HANDLED;
        m->dsink = ds->ptr;
    }
    return HANDLED;
}

// The score modifiers the call sets, as mhakit_score_mod bits (ScoreMods::kinds): the library resolver (mhakit.jit)
// builds the instances that serve them (catalogue score_mods). Dropout takes the Python path.
static int modifier_kinds(const Mods* m) {
    return (m->softcap > 0.f ? MHAKIT_MOD_SOFTCAP : 0) | (m->bias_type == MHAKIT_BIAS_ELEMENTWISE ? MHAKIT_MOD_BIAS : 0) |
           (m->bias_type == MHAKIT_BIAS_ALIBI ? MHAKIT_MOD_ALIBI : 0) | (m->sink != 0 ? MHAKIT_MOD_SINK : 0);
}

#define FILL_MODS(args, m)                                                                            \
    do {                                                                                              \
        (args).logits_soft_cap = (m).softcap, (args).bias_type = (m).bias_type;                       \
        (args).bias_fp32 = (m).bias_fp32, (args).bias_ptr = (const void*)(m).bias;                    \
        (args).batch_stride_bias = (m).bias_s[0], (args).nhead_stride_bias = (m).bias_s[1];           \
        (args).stride_bias = (m).bias_s[2], (args).sink_ptr = (const float*)(m).sink;                 \
    } while (0)

// ---------------------------------------------------------------------------------------------------------------
// fwd(q, k, v, out, lse_out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, layout, mask_type, left, right, scale,
//     return_lse, stream, dtype_override, mods, log_level) -> o | (o, lse) | NotImplemented
// ---------------------------------------------------------------------------------------------------------------

static PyObject* ext_fwd(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    (void)self;
    if (n != 18) {
        PyErr_SetString(PyExc_TypeError, "_mhakit_ext.fwd takes 18 arguments");
        return NULL;
    }
    Call c;
    Inputs in;
    Options opt;
    memset(&in, 0, sizeof(in));
    PyObject *o_obj = NULL, *lse_obj = NULL, *result = NULL;
    int rc = begin_call(&c, &opt, a[14], a[15], a + 8, a[13]);
    if (rc != HANDLED) goto not_handled;
    const int layout = opt.layout, return_lse = opt.flag;
    const int mask_type = opt.mask_type, left = opt.left, right = opt.right;
    float scale;
    if ((rc = read_inputs(&c, &in, a, layout, a[5], a[6], a[7], NULL)) != HANDLED) goto done_rc;
    if ((rc = read_scale(a[12], in.d, &scale)) != HANDLED) goto not_handled;
    const int group = layout == LAYOUT_PACKED;
    if (in.b == 0 || in.sq == 0 || (group && in.max_q == 0)) goto not_handled;  // empty: the Python path's

    // Outputs: the caller's (checked) or new ones.
    int64_t o_shape[MAXD], lse_shape[MAXD];
    const int o_ndim = layout_shape(layout, in.b, in.hq, in.sq, in.dv, o_shape);
    const int lse_ndim = lse_shape_of(&in, lse_shape);
    View *ov = NULL, *lv = NULL;
    if ((rc = call_read(&c, a[3], &ov)) != HANDLED || (rc = call_read(&c, a[4], &lv)) != HANDLED) goto done_rc;
    if (ov != NULL && !check_output(ov, o_ndim, o_shape, in.q)) goto not_handled;
    if (lv != NULL && (lv->readonly || !lse_readable(lv, lse_ndim, lse_shape, in.sq))) goto not_handled;
    int64_t os[3], ls[2] = {0, 0};
    if (ov != NULL && !layout_strides(ov, layout, in.hq, in.sq, in.dv, os)) goto not_handled;
    if (lv != NULL && !lse_strides(lv, group, in.b, in.hq, ls)) goto not_handled;
    Mods mods;
    if ((rc = read_mods(&c, a[16], &in, group, &mods)) != HANDLED) goto done_rc;
    // The library next (built on first use; None from the resolver: head dims it does not serve), then outputs.
    const Library* lib = library_for(API_FWD, c.device, in.dtype, (int)in.d, (int)in.dv, group, mask_type != 0,
                                     modifier_kinds(&mods), &rc);
    if (lib == NULL) goto done_rc;
    const int new_o = ov == NULL;
    if ((rc = fwd_outputs(&c, in.q, a[3], a[4], o_ndim, o_shape, lse_ndim, lse_shape, return_lse, &ov, &lv, &o_obj,
                          &lse_obj)) != HANDLED)
        goto done_rc;
    if (new_o) layout_strides(ov, layout, in.hq, in.sq, in.dv, os);


    mhakit_fwd_args f;
    memset(&f, 0, sizeof(f));
    f.data_type = (mhakit_dtype)in.dtype;
    f.is_group_mode = group;
    f.has_lse = lv != NULL;
    f.q_ptr = (const void*)in.q->ptr;
    f.k_ptr = (const void*)(in.k->ptr ? in.k->ptr : (group ? in.q->ptr : 0));
    f.v_ptr = (const void*)(in.v->ptr ? in.v->ptr : (group ? in.q->ptr : 0));
    f.o_ptr = (void*)ov->ptr;
    f.lse_ptr = lv ? (void*)lv->ptr : NULL;
    f.seqstart_q_ptr = group ? (const int32_t*)in.cu_q->ptr : NULL;
    f.seqstart_k_ptr = group ? (const int32_t*)in.cu_k->ptr : NULL;
    f.seqlen_q = (int)in.sq, f.seqlen_k = (int)in.sk, f.batch = (int)in.b;
    f.max_seqlen_q = group ? in.max_q : (int)in.sq;
    f.hdim_q = (int)in.d, f.hdim_v = (int)in.dv, f.nhead_q = (int)in.hq, f.nhead_k = (int)in.hk;
    f.scale_s = scale;
    f.batch_stride_q = in.qs[0], f.nhead_stride_q = in.qs[1], f.stride_q = in.qs[2];
    f.batch_stride_k = in.ks[0], f.nhead_stride_k = in.ks[1], f.stride_k = in.ks[2];
    f.batch_stride_v = in.vs[0], f.nhead_stride_v = in.vs[1], f.stride_v = in.vs[2];
    f.batch_stride_o = os[0], f.nhead_stride_o = os[1], f.stride_o = os[2];
    if (lv != NULL) {
        lse_strides(lv, group, in.b, in.hq, ls);  // checked above for the caller's; compact for a new one
        f.batch_stride_lse = ls[0], f.nhead_stride_lse = ls[1];
    }
    f.mask_type = mask_type, f.window_size_left = left, f.window_size_right = right;
    FILL_MODS(f, mods);

    mhakit_stream_config sc;
    DeviceScope scope;
    if (prepare_launch(&c, a[n - 1], &sc, &scope) != 0) goto fail;
    f.workspace_ptr = fwd_counter(c.device, c.stream);  // the tile counter (NULL: none, the one-tile grid)
    f.workspace_bytes = f.workspace_ptr != NULL ? kCounterBytes : 0;
    float ret;
    Py_BEGIN_ALLOW_THREADS
    ret = ((fwd_fn)lib->run)(&f, &sc);
    Py_END_ALLOW_THREADS
    device_exit(&scope);
    flush_log(sc.log_level);
    if (ret < 0) {
        library_error(lib, ret);
        goto fail;
    }
    result = fwd_result(o_obj, lse_obj, return_lse);
    goto fail;  // cleanup only

done_rc:
    if (rc == FAILED) goto fail;
not_handled:
    result = Py_NewRef(Py_NotImplemented);
fail:
    Py_XDECREF(o_obj);
    Py_XDECREF(lse_obj);
    call_release(&c);
    return result;
}

// ---------------------------------------------------------------------------------------------------------------
// bwd(do, q, k, v, o, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, mask_type,
//     left, right, scale, deterministic, stream, dtype_override, mods, log_level) -> (dq, dk, dv) | NotImplemented
// ---------------------------------------------------------------------------------------------------------------

static PyObject* ext_bwd(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    (void)self;
    if (n != 23) {
        PyErr_SetString(PyExc_TypeError, "_mhakit_ext.bwd takes 23 arguments");
        return NULL;
    }
    Call c;
    Inputs in;
    Options opt;
    memset(&in, 0, sizeof(in));
    PyObject* grads[3] = {NULL, NULL, NULL};
    PyObject* result = NULL;
    int rc = begin_call(&c, &opt, a[19], a[20], a + 13, a[18]);
    if (rc != HANDLED) goto not_handled;
    const int layout = opt.layout, deterministic = opt.flag;
    const int mask_type = opt.mask_type, left = opt.left, right = opt.right;
    float scale;
    if ((rc = read_inputs(&c, &in, a + 1, layout, a[9], a[10], a[11], a[12])) != HANDLED) goto done_rc;
    if ((rc = read_scale(a[17], in.d, &scale)) != HANDLED) goto not_handled;
    const int group = layout == LAYOUT_PACKED;
    if (in.b == 0 || (in.sq == 0 && in.sk == 0) || (group && in.max_q == 0 && in.max_k == 0)) goto not_handled;

    View *ov = NULL, *dov = NULL, *lv = NULL;
    if ((rc = call_read(&c, a[4], &ov)) != HANDLED || (rc = call_read(&c, a[0], &dov)) != HANDLED ||
        (rc = call_read(&c, a[5], &lv)) != HANDLED)
        goto done_rc;
    int64_t o_shape[MAXD], lse_shape[MAXD];
    const int o_ndim = layout_shape(layout, in.b, in.hq, in.sq, in.dv, o_shape);
    const int lse_ndim = lse_shape_of(&in, lse_shape);
    if (ov == NULL || dov == NULL || lv == NULL || !has_shape(ov, o_ndim, o_shape) ||
        !has_shape(dov, o_ndim, o_shape) || !same_storage(ov, in.q) || !same_storage(dov, in.q) ||
        !head_contiguous(ov) || !head_contiguous(dov) || !lse_readable(lv, lse_ndim, lse_shape, in.sq))
        goto not_handled;
    int64_t os[3], dos[3], ls[2];
    if (!layout_strides(ov, layout, in.hq, in.sq, in.dv, os) ||
        !layout_strides(dov, layout, in.hq, in.sq, in.dv, dos) || !lse_strides(lv, group, in.b, in.hq, ls))
        goto not_handled;

    // dq, dk, dv: the caller's or new ones, shaped like q, k, v.
    const int64_t heads[3] = {in.hq, in.hk, in.hk}, rows[3] = {in.sq, in.sk, in.sk}, hdims[3] = {in.d, in.d, in.dv};
    View* gv[3];
    int64_t gs[3][3], gshape[3][MAXD];
    int gndim[3];
    for (int i = 0; i < 3; ++i) {  // every caller's array is checked before anything is allocated
        gndim[i] = layout_shape(layout, in.b, heads[i], rows[i], hdims[i], gshape[i]);
        if ((rc = call_read(&c, a[6 + i], &gv[i])) != HANDLED) goto done_rc;
        if (gv[i] != NULL && (!check_output(gv[i], gndim[i], gshape[i], in.q) ||
                              !layout_strides(gv[i], layout, heads[i], rows[i], hdims[i], gs[i])))
            goto not_handled;
    }
    Mods mods;
    if ((rc = read_mods(&c, a[21], &in, group, &mods)) != HANDLED) goto done_rc;
    const Library* lib = library_for(API_BWD, c.device, in.dtype, (int)in.d, (int)in.dv, group, mask_type != 0,
                                     modifier_kinds(&mods), &rc);
    if (lib == NULL) goto done_rc;
    for (int i = 0; i < 3; ++i) {
        if (gv[i] != NULL) {
            grads[i] = Py_NewRef(a[6 + i]);
            continue;
        }
        rc = call_allocate(&c, in.q, gndim[i], gshape[i], in.q->code, in.q->bits, &grads[i], &gv[i]);
        if (rc != HANDLED) goto done_rc;
        layout_strides(gv[i], layout, heads[i], rows[i], hdims[i], gs[i]);
    }


    mhakit_bwd_args g;
    memset(&g, 0, sizeof(g));
    g.data_type = (mhakit_dtype)in.dtype;
    g.is_group_mode = group;
    g.deterministic = deterministic;
    // Group mode wants every pointer non-null; a side without tokens is never addressed.
    const uintptr_t stand_in = in.q->ptr ? in.q->ptr : (in.k->ptr ? in.k->ptr : lv->ptr);
#define PTR(view) ((view)->ptr ? (view)->ptr : (group ? stand_in : 0))
    g.q_ptr = (const void*)PTR(in.q), g.k_ptr = (const void*)PTR(in.k), g.v_ptr = (const void*)PTR(in.v);
    g.o_ptr = (const void*)PTR(ov), g.lse_ptr = (const void*)PTR(lv), g.do_ptr = (const void*)PTR(dov);
    g.dq_ptr = (void*)PTR(gv[0]), g.dk_ptr = (void*)PTR(gv[1]), g.dv_ptr = (void*)PTR(gv[2]);
#undef PTR
    g.seqstart_q_ptr = group ? (const int32_t*)in.cu_q->ptr : NULL;
    g.seqstart_k_ptr = group ? (const int32_t*)in.cu_k->ptr : NULL;
    g.seqlen_q = (int)in.sq, g.seqlen_k = (int)in.sk, g.batch = (int)in.b;
    g.max_seqlen_q = group ? in.max_q : (int)in.sq;
    g.max_seqlen_k = group ? in.max_k : (int)in.sk;
    g.hdim_q = (int)in.d, g.hdim_v = (int)in.dv, g.nhead_q = (int)in.hq, g.nhead_k = (int)in.hk;
    g.scale = scale;
    g.batch_stride_q = in.qs[0], g.nhead_stride_q = in.qs[1], g.stride_q = in.qs[2];
    g.batch_stride_k = in.ks[0], g.nhead_stride_k = in.ks[1], g.stride_k = in.ks[2];
    g.batch_stride_v = in.vs[0], g.nhead_stride_v = in.vs[1], g.stride_v = in.vs[2];
    g.batch_stride_o = os[0], g.nhead_stride_o = os[1], g.stride_o = os[2];
    g.batch_stride_do = dos[0], g.nhead_stride_do = dos[1], g.stride_do = dos[2];
    g.batch_stride_dq = gs[0][0], g.nhead_stride_dq = gs[0][1], g.stride_dq = gs[0][2];
    g.batch_stride_dk = gs[1][0], g.nhead_stride_dk = gs[1][1], g.stride_dk = gs[1][2];
    g.batch_stride_dv = gs[2][0], g.nhead_stride_dv = gs[2][1], g.stride_dv = gs[2][2];
    g.batch_stride_lse = ls[0], g.nhead_stride_lse = ls[1];
    g.mask_type = mask_type, g.window_size_left = left, g.window_size_right = right;
    FILL_MODS(g, mods);
    g.dbias_ptr = (void*)mods.dbias, g.dsink_ptr = (float*)mods.dsink;
    g.batch_stride_dbias = mods.dbias_s[0], g.nhead_stride_dbias = mods.dbias_s[1], g.stride_dbias = mods.dbias_s[2];

    const size_t need = ((ws_fn)(uintptr_t)lib->aux)(&g);
    if (need == 0) {
        const char* msg = lib->last_error();
        if (msg && msg[0]) {
            raise_from(g_make_error, Py_BuildValue("(is)", 0, msg));
            goto fail;
        }
    }
    mhakit_stream_config sc;
    DeviceScope scope;
    if (prepare_launch(&c, a[n - 1], &sc, &scope) != 0) goto fail;
    if (need > 0) {
        void* ws = NULL;
        if (workspace_get(c.device, need, c.stream, &ws) != 0) {
            device_exit(&scope);
            goto fail;
        }
        g.workspace_ptr = ws;
        g.workspace_bytes = need;
    }
    // The GIL stays held: the workspace's stream order (workspace_get) must be recorded and the launch queued
    // before another thread can take the same buffer.
    const float ret = ((bwd_fn)lib->run)(&g, &sc);
    const int recorded = need > 0 && ret >= 0 ? workspace_used(c.device, c.stream) : 0;
    device_exit(&scope);
    flush_log(sc.log_level);
    if (ret < 0) {
        library_error(lib, ret);
        goto fail;
    }
    if (recorded != 0) goto fail;
    result = PyTuple_Pack(3, grads[0], grads[1], grads[2]);
    goto fail;  // cleanup only

done_rc:
    if (rc == FAILED) goto fail;
not_handled:
    result = Py_NewRef(Py_NotImplemented);
fail:
    for (int i = 0; i < 3; ++i) Py_XDECREF(grads[i]);
    call_release(&c);
    return result;
}

// ---------------------------------------------------------------------------------------------------------------
// kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k, v, cache_batch_idx, out, lse_out, mask_type, left,
//         right, scale, num_splits, return_lse, stream, dtype_override, log_level) -> o | (o, lse) | NotImplemented
// Device arrays only (cache_seqlens / cache_batch_idx as int32 device vectors); ints, host sequences and every
// error are the Python path's. The split accumulators come from the per-device scratch buffer.
// ---------------------------------------------------------------------------------------------------------------

// An int32 device vector of `n` entries (contiguous).
static int int32_vector(const View* v, int64_t n) {
    return v->ndim == 1 && v->shape[0] == n && v->code == mhk_kDLInt && v->bits == 32 && (n <= 1 || v->strides[0] == 1);
}

static PyObject* ext_kvcache(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    (void)self;
    if (n != 19) {
        PyErr_SetString(PyExc_TypeError, "_mhakit_ext.kvcache takes 19 arguments");
        return NULL;
    }
    Call c;
    PyObject *o_obj = NULL, *lse_obj = NULL, *result = NULL;
    int rc = call_init(&c, a[16], a[17]);
    if (rc != HANDLED || (a[15] != Py_True && a[15] != Py_False) || !PyLong_CheckExact(a[14])) goto not_handled;
    const int return_lse = a[15] == Py_True;
    const int mask_type = (int)PyLong_AsLong(a[10]), left = (int)PyLong_AsLong(a[11]),
              right = (int)PyLong_AsLong(a[12]);
    const long num_splits = PyLong_AsLong(a[14]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        goto not_handled;
    }
    if (num_splits < 0 || num_splits > MHAKIT_MAX_SPLITS) goto not_handled;
    View *q, *kc, *vc, *seq, *bt, *kn, *vn, *idx;
    if ((rc = call_read(&c, a[0], &q)) != HANDLED || (rc = call_read(&c, a[1], &kc)) != HANDLED ||
        (rc = call_read(&c, a[2], &vc)) != HANDLED || (rc = call_read(&c, a[3], &seq)) != HANDLED ||
        (rc = call_read(&c, a[4], &bt)) != HANDLED || (rc = call_read(&c, a[5], &kn)) != HANDLED ||
        (rc = call_read(&c, a[6], &vn)) != HANDLED || (rc = call_read(&c, a[7], &idx)) != HANDLED)
        goto done_rc;
    if (q == NULL || kc == NULL || vc == NULL || seq == NULL || (kn == NULL) != (vn == NULL)) goto not_handled;
    if (q->ndim != 4 || kc->ndim != 4 || vc->ndim != 4) goto not_handled;
    const int dtype = kernel_dtype(q, c.override);
    if (dtype < 0 || !same_storage(q, kc) || !same_storage(q, vc)) goto not_handled;
    const int64_t b = q->shape[0], sq = q->shape[1], hq = q->shape[2], d = q->shape[3];
    const int64_t nbc = kc->shape[0], cap = kc->shape[1], hk = kc->shape[2], dv = vc->shape[3];
    if (kc->shape[3] != d || vc->shape[0] != nbc || vc->shape[1] != cap || vc->shape[2] != hk) goto not_handled;
    if (hk < 1 || hq < 1 || hq % hk || !fits_int(b) || !fits_int(sq) || !fits_int(hq) || !fits_int(d) ||
        !fits_int(dv) || !fits_int(cap))
        goto not_handled;
    if (!head_contiguous(q) || !head_contiguous(kc) || !head_contiguous(vc) || !int32_vector(seq, b)) goto not_handled;
    int64_t max_blocks = 0;
    if (bt != NULL) {
        if (idx != NULL || bt->ndim != 2 || bt->shape[0] != b || bt->code != mhk_kDLInt || bt->bits != 32 ||
            (bt->shape[1] > 1 && bt->strides[1] != 1))
            goto not_handled;
        max_blocks = bt->shape[1];
    } else if (idx != NULL ? !int32_vector(idx, b) : nbc != b) {
        goto not_handled;
    }
    int64_t s_new = 0;
    if (kn != NULL) {
        s_new = kn->shape[1];
        const int64_t kshape[4] = {b, s_new, hk, d}, vshape[4] = {b, s_new, hk, dv};
        if (!has_shape(kn, 4, kshape) || !has_shape(vn, 4, vshape) || !same_storage(q, kn) || !same_storage(q, vn) ||
            !head_contiguous(kn) || !head_contiguous(vn))
            goto not_handled;
    }
    const int64_t capacity = bt != NULL ? max_blocks * cap : cap;
    if (capacity + s_new > INT32_MAX) goto not_handled;
    float scale;
    if ((rc = read_scale(a[13], d, &scale)) != HANDLED) goto not_handled;
    if (b == 0 || (sq == 0 && s_new == 0)) goto not_handled;  // empty: the Python path's

    const int64_t o_shape[4] = {b, sq, hq, dv}, lse_shape[3] = {b, hq, sq};
    View *ov = NULL, *lv = NULL;
    if ((rc = call_read(&c, a[8], &ov)) != HANDLED || (rc = call_read(&c, a[9], &lv)) != HANDLED) goto done_rc;
    if (ov != NULL && !check_output(ov, 4, o_shape, q)) goto not_handled;
    if (lv != NULL && (lv->readonly || !lse_readable(lv, 3, lse_shape, sq))) goto not_handled;
    const Library* lib = library_for(API_SPLITKV, c.device, dtype, (int)d, (int)dv, 0, 1, 0, &rc);
    if (lib == NULL) goto done_rc;
    if ((rc = fwd_outputs(&c, q, a[8], a[9], 4, o_shape, 3, lse_shape, return_lse, &ov, &lv, &o_obj, &lse_obj)) !=
        HANDLED)
        goto done_rc;

    mhakit_fwd_splitkv_args f;
    memset(&f, 0, sizeof(f));
    f.data_type = (mhakit_dtype)dtype;
    f.has_lse = lv != NULL;
    f.q_ptr = (const void*)q->ptr;
    f.k_cache_ptr = (void*)kc->ptr;
    f.v_cache_ptr = (void*)vc->ptr;
    f.k_new_ptr = kn ? (const void*)kn->ptr : NULL;
    f.v_new_ptr = vn ? (const void*)vn->ptr : NULL;
    f.o_ptr = (void*)ov->ptr;
    f.lse_ptr = lv ? (void*)lv->ptr : NULL;
    f.seqlen_k_ptr = (const int32_t*)seq->ptr;
    f.block_table_ptr = bt ? (const int32_t*)bt->ptr : NULL;
    f.cache_batch_idx_ptr = idx ? (const int32_t*)idx->ptr : NULL;
    f.seqlen_q = (int)sq, f.seqlen_knew = (int)s_new, f.max_seqlen_k = (int)capacity, f.batch = (int)b;
    f.hdim_q = (int)d, f.hdim_v = (int)dv, f.nhead_q = (int)hq, f.nhead_k = (int)hk;
    f.page_block_size = bt ? (int)cap : 0;
    f.num_splits = (int)num_splits;
    f.scale_s = scale;
    // [batch, rows, heads, hdim] arrays: (batch, row, head) strides, the row stride normalised as the layouts' are
    int ok = api_stride(q->strides[0], b, 0, &f.batch_stride_q) && api_stride(q->strides[1], sq, d, &f.stride_q) &&
             api_stride(q->strides[2], hq, 0, &f.nhead_stride_q) &&
             api_stride(ov->strides[0], b, 0, &f.batch_stride_o) && api_stride(ov->strides[1], sq, dv, &f.stride_o) &&
             api_stride(ov->strides[2], hq, 0, &f.nhead_stride_o) &&
             api_stride(kc->strides[0], nbc, 0, &f.batch_stride_k) && api_stride(kc->strides[1], cap, d, &f.stride_k) &&
             api_stride(kc->strides[2], hk, 0, &f.nhead_stride_k) &&
             api_stride(vc->strides[0], nbc, 0, &f.batch_stride_v) &&
             api_stride(vc->strides[1], cap, dv, &f.stride_v) && api_stride(vc->strides[2], hk, 0, &f.nhead_stride_v);
    if (kn != NULL)
        ok = ok && api_stride(kn->strides[0], b, 0, &f.batch_stride_knew) &&
             api_stride(kn->strides[1], s_new, d, &f.stride_knew) &&
             api_stride(kn->strides[2], hk, 0, &f.nhead_stride_knew) &&
             api_stride(vn->strides[0], b, 0, &f.batch_stride_vnew) &&
             api_stride(vn->strides[1], s_new, dv, &f.stride_vnew) &&
             api_stride(vn->strides[2], hk, 0, &f.nhead_stride_vnew);
    if (bt != NULL) ok = ok && api_stride(bt->strides[0], b, 0, &f.batch_stride_block_table);
    if (lv != NULL) {
        int64_t ls[2];
        ok = ok && lse_strides(lv, 0, b, hq, ls);
        f.batch_stride_lse = ls[0], f.nhead_stride_lse = ls[1];
    }
    if (!ok) goto not_handled;
    f.mask_type = mask_type, f.window_size_left = left, f.window_size_right = right;

    mhakit_stream_config sc;
    DeviceScope scope;
    if (prepare_launch(&c, a[n - 1], &sc, &scope) != 0) goto fail;
    size_t lse_bytes = 0, o_bytes = 0;
    int splits = 0;
    const float qrc = ((acc_fn)(uintptr_t)lib->aux)(&f, &lse_bytes, &o_bytes, &splits);  // reads the SM count
    if (qrc < 0) {
        device_exit(&scope);
        library_error(lib, qrc);
        goto fail;
    }
    const size_t lse_span = (lse_bytes + 255) & ~(size_t)255;
    if (lse_bytes > 0) {
        void* ws = NULL;
        if (workspace_get(c.device, lse_span + o_bytes, c.stream, &ws) != 0) {
            device_exit(&scope);
            goto fail;
        }
        f.lse_acc_ptr = ws;
        f.o_acc_ptr = (char*)ws + lse_span;
        f.num_splits = splits;  // the count the sizes were computed for
    }
    // The GIL stays held, as for the backward: the scratch buffer's stream order is recorded before another thread
    // can take it.
    const float ret = ((splitkv_fn)lib->run)(&f, &sc);
    const int recorded = lse_bytes > 0 && ret >= 0 ? workspace_used(c.device, c.stream) : 0;
    device_exit(&scope);
    flush_log(sc.log_level);
    if (ret < 0) {
        library_error(lib, ret);
        goto fail;
    }
    if (recorded != 0) goto fail;
    result = fwd_result(o_obj, lse_obj, return_lse);
    goto fail;  // cleanup only

done_rc:
    if (rc == FAILED) goto fail;
not_handled:
    result = Py_NewRef(Py_NotImplemented);
fail:
    Py_XDECREF(o_obj);
    Py_XDECREF(lse_obj);
    call_release(&c);
    return result;
}

// ---------------------------------------------------------------------------------------------------------------
// configure(resolve, allocate, make_error, cuda_error); workspace_bytes(device) for tests
// ---------------------------------------------------------------------------------------------------------------

static PyObject* ext_configure(PyObject* self, PyObject* args) {
    (void)self;
    PyObject *resolve, *allocate, *make_error, *cuda_error;
    if (!PyArg_ParseTuple(args, "OOOO", &resolve, &allocate, &make_error, &cuda_error)) return NULL;
    Py_XSETREF(g_resolve, Py_NewRef(resolve));
    Py_XSETREF(g_allocate, Py_NewRef(allocate));
    Py_XSETREF(g_make_error, Py_NewRef(make_error));
    Py_XSETREF(g_cuda_error, Py_NewRef(cuda_error));
    g_nlibs = 0;  // a new resolver may map signatures to other libraries
    Py_RETURN_NONE;
}

static PyObject* ext_workspace_bytes(PyObject* self, PyObject* arg) {
    (void)self;
    const long device = PyLong_AsLong(arg);
    if (device < 0 || device >= MAX_DEVICES) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "device ordinal out of range");
        return NULL;
    }
    return PyLong_FromSize_t(g_workspace[device].size);
}

static PyMethodDef methods[] = {
    {"fwd", (PyCFunction)(void (*)(void))ext_fwd, METH_FASTCALL, "The forward call path (see mhakit.api)."},
    {"bwd", (PyCFunction)(void (*)(void))ext_bwd, METH_FASTCALL, "The backward call path (see mhakit.api)."},
    {"kvcache", (PyCFunction)(void (*)(void))ext_kvcache, METH_FASTCALL,
     "The decode call path, mha_fwd_kvcache (see mhakit.api)."},
    {"configure", ext_configure, METH_VARARGS, "Set the Python callbacks."},
    {"workspace_bytes", ext_workspace_bytes, METH_O, "Bytes of the backward's workspace held for a device."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mhakit_ext", "mhakit's per-call path in C.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mhakit_ext(void) {
    s_dlpack = PyUnicode_InternFromString("__dlpack__");
    s_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    s_kwnames_full = Py_BuildValue("(ss)", "stream", "max_version");
    s_kwnames_stream = Py_BuildValue("(s)", "stream");
    s_version_1_0 = Py_BuildValue("(ii)", 1, 0);
    if (!s_dlpack || !s_dlpack_device || !s_kwnames_full || !s_kwnames_stream || !s_version_1_0) return NULL;
    return PyModule_Create(&module);
}
