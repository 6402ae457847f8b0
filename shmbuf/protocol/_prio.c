/*
 * Shared priorities: the row words, the per-block bounds, the sum tree over
 * them, and the Prioritized draw's proposal and acceptance.
 *
 * protocol.priorities.Priorities drives every function here; the words and
 * their packing are described in protocol.layout (PRIORITY_COLUMN,
 * PRIORITY_REGIONS) and docs/design.md ("Priorities").  The geometry (offsets,
 * sizes, the chunk fields read, the trees) arrives packed by protocol.geometry
 * from protocol.layout and is read by shmbuf_words.h's one parser: nothing
 * about the layout is declared here.
 *
 * Lock-free rules, in short:
 *  - a row word is tag << 32 | float32 bits, written by one atomic exchange;
 *    a tag other than the row's chunk's current claim tag means "never set";
 *  - a block's max word only rises within a claim (CAS-max), and it is raised,
 *    and the leaf above it refreshed, BEFORE the row word is written, so a
 *    leaf never bounds a row from below even if its updater dies;
 *  - every tree node is recomputed from what it summarises (a leaf from its
 *    block words, a node from its children) and installed by CAS on a word
 *    that carries an 8-bit version, so refreshes by any number of processes,
 *    in any order, leave each node equal to the sum below it once they stop;
 *    one that dies leaves at worst a stale node, which the next refresh on its
 *    path (or repair) fixes.
 * No function waits for anything: every loop retries only after another
 * process changed the word it compared.
 *
 * Memory orders: chunk-table, block, node and largest-ever words are loaded
 * with acquire; a row word is loaded relaxed (its chunk's claim tag, loaded
 * with acquire, judges it); CAS and exchange are seq_cst; a claim's reset
 * stores its block words with release.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "shmbuf_words.h"

#define MAX_LEVELS SHM_MAX_LEVELS
#define MAX_TREES SHM_MAX_TREES
#define FANOUT 16
#define U32 0xFFFFFFFFull
#define TOUCH 32   /* windows whose first row word is loaded before any is scored */

typedef struct {
    ShmGeometry s;     /* the chunk table and the priority regions: see shmbuf_words.h */
    char *base;
    Py_ssize_t len;
    int64_t claimed;   /* chunks claimed when the call began: no entry at or above is read */
} PG;

static inline atomic_u64 *
word(const PG *g, int64_t off)
{
    return shm_word(g->base, off);
}

static inline uint64_t
chunk_word(const PG *g, int64_t chunk, int64_t field)
{
    return atomic_load_explicit(word(g, g->s.chunks_at + chunk * g->s.entry_bytes + field),
                                memory_order_acquire);
}

static inline int64_t
chunk_rows(const PG *g, int64_t chunk)
{
    int64_t left = g->s.capacity - chunk * g->s.chunk_size;
    return left < g->s.chunk_size ? left : g->s.chunk_size;
}

static inline uint64_t
tag_of(uint64_t ticket)
{
    return (ticket & 0x7FFFFFFFull) | 0x80000000ull;
}

