/*
 * What every C source of shmbuf's protocol shares (_atomic, _window_check, _prio).
 *
 * Word access: the segment's shared words are 8-byte atomics at byte offsets
 * of the mapping.  shm_load / shm_store / shm_fetch_add / shm_cas / shm_fence
 * take the memory order at every use, so each caller names the order its
 * protocol step needs; word_at is the bounds-checked word of a Python buffer.
 *
 * The geometry: ShmGeometry describes the chunk table (entry size, field
 * offsets, counts) and every other offset the extensions read (the episode
 * column, header words, the rate limiter's words, the priority regions and
 * trees).  Its one source is shmbuf/protocol/geometry.py, which builds a
 * named table from protocol.layout and packs it by name, using the table of
 * (name, offset, format, count) that shm_geometry_fields exports from this struct
 * (each extension's GEOMETRY_FIELDS).  shm_geometry_get is the one parser:
 * it checks the packed object's size and magic, then that the chunk table,
 * the episode column and the header words lie inside the mapping.  No
 * function depends on a field's position in any Python object.
 *
 * Include after <Python.h> (with PY_SSIZE_T_CLEAN).
 */
#ifndef SHMBUF_WORDS_H
#define SHMBUF_WORDS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef _Atomic uint64_t atomic_u64;

/* -- word access ------------------------------------------------------------------ */

static inline atomic_u64 *
shm_word(const char *base, int64_t off)
{
    return (atomic_u64 *)(base + off);
}

static inline uint64_t
shm_load(const char *base, int64_t off, memory_order order)
{
    return atomic_load_explicit(shm_word(base, off), order);
}

static inline void
shm_store(const char *base, int64_t off, uint64_t value, memory_order order)
{
    atomic_store_explicit(shm_word(base, off), value, order);
}

static inline uint64_t
shm_fetch_add(const char *base, int64_t off, uint64_t delta, memory_order order)
{
    return atomic_fetch_add_explicit(shm_word(base, off), delta, order);
}

/* Strong compare-and-swap; *expected receives the word's value on failure. */
static inline int
shm_cas(const char *base, int64_t off, uint64_t *expected, uint64_t desired,
        memory_order success, memory_order failure)
{
    return atomic_compare_exchange_strong_explicit(shm_word(base, off), expected, desired,
                                                   success, failure);
}

static inline void
shm_fence(memory_order order)
{
    atomic_thread_fence(order);
}

/* The 8-byte word at `offset` of a buffer, or NULL with ValueError if it is not an
 * aligned word inside it. */
static inline atomic_u64 *
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

/* -- the geometry ----------------------------------------------------------------- */

#define SHM_MAX_TREES 4      /* priority trees (one per proposal exponent) */
#define SHM_MAX_LEVELS 16    /* levels of one priority tree */
/* "SHMGEO" and a version: a packed geometry of another build is refused. */
#define SHM_GEOMETRY_MAGIC 0x53484D47454F0001LL

/*
 * Every field of ShmGeometry, in struct order: S(name) is one int64, A(type,
 * name, n, format) an array of n.  The struct, its field table and nothing
 * else are generated from this list, so they cannot disagree.
 */
#define SHM_GEOMETRY_FIELDS(S, A)                                                          \
    S(magic)                  /* SHM_GEOMETRY_MAGIC, set by geometry.pack */             \
    /* the chunk table */                                                                \
    S(chunks_at)              /* byte offset of the table */                             \
    S(n_chunks)                                                                          \
    S(chunk_size)             /* rows per chunk */                                       \
    S(capacity)               /* rows in all */                                          \
    S(entry_bytes)            /* bytes per chunk entry */                                \
    S(entry_state) S(entry_count) S(entry_next) S(entry_next_seq)                        \
    S(entry_starts) S(entry_ticket)   /* field offsets inside an entry */                \
    S(starts_bits)            /* width of a row offset in the starts word */             \
    S(slot_shift)             /* the slot's position in a chunk's state word */          \
    S(no_slot)                /* the slot value of an unclaimed or cleared chunk */      \
    /* columns and header words (byte offsets in the mapping) */                         \
    S(ep_at)                  /* the int64 episode column */                             \
    S(ticket) S(clock) S(closed) S(replayed)                                             \
    S(stopped)                /* writers_stopped: Buffer.stop_writers */                 \
    /* the rate limiter's words */                                                       \
    S(rate_flags) S(rate_ratio) S(rate_min_steps) S(rate_tolerance) S(rate_base)         \
    /* priorities (all 0 for a buffer without them) */                                   \
    S(prio_rows_at)           /* the claim-tagged row words */                           \
    S(prio_blocks_at)         /* two words per block: rows set, max */                   \
    S(prio_prev_at)           /* two words per chunk: predecessor + 1, its seq */        \
    S(prio_block)             /* rows per block */                                       \
    S(prio_blocks_per_chunk) S(prio_n_blocks)                                            \
    S(prio_max)               /* the largest-ever priority word */                       \
    S(n_trees) S(n_levels)                                                               \
    A(double, tree_exponent, SHM_MAX_TREES, "d")          /* ascending */                \
    A(int64_t, tree_level_at, SHM_MAX_TREES * SHM_MAX_LEVELS, "q")  /* [tree][level] */  \
    A(int64_t, level_nodes, SHM_MAX_LEVELS, "q")          /* nodes per level */

