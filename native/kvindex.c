/*
 * kvstore._kvindex — the index's key table, compact and cache-friendly at tens of millions of blocks.
 *
 * CONTRACT (identical to kvstore.keytable.PyKeyTable, the pure-Python fallback; tests/test_keytable.py runs both)
 *   KeyTable(capacity_hint=0) maps 20-byte keys (4-byte namespace id + 16-byte block hash) to u64 values.
 *   Every key belongs to one eviction class cls (0..65535) and is either LINKED in that class's LRU list or
 *   UNLINKED (pinned: still in the map, not an eviction candidate).
 *     len(t), key in t, t.get(key) -> int | None           no LRU effect
 *     t.insert(key, value, cls)       new key, linked at the MRU end of cls; ValueError if the key exists
 *     t.set_value(key, value)         KeyError if absent
 *     t.remove(key) -> int | None     drops key from the map and its list; the old value, or None if absent
 *     t.touch(key) -> bool            linked key to the MRU end; False if absent; an unlinked key stays unlinked
 *     t.unlink(key) / t.relink(key)   out of / back at the MRU end of its list (both idempotent); KeyError if absent
 *     t.is_linked(key), t.cls_of(key) KeyError if absent
 *     t.oldest(cls) -> (key, value) | None   the least recently used linked key of cls (over its levels)
 *     t.class_len(cls, level=None) -> int   linked keys of cls (at that level)
 *   LEVELS (the `history` eviction policy's books, kvstore.policy.history): every key also has a level 0..3 (0 on
 *   insert), and a class's list is one list per level, each least recently used first. LRU never leaves level 0.
 *     t.level_of(key) -> int          KeyError if absent
 *     t.placement(key) -> int         cls * 4 + level, -1 if absent (one call where both are wanted)
 *     t.set_level(key, level)         to that level, at its MRU end if linked; KeyError if absent
 *     t.use(key, top, pin=False) -> int   one level up (top at most), to the MRU end if linked; with pin a use
 *                                     only of a linked key, which leaves its list; the level after; -1 if absent
 *     t.pick(cls, aging=None) -> (key, value) | None   the LRU key of the lowest non-empty level; with aging >= 0,
 *                                     the stalest of the levels' LRU keys where it has gone unused for more than
 *                                     aging times as long as that one (aging 1: plain LRU over the levels)
 *   Ages are u32 differences of a tick counted per push (`now`): a key unused for 2^32 pushes looks young again.
 *     t.prefix_len(prefix, hashes, touch=False) -> int
 *         key i = prefix (4 bytes) + hashes[16i:16i+16]; how many leading keys are present (stops at the first
 *         absent one); touch=True also touches each of them. prefix/hashes: any bytes-like object. ValueError if
 *         len(prefix) != 4 or len(hashes) % 16.
 *     t.items() -> iterator of (key, value), any order, over a snapshot (mutating while iterating is safe)
 *     t.nbytes() -> int               bytes of memory the table holds (also __sizeof__)
 *   Errors: key not bytes -> TypeError; key not 20 bytes -> ValueError; value not in 0..2**64-1 -> OverflowError;
 *   cls not in 0..65535 -> ValueError. Single-key methods take the key positionally only.
 *   Not thread-safe by itself: every method runs under the GIL and never releases it.
 *
 * LAYOUT. One open-addressing table of 2^bits slots (linear probing, load <= 3/4, doubling growth,
 * backward-shift deletion: no tombstones), as two parallel arrays indexed by slot:
 *   Rec  recs[]:  key[20], meta u32, value u64 — 32 bytes, two per 64-byte cache line. meta = top 32 bits of
 *                 the key's 64-bit hash with bit 0 forced on (0 = empty slot); the key's home slot is
 *                 meta >> (32 - bits), so moves and growth never rehash keys. A lookup reads one cache line.
 *   Link links[]: prev u32, next u32 (slot numbers, NIL = none), cls u16, linked u8, level u8, tick u32 (of its
 *                 last push) — 16 bytes, read only by the LRU operations.
 * Per-list head (LRU end) / tail (MRU end) / length arrays (NLEV lists a class) grow on demand up to 65536 classes.
 * When an entry moves slot (backward shift) its list neighbours are re-pointed; growth re-inserts every entry
 * into the new arrays, leaving each one's new slot number behind in its old record to translate the links.
 * Memory: 48 bytes per slot, 64–128 bytes per key (about 80 at 10 million keys). Arrays of 1 MiB and more are
 * anonymous mappings advised to use transparent huge pages (fewer TLB misses on random probes).
 * prefix_len, the hot path, overlaps the memory misses of up to 32 keys (see there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define KEY_BYTES 20
#define HASH_BYTES 16
#define NIL 0xFFFFFFFFu
#define MAX_CLS 65536
#define MIN_BITS 6
#define MAX_BITS 31                 /* 2^31 slots: up to 1.6 billion keys */
#define CHUNK 32                    /* prefix_len hashes and prefetches this many keys ahead */
#define CACHED_BYTES ((size_t)4 << 20)   /* records up to this size: prefix_len assumes cache hits */
#define RECS_PER_LINE 2              /* 64-byte cache lines of 32-byte records, arrays 64-byte aligned */
#define BIG_BYTES ((size_t)1 << 20)
#define HUGE_PAGE ((size_t)2 << 20)

typedef struct { uint8_t key[KEY_BYTES]; uint32_t meta; uint64_t value; } Rec;
typedef struct { uint32_t prev, next; uint16_t cls; uint8_t linked, level; uint32_t tick; } Link;
_Static_assert(sizeof(Rec) == 32 && sizeof(Link) == 16, "record layout");
#define NLEV 4                      /* levels a class's list is split in */
#define LID(x) ((uint32_t)(x)->cls * NLEV + (x)->level)

typedef struct {
    PyObject_HEAD
    Rec *recs;
    Link *links;
    uint32_t bits, mask;            /* 2^bits slots, mask = 2^bits - 1 */
    uint32_t n;                     /* keys */
    uint32_t *head, *tail, *clen;   /* per list (class x NLEV + level): LRU slot, MRU slot, linked keys */
    uint32_t ncls;                  /* classes allocated in those three arrays (NLEV lists each) */
    uint32_t now;                   /* the tick of the last push (wraps: ages are u32 differences) */
} KeyTable;

static inline uint64_t load64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t load32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* ---- memory: aligned_alloc below 1 MiB, else a 2 MiB-aligned anonymous mapping advised for huge pages ---- */
static size_t big_round(size_t bytes) { return bytes < BIG_BYTES ? bytes : (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1); }

static void *big_alloc(size_t bytes) {   /* zero-filled, 64-byte aligned */
    if (bytes < BIG_BYTES) {
        void *p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        if (p) memset(p, 0, bytes);
        return p;
    }
    size_t len = big_round(bytes), span = len + HUGE_PAGE;
    uint8_t *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    uint8_t *a = (uint8_t *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (a > p) munmap(p, (size_t)(a - p));
    if (p + span > a + len) munmap(a + len, (size_t)(p + span - (a + len)));
#ifdef MADV_HUGEPAGE
    madvise(a, len, MADV_HUGEPAGE);
#endif
    return a;
}

static void big_free(void *p, size_t bytes) {
    if (!p) return;
    if (bytes < BIG_BYTES) free(p); else munmap(p, big_round(bytes));
}

/* ---- hashing: the 16-byte block hash is already uniform; mix in the namespace, then murmur3's finalizer ---- */
static inline uint32_t meta_of(const uint8_t *prefix, const uint8_t *h16) {
    uint64_t h = load64(h16) ^ (load64(h16 + 8) * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)load32(prefix) * 0xC2B2AE3D27D4EB4Full);
    h ^= h >> 33; h *= 0xff51afd7ed558ccdull; h ^= h >> 33; h *= 0xc4ceb9fe1a85ec53ull; h ^= h >> 33;
    return (uint32_t)(h >> 32) | 1u;
}

static inline uint32_t home_of(const KeyTable *t, uint32_t meta) { return meta >> (32 - t->bits); }

static inline int key_eq(const Rec *r, const uint8_t *prefix, const uint8_t *h16) {
    return load32(r->key) == load32(prefix) && load64(r->key + 4) == load64(h16) && load64(r->key + 12) == load64(h16 + 8);
}

/* Slot holding the key, or -1 with *hole (if given) set to the empty slot ending its probe run; from slot i on. */
static inline int64_t find_from(const KeyTable *t, const uint8_t *prefix, const uint8_t *h16, uint32_t meta,
                                uint32_t i, uint32_t *hole) {
    for (;;) {
        const Rec *r = &t->recs[i];
        if (r->meta == 0) { if (hole) *hole = i; return -1; }
        if (r->meta == meta && key_eq(r, prefix, h16)) return i;
        i = (i + 1) & t->mask;
    }
}