static inline float
f32(uint64_t w)
{
    uint32_t b = (uint32_t)(w & U32);
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint64_t
bits32(float f)
{
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static inline uint64_t
pack_node(uint64_t count, uint64_t version, float value)
{
    return (count << 40) | ((version & 0xFF) << 32) | bits32(value);
}

static inline atomic_u64 *
node(const PG *g, int tree, int level, int64_t i)
{
    return word(g, SHM_LEVEL_AT(&g->s, tree, level) + 8 * i);
}

static inline atomic_u64 *
block_word(const PG *g, int64_t b, int which)
{
    return word(g, g->s.prio_blocks_at + 16 * b + 8 * which);
}

/* The largest priority ever set, or 1.0 before any (the PER convention). */
static inline double
largest(const PG *g)
{
    uint64_t w = atomic_load_explicit(word(g, g->s.prio_max), memory_order_acquire);
    return (w >> 32) & 1 ? (double)f32(w) : 1.0;
}

static int
parse(Py_buffer *mm, PyObject *geo, PG *g)
{
    if (shm_geometry_get(geo, mm->len, &g->s) < 0)
        return -1;
    g->base = mm->buf;
    g->len = mm->len;
    const ShmGeometry *s = &g->s;
    if (s->n_trees < 1 || s->n_trees > MAX_TREES) {
        PyErr_SetString(PyExc_ValueError, "priority geometry: bad tree table");
        return -1;
    }
    if (s->n_levels < 1 || s->n_levels > MAX_LEVELS) {
        PyErr_SetString(PyExc_ValueError, "priority geometry: bad level table");
        return -1;
    }
    for (int t = 0; t < s->n_trees; t++) {
        if (!(s->tree_exponent[t] > 0)
            || (t > 0 && !(s->tree_exponent[t] > s->tree_exponent[t - 1]))) {
            PyErr_SetString(PyExc_ValueError, "priority geometry: bad level table");
            return -1;
        }
        for (int d = 0; d < s->n_levels; d++) {
            int64_t at = SHM_LEVEL_AT(s, t, d), n = s->level_nodes[d];
            if (at < 0 || at % 8 || n < 1 || at + 8 * n > g->len
                || (d == 0 ? n != s->prio_n_blocks
                           : n != (s->level_nodes[d - 1] + FANOUT - 1) / FANOUT)) {
                PyErr_SetString(PyExc_ValueError, "priority geometry: a tree level does not fit");
                return -1;
            }
        }
    }
    /* The chunk table, the clock and the ticket word are checked by shm_geometry_get. */
    if (s->level_nodes[s->n_levels - 1] != 1 || s->prio_block < 1
        || s->prio_blocks_per_chunk != (s->chunk_size + s->prio_block - 1) / s->prio_block
        || s->prio_n_blocks != s->n_chunks * s->prio_blocks_per_chunk
        || s->prio_rows_at < 0 || s->prio_rows_at % 8 || s->prio_rows_at + 8 * s->capacity > g->len
        || s->prio_blocks_at < 0 || s->prio_blocks_at % 8
        || s->prio_blocks_at + 16 * s->prio_n_blocks > g->len
        || s->prio_prev_at < 0 || s->prio_prev_at % 8 || s->prio_prev_at + 16 * s->n_chunks > g->len
        || !shm_is_word(s->prio_max, g->len)) {
        PyErr_SetString(PyExc_ValueError, "priority geometry does not fit the buffer");
        return -1;
    }
    /* Chunks at or above the claim count were never claimed: their entries may not
     * even have pages yet (posix/space.py), so nothing here reads them. */
    uint64_t tickets = atomic_load_explicit(word(g, g->s.ticket), memory_order_acquire);
    g->claimed = tickets < (uint64_t)g->s.n_chunks ? (int64_t)tickets : g->s.n_chunks;
    return 0;
}

/* -- the tree ------------------------------------------------------------------ */

/* What leaf b of tree `tree` should hold now: (count, value); see layout.py: PRIORITY_REGIONS. */
static void
leaf_value(const PG *g, int tree, int64_t b, uint64_t *count, float *value)
{
    int64_t chunk = b / g->s.prio_blocks_per_chunk, first = (b % g->s.prio_blocks_per_chunk) * g->s.prio_block;
    *count = 0;
    *value = 0.0f;
    if (chunk >= g->claimed)
        return;                                   /* never claimed: no step */
    uint64_t state = chunk_word(g, chunk, g->s.entry_state);
    int64_t rows = chunk_rows(g, chunk) - first;
    if ((int64_t)((state >> g->s.slot_shift) & 0x7FFF) == g->s.no_slot || rows <= 0)
        return;                                   /* never claimed, or cleared: no step */
    *count = 1;                                   /* default: "holds a step never set" */
    if ((state >> 32) & 1)
        return;
    uint64_t tag = tag_of(chunk_word(g, chunk, g->s.entry_ticket));
    uint64_t set = atomic_load_explicit(block_word(g, b, 0), memory_order_acquire);
    uint64_t top = atomic_load_explicit(block_word(g, b, 1), memory_order_acquire);
    if (rows > g->s.prio_block)
        rows = g->s.prio_block;
    if (set >> 32 != tag || (int64_t)(set & U32) < rows || top >> 32 != tag)
        return;
    *count = 0;
    *value = (float)pow((double)f32(top), g->s.tree_exponent[tree]);
}

static void
refresh_leaf(const PG *g, int tree, int64_t b)
{
    atomic_u64 *w = node(g, tree, 0, b);
    for (;;) {
        uint64_t old = atomic_load_explicit(w, memory_order_acquire), count;
        float value;
        leaf_value(g, tree, b, &count, &value);
        if (atomic_compare_exchange_strong(w, &old, pack_node(count, (old >> 32) + 1, value)))
            return;
    }
}

static void
refresh_node(const PG *g, int tree, int level, int64_t i)
{
    atomic_u64 *w = node(g, tree, level, i);
    int64_t lo = i * FANOUT, hi = lo + FANOUT;
    if (hi > g->s.level_nodes[level - 1])
        hi = g->s.level_nodes[level - 1];
    for (;;) {
        uint64_t old = atomic_load_explicit(w, memory_order_acquire), count = 0;
        double sum = 0;
        for (int64_t c = lo; c < hi; c++) {
            uint64_t v = atomic_load_explicit(node(g, tree, level - 1, c), memory_order_acquire);
            count += v >> 40;
            sum += f32(v);
        }
        if (atomic_compare_exchange_strong(w, &old, pack_node(count, (old >> 32) + 1, (float)sum)))
            return;
    }
}

static int
cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Refresh leaves idx[0..n) (any order, repeats allowed) of every tree and every node
 * above them; idx is sorted and deduplicated, scratch (n items) overwritten. */
static void
refresh_up(const PG *g, int64_t *idx, int64_t *scratch, Py_ssize_t n)
{
    if (n == 0)
        return;
    qsort(idx, (size_t)n, sizeof(int64_t), cmp_i64);
    Py_ssize_t leaves = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (i == 0 || idx[i] != idx[leaves - 1])
            idx[leaves++] = idx[i];
    for (int t = 0; t < g->s.n_trees; t++) {
        Py_ssize_t m = leaves;
        memcpy(scratch, idx, (size_t)m * sizeof(int64_t));
        for (Py_ssize_t i = 0; i < m; i++)
            refresh_leaf(g, t, scratch[i]);
        for (int d = 1; d < g->s.n_levels; d++) {
            Py_ssize_t up = 0;
            for (Py_ssize_t i = 0; i < m; i++) {
                int64_t p = scratch[i] / FANOUT;
                if (up == 0 || scratch[up - 1] != p)
                    scratch[up++] = p;
            }
            m = up;
            for (Py_ssize_t i = 0; i < m; i++)
                refresh_node(g, t, d, scratch[i]);
        }
    }
}

/* CAS-max of a tag << 32 | float32 word, only while the tag matches.
 * Returns 1 if it rose, 0 if not, -1 if the tag is another claim's. */
static int
raise_tagged(atomic_u64 *w, uint64_t tag, uint64_t bits)
{
    uint64_t old = atomic_load_explicit(w, memory_order_acquire);
    for (;;) {
        if (old >> 32 != tag)
            return -1;
        if ((old & U32) >= bits)
            return 0;
        if (atomic_compare_exchange_strong(w, &old, tag << 32 | bits))
            return 1;
    }
}

/* Does every tree's leaf of block b bound a priority `v` (v ** e <= leaf)?  Without a
 * pow for the exponents 0.5, 0.8 and 1.0 of _layout.TREE_EXPONENTS (float32 rounding
 * may say no where the answer is yes: then the caller only refreshes once more). */
static int
leaves_cover(const PG *g, int64_t b, float v)
{
    for (int t = 0; t < g->s.n_trees; t++) {
        uint64_t w = atomic_load_explicit(node(g, t, 0, b), memory_order_acquire);
        if (w >> 40)
            continue;                       /* bounded by the largest priority ever set */
        double leaf = (double)f32(w), e = g->s.tree_exponent[t], top;
        if (e == 1.0)
            top = leaf;
        else if (e == 0.5)
            top = leaf * leaf;
        else if (e == 0.8)
            top = leaf * sqrt(sqrt(leaf));
        else
            top = pow(leaf, 1.0 / e);
        if (!((double)v <= top))
            return 0;
    }
    return 1;
}

/* The chunk and row offset that `id` names if it is still held, else -1. */
static int64_t
resolve(const PG *g, int64_t id, int64_t *offset, uint64_t *tag)
{
    if (id < 0)
        return -1;
    int64_t ticket = id / g->s.chunk_size, off = id % g->s.chunk_size, chunk = ticket % g->s.n_chunks;
    if (chunk >= g->claimed || off >= chunk_rows(g, chunk))
        return -1;
    uint64_t state = chunk_word(g, chunk, g->s.entry_state);
    if ((state >> 32) & 1 || (int64_t)chunk_word(g, chunk, g->s.entry_ticket) != ticket
        || (int64_t)chunk_word(g, chunk, g->s.entry_count) <= off
        || chunk_word(g, chunk, g->s.entry_state) >> 32 != state >> 32)
        return -1;
    *offset = off;
    *tag = tag_of((uint64_t)ticket);
    return chunk;
}

/*
 * update(buffer, geometry, ids, values) -> steps updated
 *
 * ids int64, values float32 (finite, >= 0: checked by the caller), same length.
 * Stale ids are skipped.  Order: the largest-ever word and the block bounds
 * rise first and the leaves above them are refreshed, then the row words are
 * exchanged, then blocks whose every row is now set get their exact bound.
 */
static PyObject *
update(PyObject *self, PyObject *args)
{
    Py_buffer mm, ids, vals;
    PyObject *geo;
    if (!PyArg_ParseTuple(args, "w*Oy*y*", &mm, &geo, &ids, &vals))
        return NULL;
    PyObject *result = NULL;
    PG g;
    if (parse(&mm, geo, &g) < 0)
        goto done;
    Py_ssize_t n = ids.len / 8;
    if (ids.len % 8 || vals.len != n * 4) {
        PyErr_SetString(PyExc_ValueError, "update: ids and values do not fit");
        goto done;
    }
    int64_t *chunk = PyMem_Malloc((size_t)(5 * n + 1) * 8);
    if (!chunk) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *offs = chunk + n, *touched = offs + n, *scratch = touched + n;
    uint64_t *tags = (uint64_t *)(scratch + n);
    const int64_t *id = ids.buf;
    const float *val = vals.buf;
    Py_ssize_t updated = 0, raised = 0, filled = 0;
    Py_BEGIN_ALLOW_THREADS
    atomic_u64 *top = word(&g, g.s.prio_max);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t tag = 0, bits = bits32(val[i]);
        chunk[i] = resolve(&g, id[i], &offs[i], &tag);
        tags[i] = tag;
        if (chunk[i] < 0)
            continue;
        uint64_t want = (1ull << 32) | bits, old = atomic_load_explicit(top, memory_order_acquire);
        while (old < want && !atomic_compare_exchange_strong(top, &old, want))
            ;
        int64_t b = chunk[i] * g.s.prio_blocks_per_chunk + offs[i] / g.s.prio_block;
        int r = raise_tagged(block_word(&g, b, 1), tag, bits);
        if (r < 0) {
            chunk[i] = -1;          /* the claim's reset is not done: not ours to set */
            continue;
        }
        /* A block whose leaf is exact (every row set) is refreshed even when its max
         * did not rise here: an updater killed between raising the max and refreshing
         * the leaf leaves the max above the leaf, and this row must not be written
         * above a leaf that does not cover it. */
        uint64_t set = atomic_load_explicit(block_word(&g, b, 0), memory_order_acquire);
        int64_t rows = chunk_rows(&g, chunk[i]) - (offs[i] / g.s.prio_block) * g.s.prio_block;
        int full = set >> 32 == tag && (int64_t)(set & U32) >= (rows < g.s.prio_block ? rows : g.s.prio_block);
        if (r > 0 || (full && !leaves_cover(&g, b, val[i])))
            touched[raised++] = b;
    }
    refresh_up(&g, touched, scratch, raised);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (chunk[i] < 0)
            continue;
        uint64_t tag = tags[i];    /* the claim the id named, even if recycled since */
        int64_t b = chunk[i] * g.s.prio_blocks_per_chunk + offs[i] / g.s.prio_block;
        uint64_t old = atomic_exchange(word(&g, g.s.prio_rows_at + 8 * (chunk[i] * g.s.chunk_size + offs[i])),
                                       tag << 32 | bits32(val[i]));
        updated++;
        if (old >> 32 == tag)
            continue;               /* set before in this claim: the count has it */
        atomic_u64 *set = block_word(&g, b, 0);
        uint64_t was = atomic_load_explicit(set, memory_order_acquire);
        while (was >> 32 == tag && !atomic_compare_exchange_strong(set, &was, was + 1))
            ;
        int64_t rows = chunk_rows(&g, chunk[i]) - (offs[i] / g.s.prio_block) * g.s.prio_block;
        if (was >> 32 == tag && (int64_t)(was & U32) + 1 >= (rows < g.s.prio_block ? rows : g.s.prio_block))
            touched[filled++] = b;
    }
    refresh_up(&g, touched, scratch, filled);
    Py_END_ALLOW_THREADS
    PyMem_Free(chunk);
    result = PyLong_FromSsize_t(updated);
done:
    PyBuffer_Release(&mm);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&vals);
    return result;
}