#define SHM_DECLARE_S(name) int64_t name;
#define SHM_DECLARE_A(type, name, n, fmt) type name[n];
typedef struct {
    SHM_GEOMETRY_FIELDS(SHM_DECLARE_S, SHM_DECLARE_A)
} ShmGeometry;
#undef SHM_DECLARE_S
#undef SHM_DECLARE_A

/* Offset of tree t's level d in the mapping. */
#define SHM_LEVEL_AT(g, t, d) ((g)->tree_level_at[(t) * SHM_MAX_LEVELS + (d)])

/*
 * The field table: a tuple of (name, byte offset, struct format, count) per
 * field, which geometry.pack packs by and the tests compare with geometry.py.
 */
static inline PyObject *
shm_geometry_fields(void)
{
#define SHM_ROW_S(name) "(snsn)"
#define SHM_ROW_A(type, name, n, fmt) "(snsn)"
#define SHM_ARG_S(name) #name, (Py_ssize_t)offsetof(ShmGeometry, name), "q", (Py_ssize_t)1,
#define SHM_ARG_A(type, name, n, fmt) \
    #name, (Py_ssize_t)offsetof(ShmGeometry, name), fmt, (Py_ssize_t)(n),
    return Py_BuildValue("(" SHM_GEOMETRY_FIELDS(SHM_ROW_S, SHM_ROW_A) ")",
                         SHM_GEOMETRY_FIELDS(SHM_ARG_S, SHM_ARG_A) NULL);
#undef SHM_ROW_S
#undef SHM_ROW_A
#undef SHM_ARG_S
#undef SHM_ARG_A
}

/* Adds GEOMETRY_FIELDS, GEOMETRY_SIZE and GEOMETRY_MAGIC to module m; -1 on error. */
static inline int
shm_geometry_export(PyObject *m)
{
    PyObject *fields = shm_geometry_fields();
    if (fields == NULL || PyModule_AddObject(m, "GEOMETRY_FIELDS", fields) < 0) {
        Py_XDECREF(fields);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "GEOMETRY_SIZE", (long)sizeof(ShmGeometry)) < 0)
        return -1;
    PyObject *magic = PyLong_FromLongLong(SHM_GEOMETRY_MAGIC);
    if (magic == NULL || PyModule_AddObject(m, "GEOMETRY_MAGIC", magic) < 0) {
        Py_XDECREF(magic);
        return -1;
    }
    return 0;
}

static inline int
shm_is_word(int64_t off, Py_ssize_t len)
{
    return off >= 0 && off % 8 == 0 && off <= (int64_t)len - 8;
}

/*
 * Fill *g from `geo`, the bytes that geometry.pack made, and check it against a
 * mapping of `len` bytes: the chunk table, the episode column and the header
 * and rate words must lie inside it.  -1 with ValueError (TypeError for an
 * object that is not bytes) naming what is wrong.
 */
