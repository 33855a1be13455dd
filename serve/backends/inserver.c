/* torchship's in-server backend: a Triton backend library that runs torchship's Python backend code
 * (torchship_inserver.py beside this library) inside the Triton server process.
 *
 * Triton's python backend runs each model instance in a separate stub process and hands every request
 * over through shared memory: two more process wake-ups per request. This library embeds the serving
 * environment's Python interpreter instead; each instance thread takes the GIL, gives Python zero-copy
 * views of the request buffers, and copies the results into the response buffers. The model code and
 * its runtimes (ONNX Runtime, torch) release the GIL while they compute.
 *
 * The Triton C API declarations below are the subset this file calls (tritonserver.h and
 * tritonbackend.h, API major version 1), written out so the library builds with only Python's headers. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct TRITONSERVER_Error TRITONSERVER_Error;
typedef struct TRITONSERVER_Message TRITONSERVER_Message;
typedef struct TRITONBACKEND_Backend TRITONBACKEND_Backend;
typedef struct TRITONBACKEND_Model TRITONBACKEND_Model;
typedef struct TRITONBACKEND_ModelInstance TRITONBACKEND_ModelInstance;
typedef struct TRITONBACKEND_Request TRITONBACKEND_Request;
typedef struct TRITONBACKEND_Response TRITONBACKEND_Response;
typedef struct TRITONBACKEND_Input TRITONBACKEND_Input;
typedef struct TRITONBACKEND_Output TRITONBACKEND_Output;

enum { MEMORY_CPU = 0, MEMORY_GPU = 2 };                      /* TRITONSERVER_MemoryType */
enum { ERROR_INTERNAL = 1, ERROR_INVALID_ARG = 3, ERROR_UNSUPPORTED = 5 }; /* TRITONSERVER_Error_Code */
enum { KIND_GPU = 2 };                                        /* TRITONSERVER_InstanceGroupKind */
enum { RESPONSE_COMPLETE_FINAL = 1 };                         /* TRITONSERVER_ResponseCompleteFlag */
enum { REQUEST_RELEASE_ALL = 1 };                             /* TRITONSERVER_RequestReleaseFlag */
#define API_MAJOR 1u

extern TRITONSERVER_Error *TRITONSERVER_ErrorNew(int code, const char *msg);
extern void TRITONSERVER_ErrorDelete(TRITONSERVER_Error *error);
extern const char *TRITONSERVER_ErrorMessage(TRITONSERVER_Error *error);
extern const char *TRITONSERVER_DataTypeString(int datatype);
extern int TRITONSERVER_StringToDataType(const char *dtype);
extern TRITONSERVER_Error *TRITONSERVER_MessageSerializeToJson(TRITONSERVER_Message *m, const char **base, size_t *size);
extern TRITONSERVER_Error *TRITONSERVER_MessageDelete(TRITONSERVER_Message *m);
extern TRITONSERVER_Error *TRITONBACKEND_ApiVersion(uint32_t *major, uint32_t *minor);
extern TRITONSERVER_Error *TRITONBACKEND_BackendName(TRITONBACKEND_Backend *b, const char **name);
extern TRITONSERVER_Error *TRITONBACKEND_ModelName(TRITONBACKEND_Model *m, const char **name);
extern TRITONSERVER_Error *TRITONBACKEND_ModelVersion(TRITONBACKEND_Model *m, uint64_t *version);
extern TRITONSERVER_Error *TRITONBACKEND_ModelRepository(TRITONBACKEND_Model *m, int *artifact_type, const char **path);
extern TRITONSERVER_Error *TRITONBACKEND_ModelConfig(TRITONBACKEND_Model *m, uint32_t version, TRITONSERVER_Message **c);
extern TRITONSERVER_Error *TRITONBACKEND_ModelBackend(TRITONBACKEND_Model *m, TRITONBACKEND_Backend **b);
extern TRITONSERVER_Error *TRITONBACKEND_ModelInstanceKind(TRITONBACKEND_ModelInstance *i, int *kind);
extern TRITONSERVER_Error *TRITONBACKEND_ModelInstanceDeviceId(TRITONBACKEND_ModelInstance *i, int32_t *id);
extern TRITONSERVER_Error *TRITONBACKEND_ModelInstanceName(TRITONBACKEND_ModelInstance *i, const char **name);
extern TRITONSERVER_Error *TRITONBACKEND_ModelInstanceModel(TRITONBACKEND_ModelInstance *i, TRITONBACKEND_Model **m);
extern TRITONSERVER_Error *TRITONBACKEND_ModelInstanceState(TRITONBACKEND_ModelInstance *i, void **state);
extern TRITONSERVER_Error *TRITONBACKEND_ModelInstanceSetState(TRITONBACKEND_ModelInstance *i, void *state);
extern TRITONSERVER_Error *TRITONBACKEND_RequestInputCount(TRITONBACKEND_Request *r, uint32_t *count);
extern TRITONSERVER_Error *TRITONBACKEND_RequestInputByIndex(TRITONBACKEND_Request *r, uint32_t index,
                                                             TRITONBACKEND_Input **input);