/*
 * reset(buffer, geometry, chunk, ticket): a chunk was claimed with `ticket`
 * (or cleared): its blocks start a new claim with nothing set, and their
 * leaves say so.  The claimant calls it before it writes the chunk's first row.
 */
static PyObject *
reset(PyObject *self, PyObject *args)
{
    Py_buffer mm;
    PyObject *geo;
    long long chunk, ticket;
    if (!PyArg_ParseTuple(args, "w*OLL", &mm, &geo, &chunk, &ticket))
        return NULL;
    PyObject *result = NULL;
    PG g;
    int64_t *idx = NULL;
    if (parse(&mm, geo, &g) < 0)
        goto done;
    if (chunk < 0 || chunk >= g.s.n_chunks || ticket < 0) {
        PyErr_SetString(PyExc_ValueError, "reset: chunk or ticket out of range");
        goto done;
    }
    idx = PyMem_Malloc((size_t)g.s.prio_blocks_per_chunk * 16);
    if (!idx) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t tag = tag_of((uint64_t)ticket);
    for (int64_t j = 0; j < g.s.prio_blocks_per_chunk; j++) {
        int64_t b = chunk * g.s.prio_blocks_per_chunk + j;
        atomic_store_explicit(block_word(&g, b, 1), tag << 32, memory_order_release);
        atomic_store_explicit(block_word(&g, b, 0), tag << 32, memory_order_release);
        idx[j] = b;
    }
    refresh_up(&g, idx, idx + g.s.prio_blocks_per_chunk, g.s.prio_blocks_per_chunk);
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(idx);
    PyBuffer_Release(&mm);
    return result;
}