static inline int64_t find(const KeyTable *t, const uint8_t *prefix, const uint8_t *h16, uint32_t meta, uint32_t *hole) {
    return find_from(t, prefix, h16, meta, home_of(t, meta), hole);
}

/* ---- per-class LRU lists over slot numbers: head = least recently used, tail = most ---- */
static int ensure_cls(KeyTable *t, uint32_t cls) {
    if (cls < t->ncls) return 0;
    uint32_t n = t->ncls ? t->ncls : 16;
    while (n <= cls) n *= 2;
    if (n > MAX_CLS) n = MAX_CLS;
    size_t bytes = (size_t)n * NLEV * 4u;
    uint32_t *h = PyMem_Realloc(t->head, bytes);
    if (h) t->head = h;
    uint32_t *tl = h ? PyMem_Realloc(t->tail, bytes) : NULL;
    if (tl) t->tail = tl;
    uint32_t *c = tl ? PyMem_Realloc(t->clen, bytes) : NULL;
    if (!c) { PyErr_NoMemory(); return -1; }   /* the arrays that did grow are simply larger than ncls says */
    t->clen = c;
    for (uint32_t i = t->ncls * NLEV; i < n * NLEV; i++) { t->head[i] = t->tail[i] = NIL; t->clen[i] = 0; }
    t->ncls = n;
    return 0;
}

static void lru_unlink(KeyTable *t, uint32_t i) {
    Link *x = &t->links[i];
    if (!x->linked) return;
    uint32_t l = LID(x);
    if (x->prev != NIL) t->links[x->prev].next = x->next; else t->head[l] = x->next;
    if (x->next != NIL) t->links[x->next].prev = x->prev; else t->tail[l] = x->prev;
    x->linked = 0; x->prev = x->next = NIL;
    t->clen[l]--;
}

static void lru_push(KeyTable *t, uint32_t i) {   /* at the MRU end of its level's list */
    Link *x = &t->links[i];
    uint32_t l = LID(x);
    x->prev = t->tail[l]; x->next = NIL;
    if (x->prev != NIL) t->links[x->prev].next = i; else t->head[l] = i;
    t->tail[l] = i;
    x->linked = 1;
    x->tick = ++t->now;
    t->clen[l]++;
}

static inline void lru_touch(KeyTable *t, uint32_t i) {
    Link *x = &t->links[i];
    if (!x->linked) return;
    if (t->tail[LID(x)] != i) { lru_unlink(t, i); lru_push(t, i); }
    else x->tick = ++t->now;        /* the MRU of its level, maybe not of its class: its age starts again */
}

/* The victim of class cls: the LRU key of its lowest non-empty level; or, aging by a factor (aging >= 0), the
 * stalest of the levels' LRU keys where it has gone unused for more than `aging` times as long as that one
 * (aging 1: plain LRU over all levels). -1 if the class has no linked key. */
static int64_t pick_slot(const KeyTable *t, uint32_t cls, double aging) {
    if (cls >= t->ncls) return -1;
    int64_t first = -1, oldest = -1;
    uint32_t oldest_age = 0;
    for (uint32_t l = cls * NLEV; l < cls * NLEV + NLEV; l++) {
        uint32_t h = t->head[l];
        if (h == NIL) continue;
        uint32_t age = t->now - t->links[h].tick;
        if (first < 0) { first = h; if (aging < 0) return first; }
        if (oldest < 0 || age > oldest_age) { oldest = h; oldest_age = age; }
    }
    if (first < 0 || oldest == first) return first;
    return (double)oldest_age > aging * (double)(t->now - t->links[first].tick) ? oldest : first;
}

/* ---- table maintenance ---- */
static int alloc_arrays(uint32_t bits, Rec **recs, Link **links) {
    size_t n = (size_t)1 << bits;
    *recs = big_alloc(n * sizeof(Rec));
    *links = big_alloc(n * sizeof(Link));
    if (*recs && *links) return 0;
    big_free(*recs, n * sizeof(Rec)); big_free(*links, n * sizeof(Link));
    PyErr_NoMemory();
    return -1;
}

static void free_arrays(KeyTable *t) {
    size_t n = (size_t)t->mask + 1;
    big_free(t->recs, n * sizeof(Rec)); big_free(t->links, n * sizeof(Link));
    t->recs = NULL; t->links = NULL;
}

/* Re-insert every entry into 2^bits new slots. Pass 1 copies records and links (links still in old slot numbers)
 * and leaves each entry's new slot in its old record's value field; pass 2 translates the links through them. */
static int resize(KeyTable *t, uint32_t bits) {
    Rec *nr; Link *nl;
    if (alloc_arrays(bits, &nr, &nl) < 0) return -1;
    Rec *orecs = t->recs;
    uint32_t omask = t->mask, nmask = (uint32_t)(((uint64_t)1 << bits) - 1), shift = 32 - bits;
    for (uint64_t s = 0; s <= omask; s++) {
        if (!orecs[s].meta) continue;
        uint32_t i = orecs[s].meta >> shift;
        while (nr[i].meta) i = (i + 1) & nmask;
        nr[i] = orecs[s]; nl[i] = t->links[s];
        orecs[s].value = i;
    }
    for (uint64_t i = 0; i <= nmask; i++) {
        if (!nr[i].meta || !nl[i].linked) continue;
        if (nl[i].prev != NIL) nl[i].prev = (uint32_t)orecs[nl[i].prev].value;
        if (nl[i].next != NIL) nl[i].next = (uint32_t)orecs[nl[i].next].value;
    }
    for (uint32_t l = 0; l < t->ncls * NLEV; l++) {
        if (t->head[l] != NIL) t->head[l] = (uint32_t)orecs[t->head[l]].value;
        if (t->tail[l] != NIL) t->tail[l] = (uint32_t)orecs[t->tail[l]].value;
    }
    free_arrays(t);
    t->recs = nr; t->links = nl; t->bits = bits; t->mask = nmask;
    return 0;
}

/* Move the entry in slot `from` to the empty slot `to`, re-pointing its list neighbours. */
static void move_slot(KeyTable *t, uint32_t from, uint32_t to) {
    t->recs[to] = t->recs[from];
    Link *x = &t->links[to];
    *x = t->links[from];
    if (!x->linked) return;
    if (x->prev != NIL) t->links[x->prev].next = to; else t->head[LID(x)] = to;
    if (x->next != NIL) t->links[x->next].prev = to; else t->tail[LID(x)] = to;
}

/* Remove the entry in slot i: unlink it, then shift back each later entry of the run that may fill the hole
 * (one whose home is not cyclically within (hole, its slot]). */
static void remove_at(KeyTable *t, uint32_t i) {
    lru_unlink(t, i);
    for (uint32_t j = (i + 1) & t->mask; t->recs[j].meta; j = (j + 1) & t->mask) {
        uint32_t home = home_of(t, t->recs[j].meta);
        if (((j - home) & t->mask) >= ((j - i) & t->mask)) { move_slot(t, j, i); i = j; }
    }
    memset(&t->recs[i], 0, sizeof(Rec));
    t->links[i] = (Link){NIL, NIL, 0, 0, 0, 0};
    t->n--;
}

/* ---- argument helpers ---- */
static int get_key(PyObject *o, const uint8_t **k) {
    if (!PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "key must be bytes, not %.100s", Py_TYPE(o)->tp_name); return -1;
    }
    if (PyBytes_GET_SIZE(o) != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "key must be %d bytes, got %zd", KEY_BYTES, PyBytes_GET_SIZE(o)); return -1;
    }
    *k = (const uint8_t *)PyBytes_AS_STRING(o);
    return 0;
}

static int get_u64(PyObject *o, uint64_t *v) {
    PyObject *i = PyNumber_Index(o);
    if (!i) return -1;
    unsigned long long x = PyLong_AsUnsignedLongLong(i);   /* OverflowError if negative or >= 2**64 */
    Py_DECREF(i);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *v = x;
    return 0;
}

static int get_cls(PyObject *o, uint32_t *cls) {
    if (PyLong_CheckExact(o)) {                 /* the common case, without a new reference */
        int overflow;
        long c = PyLong_AsLongAndOverflow(o, &overflow);
        if (!overflow && c >= 0 && c < MAX_CLS) { *cls = (uint32_t)c; return 0; }
    }
    PyObject *i = PyNumber_Index(o);
    if (!i) return -1;
    int overflow;
    long c = PyLong_AsLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (c == -1 && PyErr_Occurred()) return -1;
    if (overflow || c < 0 || c >= MAX_CLS) { PyErr_Format(PyExc_ValueError, "cls must be in 0..65535, got %R", o); return -1; }
    *cls = (uint32_t)c;
    return 0;
}

