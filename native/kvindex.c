/*
 * kvstore._kvindex — the index's key table, compact enough for tens of millions of blocks.
 *
 * Contract (identical to kvstore.keytable.PyKeyTable, the pure-Python fallback):
 *   KeyTable maps 20-byte keys (4-byte namespace id + 16-byte block hash) to u64 values (slot locations).
 *   Every key belongs to an eviction class (0..65535) and is either linked in that class's LRU list or unlinked
 *   (pinned: in the map, not an eviction candidate). insert links at the MRU end; touch moves a linked key to the
 *   MRU end; unlink/relink take a key out of / put it back at the MRU end; oldest(cls) is the LRU linked key.
 *   prefix_len(prefix, hashes) counts the leading keys present — the lookup hot path, one C loop.
 *
 * Layout: a dense array of 40-byte entries (key, value, class, LRU links) and an open-addressing index of u64
 * slots (32 bits of hash, 32 bits of entry number + 1; 0 = empty) with linear probing and backward-shift deletion,
 * load ≤ 3/4. Removing an entry moves the last entry into its place, so the entry array stays dense with no free
 * list. About 40 + 8/0.375..0.75 bytes per key: 51–61 bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define KEY_BYTES 20
#define HASH_BYTES 16
#define NIL 0xFFFFFFFFu
#define MAX_CLS 65536
#define PREFETCH_CHUNK 64

typedef struct {
    uint8_t key[KEY_BYTES];
    uint16_t cls;
    uint8_t linked;
    uint8_t pad;
    uint32_t prev, next;
    uint64_t value;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *entries;
    uint32_t n, ecap;
    uint64_t *slots;
    uint32_t mask;            /* slots - 1 (power of two) */
    uint32_t *head, *tail, *clen;
    uint32_t ncls;            /* classes allocated */
    uint64_t mutations;
} KeyTable;

static inline uint64_t load64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t load32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* Big arrays live in anonymous mappings advised to use huge pages: at tens of millions of keys a lookup's random
 * accesses would otherwise miss the TLB as well as the caches. Mappings are zero-filled by the kernel. */
static void *big_alloc(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    if (bytes >= (2u << 20)) madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

static void big_free(void *p, size_t bytes) { if (p) munmap(p, bytes); }

static inline uint64_t hash_key(const uint8_t *k) {
    uint64_t h = load64(k + 4) ^ (load64(k + 12) * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)load32(k) << 17);
    h ^= h >> 33; h *= 0xff51afd7ed558ccdull; h ^= h >> 33; h *= 0xc4ceb9fe1a85ec53ull; h ^= h >> 33;
    return h;
}

/* Slot index holding the key, or -1; *hole receives the first empty slot of its probe chain. */
static int64_t find(KeyTable *t, const uint8_t *key, uint64_t h, uint32_t *hole) {
    uint32_t tag = (uint32_t)(h >> 32), i = (uint32_t)h & t->mask;
    for (;;) {
        uint64_t s = t->slots[i];
        if (s == 0) { if (hole) *hole = i; return -1; }
        if ((uint32_t)(s >> 32) == tag && memcmp(t->entries[(uint32_t)s - 1].key, key, KEY_BYTES) == 0) return i;
        i = (i + 1) & t->mask;
    }
}

static int grow_slots(KeyTable *t, uint32_t nslots) {
    uint64_t *slots = big_alloc((size_t)nslots * 8);
    if (!slots) { PyErr_NoMemory(); return -1; }
    big_free(t->slots, (size_t)(t->mask + 1) * 8);
    t->slots = slots;
    t->mask = nslots - 1;
    for (uint32_t e = 0; e < t->n; e++) {
        uint64_t h = hash_key(t->entries[e].key);
        uint32_t i = (uint32_t)h & t->mask;
        while (slots[i]) i = (i + 1) & t->mask;
        slots[i] = (h & 0xFFFFFFFF00000000ull) | (uint64_t)(e + 1);
    }
    return 0;
}