/*
 * repair(buffer, geometry): recompute every leaf from its block words and
 * every node from its children, bottom up: the way back to a consistent tree
 * after a process died in the middle of a refresh.  Safe while others update.
 */
static PyObject *
repair(PyObject *self, PyObject *args)
{
    Py_buffer mm;
    PyObject *geo;
    if (!PyArg_ParseTuple(args, "w*O", &mm, &geo))
        return NULL;
    PG g;
    if (parse(&mm, geo, &g) < 0) {
        PyBuffer_Release(&mm);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < g.s.n_trees; t++) {
        for (int64_t b = 0; b < g.s.prio_n_blocks; b++)
            refresh_leaf(&g, t, b);
        for (int d = 1; d < g.s.n_levels; d++)
            for (int64_t i = 0; i < g.s.level_nodes[d]; i++)
                refresh_node(&g, t, d, i);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&mm);
    Py_RETURN_NONE;
}

/*
 * stale_nodes(buffer, geometry) -> (leaves, nodes): how many leaves differ
 * from their block words and how many nodes from the sum of their children
 * (float sums compared to 1e-5 relative).  Tests and `shmbuf` diagnostics.
 */
static PyObject *
stale_nodes(PyObject *self, PyObject *args)
{
    Py_buffer mm;
    PyObject *geo;
    if (!PyArg_ParseTuple(args, "w*O", &mm, &geo))
        return NULL;
    PG g;
    if (parse(&mm, geo, &g) < 0) {
        PyBuffer_Release(&mm);
        return NULL;
    }
    Py_ssize_t leaves = 0, nodes = 0;
    for (int t = 0; t < g.s.n_trees; t++) {
        for (int64_t b = 0; b < g.s.prio_n_blocks; b++) {
            uint64_t count, v = atomic_load_explicit(node(&g, t, 0, b), memory_order_acquire);
            float value;
            leaf_value(&g, t, b, &count, &value);
            leaves += (v >> 40) != count || f32(v) != value;
        }
        for (int d = 1; d < g.s.n_levels; d++) {
            for (int64_t i = 0; i < g.s.level_nodes[d]; i++) {
                uint64_t v = atomic_load_explicit(node(&g, t, d, i), memory_order_acquire);
                uint64_t count = 0;
                double sum = 0;
                for (int64_t c = i * FANOUT; c < (i + 1) * FANOUT && c < g.s.level_nodes[d - 1]; c++) {
                    uint64_t w = atomic_load_explicit(node(&g, t, d - 1, c), memory_order_acquire);
                    count += w >> 40;
                    sum += f32(w);
                }
                nodes += (v >> 40) != count || fabs(f32(v) - sum) > 1e-5 * (sum + 1e-30);
            }
        }
    }
    PyBuffer_Release(&mm);
    return Py_BuildValue("nn", leaves, nodes);
}