/* Arguments of a METH_FASTCALL | METH_KEYWORDS method, by position or name, into out[0..nmax); nreq required. */
static int parse_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      const char *const *names, int nreq, int nmax, PyObject **out) {
    if (nargs > nmax) { PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fn, nmax, nargs); return -1; }
    for (int i = 0; i < nmax; i++) out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        while (i < nmax && PyUnicode_CompareWithASCIIString(name, names[i]) != 0) i++;
        if (i == nmax) { PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, name); return -1; }
        if (out[i]) { PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn, names[i]); return -1; }
        out[i] = args[nargs + k];
    }
    for (int i = 0; i < nreq; i++)
        if (!out[i]) { PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]); return -1; }
    return 0;
}

/* Slot of the key; -1 if absent (KeyError set when `raise`); -2 on a bad key (error set). */
static int64_t lookup(KeyTable *t, PyObject *keyobj, int raise) {
    const uint8_t *k;
    if (get_key(keyobj, &k) < 0) return -2;
    int64_t s = find(t, k, k + 4, meta_of(k, k + 4), NULL);
    if (s < 0 && raise) { PyErr_SetObject(PyExc_KeyError, keyobj); return -2; }
    return s;
}

/* ---- methods ---- */
static PyObject *kt_get(KeyTable *t, PyObject *key) {
    int64_t s = lookup(t, key, 0);
    if (s == -2) return NULL;
    if (s < 0) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(t->recs[s].value);
}

static PyObject *kt_insert(KeyTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"key", "value", "cls"};
    PyObject *a[3]; const uint8_t *k; uint64_t v; uint32_t cls, hole;
    if (parse_args("insert", args, nargs, kwnames, names, 3, 3, a) < 0 || get_key(a[0], &k) < 0 ||
        get_u64(a[1], &v) < 0 || get_cls(a[2], &cls) < 0 || ensure_cls(t, cls) < 0)
        return NULL;
    uint32_t meta = meta_of(k, k + 4);
    if (find(t, k, k + 4, meta, &hole) >= 0) { PyErr_SetString(PyExc_ValueError, "key already present"); return NULL; }
    if ((uint64_t)(t->n + 1) * 4 > ((uint64_t)t->mask + 1) * 3) {
        if (t->bits >= MAX_BITS) { PyErr_SetString(PyExc_MemoryError, "KeyTable is full"); return NULL; }
        if (resize(t, t->bits + 1) < 0) return NULL;
        find(t, k, k + 4, meta, &hole);
    }
    Rec *r = &t->recs[hole];
    memcpy(r->key, k, KEY_BYTES); r->meta = meta; r->value = v;
    t->links[hole] = (Link){NIL, NIL, (uint16_t)cls, 0, 0, 0};
    lru_push(t, hole);
    t->n++;
    Py_RETURN_NONE;
}

static PyObject *kt_set_value(KeyTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"key", "value"};
    PyObject *a[2]; uint64_t v;
    if (parse_args("set_value", args, nargs, kwnames, names, 2, 2, a) < 0) return NULL;
    int64_t s = lookup(t, a[0], 1);
    if (s < 0 || get_u64(a[1], &v) < 0) return NULL;
    t->recs[s].value = v;
    Py_RETURN_NONE;
}

static PyObject *kt_remove(KeyTable *t, PyObject *key) {
    int64_t s = lookup(t, key, 0);
    if (s == -2) return NULL;
    if (s < 0) Py_RETURN_NONE;
    uint64_t v = t->recs[s].value;
    remove_at(t, (uint32_t)s);
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *kt_touch(KeyTable *t, PyObject *key) {
    int64_t s = lookup(t, key, 0);
    if (s == -2) return NULL;
    if (s < 0) Py_RETURN_FALSE;
    lru_touch(t, (uint32_t)s);
    Py_RETURN_TRUE;
}

static PyObject *kt_unlink(KeyTable *t, PyObject *key) {
    int64_t s = lookup(t, key, 1);
    if (s < 0) return NULL;
    lru_unlink(t, (uint32_t)s);
    Py_RETURN_NONE;
}

static PyObject *kt_relink(KeyTable *t, PyObject *key) {
    int64_t s = lookup(t, key, 1);
    if (s < 0) return NULL;
    if (!t->links[s].linked) lru_push(t, (uint32_t)s);
    Py_RETURN_NONE;
}

static PyObject *kt_is_linked(KeyTable *t, PyObject *key) {
    int64_t s = lookup(t, key, 1);
    if (s < 0) return NULL;
    return PyBool_FromLong(t->links[s].linked);
}

static PyObject *kt_cls_of(KeyTable *t, PyObject *key) {
    int64_t s = lookup(t, key, 1);
    if (s < 0) return NULL;
    return PyLong_FromLong(t->links[s].cls);
}

static PyObject *rec_item(const Rec *r) {
    return Py_BuildValue("(y#K)", (const char *)r->key, (Py_ssize_t)KEY_BYTES, (unsigned long long)r->value);
}

static PyObject *kt_oldest(KeyTable *t, PyObject *clsobj) {
    uint32_t cls;
    if (get_cls(clsobj, &cls) < 0) return NULL;
    int64_t s = pick_slot(t, cls, 1.0);
    if (s < 0) Py_RETURN_NONE;
    return rec_item(&t->recs[s]);
}

static int get_level(PyObject *o, const char *what, uint32_t *level) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v >= NLEV) { PyErr_Format(PyExc_ValueError, "%s must be in 0..%d, got %ld", what, NLEV - 1, v); return -1; }
    *level = (uint32_t)v;
    return 0;
}

static PyObject *kt_class_len(KeyTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"cls", "level"};
    PyObject *a[2]; uint32_t cls, level = 0, n = 0;
    if (parse_args("class_len", args, nargs, kwnames, names, 1, 2, a) < 0 || get_cls(a[0], &cls) < 0) return NULL;
    int one = a[1] && a[1] != Py_None;
    if (one && get_level(a[1], "level", &level) < 0) return NULL;
    for (uint32_t l = 0; cls < t->ncls && l < NLEV; l++)
        if (!one || l == level) n += t->clen[cls * NLEV + l];
    return PyLong_FromUnsignedLong(n);
}

/* Move the entry in slot s to `level`: at the MRU end of that level's list if linked. */
static void set_level_at(KeyTable *t, uint32_t s, uint32_t level) {
    Link *x = &t->links[s];
    if (!x->linked) { x->level = (uint8_t)level; return; }
    lru_unlink(t, s);
    x->level = (uint8_t)level;
    lru_push(t, s);
}

static PyObject *kt_level_of(KeyTable *t, PyObject *key) {
    int64_t s = lookup(t, key, 1);
    if (s < 0) return NULL;
    return PyLong_FromLong(t->links[s].level);
}

static PyObject *kt_placement(KeyTable *t, PyObject *key) {
    int64_t s = lookup(t, key, 0);
    if (s == -2) return NULL;
    return PyLong_FromLong(s < 0 ? -1 : (long)t->links[s].cls * NLEV + t->links[s].level);
}

static PyObject *kt_set_level(KeyTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"key", "level"};
    PyObject *a[2]; uint32_t level;
    if (parse_args("set_level", args, nargs, kwnames, names, 2, 2, a) < 0) return NULL;
    int64_t s = lookup(t, a[0], 1);
    if (s < 0 || get_level(a[1], "level", &level) < 0) return NULL;
    set_level_at(t, (uint32_t)s, level);
    Py_RETURN_NONE;
}

/* A use of a key: one level up (to `top` at most), at the MRU end of its list if linked; with pin, a use only of a
 * linked key, which then leaves its list. The key's level after it; -1 if absent. */
static PyObject *kt_use(KeyTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"key", "top", "pin"};
    PyObject *a[3]; uint32_t top;
    if (parse_args("use", args, nargs, kwnames, names, 2, 3, a) < 0) return NULL;
    int pin = a[2] ? PyObject_IsTrue(a[2]) : 0;
    if (pin < 0) return NULL;
    int64_t s = lookup(t, a[0], 0);
    if (s == -2 || get_level(a[1], "top", &top) < 0) return NULL;
    if (s < 0) return PyLong_FromLong(-1);
    Link *x = &t->links[s];
    if (pin && !x->linked) return PyLong_FromLong(x->level);
    uint32_t level = x->level < top ? x->level + 1u : x->level;
    if (pin) { lru_unlink(t, (uint32_t)s); x->level = (uint8_t)level; }
    else set_level_at(t, (uint32_t)s, level);
    return PyLong_FromLong(level);
}