extern TRITONSERVER_Error *TRITONBACKEND_InputProperties(TRITONBACKEND_Input *input, const char **name, int *datatype,
                                                         const int64_t **shape, uint32_t *dims, uint64_t *byte_size,
                                                         uint32_t *buffer_count);
extern TRITONSERVER_Error *TRITONBACKEND_InputBuffer(TRITONBACKEND_Input *input, uint32_t index, const void **buffer,
                                                     uint64_t *size, int *memory_type, int64_t *memory_type_id);
extern TRITONSERVER_Error *TRITONBACKEND_RequestOutputCount(TRITONBACKEND_Request *r, uint32_t *count);
extern TRITONSERVER_Error *TRITONBACKEND_RequestOutputName(TRITONBACKEND_Request *r, uint32_t index, const char **name);
extern TRITONSERVER_Error *TRITONBACKEND_RequestRelease(TRITONBACKEND_Request *r, uint32_t flags);
extern TRITONSERVER_Error *TRITONBACKEND_ResponseNew(TRITONBACKEND_Response **response, TRITONBACKEND_Request *r);
extern TRITONSERVER_Error *TRITONBACKEND_ResponseDelete(TRITONBACKEND_Response *response);
extern TRITONSERVER_Error *TRITONBACKEND_ResponseOutput(TRITONBACKEND_Response *response, TRITONBACKEND_Output **out,
                                                        const char *name, int datatype, const int64_t *shape,
                                                        uint32_t dims);
extern TRITONSERVER_Error *TRITONBACKEND_OutputBuffer(TRITONBACKEND_Output *out, void **buffer, uint64_t size,
                                                      int *memory_type, int64_t *memory_type_id);
extern TRITONSERVER_Error *TRITONBACKEND_ResponseSend(TRITONBACKEND_Response *response, uint32_t flags,
                                                      TRITONSERVER_Error *error);
extern TRITONSERVER_Error *TRITONBACKEND_ModelInstanceReportStatistics(TRITONBACKEND_ModelInstance *i,
                                                                       TRITONBACKEND_Request *r, bool success,
                                                                       uint64_t exec_start, uint64_t compute_start,
                                                                       uint64_t compute_end, uint64_t exec_end);
extern TRITONSERVER_Error *TRITONBACKEND_ModelInstanceReportBatchStatistics(TRITONBACKEND_ModelInstance *i,
                                                                            uint64_t batch_size, uint64_t exec_start,
                                                                            uint64_t compute_start,
                                                                            uint64_t compute_end, uint64_t exec_end);

#define CHECK(expr)                                  \
    do {                                             \
        TRITONSERVER_Error *err__ = (expr);          \
        if (err__ != NULL) return err__;             \
    } while (0)

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static PyObject *module = NULL; /* torchship_inserver */

/* Each instance thread keeps one Python thread state for its life: PyGILState_Ensure/Release would
 * create and destroy one on every execute. */
static __thread PyThreadState *thread_state = NULL;

static void take_gil(void) {
    if (thread_state == NULL) {
        PyGILState_Ensure(); /* a thread state for this thread, kept: the matching Release never comes */
    } else {
        PyEval_RestoreThread(thread_state);
    }
}

static void drop_gil(void) { thread_state = PyEval_SaveThread(); }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* steady_clock, as Triton's statistics expect */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The pending Python exception as a Triton error (the GIL must be held). */
static TRITONSERVER_Error *py_error(int code, const char *what) {
    char msg[2048];
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *text = value ? PyObject_Str(value) : NULL;
    const char *s = text ? PyUnicode_AsUTF8(text) : NULL;
    snprintf(msg, sizeof msg, "%s: %s%s%s", what, type ? ((PyTypeObject *)type)->tp_name : "error", s ? ": " : "",
             s ? s : "");
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();
    return TRITONSERVER_ErrorNew(code, msg);
}