/* -- reading priorities ---------------------------------------------------------- */

/* The priority of the step at `row` (its chunk's claim tag read from the table). */
static inline double
priority_at(const PG *g, int64_t row, double dflt, int *explicit)
{
    int64_t chunk = row / g->s.chunk_size;
    uint64_t tag = tag_of(chunk_word(g, chunk, g->s.entry_ticket));
    uint64_t w = atomic_load_explicit(word(g, g->s.prio_rows_at + 8 * row), memory_order_relaxed);
    *explicit = w >> 32 == tag;
    return *explicit ? (double)f32(w) : dflt;
}

static inline double
leaf_bound(const PG *g, int tree, int64_t b, double g0)
{
    uint64_t v = atomic_load_explicit(node(g, tree, 0, b), memory_order_acquire);
    return (v >> 40) ? g0 : (double)f32(v);
}

/*
 * values(buffer, geometry, rows, out, explicit): out[i] (float32) the
 * priority of the step at rows[i] (committed rows: the caller validates),
 * explicit[i] (uint8) 1 if it was set in this claim, 0 if it is the default.
 */
static PyObject *
values(PyObject *self, PyObject *args)
{
    Py_buffer mm, rows, out, ex;
    PyObject *geo;
    if (!PyArg_ParseTuple(args, "w*Oy*w*w*", &mm, &geo, &rows, &out, &ex))
        return NULL;
    PyObject *result = NULL;
    PG g;
    if (parse(&mm, geo, &g) < 0)
        goto done;
    Py_ssize_t n = rows.len / 8;
    if (rows.len % 8 || out.len != n * 4 || ex.len != n) {
        PyErr_SetString(PyExc_ValueError, "values: arguments do not fit");
        goto done;
    }
    const int64_t *r = rows.buf;
    double dflt = largest(&g);
    for (Py_ssize_t i = 0; i < n; i++) {
        int explicit = 0;
        if (r[i] < 0 || r[i] >= g.s.capacity) {
            PyErr_SetString(PyExc_ValueError, "values: row out of range");
            goto done;
        }
        ((float *)out.buf)[i] = (float)priority_at(&g, r[i], dflt, &explicit);
        ((uint8_t *)ex.buf)[i] = (uint8_t)explicit;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&mm);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    PyBuffer_Release(&ex);
    return result;
}

/* -- the draw -------------------------------------------------------------------- */

/* The stream predecessor of `chunk` (whose seq is `seq`) if it still links to it. */
static int64_t
predecessor(const PG *g, int64_t chunk, int64_t seq, int64_t *pseq)
{
    uint64_t p = atomic_load_explicit(word(g, g->s.prio_prev_at + 16 * chunk), memory_order_acquire);
    int64_t ps = (int64_t)atomic_load_explicit(word(g, g->s.prio_prev_at + 16 * chunk + 8),
                                               memory_order_acquire);
    if (p == 0 || p > (uint64_t)g->s.n_chunks)
        return -1;
    int64_t pc = (int64_t)p - 1;
    if (pc >= g->claimed || (int64_t)(chunk_word(g, pc, g->s.entry_state) >> 32) != ps || (ps & 1)
        || chunk_word(g, pc, g->s.entry_next) != (uint64_t)chunk + 1
        || (int64_t)chunk_word(g, pc, g->s.entry_next_seq) != seq)
        return -1;
    *pseq = ps;
    return pc;
}

/*
 * propose(buffer, geometry, raw, length, tree, largest, starts): for each pair
 * of raw 64-bit words, pick a block b with probability proportional to its
 * bound in tree `tree` (count-1 leaves weigh largest ** its exponent), then one of
 * the block + length - 1 stream positions whose window of `length` steps
 * touches b, uniformly; starts[i] = that position's row, or -1 where the
 * position does not exist (before the stream's kept chunks, past the block).
 * So a start r is proposed with weight sum(bound of b for every block b its
 * window touches): the mu that score_ratio divides by.
 */
