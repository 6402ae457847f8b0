/*
 * The sampler's inner loop: which candidate start rows begin a valid window,
 * and, after the copy, whether the chunks a window used were recycled.
 *
 * shmbuf/sampling/windows.py states the rules and keeps everything else (drawing
 * candidates, retries, the gather).  Doing this per candidate in C replaces
 * about forty whole-array numpy passes with one pass that stops as soon as
 * enough windows are found, which is what made small batches slow.
 *
 * The segment may be written by other processes at any instant and may even
 * be corrupt, so every index read from it is bounds-checked before use: a bad
 * word makes a candidate invalid, never a read outside the mapping.
 *
 * Memory orders mirror the Python protocol (docs/design.md): a chunk's state
 * word, then its count, then its next link, each loaded with acquire, so that
 * the rows and episode numbers read afterwards are at least as new as the
 * count that published them; `unchanged` runs one acquire fence, then
 * relaxed loads of the state words.  The _ep words are loaded relaxed.
 *
 * Both functions take an optional `preempt` callable, called (with the GIL
 * held) before every load from the segment.  Tests use it to run a writer at
 * each such point, as if this process had been descheduled there; it is None
 * in production, where the loop runs with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "shmbuf_words.h"

/*
 * The chunk entry's size and the offsets of the fields read here are not
 * declared in C: they arrive in the packed geometry (shmbuf_words.h) that
 * protocol.geometry builds from protocol.layout, the one definition.
 */
typedef struct {
    ShmGeometry s;       /* the chunk table, the episode column: see shmbuf_words.h */
    char *base;          /* start of the mapping */
    Py_ssize_t len;      /* its length */
    PyObject *preempt;   /* None-or-callable test hook, see above; NULL if None */
} Geometry;