static int ensure_cls(KeyTable *t, uint32_t cls) {
    if (cls < t->ncls) return 0;
    uint32_t n = t->ncls ? t->ncls : 16;
    while (n <= cls) n *= 2;
    if (n > MAX_CLS) n = MAX_CLS;
    uint32_t *h = PyMem_Realloc(t->head, n * 4), *tl = NULL, *c = NULL;
    if (h) t->head = h;
    tl = h ? PyMem_Realloc(t->tail, n * 4) : NULL;
    if (tl) t->tail = tl;
    c = tl ? PyMem_Realloc(t->clen, n * 4) : NULL;
    if (!c) { PyErr_NoMemory(); return -1; }
    t->clen = c;
    for (uint32_t i = t->ncls; i < n; i++) { t->head[i] = t->tail[i] = NIL; t->clen[i] = 0; }
    t->ncls = n;
    return 0;
}

static void lru_unlink(KeyTable *t, uint32_t e) {
    Entry *x = &t->entries[e];
    if (!x->linked) return;
    if (x->prev != NIL) t->entries[x->prev].next = x->next; else t->head[x->cls] = x->next;
    if (x->next != NIL) t->entries[x->next].prev = x->prev; else t->tail[x->cls] = x->prev;
    x->linked = 0; x->prev = x->next = NIL;
    t->clen[x->cls]--;
}

static void lru_push(KeyTable *t, uint32_t e) {   /* at the MRU end (tail) */
    Entry *x = &t->entries[e];
    x->prev = t->tail[x->cls]; x->next = NIL;
    if (x->prev != NIL) t->entries[x->prev].next = e; else t->head[x->cls] = e;
    t->tail[x->cls] = e;
    x->linked = 1;
    t->clen[x->cls]++;
}

/* ---- argument helpers ---- */
static int get_key(PyObject *o, const uint8_t **k) {
    if (!PyBytes_Check(o)) { PyErr_Format(PyExc_TypeError, "key must be bytes, not %.100s", Py_TYPE(o)->tp_name); return -1; }
    if (PyBytes_GET_SIZE(o) != KEY_BYTES) { PyErr_Format(PyExc_ValueError, "key must be %d bytes, got %zd", KEY_BYTES, PyBytes_GET_SIZE(o)); return -1; }
    *k = (const uint8_t *)PyBytes_AS_STRING(o);
    return 0;
}

static int64_t lookup_entry(KeyTable *t, PyObject *keyobj, int raise) {
    const uint8_t *k;
    if (get_key(keyobj, &k) < 0) return -2;
    int64_t s = find(t, k, hash_key(k), NULL);
    if (s < 0) { if (raise) PyErr_SetObject(PyExc_KeyError, keyobj); return raise ? -2 : -1; }
    return (int64_t)((uint32_t)t->slots[s] - 1);
}

/* ---- methods ---- */
static PyObject *kt_get(KeyTable *t, PyObject *key) {
    int64_t e = lookup_entry(t, key, 0);
    if (e == -2) return NULL;
    if (e < 0) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(t->entries[e].value);
}