static PyObject *
propose(PyObject *self, PyObject *args)
{
    Py_buffer mm, raw, out;
    PyObject *geo;
    long long length;
    int tree;
    double top;
    if (!PyArg_ParseTuple(args, "w*Oy*Lidw*", &mm, &geo, &raw, &length, &tree, &top, &out))
        return NULL;
    PyObject *result = NULL;
    PG g;
    if (parse(&mm, geo, &g) < 0)
        goto done;
    Py_ssize_t n = out.len / 8;
    if (out.len % 8 || raw.len != n * 16 || length < 1 || !(top >= 0) || tree < 0
        || tree >= g.s.n_trees) {
        PyErr_SetString(PyExc_ValueError, "propose: arguments do not fit");
        goto done;
    }
    const uint64_t *rw = raw.buf;
    int64_t *starts = out.buf;
    double g0 = pow(top, g.s.tree_exponent[tree]);
    uint64_t positions = (uint64_t)(g.s.prio_block + length - 1);
    /* Breadth first: every proposal descends one level before any goes deeper,
     * and the children of all of them are prefetched first, so the cache misses
     * of a level overlap instead of following one another. */
    int64_t *at = PyMem_Malloc((size_t)(n + 1) * sizeof(int64_t));
    double *us = PyMem_Malloc((size_t)(n + 1) * sizeof(double));
    if (!at || !us) {
        PyMem_Free(at);
        PyMem_Free(us);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        at[i] = 0;
        us[i] = (double)(rw[2 * i] >> 11) * 0x1.0p-53;
    }
    for (int d = g.s.n_levels - 2; d >= 0; d--) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (at[i] >= 0) {
                const char *first = (const char *)node(&g, tree, d, at[i] * FANOUT);
                __builtin_prefetch(first);
                __builtin_prefetch(first + 64);
            }
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t j = at[i];
            if (j < 0)
                continue;
            int64_t lo = j * FANOUT, hi = lo + FANOUT;
            if (hi > g.s.level_nodes[d])
                hi = g.s.level_nodes[d];
            /* The child is the first whose running sum passes x: counted without a
             * branch per child (which the scan it replaces mispredicted). */
            double w[FANOUT], sum[FANOUT], total = 0;
            int64_t kids = hi - lo;
            for (int64_t c = 0; c < kids; c++) {
                uint64_t v = atomic_load_explicit(node(&g, tree, d, lo + c), memory_order_acquire);
                w[c] = (double)(v >> 40) * g0 + (double)f32(v);
                total += w[c];
                sum[c] = total;
            }
            if (!(total > 0)) {
                at[i] = -1;
                continue;
            }
            double x = us[i] * total;
            int64_t k = 0;
            for (int64_t c = 0; c < kids - 1; c++)
                k += sum[c] <= x;
            while (w[k] <= 0 && k > 0)   /* rounding ran past the last weighted child */
                k--;
            if (!(w[k] > 0)) {
                at[i] = -1;
                continue;
            }
            double u = (x - (k ? sum[k - 1] : 0)) / w[k];
            us[i] = u < 0 ? 0 : u >= 1 ? 0x1.fffffffffffffp-1 : u;
            at[i] = lo + k;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t j = at[i];
        starts[i] = -1;
        if (j < 0)
            continue;
        if (g.s.n_levels == 1 && !(leaf_bound(&g, tree, 0, g0) > 0))
            continue;
        int64_t chunk = j / g.s.prio_blocks_per_chunk, first = (j % g.s.prio_blocks_per_chunk) * g.s.prio_block;
        int64_t rel = (int64_t)(((unsigned __int128)rw[2 * i + 1] * positions) >> 64)
                      - (length - 1);
        int64_t last = first + g.s.prio_block < chunk_rows(&g, chunk) ? first + g.s.prio_block : chunk_rows(&g, chunk);
        if (rel >= 0) {
            if (first + rel < last)
                starts[i] = chunk * g.s.chunk_size + first + rel;
            continue;
        }
        int64_t back = -rel;                  /* steps before the block's first row */
        if (back <= first) {
            starts[i] = chunk * g.s.chunk_size + first - back;
            continue;
        }
        back -= first;
        int64_t seq = (int64_t)(chunk_word(&g, chunk, g.s.entry_state) >> 32);
        for (int64_t hop = 0; hop < length && !(seq & 1); hop++) {
            int64_t pseq, pc = predecessor(&g, chunk, seq, &pseq);
            if (pc < 0)
                break;
            int64_t rows = chunk_rows(&g, pc);
            if (back <= rows) {
                starts[i] = pc * g.s.chunk_size + rows - back;
                break;
            }
            back -= rows;
            chunk = pc;
            seq = pseq;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(at);
    PyMem_Free(us);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&mm);
    PyBuffer_Release(&raw);
    PyBuffer_Release(&out);
    return result;
}

/* What scoring a window needs besides its rows: see score_ratio. */
typedef struct {
    double exponent, maxfrac, unset, g0, scale;
    int tree;          /* -1: uniform proposals */
    Py_ssize_t length;
} Scoring;

/* Check the arguments common to score_ratio and accept; fill `c`. */
static int
scoring_args(const PG *g, const Py_buffer *rows, Py_ssize_t m, double exponent, double maxfrac,
             double top, double unset, int tree, Scoring *c, const char *who)
{
    if ((m > 0 && rows->len % (m * 8)) || tree < -1
        || tree >= g->s.n_trees || !(unset >= 0) || !(top >= unset)) {
        PyErr_Format(PyExc_ValueError, "%s: arguments do not fit", who);
        return -1;
    }
    c->length = m ? rows->len / 8 / m : 0;
    double e0 = tree >= 0 ? g->s.tree_exponent[tree] : 0;
    c->exponent = exponent;
    c->maxfrac = maxfrac;
    c->unset = unset;
    c->tree = tree;
    c->g0 = pow(top, e0);
    c->scale = pow(top, exponent - e0);
    return 0;
}