/* Run the test hook, if any, before a load; -1 if it raised. */
static int
call_preempt(PyObject *preempt)
{
    PyObject *r = PyObject_CallNoArgs(preempt);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

#define PREEMPT(g)                                                  \
    do {                                                            \
        if ((g)->preempt && call_preempt((g)->preempt) < 0)         \
            return -1;                                              \
    } while (0)

static inline uint64_t
chunk_word(const Geometry *g, int64_t chunk, int64_t field)
{
    return shm_load(g->base, g->s.chunks_at + chunk * g->s.entry_bytes + field,
                    memory_order_acquire);
}

/*
 * Step from a full chunk to its stream's successor: load `next` and
 * `next_seq` (acquire), bounds-check the successor, and require its state
 * seq to still be the one recorded at link time.  Return 1 and update
 * *chunk and *seq, 0 if there is no valid successor, -1 if the hook raised.
 */
static int
follow(const Geometry *g, int64_t *chunk, int64_t *seq)
{
    PREEMPT(g);
    uint64_t next = chunk_word(g, *chunk, g->s.entry_next);
    PREEMPT(g);
    int64_t next_seq = (int64_t)chunk_word(g, *chunk, g->s.entry_next_seq);
    if (next == 0 || next > (uint64_t)g->s.n_chunks)
        return 0;
    PREEMPT(g);
    int64_t now = (int64_t)(chunk_word(g, (int64_t)next - 1, g->s.entry_state) >> 32);
    if (now != next_seq)
        return 0;                                    /* recycled since the link */
    *chunk = (int64_t)next - 1;
    *seq = now;
    return 1;
}

static inline int64_t
episode_of(const Geometry *g, int64_t row)
{
    return (int64_t)shm_load(g->base, g->s.ep_at + row * 8, memory_order_relaxed);
}

/*
 * Does an episode start at a row in (lo, hi] of `chunk` (rows of the chunk)?
 * Read from the chunk entry's starts word (protocol.layout: first start, last start,
 * how many, saturating at 3), loaded after the count.  1: yes, the window
 * crosses an episode; 0: no; 2: the word cannot tell (three or more starts
 * and the window lies between the first and the last, or an untracked
 * chunk: first >= last with two or more), so the caller reads _ep.  A
 * start the writer recorded after our count lies above every row we use.
 */
static inline int
starts_in(const Geometry *g, int64_t chunk, int64_t lo, int64_t hi)
{
    uint64_t word = chunk_word(g, chunk, g->s.entry_starts);
    uint64_t mask = ((uint64_t)1 << g->s.starts_bits) - 1, n = word >> (2 * g->s.starts_bits);
    if (n == 0)
        return 0;
    int64_t first = (int64_t)(word & mask), last = (int64_t)((word >> g->s.starts_bits) & mask);
    if (n >= 2 && first >= last)
        return 2;
    if ((first > lo && first <= hi) || (last > lo && last <= hi))
        return 1;
    return (n <= 2 || hi < first || lo >= last) ? 0 : 2;
}

static inline int64_t
chunk_rows(const Geometry *g, int64_t chunk)
{
    int64_t left = g->s.capacity - chunk * g->s.chunk_size;
    return left < g->s.chunk_size ? left : g->s.chunk_size;
}

/*
 * Locate the window of `length` rows starting at `start`.  On success fill
 * rows[length] (physical rows), hop_chunks[n] and hop_seqs[n], set *hops = n
 * and return 1; return 0 if the window is not valid now, -1 if the preempt
 * hook raised.
 */
static int
locate_one(const Geometry *g, int64_t start, int64_t length, int64_t tail,
           int64_t max_hops, int64_t *rows, int64_t *hop_chunks,
           int64_t *hop_seqs, int64_t *hops)
{
    if (start < 0 || start >= g->s.capacity)
        return 0;
    int64_t chunk = start / g->s.chunk_size, offset = start - chunk * g->s.chunk_size;
    PREEMPT(g);
    int64_t seq = (int64_t)(chunk_word(g, chunk, g->s.entry_state) >> 32);
    if (seq & 1)
        return 0;                                    /* being recycled */
    PREEMPT(g);
    int64_t count = (int64_t)chunk_word(g, chunk, g->s.entry_count);
    int64_t rows_here = chunk_rows(g, chunk);
    if (count > rows_here || offset >= count)
        return 0;
    int64_t n = 0, t = 0, last_t = length - 1 - tail;  /* rows 0..last_t: one episode */
    int unknown = 0, in;
    hop_chunks[n] = chunk;
    hop_seqs[n++] = seq;
    for (int64_t r = start; t < length && r < chunk * g->s.chunk_size + count; r++)
        rows[t++] = r;
    PREEMPT(g);
    in = starts_in(g, chunk, offset, offset + (t - 1 < last_t ? t - 1 : last_t));
    if (in == 1)
        return 0;
    unknown |= in == 2;
    while (t < length) {
        /* A successor is linked only once the chunk is full; a count read
         * before it filled up would make the window skip rows. */
        if (count != rows_here || n >= max_hops)
            return 0;
        int linked = follow(g, &chunk, &seq);
        if (linked <= 0)
            return linked;
        PREEMPT(g);
        count = (int64_t)chunk_word(g, chunk, g->s.entry_count);
        rows_here = chunk_rows(g, chunk);
        if (count > rows_here)
            return 0;
        hop_chunks[n] = chunk;
        hop_seqs[n++] = seq;
        int64_t t0 = t;
        for (int64_t r = chunk * g->s.chunk_size; t < length && r < chunk * g->s.chunk_size + count; r++)
            rows[t++] = r;
        if (count == 0)
            return 0;
        if (t0 <= last_t) {           /* a start at row 0 here also ends the window's episode */
            PREEMPT(g);
            in = starts_in(g, chunk, -1, (t - 1 < last_t ? t - 1 : last_t) - t0);
            if (in == 1)
                return 0;
            unknown |= in == 2;
        }
    }
    if (unknown) {
        PREEMPT(g);
        int64_t first = episode_of(g, rows[0]);
        PREEMPT(g);
        if (first != episode_of(g, rows[last_t]))
            return 0;
    }
    *hops = n;
    return 1;
}

/* A candidate's start row: raw random words are mapped onto [0, span). */
static inline int64_t
start_of(int64_t word, int64_t span)
{
    return span ? (int64_t)(((unsigned __int128)(uint64_t)word * (uint64_t)span) >> 64) : word;
}

static int
get_geometry(Py_buffer *mm, PyObject *geo, PyObject *preempt, Geometry *g)
{
    g->preempt = preempt == Py_None ? NULL : preempt;
    g->base = (char *)mm->buf;
    g->len = mm->len;
    return shm_geometry_get(geo, mm->len, &g->s);
}

static int
check_len(Py_buffer *b, Py_ssize_t items, const char *what)
{
    if (b->buf != NULL && b->len < items * 8) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd",
                     what, b->len, items * 8);
        return -1;
    }
    return 0;
}

/*
 * find(buffer, geometry, starts, span, length, tail, need, max_hops,
 *      picked, rows, hop_chunks, hop_seqs, preempt=None) -> (found, examined)
 *
 * geometry: the ring's packed geometry (protocol.geometry, Ring.geometry).  Examines
 * the 8-byte `starts` in order until `need` valid windows are found.  With
 * span == 0 they are int64 start rows; with span > 0 they are raw uniform
 * 64-bit words (Generator.bit_generator.random_raw), each mapped to a row in
 * [0, span) by a 128-bit multiply-shift (bias below span / 2**64), which is
 * several times cheaper than Generator.integers for small batches.  For the
 * i-th one: picked[i] = its index in starts; rows[i, :length],
 * hop_chunks[i, :max_hops] and hop_seqs[i, :max_hops] (unused hops -1 / 0).
 * rows, hop_chunks and hop_seqs may be None when only `picked` is wanted.
 */
