/*
 * atomic_module.h: what the sources of the one extension shmbuf.protocol._atomic
 * share (atomic_words.c, rate_gate.c, appender.c, keyed_read.c).
 *
 * The rate gate's admission is here, inline, because two files run it on their
 * hot paths: RateGate.insert (rate_gate.c) and the Appender's publish
 * (appender.c).  Memory orders: the gate's words are loaded with acquire; the
 * clock is reserved by a CAS with acq_rel on success, relaxed on failure.
 * Word access and the geometry are shmbuf_words.h's.
 */
#ifndef SHMBUF_ATOMIC_MODULE_H
#define SHMBUF_ATOMIC_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "shmbuf_words.h"

/* -- the rate gate (rate_gate.c), shared with the Appender ----------------------- */

#define RATE_BLOCK_WRITERS 2

/* The rate limiter's words: byte offsets in the mapping, from the geometry. */
typedef struct {
    Py_ssize_t clock, replayed, flags, ratio, min_steps, tolerance, base;
} RateOffs;

typedef struct {
    PyObject_HEAD
    Py_buffer mm;
    RateOffs o;
} RateGate;

extern PyTypeObject RateGateType;

static inline uint64_t
rate_word(const char *mm, Py_ssize_t off)
{
    return shm_load(mm, off, memory_order_acquire);
}

static inline double
rate_double(const char *mm, Py_ssize_t off)
{
    uint64_t bits = rate_word(mm, off);
    double d;
    memcpy(&d, &bits, 8);
    return d;
}

static inline int
insert_fits(const char *mm, const RateOffs *o, uint64_t t)
{
    if (!(rate_word(mm, o->flags) & RATE_BLOCK_WRITERS))
        return 1;
    uint64_t inserted = t + rate_word(mm, o->base) + 1, m = rate_word(mm, o->min_steps);
    if (inserted <= m)
        return 1;
    double replayed = (double)rate_word(mm, o->replayed);
    return rate_double(mm, o->ratio) * (double)(inserted - m)
        <= replayed + rate_double(mm, o->tolerance);
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

/* -- the writer's fast path (appender.c) ----------------------------------------- */

extern PyTypeObject AppenderType;
PyObject *stream_copy(PyObject *self, PyObject *args);

/* -- a keyed-ring read's copies (keyed_read.c) ----------------------------------- */

PyObject *keyed_take(PyObject *self, PyObject *args);

#endif /* SHMBUF_ATOMIC_MODULE_H */