/* Load the first row word of the `n` windows from `v` on, one after the other: the
 * loads are independent, so their cache and TLB misses overlap, where scoring
 * them one at a time would wait for each in turn (a software prefetch gains
 * less: on a TLB miss it may be dropped). */
static inline void
touch_windows(const PG *g, const int64_t *v, Py_ssize_t length, Py_ssize_t n)
{
    uint64_t sink = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t row = v[j * length];
        if (row >= 0 && row < g->s.capacity)   /* scoring refuses the others */
            sink += atomic_load_explicit(word(g, g->s.prio_rows_at + 8 * row),
                                         memory_order_relaxed);
    }
    __asm__ volatile("" : : "r"(sink));   /* the loads are kept */
}

/* Window `w`'s score; *ratio = score / the bound its proposal had (see score_ratio).
 * -1 if a row of it lies outside the buffer (nothing is read there). */
static inline double
score_window(const PG *g, const Scoring *c, const int64_t *w, double *ratio)
{
    for (Py_ssize_t t = 0; t < c->length; t++)
        if (w[t] < 0 || w[t] >= g->s.capacity)
            return -1;
    double hi = 0, sum = 0, bound = 0;
    int by_tree = c->tree >= 0;
    /* Rows run consecutively within each chunk of the window: the chunk's tag
     * and the block are found once per chunk and stepped at block ends. */
    int64_t lo_row = 0, hi_row = 0, block_end = 0, b = 0;
    uint64_t tag = 0;
    for (Py_ssize_t t = 0; t < c->length; t++) {
        int64_t row = w[t];
        if (row < lo_row || row >= hi_row || row != w[t - (t > 0)] + (t > 0)) {
            int64_t chunk = row / g->s.chunk_size;
            int64_t first = (row - chunk * g->s.chunk_size) / g->s.prio_block;
            lo_row = chunk * g->s.chunk_size;
            hi_row = lo_row + chunk_rows(g, chunk);
            tag = tag_of(chunk_word(g, chunk, g->s.entry_ticket));
            b = chunk * g->s.prio_blocks_per_chunk + first;
            block_end = lo_row + (first + 1) * g->s.prio_block;
            if (by_tree)
                bound += leaf_bound(g, c->tree, b, c->g0);
        } else if (row >= block_end) {
            b++;
            block_end += g->s.prio_block;
            if (by_tree)
                bound += leaf_bound(g, c->tree, b, c->g0);
        }
        uint64_t pw = atomic_load_explicit(word(g, g->s.prio_rows_at + 8 * row),
                                           memory_order_relaxed);
        double p = pw >> 32 == tag ? (double)f32(pw) : c->unset;
        hi = p > hi ? p : hi;
        sum += p;
    }
    double s = pow(c->maxfrac * hi + (1 - c->maxfrac) * sum / (double)c->length, c->exponent);
    double mu = (by_tree ? bound : 1.0) * c->scale;
    *ratio = mu > 0 ? s / mu : 0;
    return s;
}

/*
 * score_ratio(buffer, geometry, rows, exponent, maxfrac, largest, unset, tree, score, ratio)
 *
 * tree: the index of the tree `propose` used (its exponent e0 <= exponent), or
 * -1 for uniform proposals.
 *
 * rows: (m, L) int64, windows located by _window_check.find.  score[i] =
 * (maxfrac * max + (1 - maxfrac) * mean) ** exponent of window i's
 * priorities (never-set steps count as `unset`).  `largest` is the bound of
 * every priority: at least the largest ever set and `unset` (the caller's
 * rule; count-1 leaves weigh it in `propose` too).  ratio[i] = score /
 * bound: with a tree, bound = (sum of the tree's leaf bounds of the blocks its
 * rows lie in) * largest ** (exponent - e0), the weight `propose` gave it;
 * with -1, bound = largest ** exponent, for uniform proposals.  Accepting
 * window i with probability ratio[i] makes accepted windows follow the score.
 */
static PyObject *
score_ratio(PyObject *self, PyObject *args)
{
    Py_buffer mm, rows, sc, ra;
    PyObject *geo;
    double exponent, maxfrac, top, unset;
    int tree;
    if (!PyArg_ParseTuple(args, "w*Oy*ddddiw*w*", &mm, &geo, &rows, &exponent, &maxfrac, &top,
                          &unset, &tree, &sc, &ra))
        return NULL;
    PyObject *result = NULL;
    PG g;
    Scoring c;
    if (parse(&mm, geo, &g) < 0)
        goto done;
    Py_ssize_t m = sc.len / 8;
    if (sc.len % 8 || ra.len != sc.len) {
        PyErr_SetString(PyExc_ValueError, "score_ratio: arguments do not fit");
        goto done;
    }
    if (scoring_args(&g, &rows, m, exponent, maxfrac, top, unset, tree, &c, "score_ratio") < 0)
        goto done;
    const int64_t *r = rows.buf;
    Py_ssize_t i = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < m; i++) {
        if (i % TOUCH == 0)
            touch_windows(&g, r + i * c.length, c.length, m - i < TOUCH ? m - i : TOUCH);
        double score = score_window(&g, &c, r + i * c.length, (double *)ra.buf + i);
        if (score < 0)
            break;
        ((double *)sc.buf)[i] = score;
    }
    Py_END_ALLOW_THREADS
    if (i < m) {
        PyErr_SetString(PyExc_ValueError, "score_ratio: row out of range");
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&mm);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&sc);
    PyBuffer_Release(&ra);
    return result;
}

