/*
 * rate_gate.c: RateGate, the rate limiter's two admissions (docs/design.md, "The rate
 * limiter"), one for each side, on the words that protocol.rate.RateWords
 * makes it over (offsets from the geometry): the step clock, the replayed budget, and the
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
 *
 * Memory orders: every word of the band is loaded with acquire; the reserving
 * CAS (on clock for insert, on replayed for replay) is acq_rel on success and
 * relaxed on failure.  RateGate(buffer, geometry) takes the words' offsets
 * from the geometry (shmbuf_words.h), where the shared parser checks them.
 */
#include "atomic_module.h"

static int
rate_take_replay(char *mm, const RateOffs *o, uint64_t n)
{
    uint64_t inserted = rate_word(mm, o->clock) + rate_word(mm, o->base), m = rate_word(mm, o->min_steps);
    if (inserted < m)
        return 0;
    double ratio = rate_double(mm, o->ratio), tol = rate_double(mm, o->tolerance);
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

/* RateGate(mm, geometry): the words are the geometry's clock, replayed and rate_*. */
static PyObject *
rategate_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    PyObject *mm, *geo;
    if (!PyArg_ParseTuple(args, "OO", &mm, &geo))
        return NULL;
    RateGate *self = (RateGate *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    ShmGeometry g;
    if (PyObject_GetBuffer(mm, &self->mm, PyBUF_WRITABLE) < 0
        || shm_geometry_get(geo, self->mm.len, &g) < 0)
        goto fail;
    self->o = (RateOffs){.clock = g.clock, .replayed = g.replayed, .flags = g.rate_flags,
                         .ratio = g.rate_ratio, .min_steps = g.rate_min_steps,
                         .tolerance = g.rate_tolerance, .base = g.rate_base};
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

PyTypeObject RateGateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuf.protocol._atomic.RateGate",
    .tp_basicsize = sizeof(RateGate),
    .tp_dealloc = (destructor)rategate_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The rate limiter's admissions: see rate_gate.c.",
    .tp_methods = rategate_methods,
    .tp_new = rategate_new,
};