/* Start the interpreter once per process, with this library's directory on sys.path, and import
 * torchship_inserver (which puts the serving environment's sys.path in place). */
static TRITONSERVER_Error *ensure_python(void) {
    TRITONSERVER_Error *err = NULL;
    pthread_mutex_lock(&init_lock);
    if (module != NULL) goto done;
    /* Triton opens backends with RTLD_LOCAL, so libpython's symbols are not global; extension modules
     * (numpy, torch) need them, so reopen libpython with RTLD_GLOBAL. */
    Dl_info info;
    if (!dladdr((void *)&Py_InitializeFromConfig, &info) || !dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)) {
        err = TRITONSERVER_ErrorNew(ERROR_INTERNAL, "torchship in-server backend: cannot make libpython global");
        goto done;
    }
    Dl_info self;
    char dir[4096];
    if (!dladdr((void *)&ensure_python, &self)) {
        err = TRITONSERVER_ErrorNew(ERROR_INTERNAL, "torchship in-server backend: cannot find its own path");
        goto done;
    }
    snprintf(dir, sizeof dir, "%s", self.dli_fname);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    bool started = false;
    if (!Py_IsInitialized()) {
        /* isolated (no PYTHON* variables, no user site), home from torchship serve, and no Python signal
         * handlers: Triton handles SIGINT/SIGTERM */
        PyConfig config;
        PyConfig_InitIsolatedConfig(&config);
        config.install_signal_handlers = 0;
        const char *home = getenv("TORCHSHIP_PYTHON_HOME");
        PyStatus status = PyStatus_Ok();
        if (home != NULL && *home != '\0') status = PyConfig_SetBytesString(&config, &config.home, home);
        if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
        PyConfig_Clear(&config);
        if (PyStatus_Exception(status)) {
            char msg[1024];
            snprintf(msg, sizeof msg, "torchship in-server backend: Python did not start: %s",
                     status.err_msg ? status.err_msg : "unknown error");
            err = TRITONSERVER_ErrorNew(ERROR_INTERNAL, msg);
            goto done;
        }
        started = true;
    }
    PyGILState_STATE gil = started ? PyGILState_UNLOCKED : PyGILState_Ensure();
    PyObject *path = PySys_GetObject("path"); /* borrowed */
    PyObject *d = PyUnicode_FromString(dir);
    if (path && d) PyList_Insert(path, 0, d);
    Py_XDECREF(d);
    module = PyImport_ImportModule("torchship_inserver");
    if (module == NULL) err = py_error(ERROR_INTERNAL, "torchship in-server backend: importing torchship_inserver");
    if (started)
        PyEval_SaveThread(); /* release the GIL taken by Py_InitializeEx; instance threads take it per call */
    else
        PyGILState_Release(gil);
done:
    pthread_mutex_unlock(&init_lock);
    return err;
}

TRITONSERVER_Error *TRITONBACKEND_Initialize(TRITONBACKEND_Backend *backend) {
    uint32_t major, minor;
    CHECK(TRITONBACKEND_ApiVersion(&major, &minor));
    if (major != API_MAJOR)
        return TRITONSERVER_ErrorNew(ERROR_UNSUPPORTED, "torchship in-server backend: Triton backend API major "
                                                        "version is not 1");
    (void)backend;
    return ensure_python();
}

TRITONSERVER_Error *TRITONBACKEND_Finalize(TRITONBACKEND_Backend *backend) {
    (void)backend; /* the interpreter lives until the process exits: finalizing it under torch is unsafe */
    return NULL;
}