static PyObject *kt_insert(KeyTable *t, PyObject *args, PyObject *kw) {
    static char *names[] = {"key", "value", "cls", NULL};
    PyObject *keyobj, *valobj; int cls; const uint8_t *k;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOi:insert", names, &keyobj, &valobj, &cls)) return NULL;
    if (get_key(keyobj, &k) < 0) return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(valobj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (cls < 0 || cls >= MAX_CLS) { PyErr_Format(PyExc_ValueError, "cls must be in 0..65535, got %d", cls); return NULL; }
    if (ensure_cls(t, (uint32_t)cls) < 0) return NULL;
    uint64_t h = hash_key(k);
    uint32_t hole;
    if (find(t, k, h, &hole) >= 0) { PyErr_SetString(PyExc_ValueError, "key already present"); return NULL; }
    if ((uint64_t)(t->n + 1) * 4 > (uint64_t)(t->mask + 1) * 3) {
        if (grow_slots(t, (t->mask + 1) * 2) < 0) return NULL;
        find(t, k, h, &hole);
    }
    if (t->n == t->ecap) {
        uint32_t ncap = t->ecap ? t->ecap + t->ecap / 2 : 64;
        Entry *ne = big_alloc((size_t)ncap * sizeof(Entry));
        if (!ne) return PyErr_NoMemory();
        if (t->n) memcpy(ne, t->entries, (size_t)t->n * sizeof(Entry));
        big_free(t->entries, (size_t)t->ecap * sizeof(Entry));
        t->entries = ne; t->ecap = ncap;
    }
    uint32_t e = t->n++;
    Entry *x = &t->entries[e];
    memcpy(x->key, k, KEY_BYTES);
    x->cls = (uint16_t)cls; x->value = v; x->linked = 0; x->pad = 0;
    lru_push(t, e);
    t->slots[hole] = (h & 0xFFFFFFFF00000000ull) | (uint64_t)(e + 1);
    t->mutations++;
    Py_RETURN_NONE;
}

static PyObject *kt_set_value(KeyTable *t, PyObject *args) {
    PyObject *keyobj, *valobj;
    if (!PyArg_ParseTuple(args, "OO:set_value", &keyobj, &valobj)) return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(valobj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    int64_t e = lookup_entry(t, keyobj, 1);
    if (e < 0) return NULL;
    t->entries[e].value = v;
    Py_RETURN_NONE;
}

/* Backward-shift deletion at slot i, then move the last entry into entry e's place. */
static void delete_at(KeyTable *t, uint32_t i, uint32_t e) {
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        uint64_t s = t->slots[j];
        if (s == 0) break;
        uint32_t home = (uint32_t)hash_key(t->entries[(uint32_t)s - 1].key) & t->mask;
        /* move s back to i if its home is not cyclically within (i, j] */
        if (((j - home) & t->mask) >= ((j - i) & t->mask)) { t->slots[i] = s; i = j; }
    }
    t->slots[i] = 0;
    lru_unlink(t, e);
    uint32_t last = --t->n;
    if (e != last) {
        Entry *src = &t->entries[last];
        int was_linked = src->linked;
        if (was_linked) {  /* re-point neighbours at the new position */
            if (src->prev != NIL) t->entries[src->prev].next = e; else t->head[src->cls] = e;
            if (src->next != NIL) t->entries[src->next].prev = e; else t->tail[src->cls] = e;
        }
        t->entries[e] = *src;
        int64_t s = find(t, src->key, hash_key(src->key), NULL);
        t->slots[s] = (t->slots[s] & 0xFFFFFFFF00000000ull) | (uint64_t)(e + 1);
    }
}

static PyObject *kt_remove(KeyTable *t, PyObject *keyobj) {
    const uint8_t *k;
    if (get_key(keyobj, &k) < 0) return NULL;
    int64_t s = find(t, k, hash_key(k), NULL);
    if (s < 0) Py_RETURN_NONE;
    uint32_t e = (uint32_t)t->slots[s] - 1;
    uint64_t v = t->entries[e].value;
    delete_at(t, (uint32_t)s, e);
    t->mutations++;
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *kt_touch(KeyTable *t, PyObject *keyobj) {
    int64_t e = lookup_entry(t, keyobj, 0);
    if (e == -2) return NULL;
    if (e < 0) Py_RETURN_FALSE;
    if (t->entries[e].linked) { lru_unlink(t, (uint32_t)e); lru_push(t, (uint32_t)e); }
    Py_RETURN_TRUE;
}

static PyObject *kt_unlink(KeyTable *t, PyObject *keyobj) {
    int64_t e = lookup_entry(t, keyobj, 1);
    if (e < 0) return NULL;
    lru_unlink(t, (uint32_t)e);
    Py_RETURN_NONE;
}

static PyObject *kt_relink(KeyTable *t, PyObject *keyobj) {
    int64_t e = lookup_entry(t, keyobj, 1);
    if (e < 0) return NULL;
    if (!t->entries[e].linked) lru_push(t, (uint32_t)e);
    Py_RETURN_NONE;
}

static PyObject *kt_is_linked(KeyTable *t, PyObject *keyobj) {
    int64_t e = lookup_entry(t, keyobj, 1);
    if (e < 0) return NULL;
    return PyBool_FromLong(t->entries[e].linked);
}

static PyObject *kt_cls_of(KeyTable *t, PyObject *keyobj) {
    int64_t e = lookup_entry(t, keyobj, 1);
    if (e < 0) return NULL;
    return PyLong_FromLong(t->entries[e].cls);
}

static int get_cls(PyObject *o, uint32_t *cls) {
    long c = PyLong_AsLong(o);
    if (c == -1 && PyErr_Occurred()) return -1;
    if (c < 0 || c >= MAX_CLS) { PyErr_Format(PyExc_ValueError, "cls must be in 0..65535, got %ld", c); return -1; }
    *cls = (uint32_t)c;
    return 0;
}

static PyObject *kt_oldest(KeyTable *t, PyObject *clsobj) {
    uint32_t cls;
    if (get_cls(clsobj, &cls) < 0) return NULL;
    if (cls >= t->ncls || t->head[cls] == NIL) Py_RETURN_NONE;
    Entry *x = &t->entries[t->head[cls]];
    return Py_BuildValue("(y#K)", (const char *)x->key, (Py_ssize_t)KEY_BYTES, (unsigned long long)x->value);
}

static PyObject *kt_class_len(KeyTable *t, PyObject *clsobj) {
    uint32_t cls;
    if (get_cls(clsobj, &cls) < 0) return NULL;
    return PyLong_FromUnsignedLong(cls < t->ncls ? t->clen[cls] : 0);
}

static PyObject *kt_prefix_len(KeyTable *t, PyObject *args, PyObject *kw) {
    static char *names[] = {"prefix", "hashes", "touch", NULL};
    Py_buffer prefix, hashes; int touch = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*y*|p:prefix_len", names, &prefix, &hashes, &touch)) return NULL;
    PyObject *result = NULL;
    if (prefix.len != 4) { PyErr_Format(PyExc_ValueError, "prefix must be 4 bytes, got %zd", prefix.len); goto done; }
    if (hashes.len % HASH_BYTES) { PyErr_Format(PyExc_ValueError, "hashes must be a multiple of 16 bytes, got %zd", hashes.len); goto done; }
    /* In chunks: hash every key and prefetch its home slot, then prefetch the candidate entries, then probe.
     * A lookup of 32 keys in a table far larger than the caches then waits for ~2 rounds of memory misses
     * instead of 64 in a row. */
    uint8_t keys[PREFETCH_CHUNK][KEY_BYTES];
    uint64_t hs[PREFETCH_CHUNK];
    Py_ssize_t n = 0, total = hashes.len / HASH_BYTES;
    int stop = 0;
    for (Py_ssize_t base = 0; base < total && !stop; base += PREFETCH_CHUNK) {
        Py_ssize_t m = total - base < PREFETCH_CHUNK ? total - base : PREFETCH_CHUNK;
        for (Py_ssize_t j = 0; j < m; j++) {
            memcpy(keys[j], prefix.buf, 4);
            memcpy(keys[j] + 4, (const uint8_t *)hashes.buf + (base + j) * HASH_BYTES, HASH_BYTES);
            hs[j] = hash_key(keys[j]);
            __builtin_prefetch(&t->slots[(uint32_t)hs[j] & t->mask]);
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            uint64_t s = t->slots[(uint32_t)hs[j] & t->mask];
            if (s && (uint32_t)(s >> 32) == (uint32_t)(hs[j] >> 32)) __builtin_prefetch(&t->entries[(uint32_t)s - 1]);
        }
        for (Py_ssize_t j = 0; j < m; j++, n++) {
            int64_t s = find(t, keys[j], hs[j], NULL);
            if (s < 0) { stop = 1; break; }
            if (touch) {
                uint32_t e = (uint32_t)t->slots[s] - 1;
                if (t->entries[e].linked) { lru_unlink(t, e); lru_push(t, e); }
            }
        }
    }
    result = PyLong_FromSsize_t(n);
done:
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&hashes);
    return result;
}

static PyObject *kt_items(KeyTable *t, PyObject *unused) {
    PyObject *list = PyList_New(t->n);
    if (!list) return NULL;
    for (uint32_t e = 0; e < t->n; e++) {
        PyObject *item = Py_BuildValue("(y#K)", (const char *)t->entries[e].key, (Py_ssize_t)KEY_BYTES,
                                       (unsigned long long)t->entries[e].value);
        if (!item) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, e, item);
    }
    return list;
}

