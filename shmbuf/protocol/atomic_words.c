/*
 * atomic_words.c: the Python-facing C11 atomics on 8-byte words inside a
 * writable Python buffer (the mmap of a shmbuf segment), and the init of the
 * extension shmbuf.protocol._atomic, whose other sources are rate_gate.c,
 * appender.c and keyed_read.c.  Python has no atomics for shared memory, and
 * the lock-free index protocol (docs/design.md) needs fetch-add,
 * compare-and-swap and acquire/release ordering across processes.
 *
 * Every function names its memory order: load_acquire (acquire),
 * store_release (release), fetch_add (acq_rel), compare_exchange (seq_cst,
 * then a seq_cst fence on success), load_many (relaxed loads, then an acquire
 * fence), store_many (a release fence, then relaxed stores), and the three
 * fences.  Offsets must be 8-byte aligned and inside the buffer; anything else
 * raises ValueError before memory is touched.
 */
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "atomic_module.h"
#include <numpy/arrayobject.h>

/* load_acquire(buffer, offset) -> int */
static PyObject *
load_acquire(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "w*n", &view, &offset))
        return NULL;
    atomic_u64 *p = word_at(&view, offset);
    uint64_t v = p ? atomic_load_explicit(p, memory_order_acquire) : 0;
    PyBuffer_Release(&view);
    return p ? PyLong_FromUnsignedLongLong(v) : NULL;
}

/* store_release(buffer, offset, value) -> None */
static PyObject *
store_release(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset;
    unsigned long long value;
    if (!PyArg_ParseTuple(args, "w*nK", &view, &offset, &value))
        return NULL;
    atomic_u64 *p = word_at(&view, offset);
    if (p)
        atomic_store_explicit(p, (uint64_t)value, memory_order_release);
    PyBuffer_Release(&view);
    if (!p)
        return NULL;
    Py_RETURN_NONE;
}

/* fetch_add(buffer, offset, delta) -> previous value; acq_rel */
static PyObject *
fetch_add(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset;
    unsigned long long delta;
    if (!PyArg_ParseTuple(args, "w*nK", &view, &offset, &delta))
        return NULL;
    atomic_u64 *p = word_at(&view, offset);
    uint64_t old = p ? atomic_fetch_add_explicit(p, (uint64_t)delta,
                                                 memory_order_acq_rel) : 0;
    PyBuffer_Release(&view);
    return p ? PyLong_FromUnsignedLongLong(old) : NULL;
}

/*
 * compare_exchange(buffer, offset, expected, desired) -> bool; seq_cst.
 * On success a seq_cst fence follows, so that the claim is ordered before
 * every later store of the caller, plain numpy stores included: this is the
 * writer half of the seqlock that readers validate against.
 */
static PyObject *
compare_exchange(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset;
    unsigned long long expected, desired;
    if (!PyArg_ParseTuple(args, "w*nKK", &view, &offset, &expected, &desired))
        return NULL;
    atomic_u64 *p = word_at(&view, offset);
    int ok = 0;
    if (p) {
        uint64_t e = (uint64_t)expected;
        ok = atomic_compare_exchange_strong_explicit(
            p, &e, (uint64_t)desired, memory_order_seq_cst, memory_order_seq_cst);
        if (ok)
            atomic_thread_fence(memory_order_seq_cst);
    }
    PyBuffer_Release(&view);
    if (!p)
        return NULL;
    return PyBool_FromLong(ok);
}

/* Checks that ``idx`` is a contiguous int64 buffer of offsets. */
static int
get_offsets(PyObject *obj, Py_buffer *idx)
{
    if (PyObject_GetBuffer(obj, idx, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (idx->itemsize != 8 || idx->format == NULL ||
        (strcmp(idx->format, "q") != 0 && strcmp(idx->format, "l") != 0 &&
         strcmp(idx->format, "<q") != 0 && strcmp(idx->format, "<l") != 0)) {
        PyErr_SetString(PyExc_TypeError, "offsets must be a contiguous int64 array");
        PyBuffer_Release(idx);
        return -1;
    }
    return 0;
}

/*
 * load_many(buffer, offsets, out): out[i] = word at offsets[i], each a
 * relaxed atomic load, then one acquire fence, so that later reads see at
 * least what the stores published with release before these words.
 */
static PyObject *
load_many(PyObject *self, PyObject *args)
{
    Py_buffer view, idx, out;
    PyObject *idx_obj;
    if (!PyArg_ParseTuple(args, "w*Ow*", &view, &idx_obj, &out))
        return NULL;
    if (get_offsets(idx_obj, &idx) < 0) {
        PyBuffer_Release(&view);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t n = idx.len / 8;
    PyObject *result = NULL;
    if (out.len != idx.len) {
        PyErr_SetString(PyExc_ValueError, "out must hold one 8-byte word per offset");
        goto done;
    }
    const int64_t *offs = (const int64_t *)idx.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!word_at(&view, offs[i]))
            goto done;
    }
    uint64_t *dst = (uint64_t *)out.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        dst[i] = atomic_load_explicit(
            (atomic_u64 *)((char *)view.buf + offs[i]), memory_order_relaxed);
    atomic_thread_fence(memory_order_acquire);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&view);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&out);
    return result;
}