/* Each instance owns one Python object (torchship_inserver.Instance). */
TRITONSERVER_Error *TRITONBACKEND_ModelInstanceInitialize(TRITONBACKEND_ModelInstance *instance) {
    TRITONBACKEND_Model *model;
    TRITONBACKEND_Backend *backend;
    const char *backend_name, *model_name, *instance_name, *repo, *json;
    uint64_t version;
    int artifact, kind;
    int32_t device;
    size_t json_size;
    TRITONSERVER_Message *config;
    CHECK(TRITONBACKEND_ModelInstanceModel(instance, &model));
    CHECK(TRITONBACKEND_ModelBackend(model, &backend));
    CHECK(TRITONBACKEND_BackendName(backend, &backend_name));
    CHECK(TRITONBACKEND_ModelName(model, &model_name));
    CHECK(TRITONBACKEND_ModelVersion(model, &version));
    CHECK(TRITONBACKEND_ModelRepository(model, &artifact, &repo));
    CHECK(TRITONBACKEND_ModelInstanceName(instance, &instance_name));
    CHECK(TRITONBACKEND_ModelInstanceKind(instance, &kind));
    CHECK(TRITONBACKEND_ModelInstanceDeviceId(instance, &device));
    CHECK(TRITONBACKEND_ModelConfig(model, 1, &config));
    TRITONSERVER_Error *err = TRITONSERVER_MessageSerializeToJson(config, &json, &json_size);
    if (err != NULL) {
        TRITONSERVER_MessageDelete(config);
        return err;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *obj = PyObject_CallMethod(module, "Instance", "ss#sKsssi", backend_name, json, (Py_ssize_t)json_size,
                                        repo, (unsigned long long)version, model_name, instance_name,
                                        kind == KIND_GPU ? "GPU" : "CPU", (int)device);
    err = obj == NULL ? py_error(ERROR_INVALID_ARG, model_name) : NULL;
    PyGILState_Release(gil);
    TRITONSERVER_MessageDelete(config);
    if (err != NULL) return err;
    return TRITONBACKEND_ModelInstanceSetState(instance, obj);
}

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceFinalize(TRITONBACKEND_ModelInstance *instance) {
    void *state;
    CHECK(TRITONBACKEND_ModelInstanceState(instance, &state));
    if (state == NULL) return NULL;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *r = PyObject_CallMethod((PyObject *)state, "finalize", NULL);
    if (r == NULL) PyErr_Clear();
    Py_XDECREF(r);
    Py_DECREF((PyObject *)state);
    PyGILState_Release(gil);
    return NULL;
}

/* Whether a floating-point buffer holds only finite values: NaN and Inf are the values whose exponent
 * bits are all set, so each element is one mask and compare. Types without NaN or Inf are finite. Done
 * here rather than with np.isfinite(x).all() in Python because this runs right after a model has swept
 * the caches, where numpy's ufunc machinery was the largest part of the backend's time before the model. */
#define ALL_FINITE(T, MASK)                                    \
    do {                                                       \
        T v, bad = 0;                                          \
        for (uint64_t i = 0; i + sizeof(T) <= size; i += sizeof(T)) { \
            memcpy(&v, p + i, sizeof(T)); /* unaligned-safe */ \
            bad |= (T)((v & (MASK)) == (MASK));                \
        }                                                      \
        return bad == 0;                                       \
    } while (0)

static bool all_finite(const char *dtype, const char *p, uint64_t size) {
    if (strcmp(dtype, "FP32") == 0) ALL_FINITE(uint32_t, 0x7F800000u);
    if (strcmp(dtype, "FP16") == 0) ALL_FINITE(uint16_t, 0x7C00u);
    if (strcmp(dtype, "BF16") == 0) ALL_FINITE(uint16_t, 0x7F80u);
    if (strcmp(dtype, "FP64") == 0) ALL_FINITE(uint64_t, 0x7FF0000000000000ull);
    return true;
}

/* One request's inputs as a tuple of (name, datatype, shape, memoryview, finite); NULL with a Python
 * exception set if the request cannot be read. finite: whether all_finite() holds for the data. */
static PyObject *request_inputs(TRITONBACKEND_Request *request) {
    uint32_t count;
    TRITONSERVER_Error *err = TRITONBACKEND_RequestInputCount(request, &count);
    if (err != NULL) {
        PyErr_Format(PyExc_ValueError, "%s", "cannot read the request's inputs");
        return NULL;
    }
    PyObject *inputs = PyTuple_New(count);
    for (uint32_t i = 0; inputs && i < count; i++) {
        TRITONBACKEND_Input *input;
        const char *name;
        int datatype;
        const int64_t *shape;
        uint32_t dims, buffers;
        uint64_t byte_size;
        if (TRITONBACKEND_RequestInputByIndex(request, i, &input) ||
            TRITONBACKEND_InputProperties(input, &name, &datatype, &shape, &dims, &byte_size, &buffers)) {
            PyErr_Format(PyExc_ValueError, "cannot read input %u", i);
            Py_CLEAR(inputs);
            break;
        }
        PyObject *dims_tuple = PyTuple_New(dims);
        for (uint32_t k = 0; k < dims; k++) PyTuple_SET_ITEM(dims_tuple, k, PyLong_FromLongLong(shape[k]));
        PyObject *data = NULL;
        const char *dtype = TRITONSERVER_DataTypeString(datatype);
        bool finite = true;
        if (buffers == 1) { /* the common case: one contiguous buffer, viewed in place */
            const void *buf;
            uint64_t size;
            int mtype = MEMORY_CPU;
            int64_t mid = 0;
            if (TRITONBACKEND_InputBuffer(input, 0, &buf, &size, &mtype, &mid) == NULL && mtype != MEMORY_GPU) {
                data = PyMemoryView_FromMemory((char *)buf, (Py_ssize_t)size, PyBUF_READ);
                finite = all_finite(dtype, buf, size);
            }
        } else { /* several buffers (or none): gather them into one bytes object */
            data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)byte_size);
            char *dst = data ? PyBytes_AS_STRING(data) : NULL;
            uint64_t off = 0;
            for (uint32_t b = 0; dst && b < buffers; b++) {
                const void *buf;
                uint64_t size;
                int mtype = MEMORY_CPU;
                int64_t mid = 0;
                if (TRITONBACKEND_InputBuffer(input, b, &buf, &size, &mtype, &mid) != NULL || mtype == MEMORY_GPU ||
                    off + size > byte_size) {
                    Py_CLEAR(data);
                    break;
                }
                memcpy(dst + off, buf, size);
                off += size;
            }
            if (dst != NULL && data != NULL) finite = all_finite(dtype, dst, off);
        }
        if (data == NULL) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "input '%s' is not in CPU memory", name);
            Py_DECREF(dims_tuple);
            Py_CLEAR(inputs);
            break;
        }
        PyTuple_SET_ITEM(inputs, i, Py_BuildValue("(ssNNO)", name, dtype, dims_tuple, data, finite ? Py_True : Py_False));
    }
    return inputs;
}