/*
 * accept(buffer, geometry, rows, exponent, maxfrac, largest, unset, tree, uniforms, need,
 *        picked) -> (accepted, scored)
 *
 * The acceptance step of the draw, stopped as soon as it has enough: the
 * windows are scored in order, as score_ratio scores them, and window i is
 * accepted where uniforms[i] (float64, one per window) < its ratio; picked[k]
 * (int64, room for `need`) = the index of the k-th accepted window.  It stops
 * after `need` acceptances or the last window.  The windows it picks are
 * those that scoring every window and keeping the first `need` with
 * uniforms[i] < ratio[i] would pick; only the windows after the last one
 * picked go unscored.
 */
static PyObject *
accept(PyObject *self, PyObject *args)
{
    Py_buffer mm, rows, us, pk;
    PyObject *geo;
    double exponent, maxfrac, top, unset;
    int tree;
    Py_ssize_t need;
    if (!PyArg_ParseTuple(args, "w*Oy*ddddiy*nw*", &mm, &geo, &rows, &exponent, &maxfrac, &top,
                          &unset, &tree, &us, &need, &pk))
        return NULL;
    PyObject *result = NULL;
    PG g;
    Scoring c;
    if (parse(&mm, geo, &g) < 0)
        goto done;
    Py_ssize_t m = us.len / 8;
    if (us.len % 8 || need < 0 || pk.len < need * 8) {
        PyErr_SetString(PyExc_ValueError, "accept: arguments do not fit");
        goto done;
    }
    if (scoring_args(&g, &rows, m, exponent, maxfrac, top, unset, tree, &c, "accept") < 0)
        goto done;
    const int64_t *r = rows.buf;
    const double *u = us.buf;
    int64_t *picked = pk.buf;
    Py_ssize_t i = 0, k = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < m && k < need; i++) {
        if (i % TOUCH == 0)
            touch_windows(&g, r + i * c.length, c.length, m - i < TOUCH ? m - i : TOUCH);
        double ratio;
        if (score_window(&g, &c, r + i * c.length, &ratio) < 0)
            break;
        if (u[i] < ratio)
            picked[k++] = i;
    }
    Py_END_ALLOW_THREADS
    if (i < m && k < need) {
        PyErr_SetString(PyExc_ValueError, "accept: row out of range");
        goto done;
    }
    result = Py_BuildValue("nn", k, i);
done:
    PyBuffer_Release(&mm);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&us);
    PyBuffer_Release(&pk);
    return result;
}

/* mass(buffer, geometry, tree, largest) -> tree's total weight (count * largest ** e + sum). */
static PyObject *
mass(PyObject *self, PyObject *args)
{
    Py_buffer mm;
    PyObject *geo;
    int tree;
    double top;
    if (!PyArg_ParseTuple(args, "w*Oid", &mm, &geo, &tree, &top))
        return NULL;
    PG g;
    if (parse(&mm, geo, &g) < 0) {
        PyBuffer_Release(&mm);
        return NULL;
    }
    if (tree < 0 || tree >= g.s.n_trees) {
        PyBuffer_Release(&mm);
        PyErr_SetString(PyExc_ValueError, "mass: no such tree");
        return NULL;
    }
    uint64_t v = atomic_load_explicit(node(&g, tree, g.s.n_levels - 1, 0), memory_order_acquire);
    PyBuffer_Release(&mm);
    return PyFloat_FromDouble((double)(v >> 40) * pow(top, g.s.tree_exponent[tree]) + (double)f32(v));
}

static PyMethodDef methods[] = {
    {"update", update, METH_VARARGS, "update(buffer, geometry, ids, values) -> steps updated"},
    {"reset", reset, METH_VARARGS, "reset(buffer, geometry, chunk, ticket)"},
    {"repair", repair, METH_VARARGS, "repair(buffer, geometry)"},
    {"stale_nodes", stale_nodes, METH_VARARGS, "stale_nodes(buffer, geometry) -> (leaves, nodes)"},
    {"values", values, METH_VARARGS, "values(buffer, geometry, rows, out, explicit)"},
    {"propose", propose, METH_VARARGS,
     "propose(buffer, geometry, raw, length, tree, largest, starts)"},
    {"score_ratio", score_ratio, METH_VARARGS,
     "score_ratio(buffer, geometry, rows, exponent, maxfrac, largest, unset, tree, score, ratio)"},
    {"accept", accept, METH_VARARGS,
     "accept(buffer, geometry, rows, exponent, maxfrac, largest, unset, tree, uniforms, need, "
     "picked) -> (accepted, scored)"},
    {"mass", mass, METH_VARARGS, "mass(buffer, geometry, tree, largest) -> float"},
    SHM_READ_GEOMETRY_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmbuf.protocol._prio",
    "Shared priorities: row words, block bounds, the sum tree and the prioritized draw.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__prio(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && shm_geometry_export(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