static PyObject *kt_nbytes(KeyTable *t, PyObject *unused) {
    size_t b = sizeof(KeyTable) + (size_t)t->ecap * sizeof(Entry) + (size_t)(t->mask + 1) * 8 + (size_t)t->ncls * 12;
    return PyLong_FromSize_t(b);
}

static Py_ssize_t kt_len(KeyTable *t) { return t->n; }

static int kt_contains(KeyTable *t, PyObject *key) {
    int64_t e = lookup_entry(t, key, 0);
    return e == -2 ? -1 : e >= 0;
}

static int kt_init(KeyTable *t, PyObject *args, PyObject *kw) {
    static char *names[] = {"capacity_hint", NULL};
    Py_ssize_t hint = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|n:KeyTable", names, &hint)) return -1;
    if (hint < 0 || hint > 0x3FFFFFFF) { PyErr_SetString(PyExc_ValueError, "capacity_hint out of range"); return -1; }
    uint32_t nslots = 64;
    while ((uint64_t)nslots * 3 < (uint64_t)hint * 4) nslots *= 2;
    if (t->slots) { PyErr_SetString(PyExc_RuntimeError, "KeyTable is already initialised"); return -1; }
    if (hint) {
        t->entries = big_alloc((size_t)hint * sizeof(Entry));
        if (!t->entries) { PyErr_NoMemory(); return -1; }
        t->ecap = (uint32_t)hint;
    }
    t->slots = big_alloc((size_t)nslots * 8);
    if (!t->slots) { PyErr_NoMemory(); return -1; }
    t->mask = nslots - 1;
    return 0;
}