/*
 * store_many(buffer, offsets, values): one release fence, then a relaxed
 * atomic store of values[i] at offsets[i]; publishes everything the caller
 * wrote before the call.
 */
static PyObject *
store_many(PyObject *self, PyObject *args)
{
    Py_buffer view, idx, vals;
    PyObject *idx_obj;
    if (!PyArg_ParseTuple(args, "w*Oy*", &view, &idx_obj, &vals))
        return NULL;
    if (get_offsets(idx_obj, &idx) < 0) {
        PyBuffer_Release(&view);
        PyBuffer_Release(&vals);
        return NULL;
    }
    Py_ssize_t n = idx.len / 8;
    PyObject *result = NULL;
    if (vals.len != idx.len) {
        PyErr_SetString(PyExc_ValueError, "values must hold one 8-byte word per offset");
        goto done;
    }
    const int64_t *offs = (const int64_t *)idx.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!word_at(&view, offs[i]))
            goto done;
    }
    const uint64_t *src = (const uint64_t *)vals.buf;
    atomic_thread_fence(memory_order_release);
    for (Py_ssize_t i = 0; i < n; i++)
        atomic_store_explicit((atomic_u64 *)((char *)view.buf + offs[i]), src[i],
                              memory_order_relaxed);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&view);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&vals);
    return result;
}

static PyObject *
fence_acquire(PyObject *self, PyObject *unused)
{
    atomic_thread_fence(memory_order_acquire);
    Py_RETURN_NONE;
}

static PyObject *
fence_release(PyObject *self, PyObject *unused)
{
    atomic_thread_fence(memory_order_release);
    Py_RETURN_NONE;
}

static PyObject *
fence_seq_cst(PyObject *self, PyObject *unused)
{
    atomic_thread_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load_acquire", load_acquire, METH_VARARGS,
     "load_acquire(buffer, offset) -> int: 8-byte load, acquire order."},
    {"store_release", store_release, METH_VARARGS,
     "store_release(buffer, offset, value): 8-byte store, release order."},
    {"fetch_add", fetch_add, METH_VARARGS,
     "fetch_add(buffer, offset, delta) -> int: returns the old value; acq_rel."},
    {"compare_exchange", compare_exchange, METH_VARARGS,
     "compare_exchange(buffer, offset, expected, desired) -> bool: seq_cst, "
     "followed by a seq_cst fence on success."},
    {"load_many", load_many, METH_VARARGS,
     "load_many(buffer, offsets, out): relaxed loads into out, then an acquire fence."},
    {"store_many", store_many, METH_VARARGS,
     "store_many(buffer, offsets, values): a release fence, then relaxed stores."},
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(dst, src): copy src into dst (contiguous, equal sizes) with streaming "
     "stores where it pays, then a store fence."},
    {"keyed_take", keyed_take, METH_VARARGS,
     "keyed_take(buffer, count_offsets, base, count, lengths, ages, ring_len, columns, "
     "stale) -> int: a keyed-ring read's copies, then its staleness check (see keyed_read.c)."},
    {"fence_acquire", fence_acquire, METH_NOARGS, "Acquire fence."},
    {"fence_release", fence_release, METH_NOARGS, "Release fence."},
    {"fence_seq_cst", fence_seq_cst, METH_NOARGS, "Sequentially consistent fence."},
    SHM_READ_GEOMETRY_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmbuf.protocol._atomic",
    "C11 atomics on 8-byte words of a writable buffer.", -1, methods,
};

PyMODINIT_FUNC
PyInit__atomic(void)
{
    if (sizeof(atomic_u64) != 8 || ATOMIC_LLONG_LOCK_FREE != 2) {
        PyErr_SetString(PyExc_ImportError,
                        "shmbuf needs lock-free 8-byte atomics on this platform");
        return NULL;
    }
    {
        const uint16_t one = 1;
        if (*(const uint8_t *)&one != 1) {
            PyErr_SetString(PyExc_ImportError, "shmbuf needs a little-endian host");
            return NULL;
        }
    }
    import_array();
    if (PyType_Ready(&AppenderType) < 0 || PyType_Ready(&RateGateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&AppenderType);
    if (PyModule_AddObject(m, "Appender", (PyObject *)&AppenderType) < 0) {
        Py_DECREF(&AppenderType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&RateGateType);
    if (PyModule_AddObject(m, "RateGate", (PyObject *)&RateGateType) < 0) {
        Py_DECREF(&RateGateType);
        Py_DECREF(m);
        return NULL;
    }
    if (shm_geometry_export(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