static inline int
shm_geometry_get(PyObject *geo, Py_ssize_t len, ShmGeometry *g)
{
    if (!PyBytes_Check(geo) || PyBytes_GET_SIZE(geo) != (Py_ssize_t)sizeof(ShmGeometry)) {
        PyErr_Format(PyBytes_Check(geo) ? PyExc_ValueError : PyExc_TypeError,
                     "geometry must be the %zd bytes that shmbuf.protocol.geometry.pack "
                     "makes, got %R", (Py_ssize_t)sizeof(ShmGeometry), (PyObject *)Py_TYPE(geo));
        return -1;
    }
    memcpy(g, PyBytes_AS_STRING(geo), sizeof(ShmGeometry));
    if (g->magic != SHM_GEOMETRY_MAGIC) {
        PyErr_SetString(PyExc_ValueError, "geometry was not packed by this build's "
                        "shmbuf.protocol.geometry.pack (wrong magic)");
        return -1;
    }
    if (g->starts_bits < 1 || g->starts_bits > 31) {
        PyErr_SetString(PyExc_ValueError, "geometry: starts_bits must be 1..31");
        return -1;
    }
    int64_t fields[6] = {g->entry_state, g->entry_count, g->entry_next, g->entry_next_seq,
                         g->entry_starts, g->entry_ticket};
    for (int f = 0; f < 6; f++) {
        if (fields[f] < 0 || fields[f] % 8 || fields[f] + 8 > g->entry_bytes) {
            PyErr_SetString(PyExc_ValueError, "geometry: a chunk field lies outside its entry");
            return -1;
        }
    }
    if (g->chunk_size < 1 || g->n_chunks < 1 || g->capacity < 1 || g->entry_bytes < 8
        || g->entry_bytes % 8 || g->capacity > g->n_chunks * g->chunk_size
        || g->chunks_at < 0 || g->chunks_at % 8
        || g->chunks_at + g->n_chunks * g->entry_bytes > len
        || g->ep_at < 0 || g->ep_at % 8 || g->ep_at + g->capacity * 8 > len) {
        PyErr_SetString(PyExc_ValueError, "geometry does not fit the buffer");
        return -1;
    }
    int64_t words[] = {g->ticket, g->clock, g->closed, g->stopped, g->replayed, g->rate_flags,
                       g->rate_ratio, g->rate_min_steps, g->rate_tolerance, g->rate_base};
    for (size_t w = 0; w < sizeof(words) / sizeof(words[0]); w++) {
        if (!shm_is_word(words[w], len)) {
            PyErr_SetString(PyExc_ValueError,
                            "geometry: a header word is not an aligned word of the buffer");
            return -1;
        }
    }
    return 0;
}

/*
 * read_geometry(geometry, buffer) -> dict: the fields as shm_geometry_get reads
 * them for `buffer` (arrays as tuples).  Every extension has it, so the tests
 * can check that each one reads every field Python packed, by name.
 */
static inline PyObject *
shm_read_geometry(PyObject *self, PyObject *args)
{
    PyObject *geo;
    Py_buffer mm;
    if (!PyArg_ParseTuple(args, "Oy*", &geo, &mm))
        return NULL;
    ShmGeometry g;
    int bad = shm_geometry_get(geo, mm.len, &g);
    PyBuffer_Release(&mm);
    if (bad < 0)
        return NULL;
    PyObject *out = PyDict_New(), *v = NULL;
    if (out == NULL)
        return NULL;
#define SHM_PUT(name, value)                                                          \
    do {                                                                              \
        v = (value);                                                                  \
        if (v == NULL || PyDict_SetItemString(out, #name, v) < 0)                     \
            goto fail;                                                                \
        Py_DECREF(v);                                                                 \
        v = NULL;                                                                     \
    } while (0);
#define SHM_GET_S(name) SHM_PUT(name, PyLong_FromLongLong(g.name))
#define SHM_GET_A(type, name, n, fmt)                                                 \
    SHM_PUT(name, PyTuple_New(n))                                                     \
    for (Py_ssize_t i = 0; i < (n); i++) {                                            \
        PyObject *item = (fmt)[0] == 'd' ? PyFloat_FromDouble((double)g.name[i])      \
                                         : PyLong_FromLongLong((long long)g.name[i]); \
        if (item == NULL)                                                             \
            goto fail;                                                                \
        PyTuple_SET_ITEM(PyDict_GetItemString(out, #name), i, item);                  \
    }
    SHM_GEOMETRY_FIELDS(SHM_GET_S, SHM_GET_A)
#undef SHM_GET_S
#undef SHM_GET_A
#undef SHM_PUT
    return out;
fail:
    Py_XDECREF(v);
    Py_DECREF(out);
    return NULL;
}

#define SHM_READ_GEOMETRY_METHOD                                                      \
    {"read_geometry", shm_read_geometry, METH_VARARGS,                                \
     "read_geometry(geometry, buffer) -> dict: the packed geometry as this extension " \
     "reads it (tests)."}

#endif /* SHMBUF_WORDS_H */