static void kt_dealloc(KeyTable *t) {
    big_free(t->entries, (size_t)t->ecap * sizeof(Entry));
    if (t->slots) big_free(t->slots, (size_t)(t->mask + 1) * 8);
    PyMem_Free(t->head); PyMem_Free(t->tail); PyMem_Free(t->clen);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef kt_methods[] = {
    {"get", (PyCFunction)kt_get, METH_O, "value of key, or None (no LRU effect)"},
    {"insert", (PyCFunction)(void (*)(void))kt_insert, METH_VARARGS | METH_KEYWORDS, "insert(key, value, cls): new key at the MRU end of cls"},
    {"set_value", (PyCFunction)kt_set_value, METH_VARARGS, "set_value(key, value)"},
    {"remove", (PyCFunction)kt_remove, METH_O, "remove key; returns its value or None"},
    {"touch", (PyCFunction)kt_touch, METH_O, "move a linked key to the MRU end; False if absent"},
    {"unlink", (PyCFunction)kt_unlink, METH_O, "take key out of its LRU list"},
    {"relink", (PyCFunction)kt_relink, METH_O, "put key back at the MRU end"},
    {"is_linked", (PyCFunction)kt_is_linked, METH_O, "whether key is an eviction candidate"},
    {"cls_of", (PyCFunction)kt_cls_of, METH_O, "class of key"},
    {"oldest", (PyCFunction)kt_oldest, METH_O, "(key, value) of the LRU linked key of cls, or None"},
    {"class_len", (PyCFunction)kt_class_len, METH_O, "linked keys in cls"},
    {"prefix_len", (PyCFunction)(void (*)(void))kt_prefix_len, METH_VARARGS | METH_KEYWORDS,
     "prefix_len(prefix, hashes, touch=False): leading keys present"},
    {"items", (PyCFunction)kt_items, METH_NOARGS, "list of (key, value)"},
    {"nbytes", (PyCFunction)kt_nbytes, METH_NOARGS, "bytes of memory held"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods kt_as_sequence = {.sq_length = (lenfunc)kt_len, .sq_contains = (objobjproc)kt_contains};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore._kvindex.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Map 20-byte keys to u64 values, with an intrusive LRU list per class.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)kt_init,
    .tp_dealloc = (destructor)kt_dealloc,
    .tp_methods = kt_methods,
    .tp_as_sequence = &kt_as_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvindex", "Native key table of the kvstore index.", -1, NULL};

PyMODINIT_FUNC PyInit__kvindex(void) {
    if (PyType_Ready(&KeyTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTableType) < 0) { Py_DECREF(&KeyTableType); Py_DECREF(m); return NULL; }
    return m;
}
