/*
 * A handful of C11 atomic operations on 8-byte words inside a writable
 * Python buffer (the mmap of a shmbuf segment).  Python has no atomics for
 * shared memory, and the lock-free index protocol (docs/design.md) needs
 * fetch-add, compare-and-swap and acquire/release ordering across processes.
 *
 * Every function names its memory order.  Offsets must be 8-byte aligned and
 * inside the buffer; anything else raises ValueError before memory is touched.
 * Two fast paths live here too, each with the protocol order of its Python
 * owner: the writer's (Appender, _ring.Streams) and a keyed-ring read's copies
 * (keyed_take, _keyed_ring.KeyWords.read).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/*
 * Copy n bytes of step data into the segment.  Rows of 1 KiB or more go
 * with non-temporal stores where the CPU has them (x86 SSE2): a writer
 * fills memory that it will not read again, and streaming stores skip
 * reading each destination line first, which doubles the copy rate into
 * cold memory on this project's VM (12 KiB rows: 2.1 -> 1.1 us).  They are
 * weakly ordered: every caller issues stream_fence() before the release
 * store that publishes the rows.  Returns 1 if it streamed.
 */
#define STREAM_MIN 1024
static inline int
copy_row(char *dst, const char *src, size_t n)
{
#if defined(__SSE2__)
    if (n >= STREAM_MIN && ((uintptr_t)dst & 15) == 0) {
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, n - i);
        return 1;
    }
#endif
    memcpy(dst, src, n);
    return 0;
}