static PyObject *kt_pick(KeyTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"cls", "aging"};
    PyObject *a[2]; uint32_t cls;
    if (parse_args("pick", args, nargs, kwnames, names, 1, 2, a) < 0 || get_cls(a[0], &cls) < 0) return NULL;
    double aging = -1.0;
    if (a[1] && a[1] != Py_None) {
        aging = PyFloat_AsDouble(a[1]);
        if (aging == -1.0 && PyErr_Occurred()) return NULL;
        if (aging < 0) { PyErr_Format(PyExc_ValueError, "aging must be >= 0 or None, got %R", a[1]); return NULL; }
    }
    int64_t s = pick_slot(t, cls, aging);
    if (s < 0) Py_RETURN_NONE;
    return rec_item(&t->recs[s]);
}

/* The lookup hot path, a chunk of keys at a time: hash each key and prefetch its home slot's cache line (and its
 * links when touching); probe each key within that line, prefetching the next line for a probe run that goes on;
 * then finish those runs in order and count (and touch) up to the first absent key. At 10 million keys every line
 * is a memory miss: this way the misses of a chunk overlap instead of following one another. */
static PyObject *kt_prefix_len(KeyTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"prefix", "hashes", "touch"};
    PyObject *a[3];
    if (parse_args("prefix_len", args, nargs, kwnames, names, 2, 3, a) < 0) return NULL;
    int touch = a[2] ? PyObject_IsTrue(a[2]) : 0;
    if (touch < 0) return NULL;
    Py_buffer pb, hb;
    if (PyObject_GetBuffer(a[0], &pb, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(a[1], &hb, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&pb); return NULL; }
    PyObject *result = NULL;
    if (pb.len != 4) { PyErr_Format(PyExc_ValueError, "prefix must be 4 bytes, got %zd", pb.len); goto done; }
    if (hb.len % HASH_BYTES) { PyErr_Format(PyExc_ValueError, "hashes must be a multiple of 16 bytes, got %zd", hb.len); goto done; }
    const uint8_t *prefix = pb.buf, *hashes = hb.buf;
    uint32_t metas[CHUNK], at[CHUNK];   /* at: the key's slot, or (pending) where its probe run goes on */
    uint8_t pending[CHUNK];
    Py_ssize_t total = hb.len / HASH_BYTES, n = 0;
    int cached = ((size_t)t->mask + 1) * sizeof(Rec) <= CACHED_BYTES;
    while (n < total) {
        Py_ssize_t m = total - n < CHUNK ? total - n : CHUNK, j, stop;
        const uint8_t *h16 = hashes + n * HASH_BYTES;
        for (j = 0; j < m; j++) {
            metas[j] = meta_of(prefix, h16 + j * HASH_BYTES);
            uint32_t home = home_of(t, metas[j]);
            __builtin_prefetch(&t->recs[home]);
            if (touch) __builtin_prefetch(&t->links[home]);
        }
        if (cached) {                   /* the table fits in the caches: probe each key to its end, in order */
            for (j = 0; j < m; j++) {
                int64_t s = find(t, prefix, h16 + j * HASH_BYTES, metas[j], NULL);
                if (s < 0) break;
                if (touch) lru_touch(t, (uint32_t)s);
            }
            n += j;
            if (j < m) break;
            continue;
        }
        for (j = 0, stop = m; j < stop; j++) {
            uint32_t i = home_of(t, metas[j]);
            pending[j] = 0;
            for (;;) {
                const Rec *r = &t->recs[i];
                if (r->meta == 0) { stop = j; break; }
                if (r->meta == metas[j] && key_eq(r, prefix, h16 + j * HASH_BYTES)) { at[j] = i; break; }
                i = (i + 1) & t->mask;
                if (i % RECS_PER_LINE == 0) { pending[j] = 1; at[j] = i; __builtin_prefetch(&t->recs[i]); break; }
            }
        }
        for (j = 0; j < stop; j++) {
            if (pending[j]) {
                int64_t s = find_from(t, prefix, h16 + j * HASH_BYTES, metas[j], at[j], NULL);
                if (s < 0) break;
                at[j] = (uint32_t)s;
            }
            if (touch) lru_touch(t, at[j]);
        }
        n += j;
        if (j < m) break;
    }
    result = PyLong_FromSsize_t(n);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&hb);
    return result;
}

static PyObject *kt_items(KeyTable *t, PyObject *unused) {
    (void)unused;
    PyObject *list = PyList_New(t->n);
    if (!list) return NULL;
    Py_ssize_t k = 0;
    for (uint64_t s = 0; s <= t->mask && k < (Py_ssize_t)t->n; s++) {
        if (!t->recs[s].meta) continue;
        PyObject *item = rec_item(&t->recs[s]);
        if (!item) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, k++, item);
    }
    PyObject *it = PyObject_GetIter(list);   /* an iterator over the snapshot, like the fallback's */
    Py_DECREF(list);
    return it;
}

static PyObject *kt_nbytes(KeyTable *t, PyObject *unused) {
    (void)unused;
    size_t slots = (size_t)t->mask + 1;
    size_t b = sizeof(KeyTable) + big_round(slots * sizeof(Rec)) + big_round(slots * sizeof(Link)) + (size_t)t->ncls * NLEV * 12;
    return PyLong_FromSize_t(b);
}

static Py_ssize_t kt_len(KeyTable *t) { return t->n; }

static int kt_contains(KeyTable *t, PyObject *key) {
    int64_t s = lookup(t, key, 0);
    return s == -2 ? -1 : s >= 0;
}

/* ---- lifecycle: __new__ makes a usable empty table; __init__ may size it for capacity_hint keys ---- */
static PyObject *kt_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args; (void)kw;
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    if (!t) return NULL;
    t->bits = MIN_BITS; t->mask = (1u << MIN_BITS) - 1;
    if (alloc_arrays(MIN_BITS, &t->recs, &t->links) < 0) { Py_DECREF(t); return NULL; }
    return (PyObject *)t;
}

static int kt_init(KeyTable *t, PyObject *args, PyObject *kw) {
    static char *names[] = {"capacity_hint", NULL};
    Py_ssize_t hint = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|n:KeyTable", names, &hint)) return -1;
    if (hint < 0 || (uint64_t)hint * 4 > ((uint64_t)1 << MAX_BITS) * 3) {
        PyErr_Format(PyExc_ValueError, "capacity_hint must be in 0..%llu", (((unsigned long long)1 << MAX_BITS) * 3) / 4);
        return -1;
    }
    uint32_t bits = MIN_BITS;
    while (((uint64_t)1 << bits) * 3 < (uint64_t)hint * 4) bits++;
    if (bits <= t->bits) return 0;
    if (t->n) { PyErr_SetString(PyExc_RuntimeError, "KeyTable is already in use"); return -1; }
    return resize(t, bits);
}

