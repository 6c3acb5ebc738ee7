/* A SHA-256 byte stream whose digest can be read after every hash block, in native code.
 *
 * kvproof's request hashes are the digests of one canonical byte stream taken after each hash
 * block's record (impl/hashing.py). From Python every block costs an update and a digest call
 * (~0.5 us each at H = 16, the whole budget); here one call absorbs a run of records and returns
 * their digests. The digests are exactly hashlib.sha256's (tests/impl/test_hashing.py compares
 * them); OpenSSL's SHA-256 uses the CPU's SHA extensions where present.
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_API_COMPAT 0x10100000L
#include <Python.h>
#include <openssl/sha.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    SHA256_CTX ctx;
} StreamObject;

static PyObject *stream_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_buffer data = {0};
    if (!PyArg_ParseTuple(args, "|y*:Sha256Stream", &data)) return NULL;
    StreamObject *self = (StreamObject *)type->tp_alloc(type, 0);
    if (self == NULL) { if (data.obj) PyBuffer_Release(&data); return NULL; }
    SHA256_Init(&self->ctx);
    if (data.obj) {
        SHA256_Update(&self->ctx, data.buf, (size_t)data.len);
        PyBuffer_Release(&data);
    }
    return (PyObject *)self;
}

static PyObject *stream_update(StreamObject *self, PyObject *arg) {
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0) return NULL;
    SHA256_Update(&self->ctx, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

static PyObject *digest_of(const SHA256_CTX *ctx) {
    SHA256_CTX copy = *ctx;  /* finalising consumes a context: finalise a copy */
    unsigned char out[SHA256_DIGEST_LENGTH];
    SHA256_Final(out, &copy);
    return PyBytes_FromStringAndSize((const char *)out, SHA256_DIGEST_LENGTH);
}

static PyObject *stream_digest(StreamObject *self, PyObject *Py_UNUSED(ignored)) {
    return digest_of(&self->ctx);
}

/* absorb_blocks(buffer, count, step, record, out): for i in range(count), absorb
 * buffer[i*step : i*step + record] and append the digest to the list `out`. */
static PyObject *stream_absorb_blocks(StreamObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t count, step, record;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "y*nnnO!:absorb_blocks", &data, &count, &step, &record, &PyList_Type, &out))
        return NULL;
    if (count < 0 || step < 0 || record < 0 || (count > 0 && (count - 1) * step + record > data.len)) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "absorb_blocks: %zd records of %zd bytes every %zd bytes overrun a %zd-byte buffer",
                     count, record, step, data.len);
        return NULL;
    }
    const unsigned char *buf = (const unsigned char *)data.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        SHA256_Update(&self->ctx, buf + i * step, (size_t)record);
        PyObject *d = digest_of(&self->ctx);
        if (d == NULL || PyList_Append(out, d) < 0) {
            Py_XDECREF(d);
            PyBuffer_Release(&data);
            return NULL;
        }
        Py_DECREF(d);
    }
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

static PyMethodDef stream_methods[] = {
    {"update", (PyCFunction)stream_update, METH_O, "Absorb bytes."},
    {"digest", (PyCFunction)stream_digest, METH_NOARGS, "SHA-256 of everything absorbed so far."},
    {"absorb_blocks", (PyCFunction)stream_absorb_blocks, METH_VARARGS,
     "absorb_blocks(buffer, count, step, record, out): absorb count records, appending each digest to out."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StreamType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvproof.impl._sha256_stream.Sha256Stream",
    .tp_basicsize = sizeof(StreamObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A SHA-256 stream whose digest can be read after every record.",
    .tp_new = stream_new,
    .tp_methods = stream_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sha256_stream", "Native SHA-256 stream for request block hashes.", -1, NULL,
};

PyMODINIT_FUNC PyInit__sha256_stream(void) {
    if (PyType_Ready(&StreamType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&StreamType);
    if (PyModule_AddObject(m, "Sha256Stream", (PyObject *)&StreamType) < 0) {
        Py_DECREF(&StreamType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