/* Orders streaming stores before later stores (the publishing release store). */
static inline void
stream_fence(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

typedef _Atomic uint64_t atomic_u64;

static atomic_u64 *
word_at(Py_buffer *view, Py_ssize_t offset)
{
    if (offset < 0 || offset % 8 != 0 || offset > view->len - 8) {
        PyErr_Format(PyExc_ValueError,
                     "offset %zd is not an aligned 8-byte word inside a "
                     "buffer of %zd bytes", offset, view->len);
        return NULL;
    }
    return (atomic_u64 *)((char *)view->buf + offset);
}

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

/*
 * RateGate: the rate limiter's two admissions (docs/design.md, "The rate
 * limiter"), one for each side, on the words whose offsets _ring.RateWords
 * gives it (from _layout): the step clock, the replayed budget, and the
 * limiter's flags, train ratio and min_steps (constants), tolerance (set
 * once) and inserted base (set by a restore).  Ratio and tolerance are
 * IEEE doubles stored as their bits.  Counted inserts are
 * e = clock + base - min_steps; the band is
 *     -tolerance <= replayed - ratio * e <= tolerance.
 *   - insert(n) reserves n clock numbers by CAS if the first of them keeps
 *     the band's lower edge (or the writers are not limited, or min_steps
 *     is not reached): it returns the old clock, else -1.  Writers call it
 *     where they number their steps, before the publish; the Appender calls
 *     the same function.
 *   - replay(n) adds n to replayed by CAS if that keeps the upper edge:
 *     1; 0 while fewer than min_steps are inserted; 2 past the edge.
 * Each side only waits for the other side's word to grow, and reads it
 * before its CAS: a stale read is conservative, so the CAS keeps the band
 * exactly (a restore or a refund may leave it for a moment).
 */
#define RATE_BLOCK_WRITERS 2

typedef struct {
    Py_ssize_t clock, replayed, flags, ratio, min_steps, tolerance, base;
} RateOffs;

typedef struct {
    PyObject_HEAD
    Py_buffer mm;
    RateOffs o;
} RateGate;

static inline uint64_t
word(const char *mm, Py_ssize_t off)
{
    return atomic_load_explicit((atomic_u64 *)(mm + off), memory_order_acquire);
}

static inline double
word_double(const char *mm, Py_ssize_t off)
{
    uint64_t bits = word(mm, off);
    double d;
    memcpy(&d, &bits, 8);
    return d;
}

/* Does the step numbered t (the clock before it) keep the lower edge? */
static inline int
insert_fits(const char *mm, const RateOffs *o, uint64_t t)
{
    if (!(word(mm, o->flags) & RATE_BLOCK_WRITERS))
        return 1;
    uint64_t inserted = t + word(mm, o->base) + 1, m = word(mm, o->min_steps);
    if (inserted <= m)
        return 1;
    double replayed = (double)word(mm, o->replayed);
    return word_double(mm, o->ratio) * (double)(inserted - m)
        <= replayed + word_double(mm, o->tolerance);
}

static inline int64_t
rate_take_insert(char *mm, const RateOffs *o, uint64_t n)
{
    atomic_u64 *clock = (atomic_u64 *)(mm + o->clock);
    uint64_t t = atomic_load_explicit(clock, memory_order_relaxed);
    do {
        if (!insert_fits(mm, o, t))
            return -1;
    } while (!atomic_compare_exchange_weak_explicit(clock, &t, t + n, memory_order_acq_rel,
                                                    memory_order_relaxed));
    return (int64_t)t;
}

static int
rate_take_replay(char *mm, const RateOffs *o, uint64_t n)
{
    uint64_t inserted = word(mm, o->clock) + word(mm, o->base), m = word(mm, o->min_steps);
    if (inserted < m)
        return 0;
    double ratio = word_double(mm, o->ratio), tol = word_double(mm, o->tolerance);
    double counted = ratio * (double)(inserted - m);
    atomic_u64 *replayed = (atomic_u64 *)(mm + o->replayed);
    uint64_t r = atomic_load_explicit(replayed, memory_order_relaxed);
    do {
        if ((double)(r + n) - counted > tol)
            return 2;
    } while (!atomic_compare_exchange_weak_explicit(replayed, &r, r + n, memory_order_acq_rel,
                                                    memory_order_relaxed));
    return 1;
}

static void
rategate_dealloc(RateGate *self)
{
    if (self->mm.obj)
        PyBuffer_Release(&self->mm);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* RateGate(mm, (clock, replayed, flags, ratio, min_steps, tolerance, base) offsets) */
static PyObject *
rategate_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    PyObject *mm;
    RateOffs o;
    if (!PyArg_ParseTuple(args, "O(nnnnnnn)", &mm, &o.clock, &o.replayed, &o.flags, &o.ratio,
                          &o.min_steps, &o.tolerance, &o.base))
        return NULL;
    RateGate *self = (RateGate *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    if (PyObject_GetBuffer(mm, &self->mm, PyBUF_WRITABLE) < 0)
        goto fail;
    Py_ssize_t offs[] = {o.clock, o.replayed, o.flags, o.ratio, o.min_steps, o.tolerance, o.base};
    for (int i = 0; i < 7; i++)
        if (!word_at(&self->mm, offs[i]))
            goto fail;
    self->o = o;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static int
count_arg(PyObject *arg, uint64_t *n)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *n = (uint64_t)v;
    return 0;
}

static PyObject *
rategate_insert(RateGate *self, PyObject *arg)
{
    uint64_t n;
    if (count_arg(arg, &n) < 0)
        return NULL;
    return PyLong_FromLongLong(rate_take_insert((char *)self->mm.buf, &self->o, n));
}

static PyObject *
rategate_replay(RateGate *self, PyObject *arg)
{
    uint64_t n;
    if (count_arg(arg, &n) < 0)
        return NULL;
    return PyLong_FromLong(rate_take_replay((char *)self->mm.buf, &self->o, n));
}

static PyMethodDef rategate_methods[] = {
    {"insert", (PyCFunction)rategate_insert, METH_O,
     "insert(n) -> the clock before n reserved step numbers, or -1: the band refuses."},
    {"replay", (PyCFunction)rategate_replay, METH_O,
     "replay(n) -> 1: n replayed steps taken; 0: min_steps not inserted yet; 2: past the "
     "band's upper edge."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RateGateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuf.protocol._atomic.RateGate",
    .tp_basicsize = sizeof(RateGate),
    .tp_dealloc = (destructor)rategate_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The rate limiter's admissions: see _atomic.c.",
    .tp_methods = rategate_methods,
    .tp_new = rategate_new,
};

/*
 * Appender: the writer's fast path for `add` and `add_batch`.
 *
 * _ring.Streams.appender builds one per Streams object (a writer's stream,
 * or its n_envs streams) from the column views and the Streams' cursor
 * arrays, which it shares: fill, base, rows, count_off, ep and left are
 * read and advanced here and in _ring alike.  A call takes the keyword
 * dict of `add` / `add_batch` and either
 *   - returns -1 having published nothing: a column is missing or unknown, a
 *     value is not an exact ndarray (or numpy scalar) of its column's dtype
 *     and shape, nor a Python bool/int/float that the column holds exactly
 *     (_cast.scalar_fast_path's rules), a float done value is not exactly 0
 *     or 1, a stream's chunk is full, the
 *     buffer's closed word is set (the Python path decides what that means),
 *     or the rate limiter (`gate`) does not admit the first step now (checked
 *     before the copy, and again by the reserving CAS after it; only a lost
 *     race leaves written, unpublished rows, which the Python path rewrites).  The
 *     caller then takes the Python path, which makes every check and raises
 *     its errors, or claims the next chunk;
 *   - or copies every value into the stream's next row, stores the row's
 *     episode number in _ep, numbers the steps (a fetch-add on the header's
 *     clock, then each row's _t), counts the steps in the slot (release), and
 *     publishes the new counts (release; for many streams one release fence
 *     and relaxed stores), in _ring.Streams.publish's order.  It returns 1
 *     if the done column is true in a row (the caller ends those episodes),
 *     else 0.
 * It holds the mapping's buffer, so the memory stays mapped while it lives.
 */
typedef struct {
    PyObject *name;          /* the column's name */
    PyArray_Descr *descr;    /* its dtype */
    int ndim;                /* per-step ndim and shape */
    npy_intp dims[NPY_MAXDIMS];
    char *data;              /* row 0 of the column */
    npy_intp row_bytes, itemsize;
    char kind;               /* 'b', 'i', 'u', 'f': Python scalars are converted; 0: never */
} Col;

typedef struct {
    PyObject_HEAD
    Py_buffer mm;
    PyObject *keep;          /* the views and cursor arrays, kept alive */
    Py_ssize_t ncols, n;     /* columns; streams */
    Col *cols;
    int done;                /* index of the done column, -1 if none */
    char *ep_col;            /* the int64 _ep column */
    char *t_col;             /* the int64 _t column: each row's clock number */
    npy_intp capacity;
    int64_t *fill, *base, *rows, *count_off, *ep, *left;
    Py_ssize_t steps_off;    /* the slot's step counter */
    Py_ssize_t clock_off;    /* the header's clock */
    Py_ssize_t closed_off;   /* the header's closed word */
    const RateOffs *rate;    /* the rate limiter's words (the gate's), NULL: not limited */
} Appender;

static void
appender_dealloc(Appender *self)
{
    if (self->cols) {
        for (Py_ssize_t i = 0; i < self->ncols; i++) {
            Py_XDECREF(self->cols[i].name);
            Py_XDECREF(self->cols[i].descr);
        }
        PyMem_Free(self->cols);
    }
    if (self->mm.obj)
        PyBuffer_Release(&self->mm);
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A C-contiguous int64 (or uint8 for ep column) array's data, or NULL with an error. */
static char *
array_data(PyObject *o, int type, npy_intp min_len, const char *what)
{
    if (!PyArray_Check(o) || PyArray_TYPE((PyArrayObject *)o) != type
        || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o)
        || PyArray_SIZE((PyArrayObject *)o) < min_len) {
        PyErr_Format(PyExc_ValueError, "Appender: %s must be a contiguous array of "
                     "at least %zd items of the expected dtype", what, (Py_ssize_t)min_len);
        return NULL;
    }
    return PyArray_BYTES((PyArrayObject *)o);
}

/* Which Python scalars a column of `d` converts: its kind, or 0 for none. */
static char
scalar_kind(PyArray_Descr *d)
{
    if (!PyArray_ISNBO(d->byteorder))
        return 0;
    switch (d->type_num) {
    case NPY_BOOL: return 'b';
    case NPY_BYTE: case NPY_SHORT: case NPY_INT: case NPY_LONG: case NPY_LONGLONG:
        return 'i';
    case NPY_UBYTE: case NPY_USHORT: case NPY_UINT: case NPY_ULONG: case NPY_ULONGLONG:
        return 'u';
    case NPY_FLOAT: case NPY_DOUBLE: return 'f';
    default: return 0;
    }
}

/*
 * Appender(mm, names, views, ep_view, t_view, done, fill, base, rows, count_off, ep,
 *          left, steps_off, clock_off, closed_off[, gate])
 * gate: the writer's RateGate (kept alive in `keep`), or None.
 */
static PyObject *
appender_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    PyObject *names, *views, *ep_view, *t_view, *fill, *base, *rows, *count_off, *ep, *left, *mm;
    PyObject *gate = Py_None;
    int done;
    Py_ssize_t steps_off, clock_off, closed_off;
    if (!PyArg_ParseTuple(args, "OO!O!OOiOOOOOOnnn|O", &mm, &PyTuple_Type, &names, &PyTuple_Type,
                          &views, &ep_view, &t_view, &done, &fill, &base, &rows, &count_off,
                          &ep, &left, &steps_off, &clock_off, &closed_off, &gate))
        return NULL;
    if (gate != Py_None && !PyObject_TypeCheck(gate, &RateGateType)) {
        PyErr_SetString(PyExc_TypeError, "Appender: gate must be a RateGate or None");
        return NULL;
    }
    Appender *self = (Appender *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    if (PyObject_GetBuffer(mm, &self->mm, PyBUF_WRITABLE) < 0)
        goto fail;
    self->keep = Py_BuildValue("(OOOOOOOOOOO)", views, ep_view, t_view, fill, base, rows,
                               count_off, ep, left, names, gate);
    if (!self->keep)
        goto fail;
    if (gate != Py_None) {
        if (((RateGate *)gate)->mm.buf != self->mm.buf) {
            PyErr_SetString(PyExc_ValueError, "Appender: the gate is over another mapping");
            goto fail;
        }
        self->rate = &((RateGate *)gate)->o;
    }
    Py_ssize_t ncols = PyTuple_GET_SIZE(names);
    if (ncols != PyTuple_GET_SIZE(views) || done < -1 || done >= ncols) {
        PyErr_SetString(PyExc_ValueError, "Appender: names, views and done do not fit");
        goto fail;
    }
    self->n = PyArray_Check(fill) ? PyArray_SIZE((PyArrayObject *)fill) : 0;
    if (self->n < 1 || !(self->fill = (int64_t *)array_data(fill, NPY_INT64, self->n, "fill"))
        || !(self->base = (int64_t *)array_data(base, NPY_INT64, self->n, "base"))
        || !(self->rows = (int64_t *)array_data(rows, NPY_INT64, self->n, "rows"))
        || !(self->count_off = (int64_t *)array_data(count_off, NPY_INT64, self->n, "count_off"))
        || !(self->ep = (int64_t *)array_data(ep, NPY_INT64, self->n, "ep"))
        || !(self->left = (int64_t *)array_data(left, NPY_INT64, 1, "left"))
        || !(self->ep_col = array_data(ep_view, NPY_INT64, 1, "ep_view"))
        || !(self->t_col = array_data(t_view, NPY_INT64, 1, "t_view")))
        goto fail;
    self->capacity = PyArray_DIM((PyArrayObject *)ep_view, 0);
    if (PyArray_DIM((PyArrayObject *)t_view, 0) != self->capacity) {
        PyErr_SetString(PyExc_ValueError, "Appender: the _t view does not fit");
        goto fail;
    }
    if (steps_off < 0 || steps_off % 8 || steps_off > self->mm.len - 8
        || clock_off < 0 || clock_off % 8 || clock_off > self->mm.len - 8
        || closed_off < 0 || closed_off % 8 || closed_off > self->mm.len - 8) {
        PyErr_SetString(PyExc_ValueError, "Appender: an offset is not a word of the mapping");
        goto fail;
    }
    self->steps_off = steps_off;
    self->clock_off = clock_off;
    self->closed_off = closed_off;
    self->done = done;
    self->cols = PyMem_Calloc(ncols ? ncols : 1, sizeof(Col));
    if (!self->cols) {
        PyErr_NoMemory();
        goto fail;
    }
    self->ncols = ncols;
    for (Py_ssize_t i = 0; i < ncols; i++) {
        Col *c = &self->cols[i];
        PyObject *name = PyTuple_GET_ITEM(names, i), *view = PyTuple_GET_ITEM(views, i);
        if (!PyUnicode_Check(name) || !PyArray_Check(view)
            || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)view)
            || PyArray_NDIM((PyArrayObject *)view) < 1
            || PyArray_DIM((PyArrayObject *)view, 0) != self->capacity) {
            PyErr_SetString(PyExc_ValueError, "Appender: a column view does not fit");
            goto fail;
        }
        PyArrayObject *a = (PyArrayObject *)view;
        Py_INCREF(name);
        c->name = name;
        c->descr = PyArray_DESCR(a);
        Py_INCREF(c->descr);
        c->ndim = PyArray_NDIM(a) - 1;
        c->row_bytes = c->itemsize = PyArray_ITEMSIZE(a);
        for (int d = 0; d < c->ndim; d++) {
            c->dims[d] = PyArray_DIM(a, d + 1);
            c->row_bytes *= c->dims[d];
        }
        c->data = PyArray_BYTES(a);
        c->kind = scalar_kind(c->descr);
    }
    if (done >= 0 && (self->cols[done].kind == 0 || self->cols[done].ndim != 0)) {
        PyErr_SetString(PyExc_ValueError, "Appender: the done column must be a numeric scalar");
        goto fail;
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* Store the Python scalar v into out as column c's type; 0 if it does not fit exactly. */
static int
convert_scalar(const Col *c, PyObject *v, char *out, int *truth)
{
    int size = (int)c->itemsize;
    double x;
    long long i = 0;
    unsigned long long u = 0;
    int is_float = 0, negative = 0;
    if (PyBool_Check(v)) {
        i = u = v == Py_True;
    } else if (PyFloat_CheckExact(v)) {
        x = PyFloat_AS_DOUBLE(v);
        is_float = 1;
    } else if (PyLong_CheckExact(v)) {
        int overflow;
        i = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow < 0 || (i == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        if (overflow > 0) {
            u = PyLong_AsUnsignedLongLong(v);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            if (c->kind != 'u')
                return 0;
        } else {
            negative = i < 0;
            u = (unsigned long long)i;
        }
        if (c->kind == 'b')
            return 0;                       /* ints into bool take the Python path */
        if (c->kind == 'f') {               /* exact below 2**nmant */
            unsigned long long lim = size == 4 ? 1ULL << 23 : 1ULL << 52;
            if (overflow > 0 || (negative ? -(unsigned long long)i : u) > lim)
                return 0;
        }
    } else {
        return 0;
    }
    if (is_float) {
        *truth = x != 0.0;
        if (c->kind == 'b') {
            if (x != 0.0 && x != 1.0)
                return 0;
            *(npy_bool *)out = x != 0.0;
            return 1;
        }
        if (c->kind != 'f')
            return 0;
        if (size == 4) {
            if (fabs(x) > FLT_MAX && isfinite(x))
                return 0;
            float f = (float)x;
            memcpy(out, &f, 4);
        } else {
            memcpy(out, &x, 8);
        }
        return 1;
    }
    *truth = negative || u != 0;
    switch (c->kind) {
    case 'b':
        *(npy_bool *)out = u != 0;
        return 1;
    case 'f':
        if (size == 4) {
            float f = negative ? (float)i : (float)u;
            memcpy(out, &f, 4);
        } else {
            double d = negative ? (double)i : (double)u;
            memcpy(out, &d, 8);
        }
        return 1;
    case 'i': {
        long long lo = size == 8 ? LLONG_MIN : -(1LL << (8 * size - 1));
        long long hi = size == 8 ? LLONG_MAX : (1LL << (8 * size - 1)) - 1;
        if (!negative && u > (unsigned long long)hi)
            return 0;
        if (negative && i < lo)
            return 0;
        break;
    }
    case 'u':
        if (negative || (size < 8 && u >> (8 * size)))
            return 0;
        break;
    default:
        return 0;
    }
    /* little-endian host (checked at import): the low bytes are the value */
    memcpy(out, &u, size);
    return 1;
}

/* Is the stored scalar at p (column c's type) true? */
static int
truth_of(const Col *c, const char *p)
{
    if (c->kind == 'f') {
        float f;
        double d;
        if (c->itemsize == 4)
            return memcpy(&f, p, 4), f != 0.0f;
        return memcpy(&d, p, 8), d != 0.0;
    }
    for (npy_intp b = 0; b < c->itemsize; b++)
        if (p[b])
            return 1;
    return 0;
}

/* 1 if each of the n values of float column c at p is exactly 0 or 1 (a float done
 * column holds flags only: 0.5 or -3.0 must not end an episode; NaN is neither). */
static int
float_flags(const Col *c, const char *p, npy_intp n)
{
    for (npy_intp j = 0; j < n; j++, p += c->itemsize) {
        double x;
        if (c->itemsize == 4) {
            float f;
            memcpy(&f, p, 4);
            x = f;
        } else {
            memcpy(&x, p, 8);
        }
        if (x != 0.0 && x != 1.0)
            return 0;
    }
    return 1;
}

/*
 * Check value v of column c for `lead` rows (0: a single step) without
 * writing: 1 and *src = its bytes if it goes as it is, 0 if not.  Python
 * scalars are converted into `scratch` (16 bytes).
 */
static int
value_fits(const Col *c, PyObject *v, npy_intp lead, const char **src, char *scratch,
           int *truth)
{
    if (PyArray_CheckExact(v)) {
        PyArrayObject *a = (PyArrayObject *)v;
        int off = lead > 0;
        if (PyArray_NDIM(a) != c->ndim + off || !PyArray_IS_C_CONTIGUOUS(a))
            return 0;
        if (off && PyArray_DIM(a, 0) != lead)
            return 0;
        for (int d = 0; d < c->ndim; d++)
            if (PyArray_DIM(a, d + off) != c->dims[d])
                return 0;
        if (PyArray_DESCR(a) != c->descr && !PyArray_EquivTypes(PyArray_DESCR(a), c->descr))
            return 0;
        *src = PyArray_BYTES(a);
        *truth = -1;                                 /* read from the bytes */
        return 1;
    }
    if (lead > 0 || c->ndim != 0 || c->kind == 0)
        return 0;
    if (PyArray_IsScalar(v, Generic)) {
        PyArray_Descr *d = PyArray_DescrFromScalar(v);
        if (!d) {
            PyErr_Clear();
            return 0;
        }
        int same = d == c->descr || PyArray_EquivTypes(d, c->descr);
        Py_DECREF(d);
        if (!same)
            return 0;
        PyArray_ScalarAsCtype(v, scratch);
        *src = scratch;
        *truth = -1;
        return 1;
    }
    *src = scratch;
    return convert_scalar(c, v, scratch, truth);
}

#define MAX_FAST_COLUMNS 64

static PyObject *
append(Appender *self, PyObject *columns, int batch)
{
    if (!PyDict_CheckExact(columns) || PyDict_GET_SIZE(columns) != self->ncols
        || self->ncols > MAX_FAST_COLUMNS
        || atomic_load_explicit((atomic_u64 *)((char *)self->mm.buf + self->closed_off),
                                memory_order_relaxed))
        return PyLong_FromLong(-1);
    /* A step the rate limiter would make wait: the Python path waits (copying nothing here). */
    if (self->rate && !insert_fits((char *)self->mm.buf, self->rate, atomic_load_explicit(
            (atomic_u64 *)((char *)self->mm.buf + self->clock_off), memory_order_relaxed)))
        return PyLong_FromLong(-1);
    npy_intp n = batch ? self->n : 1;
    const char *src[MAX_FAST_COLUMNS];
    char scratch[MAX_FAST_COLUMNS][16];
    int truth = 0;
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        Col *c = &self->cols[i];
        PyObject *v = PyDict_GetItemWithError(columns, c->name);
        int t = 0;
        if (!v) {
            if (PyErr_Occurred())
                return NULL;
            return PyLong_FromLong(-1);
        }
        if (!value_fits(c, v, batch ? n : 0, &src[i], scratch[i], &t))
            return PyLong_FromLong(-1);
        if (i == self->done) {
            if (c->kind == 'f' && !float_flags(c, src[i], n))
                return PyLong_FromLong(-1);   /* the Python path names the value */
            truth = t;
        }
    }
    /* Room in every stream's chunk, and rows and count words inside the mapping. */
    if (batch && *self->left <= 0)
        return PyLong_FromLong(-1);
    for (npy_intp j = 0; j < n; j++) {
        int64_t row = self->base[j] + self->fill[j];
        if (self->fill[j] < 0 || self->fill[j] >= self->rows[j] || self->base[j] < 0
            || row >= self->capacity || self->count_off[j] < 0 || self->count_off[j] % 8
            || self->count_off[j] > self->mm.len - 8)
            return PyLong_FromLong(-1);
    }
    int streamed = 0;
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        const Col *c = &self->cols[i];
        for (npy_intp j = 0; j < n; j++)
            streamed |= copy_row(c->data + (self->base[j] + self->fill[j]) * c->row_bytes,
                                 src[i] + j * c->row_bytes, (size_t)c->row_bytes);
    }
    if (streamed)
        stream_fence();
    int terminal = 0;
    if (self->done >= 0) {
        const Col *c = &self->cols[self->done];
        if (truth >= 0)
            terminal = truth;
        else
            for (npy_intp j = 0; j < n && !terminal; j++)
                terminal = truth_of(c, src[self->done] + j * c->row_bytes);
    }
    char *mm = (char *)self->mm.buf;
    /* Numbered in the buffer's publish order before the counts publish the rows.  Rate
     * limited, the numbers are reserved by the gate's CAS; if another writer took the
     * room since the check above, nothing is published (the rows written stay
     * unpublished) and the Python path waits and writes them again. */
    uint64_t t;
    if (self->rate) {
        int64_t got = rate_take_insert(mm, self->rate, (uint64_t)n);
        if (got < 0)
            return PyLong_FromLong(-1);
        t = (uint64_t)got;
    } else {
        t = atomic_fetch_add_explicit((atomic_u64 *)(mm + self->clock_off), (uint64_t)n,
                                      memory_order_relaxed);
    }
    for (npy_intp j = 0; j < n; j++) {
        ((int64_t *)self->ep_col)[self->base[j] + self->fill[j]] = self->ep[j];
        ((int64_t *)self->t_col)[self->base[j] + self->fill[j]] = (int64_t)(t + (uint64_t)j);
    }
    /* Counted before published: steps_written is never behind what readers see. */
    atomic_u64 *steps = (atomic_u64 *)(mm + self->steps_off);
    atomic_store_explicit(steps, atomic_load_explicit(steps, memory_order_relaxed)
                          + (uint64_t)n, memory_order_release);
    if (!batch) {
        self->fill[0] += 1;
        atomic_store_explicit((atomic_u64 *)(mm + self->count_off[0]), (uint64_t)self->fill[0],
                              memory_order_release);
    } else {
        *self->left -= 1;
        atomic_thread_fence(memory_order_release);
        for (npy_intp j = 0; j < n; j++) {
            self->fill[j] += 1;
            atomic_store_explicit((atomic_u64 *)(mm + self->count_off[j]),
                                  (uint64_t)self->fill[j], memory_order_relaxed);
        }
    }
    return PyLong_FromLong(terminal);
}

static PyObject *
appender_add(Appender *self, PyObject *columns)
{
    return append(self, columns, 0);
}

static PyObject *
appender_add_batch(Appender *self, PyObject *columns)
{
    return append(self, columns, 1);
}

/*
 * stream_copy(dst, src): copy the bytes of src into dst (equal sizes, both
 * C-contiguous), streaming rows of STREAM_MIN bytes or more, then
 * stream_fence(): the copy is ordered before any later store, so a run
 * copied with it can be published by a release store (Writer.extend).
 */
static PyObject *
stream_copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src))
        return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len || !PyBuffer_IsContiguous(&dst, 'C')
        || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_ValueError, "stream_copy: dst and src must be contiguous and "
                        "of one size");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (copy_row((char *)dst.buf, (const char *)src.buf, (size_t)dst.len))
        stream_fence();
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef appender_methods[] = {
    {"add", (PyCFunction)appender_add, METH_O,
     "add(columns) -> -1 (take the Python path; nothing written), 0, or 1 (terminal): "
     "one step of stream 0."},
    {"add_batch", (PyCFunction)appender_add_batch, METH_O,
     "add_batch(columns) -> -1, 0, or 1 (some row terminal): one step of every stream."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AppenderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuf.protocol._atomic.Appender",
    .tp_basicsize = sizeof(Appender),
    .tp_dealloc = (destructor)appender_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The writer's fast path: see _atomic.c.",
    .tp_methods = appender_methods,
    .tp_new = appender_new,
};

/*
 * keyed_take(buffer, count_offsets, base, count, lengths, ages, ring_len,
 *            columns, stale) -> int
 *
 * The copy half of a keyed-ring read (_keyed_ring.KeyWords.read), for E keys
 * whose counts and live lengths the caller loaded: entry age a of key e is
 * position count[e]-1-a, slot (count[e]-1-a) % ring_len, row base[e]+slot.
 * ages is an (E, m) int64 array; an age outside [0, lengths[e]) gives a zero
 * row.  columns is a tuple of (src, start, stop, out): src the column's
 * (capacity, ...) array over the segment, out an (E, stop-start, ...) array
 * that receives ages[:, start:stop].  The copies run without the GIL.
 * Then one acquire fence and a relaxed load of each key's count: key e is
 * stale (stale[e] = 1) if a writer may have overwritten the oldest entry it
 * copied, i.e. oldest < after - (ring_len - 1).  Returns how many are stale.
 * Every row is bounds-checked before any copy: a corrupt base, count or age
 * raises ValueError, never reads outside src.
 */
typedef struct {
    Py_buffer src, out;
    Py_ssize_t start, stop, row_bytes, capacity;
} TakeColumn;

static PyObject *
keyed_take(PyObject *self, PyObject *args)
{
    Py_buffer mm, offs, base, count, lengths, ages, stale;
    Py_ssize_t ring_len;
    PyObject *columns;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*y*nO!w*", &mm, &offs, &base, &count, &lengths,
                          &ages, &ring_len, &PyTuple_Type, &columns, &stale))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t ncols = PyTuple_GET_SIZE(columns), ready = 0;
    TakeColumn *cols = PyMem_Calloc(ncols ? ncols : 1, sizeof(TakeColumn));
    if (cols == NULL) {
        PyErr_NoMemory();
        goto release;
    }
    Py_ssize_t n = offs.len / 8, m = 0;
    if (offs.len % 8 || base.len != offs.len || count.len != offs.len
            || lengths.len != offs.len || stale.len != n || ring_len < 1) {
        PyErr_SetString(PyExc_ValueError, "keyed_take: inconsistent key arrays");
        goto release;
    }
    if (n) {
        if (ages.len % (8 * n)) {
            PyErr_SetString(PyExc_ValueError, "keyed_take: ages is not (E, m) int64");
            goto release;
        }
        m = ages.len / (8 * n);
    }
    const int64_t *off = offs.buf, *b = base.buf, *c = count.buf, *len = lengths.buf;
    const int64_t *age = ages.buf;
    for (Py_ssize_t e = 0; e < n; e++)
        if (!word_at(&mm, off[e]))
            goto release;
    for (; ready < ncols; ready++) {
        TakeColumn *col = &cols[ready];
        PyObject *item = PyTuple_GET_ITEM(columns, ready), *src, *out;
        if (!PyArg_ParseTuple(item, "OnnO", &src, &col->start, &col->stop, &out))
            goto release;
        if (PyObject_GetBuffer(src, &col->src, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0)
            goto release;
        if (PyObject_GetBuffer(out, &col->out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&col->src);
            goto release;
        }
        Py_ssize_t cap = col->src.ndim ? col->src.shape[0] : 0;
        col->capacity = cap;
        col->row_bytes = cap ? col->src.len / cap : 0;
        if (col->start < 0 || col->stop < col->start || col->stop > m
                || col->out.len != n * (col->stop - col->start) * col->row_bytes) {
            ready++;
            PyErr_SetString(PyExc_ValueError, "keyed_take: a column's ages or output do not fit");
            goto release;
        }
    }
    /* Every row the copies will read, checked before any copy. */
    for (Py_ssize_t e = 0; e < n; e++) {
        for (Py_ssize_t k = 0; k < m; k++) {
            int64_t a = age[e * m + k];
            if (a < 0 || a >= len[e])
                continue;
            int64_t pos = c[e] - 1 - a, row = b[e] + (pos % ring_len);
            for (Py_ssize_t j = 0; j < ncols; j++) {
                if (pos < 0 || row < 0 || row >= cols[j].capacity) {
                    PyErr_Format(PyExc_ValueError, "keyed_take: key %zd's age %lld maps to "
                                 "row %lld, outside the column", e, (long long)a,
                                 (long long)row);
                    goto release;
                }
            }
        }
    }
    uint8_t *st = stale.buf;
    Py_ssize_t n_stale = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < ncols; j++) {
        TakeColumn *col = &cols[j];
        Py_ssize_t rb = col->row_bytes;
        char *dst = col->out.buf;
        const char *src = col->src.buf;
        for (Py_ssize_t e = 0; e < n; e++) {
            for (Py_ssize_t k = col->start; k < col->stop; k++, dst += rb) {
                int64_t a = age[e * m + k];
                if (a < 0 || a >= len[e]) {
                    memset(dst, 0, rb);
                    continue;
                }
                memcpy(dst, src + (b[e] + (c[e] - 1 - a) % ring_len) * rb, rb);
            }
        }
    }
    atomic_thread_fence(memory_order_acquire);  /* the copies before the loads below */
    for (Py_ssize_t e = 0; e < n; e++) {
        int64_t oldest = INT64_MAX;
        for (Py_ssize_t k = 0; k < m; k++) {
            int64_t a = age[e * m + k];
            if (a >= 0 && a < len[e] && c[e] - 1 - a < oldest)
                oldest = c[e] - 1 - a;
        }
        int64_t after = (int64_t)atomic_load_explicit(
            (atomic_u64 *)((char *)mm.buf + off[e]), memory_order_relaxed);
        st[e] = oldest != INT64_MAX && oldest < after - (ring_len - 1);
        n_stale += st[e];
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(n_stale);
release:
    for (Py_ssize_t j = 0; j < ready && cols; j++) {
        PyBuffer_Release(&cols[j].src);
        PyBuffer_Release(&cols[j].out);
    }
    PyMem_Free(cols);
    PyBuffer_Release(&mm);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&base);
    PyBuffer_Release(&count);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&ages);
    PyBuffer_Release(&stale);
    return result;
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
     "stale) -> int: a keyed-ring read's copies, then its staleness check (see _atomic.c)."},
    {"fence_acquire", fence_acquire, METH_NOARGS, "Acquire fence."},
    {"fence_release", fence_release, METH_NOARGS, "Release fence."},
    {"fence_seq_cst", fence_seq_cst, METH_NOARGS, "Sequentially consistent fence."},
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
    return m;
}