static bool requested(TRITONBACKEND_Request *request, const char *name) {
    uint32_t count;
    if (TRITONBACKEND_RequestOutputCount(request, &count) != NULL || count == 0) return true;
    for (uint32_t i = 0; i < count; i++) {
        const char *n;
        if (TRITONBACKEND_RequestOutputName(request, i, &n) == NULL && strcmp(n, name) == 0) return true;
    }
    return false;
}

/* Fill and send one response from a list of (name, datatype, shape, array); returns the error to send
 * instead, if any (the GIL must be held). */
static TRITONSERVER_Error *respond(TRITONBACKEND_Request *request, TRITONBACKEND_Response *response, PyObject *outs) {
    Py_ssize_t n = PySequence_Size(outs);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = PySequence_GetItem(outs, k);
        const char *name, *dtype;
        PyObject *shape, *array;
        if (item == NULL || !PyArg_ParseTuple(item, "ssOO", &name, &dtype, &shape, &array)) {
            Py_XDECREF(item);
            return py_error(ERROR_INTERNAL, "torchship in-server backend: bad output from execute()");
        }
        if (!requested(request, name)) {
            Py_DECREF(item);
            continue;
        }
        int64_t dims[16];
        Py_ssize_t nd = PySequence_Size(shape);
        for (Py_ssize_t d = 0; d < nd && d < 16; d++) {
            PyObject *v = PySequence_GetItem(shape, d);
            dims[d] = PyLong_AsLongLong(v);
            Py_XDECREF(v);
        }
        Py_buffer view;
        if (nd > 16 || PyObject_GetBuffer(array, &view, PyBUF_C_CONTIGUOUS) != 0) {
            Py_DECREF(item);
            return py_error(ERROR_INTERNAL, "torchship in-server backend: output is not a contiguous array");
        }
        TRITONBACKEND_Output *output;
        void *buf;
        int mtype = MEMORY_CPU;
        int64_t mid = 0;
        TRITONSERVER_Error *err = TRITONBACKEND_ResponseOutput(response, &output, name,
                                                               TRITONSERVER_StringToDataType(dtype), dims,
                                                               (uint32_t)nd);
        if (err == NULL) err = TRITONBACKEND_OutputBuffer(output, &buf, (uint64_t)view.len, &mtype, &mid);
        if (err == NULL && view.len > 0) {
            if (mtype == MEMORY_GPU)
                err = TRITONSERVER_ErrorNew(ERROR_UNSUPPORTED, "torchship in-server backend: GPU output buffers");
            else
                memcpy(buf, view.buf, (size_t)view.len);
        }
        PyBuffer_Release(&view);
        Py_DECREF(item);
        if (err != NULL) return err;
    }
    return NULL;
}

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceExecute(TRITONBACKEND_ModelInstance *instance,
                                                       TRITONBACKEND_Request **requests, const uint32_t count) {
    uint64_t exec_start = now_ns();
    void *state;
    CHECK(TRITONBACKEND_ModelInstanceState(instance, &state));
    TRITONBACKEND_Response **responses = calloc(count, sizeof *responses);
    TRITONSERVER_Error **errors = calloc(count, sizeof *errors);
    if (responses == NULL || errors == NULL) {
        free(responses);
        free(errors);
        return TRITONSERVER_ErrorNew(ERROR_INTERNAL, "torchship in-server backend: out of memory");
    }
    for (uint32_t r = 0; r < count; r++) TRITONBACKEND_ResponseNew(&responses[r], requests[r]);

    take_gil();
    PyObject *batch = PyList_New(count);
    for (uint32_t r = 0; batch && r < count; r++) {
        PyObject *inputs = request_inputs(requests[r]);
        if (inputs == NULL) {
            errors[r] = py_error(ERROR_INVALID_ARG, "bad request");
            inputs = Py_NewRef(Py_None);
        }
        PyList_SET_ITEM(batch, r, inputs);
    }
    unsigned long long compute_start = 0, compute_end = 0, batch_size = 0;
    PyObject *outs = NULL;
    PyObject *result = batch ? PyObject_CallMethod((PyObject *)state, "execute", "O", batch) : NULL;
    if (result == NULL || !PyArg_ParseTuple(result, "OKKK", &outs, &compute_start, &compute_end, &batch_size) ||
        !PyList_Check(outs) || PyList_GET_SIZE(outs) != (Py_ssize_t)count) {
        /* execute() itself failed (it answers bad requests and model failures per request instead) */
        TRITONSERVER_Error *e = py_error(ERROR_INTERNAL, "torchship in-server backend: execute() failed");
        for (uint32_t r = 0; r < count; r++)
            if (errors[r] == NULL) errors[r] = TRITONSERVER_ErrorNew(ERROR_INTERNAL, TRITONSERVER_ErrorMessage(e));
        TRITONSERVER_ErrorDelete(e);
        outs = NULL;
    }
    for (uint32_t r = 0; outs && r < count; r++) {
        if (errors[r] != NULL) continue;
        PyObject *o = PyList_GET_ITEM(outs, r); /* borrowed */
        if (PyUnicode_Check(o))
            errors[r] = TRITONSERVER_ErrorNew(ERROR_INVALID_ARG, PyUnicode_AsUTF8(o));
        else if (responses[r] != NULL)
            errors[r] = respond(requests[r], responses[r], o);
    }
    Py_XDECREF(result);
    Py_XDECREF(batch); /* drops the memoryviews onto the request buffers before the requests go */
    drop_gil();

    uint64_t exec_end = now_ns();
    if (compute_start == 0) compute_start = compute_end = exec_end;
    bool any = false;
    for (uint32_t r = 0; r < count; r++) {
        if (responses[r] != NULL) TRITONBACKEND_ResponseSend(responses[r], RESPONSE_COMPLETE_FINAL, errors[r]);
        TRITONBACKEND_ModelInstanceReportStatistics(instance, requests[r], errors[r] == NULL, exec_start,
                                                    compute_start, compute_end, exec_end);
        any = any || errors[r] == NULL;
        if (errors[r] != NULL) TRITONSERVER_ErrorDelete(errors[r]);
        TRITONBACKEND_RequestRelease(requests[r], REQUEST_RELEASE_ALL);
    }
    if (any)
        TRITONBACKEND_ModelInstanceReportBatchStatistics(instance, batch_size, exec_start, compute_start, compute_end,
                                                         exec_end);
    free(responses);
    free(errors);
    return NULL;
}