static void kt_dealloc(KeyTable *t) {
    free_arrays(t);
    PyMem_Free(t->head); PyMem_Free(t->tail); PyMem_Free(t->clen);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

#define FAST(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL | METH_KEYWORDS
static PyMethodDef kt_methods[] = {
    {"get", (PyCFunction)kt_get, METH_O, "get(key, /): the value of key, or None (no LRU effect)"},
    {"insert", FAST(kt_insert), "insert(key, value, cls): a new key, linked at the MRU end of cls"},
    {"set_value", FAST(kt_set_value), "set_value(key, value); KeyError if absent"},
    {"remove", (PyCFunction)kt_remove, METH_O, "remove(key, /): drop key; its old value, or None if absent"},
    {"touch", (PyCFunction)kt_touch, METH_O, "touch(key, /): a linked key to the MRU end; False if absent"},
    {"unlink", (PyCFunction)kt_unlink, METH_O, "unlink(key, /): out of its LRU list (pinned); KeyError if absent"},
    {"relink", (PyCFunction)kt_relink, METH_O, "relink(key, /): back at the MRU end; KeyError if absent"},
    {"is_linked", (PyCFunction)kt_is_linked, METH_O, "is_linked(key, /): whether key is an eviction candidate"},
    {"cls_of", (PyCFunction)kt_cls_of, METH_O, "cls_of(key, /): the class of key"},
    {"oldest", (PyCFunction)kt_oldest, METH_O, "oldest(cls, /): (key, value) of the LRU linked key of cls, or None"},
    {"class_len", FAST(kt_class_len), "class_len(cls, level=None): linked keys in cls (at that level)"},
    {"level_of", (PyCFunction)kt_level_of, METH_O, "level_of(key, /): the level of key (0..3); KeyError if absent"},
    {"placement", (PyCFunction)kt_placement, METH_O, "placement(key, /): cls * 4 + level of key, -1 if absent"},
    {"set_level", FAST(kt_set_level), "set_level(key, level): key to level (at its MRU end if linked); KeyError if absent"},
    {"use", FAST(kt_use), "use(key, top, pin=False): one level up (top at most) and MRU; pin: a linked key only, unlinked; its level, -1 if absent"},
    {"pick", FAST(kt_pick), "pick(cls, aging=None): (key, value) of the victim by levels (see the module doc), or None"},
    {"prefix_len", FAST(kt_prefix_len), "prefix_len(prefix, hashes, touch=False): how many leading keys are present"},
    {"items", (PyCFunction)kt_items, METH_NOARGS, "items(): iterator of (key, value) over a snapshot"},
    {"nbytes", (PyCFunction)kt_nbytes, METH_NOARGS, "nbytes(): bytes of memory the table holds"},
    {"__sizeof__", (PyCFunction)kt_nbytes, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods kt_as_sequence = {.sq_length = (lenfunc)kt_len, .sq_contains = (objobjproc)kt_contains};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore._kvindex.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KeyTable(capacity_hint=0): map 20-byte keys to u64 values, with an intrusive LRU list per class.",
    .tp_new = kt_new,
    .tp_init = (initproc)kt_init,
    .tp_dealloc = (destructor)kt_dealloc,
    .tp_methods = kt_methods,
    .tp_as_sequence = &kt_as_sequence,
};

/* ==== History: what the `history` eviction policy remembers of the blocks it evicted (kvstore.policy.levels) ====
 *   History(capacity) remembers the last `capacity` records key -> level (1..255) made, forgetting the oldest
 *   first; a key's answer is its newest record among them (one recorded again leaves a dead record behind).
 *     h.record(key, level)     a record, the newest
 *     h.level(key) -> int      the key's level, 0 if not remembered
 *     h.resize(capacity)       keeps the newest records that fit
 *     len(h), h.capacity, h.nbytes()
 *   Keys are any bytes (the host pool's 20-byte keys, the SSD tier's block ids), known by a 56-bit fingerprint.
 *   LAYOUT: a ring of the records in the order they came, 8 bytes each: the fingerprint's top 56 bits and the level
 *   (0 = a dead record: one recorded again later); an open-addressing index (linear probing from the fingerprint's
 *   top bits, load <= 3/4, backward-shift deletion) of 8-byte entries: ring position + 1 (low 32 bits; 0 = empty)
 *   and the fingerprint's top 32 bits, so that an entry's home is known without reading the ring — 19–29 bytes a
 *   record, and 1.3–2.7 more for the filters in front of the index (hx_mark). A look reads one line of the index, and the ring's record where the entry's 32 bits match; records
 *   are gathered HX_PENDING at a time and go in together (hx_flush). Every operation is O(1) but resize. */
#define HX_PENDING 32               /* records gathered before they go in together (their misses overlap) */
typedef struct {
    PyObject_HEAD
    uint64_t *ring;         /* fingerprint's top 56 bits | level; oldest at `first` */
    uint64_t *ix;           /* pos + 1 (bits 0-31; 0 = empty) | fingerprint's top 32 bits (32-63) */
    uint32_t cap, first, used;      /* ring capacity, oldest position, positions used (live or dead) */
    uint32_t live, bits;            /* live records; the index has 2^bits slots */
    uint64_t pend[HX_PENDING];      /* records not yet in the ring, oldest first (fingerprint's top 56 | level) */
    uint64_t pmask;                 /* bit (fingerprint >> 8) % 64 of each pending record: most looks skip them */
    uint64_t *filt;                 /* HX_GENS Bloom filters of the records in the ring (see hx_maybe) */
    uint32_t fwords, fgen, fcount, fsize;   /* words a filter (a power of 2), the one filled now, its records, */
                                            /* records a filter takes before the oldest is cleared for the next */
    uint32_t npend;
} History;

#define HX_POS(e) ((uint32_t)(e))
#define HX_ID(fp) ((fp) & ~0xFFull)                 /* what the ring keeps of a fingerprint */

static uint64_t fp_of(const uint8_t *p, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (; n >= 8; p += 8, n -= 8) { h ^= load64(p); h *= 0xff51afd7ed558ccdull; h ^= h >> 32; }
    uint64_t tail = 0;
    memcpy(&tail, p, (size_t)n);
    h ^= tail; h *= 0xc4ceb9fe1a85ec53ull; h ^= h >> 29; h *= 0xff51afd7ed558ccdull; h ^= h >> 32;
    return h;
}

static inline uint32_t hx_home_of_entry(const History *h, uint64_t e) { return (uint32_t)(e >> (64 - h->bits)); }
static inline uint32_t hx_home(const History *h, uint64_t fp) { return (uint32_t)(fp >> (64 - h->bits)); }

/* The index slot of fp's entry, or -1 (with *hole the empty slot that ends its run). */
static int64_t hx_find(const History *h, uint64_t fp, uint32_t *hole) {
    uint32_t mask = (1u << h->bits) - 1;
    uint64_t hi = fp & 0xFFFFFFFF00000000ull;
    for (uint32_t i = hx_home(h, fp);; i = (i + 1) & mask) {
        uint64_t e = h->ix[i];
        if (!e) { if (hole) *hole = i; return -1; }
        if ((e & 0xFFFFFFFF00000000ull) == hi && HX_ID(h->ring[HX_POS(e) - 1]) == HX_ID(fp)) return i;
    }
}

static inline int hx_level_at(const History *h, int64_t i) { return (int)(h->ring[HX_POS(h->ix[i]) - 1] & 0xFF); }

/* The index slot of the entry for ring position pos (whose fingerprint's top bits are in rec). */
static uint32_t hx_slot_of(const History *h, uint64_t rec, uint32_t pos) {
    uint32_t mask = (1u << h->bits) - 1, i = hx_home(h, rec);
    while (HX_POS(h->ix[i]) != pos + 1) i = (i + 1) & mask;
    return i;
}

static void hx_delete(History *h, uint32_t i) {      /* backward shift, as the key table's remove_at */
    uint32_t mask = (1u << h->bits) - 1;
    for (uint32_t j = (i + 1) & mask; h->ix[j]; j = (j + 1) & mask) {
        uint32_t home = hx_home_of_entry(h, h->ix[j]);
        if (((j - home) & mask) >= ((j - i) & mask)) { h->ix[i] = h->ix[j]; i = j; }
    }
    h->ix[i] = 0;
}

static void hx_forget_oldest(History *h) {
    uint64_t rec = h->ring[h->first];
    if (rec) { hx_delete(h, hx_slot_of(h, rec, h->first)); h->live--; }
    h->first = h->first + 1 == h->cap ? 0 : h->first + 1;
    h->used--;
}

/* Bloom filters in front of the index, so that a key never recorded (most stores are of new blocks) costs a look
 * in a few megabytes of filters instead of a memory miss in the index: HX_GENS of them, each of about 8 bits a
 * record, 2 bits in one 64-bit word; records go into the newest, and when it holds fsize (half the capacity) the
 * oldest is cleared and becomes the newest. A record in the ring was made at most `cap` records ago, so it is in
 * one of the filters (the two full ones hold cap records): a filter never says no to a key the ring holds. */
#define HX_GENS 4                   /* the filters' words of one index are side by side: one 32-byte look */
static inline uint64_t *hx_word(const History *h, uint32_t gen, uint64_t fp) {
    return &h->filt[((fp >> 8) & (h->fwords - 1)) * HX_GENS + gen];
}
static inline uint64_t hx_bits(uint64_t fp) { return 1ull << ((fp >> 40) & 63) | 1ull << ((fp >> 46) & 63); }

static void hx_mark(History *h, uint64_t fp) {
    *hx_word(h, h->fgen, fp) |= hx_bits(fp);
    if (++h->fcount < h->fsize) return;
    h->fgen = (h->fgen + 1) % HX_GENS;
    for (size_t w = h->fgen; w < (size_t)h->fwords * HX_GENS; w += HX_GENS) h->filt[w] = 0;
    h->fcount = 0;
}

static inline int hx_maybe(const History *h, uint64_t fp) {
    uint64_t bits = hx_bits(fp);
    const uint64_t *w = hx_word(h, 0, fp);
    for (uint32_t g = 0; g < HX_GENS; g++)
        if ((w[g] & bits) == bits) return 1;
    return 0;
}

static void hx_record(History *h, uint64_t fp, uint8_t level) {
    uint32_t hole = 0;
    int64_t i = hx_find(h, fp, &hole);
    if (i >= 0) { h->ring[HX_POS(h->ix[i]) - 1] = 0; hx_delete(h, (uint32_t)i); h->live--; }
    if (h->used == h->cap) hx_forget_oldest(h);
    uint32_t pos = (uint32_t)(((uint64_t)h->first + h->used) % h->cap);
    h->ring[pos] = HX_ID(fp) | level;
    h->used++; h->live++;
    hx_find(h, fp, &hole);          /* the run may have moved under the deletions (finds no entry: fp's is gone) */
    h->ix[hole] = (uint64_t)(pos + 1) | (fp & 0xFFFFFFFF00000000ull);
    hx_mark(h, fp);
}

/* History arrays: huge pages from HX_BIG bytes on (rounded to 2 MiB, at most an eighth more), the heap below. */
#define HX_BIG ((size_t)16 << 20)
static size_t hx_round(size_t bytes) { return bytes < HX_BIG ? bytes : big_round(bytes); }
static void *hx_alloc(size_t bytes) { return bytes < HX_BIG ? PyMem_Calloc(bytes, 1) : big_alloc(bytes); }
static void hx_release(void *p, size_t bytes) { if (bytes < HX_BIG) PyMem_Free(p); else big_free(p, bytes); }

/* The pending records into the ring and index, their index lines (and the lines of the records they push out)
 * fetched first, all at once: at a history larger than the caches each record costs about one memory miss
 * otherwise, one after another. */
static void hx_flush(History *h) {
    uint32_t n = h->npend;
    h->npend = 0;
    h->pmask = 0;
    for (uint32_t k = 0; k < n; k++) {
        __builtin_prefetch(&h->ix[hx_home(h, h->pend[k])]);
        if (h->used + k >= h->cap) {
            uint64_t old = h->ring[(uint32_t)(((uint64_t)h->first + h->used + k - h->cap) % h->cap)];
            if (old) __builtin_prefetch(&h->ix[hx_home(h, old)]);
        }
    }
    for (uint32_t k = 0; k < n; k++) hx_record(h, HX_ID(h->pend[k]), (uint8_t)(h->pend[k] & 0xFF));
}

/* A record, gathered (see hx_flush). */
static void hx_add(History *h, uint64_t fp, uint8_t level) {
    h->pend[h->npend++] = HX_ID(fp) | level;
    h->pmask |= 1ull << (fp >> 8 & 63);
    if (h->npend == HX_PENDING || h->npend * 8u >= h->cap) hx_flush(h);
}

/* The level remembered for fp, 0 if none: the newest pending record of it, else its record in the ring unless
 * the pending ones will push it out (the answer is the same before and after they go in). */
static int hx_level(const History *h, uint64_t fp) {
    if (h->pmask >> (fp >> 8 & 63) & 1)
        for (uint32_t k = h->npend; k-- > 0;)
            if (HX_ID(h->pend[k]) == HX_ID(fp)) return (int)(h->pend[k] & 0xFF);
    if (!hx_maybe(h, fp)) return 0;
    int64_t i = hx_find(h, fp, NULL);
    if (i < 0) return 0;
    uint64_t over = (uint64_t)h->used + h->npend, pos = HX_POS(h->ix[i]) - 1;
    if (over > h->cap && (pos + h->cap - h->first) % h->cap < over - h->cap) return 0;
    return hx_level_at(h, i);
}

static void hx_free(History *h) {
    if (h->ring) hx_release(h->ring, (size_t)h->cap * 8);
    if (h->ix) hx_release(h->ix, (size_t)8 << h->bits);
    if (h->filt) hx_release(h->filt, (size_t)HX_GENS * h->fwords * 8);
    h->ring = NULL; h->ix = NULL; h->filt = NULL;
}

/* A new ring of `cap` records holding the newest live ones of the old, in order. */
static int hx_resize(History *h, uint32_t cap) {
    if (h->ring) hx_flush(h);
    uint32_t bits = 4;
    while ((1ull << bits) * 3 < 4ull * cap) bits++;
    uint32_t fsize = cap / (HX_GENS - 1) + 1, fwords = 1;
    while (fwords * 8ull < fsize) fwords *= 2;                  /* 8-16 bits a record, each filter */
    size_t fbytes = (size_t)HX_GENS * fwords * 8;
    uint64_t *ring = hx_alloc((size_t)cap * 8), *ix = hx_alloc((size_t)8 << bits), *filt = hx_alloc(fbytes);
    if (!ring || !ix || !filt) {
        if (ring) hx_release(ring, (size_t)cap * 8);
        if (ix) hx_release(ix, (size_t)8 << bits);
        if (filt) hx_release(filt, fbytes);
        PyErr_NoMemory();
        return -1;
    }
    memset(ring, 0, (size_t)cap * 8);       /* written now: the pages are faulted in here, once, not one by one */
    memset(ix, 0, (size_t)8 << bits);       /* under the records that first touch them */
    memset(filt, 0, fbytes);
    History old = *h;
    h->ring = ring; h->ix = ix; h->cap = cap; h->first = 0; h->used = 0; h->live = 0; h->bits = bits;
    h->filt = filt; h->fwords = fwords; h->fgen = 0; h->fcount = 0; h->fsize = fsize;
    uint32_t skip = old.live > cap ? old.live - cap : 0;
    for (uint32_t k = 0; k < old.used; k++) {
        uint64_t rec = old.ring[(uint32_t)(((uint64_t)old.first + k) % old.cap)];
        if (!rec) continue;
        if (skip) { skip--; continue; }
        hx_record(h, HX_ID(rec), (uint8_t)(rec & 0xFF));
    }
    hx_free(&old);
    return 0;
}

static int get_bytes(PyObject *o, const uint8_t **p, Py_ssize_t *n) {
    if (!PyBytes_Check(o)) { PyErr_Format(PyExc_TypeError, "key must be bytes, not %.100s", Py_TYPE(o)->tp_name); return -1; }
    *p = (const uint8_t *)PyBytes_AS_STRING(o); *n = PyBytes_GET_SIZE(o);
    return 0;
}

static int get_capacity(PyObject *o, uint32_t *cap) {
    Py_ssize_t c = PyNumber_AsSsize_t(o, PyExc_OverflowError);
    if (c == -1 && PyErr_Occurred()) return -1;
    if (c < 1 || c > (1 << 30)) { PyErr_Format(PyExc_ValueError, "capacity must be in 1..%d, got %zd", 1 << 30, c); return -1; }
    *cap = (uint32_t)c;
    return 0;
}

static PyObject *hx_py_record(History *h, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *k; Py_ssize_t n;
    if (nargs != 2) { PyErr_Format(PyExc_TypeError, "record() takes 2 arguments (%zd given)", nargs); return NULL; }
    if (!h->ix) { PyErr_SetString(PyExc_RuntimeError, "History was not initialised"); return NULL; }
    if (get_bytes(args[0], &k, &n) < 0) return NULL;
    long level = PyLong_AsLong(args[1]);
    if (level == -1 && PyErr_Occurred()) return NULL;
    if (level < 1 || level > 255) { PyErr_Format(PyExc_ValueError, "level must be in 1..255, got %ld", level); return NULL; }
    hx_add(h, fp_of(k, n), (uint8_t)level);
    Py_RETURN_NONE;
}

static PyObject *hx_py_level(History *h, PyObject *key) {
    const uint8_t *k; Py_ssize_t n;
    if (get_bytes(key, &k, &n) < 0) return NULL;
    if (!h->ix) return PyLong_FromLong(0);
    return PyLong_FromLong(hx_level(h, fp_of(k, n)));
}

static PyObject *hx_py_resize(History *h, PyObject *capobj) {
    uint32_t cap;
    if (get_capacity(capobj, &cap) < 0) return NULL;
    if (cap != h->cap && hx_resize(h, cap) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *hx_py_nbytes(History *h, PyObject *unused) {
    (void)unused;
    return PyLong_FromSize_t(sizeof(History) + hx_round((size_t)h->cap * 8) + hx_round((size_t)8 << h->bits) +
                             hx_round((size_t)HX_GENS * h->fwords * 8));
}

static PyObject *hx_py_capacity(History *h, void *unused) { (void)unused; return PyLong_FromUnsignedLong(h->cap); }

static Py_ssize_t hx_len(History *h) {
    if (h->ring) hx_flush(h);
    return h->live;
}

static int hx_init(History *h, PyObject *args, PyObject *kw) {
    static char *names[] = {"capacity", NULL};
    PyObject *capobj;
    uint32_t cap;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O:History", names, &capobj) || get_capacity(capobj, &cap) < 0) return -1;
    hx_free(h);
    h->cap = 0; h->first = h->used = h->live = h->npend = 0; h->pmask = 0;
    return hx_resize(h, cap);
}

static void hx_dealloc(History *h) {
    hx_free(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyMethodDef hx_methods[] = {
    {"record", (PyCFunction)(void (*)(void))hx_py_record, METH_FASTCALL, "record(key, level): remember key's level (1..255)"},
    {"level", (PyCFunction)hx_py_level, METH_O, "level(key, /): the level remembered for key, 0 if none"},
    {"resize", (PyCFunction)hx_py_resize, METH_O, "resize(capacity, /): keep the newest records that fit"},
    {"nbytes", (PyCFunction)hx_py_nbytes, METH_NOARGS, "nbytes(): bytes of memory the history holds"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef hx_getset[] = {
    {"capacity", (getter)hx_py_capacity, NULL, "records it keeps at most", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods hx_as_sequence = {.sq_length = (lenfunc)hx_len};

static PyTypeObject HistoryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore._kvindex.History",
    .tp_basicsize = sizeof(History),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "History(capacity): the levels of evicted keys, the newest `capacity` records (see kvindex.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hx_init,
    .tp_dealloc = (destructor)hx_dealloc,
    .tp_methods = hx_methods,
    .tp_getset = hx_getset,
    .tp_as_sequence = &hx_as_sequence,
};

/* ==== Hooks: the `history` policy's per-block hooks over a key table, in one call each (kvstore.policy.history) ====
 *   Hooks(table, top, factor, min_records) — the index calls these as it would the Python policy's methods:
 *     added(key, cls, touch=None)   a new block of cls (in the table already): its level from the class's history
 *                                   (0 while the class admits anew), never below the block placed just before
 *     accessed(key, touch=None)     a store of a held block: a use
 *     pinned(key) / unpinned(key)   a read begins (a use; no candidate) / ends (a candidate, the newest)
 *     removed(key)                  a block leaves (before the table lets go): its level is remembered
 *     victim(cls) -> key | None     by the class's way (set_way): the table's pick
 *     admits(victim, touch, key) -> bool False where the class bypasses and the victim was used more than once
 *   and the Python side (its shadows choose the way) uses:
 *     set_way(cls, aging, anew, bypass)   aging: pick's factor or None; anew: blocks come at level 0 (`forget`,
 *                                   `bypass`: taken up at the next block the history does not remember);
 *                                   bypass: admits() may refuse
 *     history(cls) -> History       the class's (made if new; shadows ask it); held(cls) -> int, refusing(cls)
 *                                   -> bool, pressed(cls) -> bool: victim() was asked (0 / False for a class
 *                                   it has no books of: none are made)
 *     admitting_anew(cls) -> bool; classes() -> [cls, ...]
 *   `carry`, the level of the block placed just before, is reset by every hook but added and accessed. */
typedef struct {
    History *hist;
    uint32_t held, grow_at, shrink_at;
    double aging;                   /* < 0: none */
    uint8_t anew, want_anew, bypass, refusing, pressed;
} HookClass;

typedef struct {
    PyObject_HEAD
    KeyTable *table;
    HookClass *cls;
    uint32_t ncls, top, factor, min_records;
    int carry;
} Hooks;

static int hk_ready(const Hooks *k) {
    if (k->table) return 0;
    PyErr_SetString(PyExc_RuntimeError, "Hooks was not initialised");
    return -1;
}

static HookClass *hk_class(Hooks *k, uint32_t cls) {
    if (cls < k->ncls && k->cls[cls].hist) return &k->cls[cls];
    if (cls >= k->ncls) {
        uint32_t n = k->ncls ? k->ncls : 16;
        while (n <= cls) n *= 2;
        HookClass *c = PyMem_Realloc(k->cls, (size_t)n * sizeof(HookClass));
        if (!c) { PyErr_NoMemory(); return NULL; }
        memset(c + k->ncls, 0, (size_t)(n - k->ncls) * sizeof(HookClass));
        k->cls = c; k->ncls = n;
    }
    HookClass *c = &k->cls[cls];
    PyObject *h = PyObject_CallFunction((PyObject *)&HistoryType, "I", k->min_records);
    if (!h) return NULL;
    c->hist = (History *)h;
    c->grow_at = k->min_records / k->factor;
    c->shrink_at = 0;
    c->aging = -1.0;
    return c;
}

static inline HookClass *hk_known(Hooks *k, uint32_t cls) {
    return cls < k->ncls && k->cls[cls].hist ? &k->cls[cls] : NULL;
}

/* The class's history sized for `held` blocks, a quarter ahead: grown past what it has, shrunk under a quarter of
 * it (a class that lends half its memory away and takes it back does not rebuild its history each time). */
static int hk_fit(Hooks *k, HookClass *c) {
    uint64_t want = (uint64_t)c->held * k->factor, have = c->hist->cap;
    if (want > have || want < have / 4) {
        want += want / 4;
        if (want < k->min_records) want = k->min_records;
        if (want > (1u << 30)) want = 1u << 30;
        if (want != have && hx_resize(c->hist, (uint32_t)want) < 0) return -1;
    }
    have = c->hist->cap;
    c->grow_at = (uint32_t)(have / k->factor);
    c->shrink_at = (uint32_t)(have / (4 * k->factor));
    return 0;
}

static int hk_args(const char *fn, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi) {
    if (nargs >= lo && nargs <= hi) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", fn, lo, hi, nargs);
    return -1;
}

static PyObject *hk_added(Hooks *k, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"key", "cls", "touch"};
    PyObject *args[3];
    if (hk_ready(k) < 0) return NULL;
    uint32_t cls;
    const uint8_t *key;
    Py_ssize_t n;
    if (parse_args("added", argv, nargs, kwnames, names, 2, 3, args) < 0 || get_key(args[0], &key) < 0 ||
        get_cls(args[1], &cls) < 0)
        return NULL;
    HookClass *c = hk_class(k, cls);
    if (!c) return NULL;
    n = KEY_BYTES;
    uint64_t fp = fp_of(key, n);
    int look = !c->anew || c->anew != c->want_anew;
    if (look) __builtin_prefetch(&c->hist->ix[hx_home(c->hist, fp)]);   /* its miss overlaps the table's look */
    int64_t s = find(k->table, key, key + 4, meta_of(key, key + 4), NULL);
    if (s < 0) { PyErr_SetObject(PyExc_KeyError, args[0]); return NULL; }
    c->held++;
    uint32_t level = 0;
    if (look) {
        uint32_t remembered = (uint32_t)hx_level(c->hist, fp);
        if (c->anew != c->want_anew && (!c->want_anew || remembered == 0)) c->anew = c->want_anew;
        if (!c->anew) level = remembered < k->top ? remembered : k->top;
    }
    if ((int)level < k->carry) level = (uint32_t)k->carry;
    k->carry = (int)level;
    if (level) set_level_at(k->table, (uint32_t)s, level);
    if (c->held > c->grow_at && hk_fit(k, c) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *hk_accessed(Hooks *k, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"key", "touch"};
    PyObject *args[2];
    if (hk_ready(k) < 0) return NULL;
    if (parse_args("accessed", argv, nargs, kwnames, names, 1, 2, args) < 0) return NULL;
    int64_t s = lookup(k->table, args[0], 0);
    if (s == -2) return NULL;
    if (s >= 0) {
        Link *x = &k->table->links[s];
        set_level_at(k->table, (uint32_t)s, x->level < k->top ? x->level + 1u : x->level);
        k->carry = x->level;
    }
    Py_RETURN_NONE;
}

static PyObject *hk_pinned(Hooks *k, PyObject *key) {
    if (hk_ready(k) < 0) return NULL;
    k->carry = -1;
    int64_t s = lookup(k->table, key, 0);
    if (s == -2) return NULL;
    if (s >= 0 && k->table->links[s].linked) {
        Link *x = &k->table->links[s];
        lru_unlink(k->table, (uint32_t)s);
        if (x->level < k->top) x->level++;
    }
    Py_RETURN_NONE;
}

static PyObject *hk_unpinned(Hooks *k, PyObject *key) {
    if (hk_ready(k) < 0) return NULL;
    k->carry = -1;
    int64_t s = lookup(k->table, key, 0);
    if (s == -2) return NULL;
    if (s >= 0 && !k->table->links[s].linked) lru_push(k->table, (uint32_t)s);
    Py_RETURN_NONE;
}

static PyObject *hk_removed(Hooks *k, PyObject *keyobj) {
    if (hk_ready(k) < 0) return NULL;
    k->carry = -1;
    int64_t s = lookup(k->table, keyobj, 0);
    if (s == -2) return NULL;
    if (s < 0) Py_RETURN_NONE;
    Link *x = &k->table->links[s];
    HookClass *c = hk_known(k, x->cls);
    if (!c) Py_RETURN_NONE;                 /* a block this policy never saw added */
    c->held--;
    hx_add(c->hist, fp_of((const uint8_t *)PyBytes_AS_STRING(keyobj), KEY_BYTES), (uint8_t)(x->level + 1));
    if (c->held < c->shrink_at && hk_fit(k, c) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *hk_victim(Hooks *k, PyObject *clsobj) {
    if (hk_ready(k) < 0) return NULL;
    uint32_t cls;
    k->carry = -1;
    if (get_cls(clsobj, &cls) < 0) return NULL;
    HookClass *c = hk_known(k, cls);
    if (c) c->pressed = 1;
    int64_t s = c ? pick_slot(k->table, cls, c->aging) : -1;
    if (s < 0) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)k->table->recs[s].key, KEY_BYTES);
}

static PyObject *hk_admits(Hooks *k, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"victim", "touch", "key"};      /* the block coming: not asked here */
    PyObject *args[3];
    if (hk_ready(k) < 0) return NULL;
    if (parse_args("admits", argv, nargs, kwnames, names, 1, 3, args) < 0) return NULL;
    int64_t s = lookup(k->table, args[0], 0);
    if (s == -2) return NULL;
    if (s < 0) Py_RETURN_TRUE;
    HookClass *c = hk_known(k, k->table->links[s].cls);
    if (!c) Py_RETURN_TRUE;
    c->refusing = 1;
    return PyBool_FromLong(k->table->links[s].level == 0 || !c->bypass);
}

static PyObject *hk_set_way(Hooks *k, PyObject *const *args, Py_ssize_t nargs) {
    if (hk_ready(k) < 0) return NULL;
    uint32_t cls;
    if (hk_args("set_way", nargs, 4, 4) < 0 || get_cls(args[0], &cls) < 0) return NULL;
    double aging = -1.0;
    if (args[1] != Py_None) {
        aging = PyFloat_AsDouble(args[1]);
        if (aging == -1.0 && PyErr_Occurred()) return NULL;
        if (aging < 0) { PyErr_Format(PyExc_ValueError, "aging must be >= 0 or None, got %R", args[1]); return NULL; }
    }
    int anew = PyObject_IsTrue(args[2]), bypass = PyObject_IsTrue(args[3]);
    if (anew < 0 || bypass < 0) return NULL;
    HookClass *c = hk_class(k, cls);
    if (!c) return NULL;
    c->aging = aging; c->want_anew = (uint8_t)anew; c->bypass = (uint8_t)bypass;
    Py_RETURN_NONE;
}

static HookClass *hk_arg_class(Hooks *k, PyObject *clsobj) {
    uint32_t cls;
    return hk_ready(k) < 0 || get_cls(clsobj, &cls) < 0 ? NULL : hk_class(k, cls);
}

static PyObject *hk_history(Hooks *k, PyObject *clsobj) {
    HookClass *c = hk_arg_class(k, clsobj);
    if (!c) return NULL;
    Py_INCREF(c->hist);
    return (PyObject *)c->hist;
}

/* The class's books if it has any, without making them (*c = NULL: none); -1 on a bad class. */
static int hk_peek(Hooks *k, PyObject *clsobj, HookClass **c) {
    uint32_t cls;
    if (hk_ready(k) < 0 || get_cls(clsobj, &cls) < 0) return -1;
    *c = hk_known(k, cls);
    return 0;
}

static PyObject *hk_held(Hooks *k, PyObject *clsobj) {
    HookClass *c;
    if (hk_peek(k, clsobj, &c) < 0) return NULL;
    return PyLong_FromUnsignedLong(c ? c->held : 0);
}

static PyObject *hk_refusing(Hooks *k, PyObject *clsobj) {
    HookClass *c;
    if (hk_peek(k, clsobj, &c) < 0) return NULL;
    return PyBool_FromLong(c && c->refusing);
}

static PyObject *hk_pressed(Hooks *k, PyObject *clsobj) {
    HookClass *c;
    if (hk_peek(k, clsobj, &c) < 0) return NULL;
    return PyBool_FromLong(c && c->pressed);
}

static PyObject *hk_admitting_anew(Hooks *k, PyObject *clsobj) {
    HookClass *c;
    if (hk_peek(k, clsobj, &c) < 0) return NULL;
    return PyBool_FromLong(c && c->anew);
}

static PyObject *hk_classes(Hooks *k, PyObject *unused) {
    (void)unused;
    PyObject *out = PyList_New(0);
    for (uint32_t i = 0; out && i < k->ncls; i++) {
        if (!k->cls[i].hist) continue;
        PyObject *c = PyLong_FromUnsignedLong(i);
        if (!c || PyList_Append(out, c) < 0) Py_CLEAR(out);
        Py_XDECREF(c);
    }
    return out;
}

static PyObject *hk_reset_carry(Hooks *k, PyObject *unused) {
    (void)unused;
    k->carry = -1;
    Py_RETURN_NONE;
}

static int hk_init(Hooks *k, PyObject *args, PyObject *kw) {
    static char *names[] = {"table", "top", "factor", "min_records", NULL};
    PyObject *table;
    unsigned int top, factor, min_records;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!III:Hooks", names, &KeyTableType, &table, &top, &factor,
                                     &min_records))
        return -1;
    if (top >= NLEV || factor < 1 || min_records < 1 || min_records > (1u << 30)) {
        PyErr_SetString(PyExc_ValueError, "Hooks: top must be < 4, factor and min_records >= 1");
        return -1;
    }
    Py_XSETREF(k->table, (KeyTable *)Py_NewRef(table));
    k->top = top; k->factor = factor; k->min_records = min_records; k->carry = -1;
    return 0;
}

static void hk_dealloc(Hooks *k) {
    for (uint32_t i = 0; i < k->ncls; i++) Py_XDECREF(k->cls[i].hist);
    PyMem_Free(k->cls);
    Py_XDECREF(k->table);
    Py_TYPE(k)->tp_free((PyObject *)k);
}

#define FASTPOS(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL
static PyMethodDef hk_methods[] = {
    {"added", FAST(hk_added), "added(key, cls, touch=None)"},
    {"accessed", FAST(hk_accessed), "accessed(key, touch=None)"},
    {"pinned", (PyCFunction)hk_pinned, METH_O, "pinned(key, /)"},
    {"unpinned", (PyCFunction)hk_unpinned, METH_O, "unpinned(key, /)"},
    {"removed", (PyCFunction)hk_removed, METH_O, "removed(key, /)"},
    {"victim", (PyCFunction)hk_victim, METH_O, "victim(cls, /) -> key | None"},
    {"admits", FAST(hk_admits), "admits(victim, touch=None) -> bool"},
    {"set_way", FASTPOS(hk_set_way), "set_way(cls, aging, anew, bypass)"},
    {"history", (PyCFunction)hk_history, METH_O, "history(cls, /) -> History"},
    {"held", (PyCFunction)hk_held, METH_O, "held(cls, /) -> int"},
    {"refusing", (PyCFunction)hk_refusing, METH_O, "refusing(cls, /) -> bool: admits() was asked"},
    {"pressed", (PyCFunction)hk_pressed, METH_O, "pressed(cls, /) -> bool: victim() was asked"},
    {"admitting_anew", (PyCFunction)hk_admitting_anew, METH_O, "admitting_anew(cls, /) -> bool"},
    {"classes", (PyCFunction)hk_classes, METH_NOARGS, "classes() -> list of the classes it has books of"},
    {"reset_carry", (PyCFunction)hk_reset_carry, METH_NOARGS, "reset_carry(): the next block starts a row"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HooksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore._kvindex.Hooks",
    .tp_basicsize = sizeof(Hooks),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hooks(table, top, factor, min_records): the history policy's per-block hooks (see kvindex.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hk_init,
    .tp_dealloc = (destructor)hk_dealloc,
    .tp_methods = hk_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kvindex", .m_doc = "Native key table of the kvstore index.", .m_size = -1,
};

PyMODINIT_FUNC PyInit__kvindex(void) {
    if (PyType_Ready(&KeyTableType) < 0 || PyType_Ready(&HistoryType) < 0 || PyType_Ready(&HooksType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "KeyTable", (PyObject *)&KeyTableType) < 0 ||
        PyModule_AddObjectRef(m, "History", (PyObject *)&HistoryType) < 0 ||
        PyModule_AddObjectRef(m, "Hooks", (PyObject *)&HooksType) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