static PyObject *
find(PyObject *self, PyObject *args)
{
    Py_buffer mm, starts, picked, rows = {0}, hc = {0}, hs = {0};
    PyObject *geo, *rows_o, *hc_o, *hs_o, *preempt = Py_None;
    long long span, length, tail, need, max_hops;
    if (!PyArg_ParseTuple(args, "w*Oy*LLLLLw*OOO|O", &mm, &geo, &starts, &span, &length,
                          &tail, &need, &max_hops, &picked, &rows_o, &hc_o, &hs_o,
                          &preempt))
        return NULL;
    PyObject *result = NULL;
    Geometry g;
    int full = rows_o != Py_None, failed = 0;
    if (get_geometry(&mm, geo, preempt, &g) < 0)
        goto done;
    if (span < 0 || length < 1 || tail < 0 || tail >= length || need < 0 || max_hops < 1
        || max_hops > length + 2) {
        PyErr_SetString(PyExc_ValueError, "bad span, length, tail, need or max_hops");
        goto done;
    }
    if (full && (PyObject_GetBuffer(rows_o, &rows, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0
                 || PyObject_GetBuffer(hc_o, &hc, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0
                 || PyObject_GetBuffer(hs_o, &hs, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0))
        goto done;
    if (starts.len % 8) {
        PyErr_SetString(PyExc_ValueError, "starts must hold 8-byte integers");
        goto done;
    }
    if (check_len(&picked, need, "picked") < 0
        || (full && (check_len(&rows, need * length, "rows") < 0
                     || check_len(&hc, need * max_hops, "hop_chunks") < 0
                     || check_len(&hs, need * max_hops, "hop_seqs") < 0)))
        goto done;
    Py_ssize_t n_starts = starts.len / 8, found = 0, i = 0;
    const int64_t *cand = (const int64_t *)starts.buf;
    int64_t *row_scratch = PyMem_Malloc((size_t)(length + 2 * max_hops) * 8);
    if (!row_scratch) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *chunk_scratch = row_scratch + length, *seq_scratch = chunk_scratch + max_hops;
    PyThreadState *released = g.preempt ? NULL : PyEval_SaveThread();
    for (; i < n_starts && found < need; i++) {
        int64_t hops;
        int64_t *r = full ? (int64_t *)rows.buf + found * length : row_scratch;
        int64_t *c = full ? (int64_t *)hc.buf + found * max_hops : chunk_scratch;
        int64_t *s = full ? (int64_t *)hs.buf + found * max_hops : seq_scratch;
        int64_t start = start_of(cand[i], span);
        int valid = locate_one(&g, start, length, tail, max_hops, r, c, s, &hops);
        if (valid < 0) {
            failed = 1;
            break;
        }
        if (!valid)
            continue;
        for (int64_t h = hops; h < max_hops; h++) {
            c[h] = -1;
            s[h] = 0;
        }
        ((int64_t *)picked.buf)[found++] = i;
    }
    if (released)
        PyEval_RestoreThread(released);
    PyMem_Free(row_scratch);
    if (!failed)
        result = Py_BuildValue("nn", found, i);
done:
    PyBuffer_Release(&mm);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&picked);
    if (rows.buf) PyBuffer_Release(&rows);
    if (hc.buf) PyBuffer_Release(&hc);
    if (hs.buf) PyBuffer_Release(&hs);
    return result;
}

/*
 * unchanged(buffer, geometry, hop_chunks, hop_seqs, max_hops, ok, preempt=None) -> count
 *
 * After an acquire fence, ok[i] = 1 if every used hop of window i still has
 * the seq it had when located, else 0.  hop_chunks is -1 where unused.
 * Returns how many windows are unchanged.
 */
static PyObject *
unchanged(PyObject *self, PyObject *args)
{
    Py_buffer mm, hc, hs, ok;
    PyObject *geo, *preempt = Py_None;
    long long max_hops;
    if (!PyArg_ParseTuple(args, "w*Oy*y*Lw*|O", &mm, &geo, &hc, &hs, &max_hops, &ok,
                          &preempt))
        return NULL;
    PyObject *result = NULL;
    Geometry g;
    if (get_geometry(&mm, geo, preempt, &g) < 0)
        goto done;
    Py_ssize_t n = max_hops > 0 ? hc.len / 8 / max_hops : 0;
    if (max_hops < 1 || hs.len != hc.len || ok.len < n || hc.len != n * max_hops * 8) {
        PyErr_SetString(PyExc_ValueError, "unchanged: arguments do not fit");
        goto done;
    }
    const int64_t *c = hc.buf, *s = hs.buf;
    Py_ssize_t count = 0;
    shm_fence(memory_order_acquire);
    for (Py_ssize_t i = 0; i < n; i++) {
        char same = 1;
        for (Py_ssize_t h = 0; h < max_hops; h++) {
            int64_t chunk = c[i * max_hops + h];
            if (chunk < 0)
                break;
            if (g.preempt && call_preempt(g.preempt) < 0)
                goto done;
            if (chunk >= g.s.n_chunks) {
                same = 0;
                break;
            }
            uint64_t state = shm_load(
                g.base, g.s.chunks_at + chunk * g.s.entry_bytes + g.s.entry_state,
                memory_order_relaxed);
            if ((int64_t)(state >> 32) != s[i * max_hops + h]) {
                same = 0;
                break;
            }
        }
        ((char *)ok.buf)[i] = same;
        count += same;
    }
    result = PyLong_FromSsize_t(count);
done:
    PyBuffer_Release(&mm);
    PyBuffer_Release(&hc);
    PyBuffer_Release(&hs);
    PyBuffer_Release(&ok);
    return result;
}

/*
 * Row `advance` steps after row `offset` of `chunk` along its stream, given
 * the seq the chunk had when the caller learnt of it; -1 if the chunk was
 * recycled since, or the stream does not reach that far (yet).
 */
static int
seek_one(const Geometry *g, int64_t chunk, int64_t seq, int64_t offset, int64_t advance,
         int64_t *row)
{
    *row = -1;
    if (chunk < 0 || chunk >= g->s.n_chunks || offset < 0 || advance < 0)
        return 0;
    PREEMPT(g);
    if ((int64_t)(chunk_word(g, chunk, g->s.entry_state) >> 32) != seq)
        return 0;
    for (int64_t hops = 0; hops <= g->s.n_chunks; hops++) {
        int64_t rows_here = chunk_rows(g, chunk);
        if (offset + advance < rows_here) {
            *row = chunk * g->s.chunk_size + offset + advance;
            return 0;
        }
        PREEMPT(g);
        if ((int64_t)chunk_word(g, chunk, g->s.entry_count) != rows_here)
            return 0;                                /* not full: no successor yet */
        advance -= rows_here - offset;
        offset = 0;
        int linked = follow(g, &chunk, &seq);
        if (linked <= 0)
            return linked;
    }
    return 0;
}

/*
 * seek(buffer, geometry, chunks, seqs, offsets, advances, rows, preempt=None)
 *
 * rows[i] = the physical row `advances[i]` steps after row `offsets[i]` of
 * chunk `chunks[i]` along that chunk's stream, or -1 (see seek_one).  The
 * episode index uses it to turn "step p of episode e" into a start row,
 * which `find` then validates like any other candidate.
 */
static PyObject *
seek(PyObject *self, PyObject *args)
{
    Py_buffer mm, ch, sq, of, ad, out;
    PyObject *geo, *preempt = Py_None;
    if (!PyArg_ParseTuple(args, "w*Oy*y*y*y*w*|O", &mm, &geo, &ch, &sq, &of, &ad, &out,
                          &preempt))
        return NULL;
    PyObject *result = NULL;
    Geometry g;
    if (get_geometry(&mm, geo, preempt, &g) < 0)
        goto done;
    Py_ssize_t n = ch.len / 8;
    if (ch.len % 8 || sq.len != ch.len || of.len != ch.len || ad.len != ch.len
        || out.len != ch.len) {
        PyErr_SetString(PyExc_ValueError, "seek: arrays must be int64 of one length");
        goto done;
    }
    const int64_t *c = ch.buf, *s = sq.buf, *o = of.buf, *a = ad.buf;
    int64_t *r = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (seek_one(&g, c[i], s[i], o[i], a[i], &r[i]) < 0)
            goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&mm);
    PyBuffer_Release(&ch);
    PyBuffer_Release(&sq);
    PyBuffer_Release(&of);
    PyBuffer_Release(&ad);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS,
     "find(buffer, geometry, starts, span, length, tail, need, max_hops, picked, rows, "
     "hop_chunks, hop_seqs, preempt=None) -> (found, examined)"},
    {"unchanged", unchanged, METH_VARARGS,
     "unchanged(buffer, geometry, hop_chunks, hop_seqs, max_hops, ok, preempt=None) -> count"},
    {"seek", seek, METH_VARARGS,
     "seek(buffer, geometry, chunks, seqs, offsets, advances, rows, preempt=None)"},
    SHM_READ_GEOMETRY_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmbuf.protocol._window_check",
    "The sampler's per-candidate window check, in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__window_check(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (shm_geometry_export(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
