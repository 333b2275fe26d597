/*
 * kvstore._kvcopy — one pass over a buffer that copies it and computes its CRC-32C.
 *
 * CONTRACT
 *   copy_crc32c(dst, src, crc=0, *, stream=False) -> int
 *     Copies src into dst (same length, both C-contiguous, dst writable, not overlapping) and returns the CRC-32C
 *     of the bytes copied, continuing `crc` (the `crc32c` package's `value`): the result equals
 *     kvstore.checksum.crc32c(src) for crc=0. Each 8-byte word is loaded once, into a register that is both stored
 *     and fed to the CRC, so the CRC is that of dst as written even if another process alters src meanwhile (a
 *     reader copying from a shared slot checks its private copy, not a slot a client could change under it).
 *     Releases the GIL for buffers of 16 KiB and more. Errors: TypeError (no buffer), ValueError (lengths differ,
 *     not contiguous, dst read-only, overlap), RuntimeError (HARDWARE is False).
 *   copy_pages(pages, offsets, slots, slot_offset, run_bytes, crcs=None, *, to_slots, stream=False) -> None
 *     The connector's layer move in one call: block i of `slots` (a sequence of buffers, one per block) holds its
 *     layer's runs back to back from `slot_offset`; run k of block i is at pages[offsets[i * R + k]:][:run_bytes]
 *     (R = len(offsets) / len(slots) runs per block; offsets: int64 buffer). to_slots=True copies pages -> slots
 *     (a save), False slots -> pages (a load). With `crcs` (a writable uint32 buffer, one per block) each block's
 *     CRC-32C is continued over its runs in slot order, in the same pass as the copy: a caller that moves layer 0,
 *     then 1, ... of a block ends with the CRC of the whole slot, with no second read of any byte. Without `crcs`,
 *     plain memcpy (works without HARDWARE). Every offset and slot is bounds-checked before any byte moves; the
 *     GIL is released for the copies. Errors: TypeError, ValueError (bounds, sizes, a slot inside `pages`),
 *     RuntimeError (crcs given and HARDWARE is False).
 *   HARDWARE: bool — this CPU has the CRC-32C instruction (x86-64 SSE 4.2, checked at import). Elsewhere the
 *     module loads but copy_crc32c raises, and kvstore.checksum falls back to a copy and the `crc32c` package.
 *   VECTOR: bool — this CPU has AVX2 too (checked at import): streamed copies take the vector loop (STORES).
 *     KVCOPY_NO_VECTOR set in the environment at import: False (the scalar loop alone, for comparison).
 *
 * WHY FUSED. A copy and then a CRC read every byte twice; with two copy threads on two cores the second pass
 * costs as much as the copy (put/get at 0.52x memcpy). Here the CRC rides on the copy's loads.
 *
 * WHY THREE STREAMS. crc32q has a latency of 3 cycles and a throughput of 1 per cycle: one dependent chain runs
 * at a third of the instruction's speed. Each chunk is cut into three parts, each with its own CRC register,
 * and the three are combined with "zeros" operators (the CRC of a part shifted past the LONG or SHORT bytes that
 * follow it, four table lookups). This is Mark Adler's scheme from crc32c.c (zlib licence, 2013, "crc32c_shift"
 * and the LONG/SHORT interleave; https://stackoverflow.com/a/17646775), reimplemented here with the copy added.
 *
 * WHY A BATCH. A layer of a 32 K-token prompt is a thousand pages; a Python loop of np.copyto per page costs a few
 * microseconds each, per layer, which at 32 layers is as much as the bytes themselves.
 *
 * STORES. With stream=True (the caller's word that the copy is large and not read again soon: a transfer bigger
 * than the caches), copies of STREAM_MIN bytes and more are written with non-temporal stores, then fenced: a
 * regular store first reads its line from memory, bandwidth the copy needs (measured here: a plain memcpy of 2 MiB
 * blocks 9-10 GB/s, non-temporal 12-17). Otherwise, and by default, regular stores: the bytes stay in the cache for
 * whoever reads them next.
 *
 * WHY A VECTOR LOOP THAT LOADS AHEAD. A non-temporal store waits in a write-combining buffer long after it left the
 * core, and a later load whose address has the same low 12 bits waits for it ("4K aliasing"). Where dst - src mod
 * 4096 is small, the copy's next loads are exactly those: an engine's KV tensors sit 64 bytes into a page (torch's
 * alignment) and the slots on page boundaries, so every load of a layer (slot -> pages) has dst - src = 64. The
 * scalar loop cannot stream there (0.3-1.3 GB/s for deltas of 16..64) and falls back to regular stores: a checked
 * load at 0.75x memcpy, measured, where the unchecked one is a memcpy (bench_vllm_ttft). Where the
 * CPU has AVX2 (VECTOR), the streamed copy loads 32 bytes a register and keeps each stream's loads 64 bytes ahead
 * of its stores (chunk3_lead): a load then never comes after a store it could alias, for any dst - src up to 64,
 * and the CRC is fed from the very registers that are stored. Measured here on 1 GiB of 64 KiB runs (the K or V of
 * one layer of a 4 MiB block), dst - src = 64: memcpy 81 ms, the scalar loop 107 ms, the vector loop 86 ms; at 0,
 * 16, 256, 512 and 4032 it is as fast as memcpy or faster (memcpy itself falls to 166 ms at 16). Between 65 and
 * 255 the loads may come after a store they alias: there the scalar loop decides as before (STREAM_GAP).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(KVCOPY_PORTABLE)   /* -DKVCOPY_PORTABLE: build the other branch */
#define KV_X86 1
#include <immintrin.h>
#else
#define KV_X86 0
#endif

#define POLY 0x82f63b78u            /* CRC-32C (Castagnoli), reflected */
#define LONG 8192                   /* bytes per stream in a long chunk (3 streams: 24 KiB) */
#define SHORT 256                   /* bytes per stream in a short chunk (768 bytes) */
#define NOGIL_MIN ((Py_ssize_t)16 << 10)
#define STREAM_MIN ((size_t)64 << 10)  /* non-temporal stores only for copies of this many bytes and more */
#define STREAM_GAP 512                  /* ... and only where dst - src mod 4096 is 0 or at least this */
#define LEAD 64                         /* the vector loop's loads run this far ahead of its stores ... */
#define LEAD_GAP 256                    /* ... so it streams where dst - src mod 4096 <= LEAD or >= LEAD_GAP */

static uint32_t zeros_long[4][256];
static uint32_t zeros_short[4][256];
static int hardware;
static int vector;                  /* AVX2: the streamed copies take the vector loop */

/* ---- the zeros operators (Adler): a 32x32 GF(2) matrix that appends len zero bytes to a CRC register ---- */

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec)
{
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1)
            sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat)
{
    for (int n = 0; n < 32; n++)
        square[n] = gf2_times(mat, mat[n]);
}

/* The operator for len zero bytes (len a power of two, at least 1), by repeated squaring of the one-bit operator. */
static void zeros_op(uint32_t *even, size_t len)
{
    uint32_t odd[32];
    odd[0] = POLY;                          /* one zero bit */
    uint32_t row = 1;
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd);                  /* 2 bits */
    gf2_square(odd, even);                  /* 4 bits */
    do {                                    /* 8 bits (one byte), then doubling while len's bits remain */
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0)
            return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_table(uint32_t table[4][256], size_t len)
{
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        table[0][n] = gf2_times(op, n);
        table[1][n] = gf2_times(op, n << 8);
        table[2][n] = gf2_times(op, n << 16);
        table[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift(const uint32_t table[4][256], uint32_t crc)
{
    return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^
           table[3][crc >> 24];
}

#if KV_X86
/* ---- the fused loop ---- */

#define TARGET __attribute__((target("sse4.2")))
#define INLINE static inline __attribute__((always_inline))

/* One 8-byte word, or the tail's bytes: loaded once, stored and checksummed from the same register. */
#define STORE(d, w, nt)                                                 \
    do {                                                                \
        if (nt)                                                         \
            _mm_stream_si64((long long *)(void *)(d), (long long)(w));  \
        else                                                            \
            memcpy((d), &(w), 8);                                       \
    } while (0)

INLINE TARGET uint64_t word(unsigned char *d, const unsigned char *s, uint64_t c, int nt)
{
    uint64_t w;
    memcpy(&w, s, 8);
    STORE(d, w, nt);
    return _mm_crc32_u64(c, w);
}

INLINE TARGET uint32_t bytes(unsigned char *d, const unsigned char *s, size_t n, uint32_t c)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char b = s[i];
        d[i] = b;
        c = _mm_crc32_u8(c, b);
    }
    return c;
}

/* Three streams of `part` bytes each over d/s[0, 3*part), 16 bytes of each per step; returns the register continued
 * from c over all of it. A step's six loads come before its stores: the streams are 8 KiB apart, so a store has
 * the low 12 bits of the next stream's load, and a load behind a store that matches it there ("4K aliasing")
 * waits for that store to leave the core (for a non-temporal store, ten times slower than the copy). */
INLINE TARGET uint64_t chunk3(unsigned char *d, const unsigned char *s, size_t part, uint64_t c,
                              const uint32_t table[4][256], int nt)
{
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < part; i += 16) {
        uint64_t a0, a1, b0, b1, e0, e1;
        memcpy(&a0, s + i, 8);
        memcpy(&a1, s + i + 8, 8);
        memcpy(&b0, s + part + i, 8);
        memcpy(&b1, s + part + i + 8, 8);
        memcpy(&e0, s + 2 * part + i, 8);
        memcpy(&e1, s + 2 * part + i + 8, 8);
        STORE(d + i, a0, nt);
        STORE(d + i + 8, a1, nt);
        STORE(d + part + i, b0, nt);
        STORE(d + part + i + 8, b1, nt);
        STORE(d + 2 * part + i, e0, nt);
        STORE(d + 2 * part + i + 8, e1, nt);
        c = _mm_crc32_u64(_mm_crc32_u64(c, a0), a1);
        c1 = _mm_crc32_u64(_mm_crc32_u64(c1, b0), b1);
        c2 = _mm_crc32_u64(_mm_crc32_u64(c2, e0), e1);
    }
    c = shift(table, (uint32_t)c) ^ c1;
    return shift(table, (uint32_t)c) ^ c2;
}

INLINE TARGET uint32_t fused(unsigned char *d, const unsigned char *s, size_t len, uint32_t crc, int nt)
{
    size_t head = (size_t)(-(uintptr_t)d & 7);      /* bring dst to an 8-byte boundary (movnti needs it) */
    head = head < len ? head : len;
    uint64_t c = bytes(d, s, head, crc ^ 0xffffffffu);
    d += head, s += head, len -= head;
    for (; len >= 3 * LONG; d += 3 * LONG, s += 3 * LONG, len -= 3 * LONG)
        c = chunk3(d, s, LONG, c, zeros_long, nt);
    for (; len >= 3 * SHORT; d += 3 * SHORT, s += 3 * SHORT, len -= 3 * SHORT)
        c = chunk3(d, s, SHORT, c, zeros_short, nt);
    for (; len >= 8; d += 8, s += 8, len -= 8)
        c = word(d, s, c, nt);
    if (nt)
        _mm_sfence();                       /* the copy is visible before anything this thread does next */
    return bytes(d, s, len, (uint32_t)c) ^ 0xffffffffu;
}

#define VTARGET __attribute__((target("avx2,sse4.2")))
#define VLOAD(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define VSTREAM(p, v) _mm256_stream_si256((__m256i *)(void *)(p), (v))

/* The register's four words into the CRC register, in memory order. */
INLINE VTARGET uint64_t crc_vec(uint64_t c, __m256i v)
{
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    c = _mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(lo));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(lo, 1));
    c = _mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(hi));
    return _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(hi, 1));
}

/* chunk3 with 32-byte registers and non-temporal stores (d 32-byte aligned, part a multiple of LEAD = 64): each
 * stream holds its last LEAD bytes loaded while it loads the next, and only then stores and checksums what it held,
 * so no load comes after a store of its stream that it could alias (the module's WHY A VECTOR LOOP). */
INLINE VTARGET uint64_t chunk3_lead(unsigned char *d, const unsigned char *s, size_t part, uint64_t c,
                                    const uint32_t table[4][256])
{
    uint64_t c1 = 0, c2 = 0;
    const unsigned char *s1 = s + part, *s2 = s + 2 * part;
    unsigned char *d1 = d + part, *d2 = d + 2 * part;
    __m256i a0 = VLOAD(s), a1 = VLOAD(s + 32), b0 = VLOAD(s1), b1 = VLOAD(s1 + 32), e0 = VLOAD(s2),
            e1 = VLOAD(s2 + 32);
    for (size_t i = LEAD;; i += LEAD) {
        __m256i na0 = a0, na1 = a1, nb0 = b0, nb1 = b1, ne0 = e0, ne1 = e1;
        if (i < part) {
            na0 = VLOAD(s + i), na1 = VLOAD(s + i + 32), nb0 = VLOAD(s1 + i), nb1 = VLOAD(s1 + i + 32);
            ne0 = VLOAD(s2 + i), ne1 = VLOAD(s2 + i + 32);
        }
        VSTREAM(d + i - LEAD, a0), VSTREAM(d + i - 32, a1);
        VSTREAM(d1 + i - LEAD, b0), VSTREAM(d1 + i - 32, b1);
        VSTREAM(d2 + i - LEAD, e0), VSTREAM(d2 + i - 32, e1);
        c = crc_vec(crc_vec(c, a0), a1);
        c1 = crc_vec(crc_vec(c1, b0), b1);
        c2 = crc_vec(crc_vec(c2, e0), e1);
        if (i >= part)
            break;
        a0 = na0, a1 = na1, b0 = nb0, b1 = nb1, e0 = ne0, e1 = ne1;
    }
    c = shift(table, (uint32_t)c) ^ c1;
    return shift(table, (uint32_t)c) ^ c2;
}

static VTARGET uint32_t fused_lead(unsigned char *d, const unsigned char *s, size_t len, uint32_t crc)
{
    size_t head = (size_t)(-(uintptr_t)d & 31);      /* bring dst to a 32-byte boundary (vmovntdq needs it) */
    head = head < len ? head : len;
    uint64_t c = bytes(d, s, head, crc ^ 0xffffffffu);
    d += head, s += head, len -= head;
    for (; len >= 3 * LONG; d += 3 * LONG, s += 3 * LONG, len -= 3 * LONG)
        c = chunk3_lead(d, s, LONG, c, zeros_long);
    for (; len >= 3 * SHORT; d += 3 * SHORT, s += 3 * SHORT, len -= 3 * SHORT)
        c = chunk3_lead(d, s, SHORT, c, zeros_short);
    _mm_sfence();                           /* the copy is visible before anything this thread does next */
    for (; len >= 8; d += 8, s += 8, len -= 8)
        c = word(d, s, c, 0);
    return bytes(d, s, len, (uint32_t)c) ^ 0xffffffffu;
}

/* Non-temporal stores where asked, long enough, and where no store can hold back a load of the same stream: a
 * store at dst + i matches the load at src + i + delta in its low 12 bits (delta = (dst - src) mod 4096), which
 * comes delta/8 words later; below STREAM_GAP that is still inside the core's store queue (measured here: 0.3-1.3
 * GB/s for delta 16..64, full speed from 128 on and at 0). The vector loop loads LEAD bytes ahead and streams
 * wherever delta <= LEAD, and from LEAD_GAP on (the module's WHY A VECTOR LOOP). */
static TARGET uint32_t copy_crc(unsigned char *d, const unsigned char *s, size_t len, uint32_t crc, int stream)
{
    size_t delta = (size_t)((uintptr_t)d - (uintptr_t)s) & 4095;
    if (stream && len >= STREAM_MIN && vector && (delta <= LEAD || delta >= LEAD_GAP))
        return fused_lead(d, s, len, crc);
    if (stream && len >= STREAM_MIN && (delta == 0 || delta >= STREAM_GAP))
        return fused(d, s, len, crc, 1);
    return fused(d, s, len, crc, 0);
}

static int detect(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}

static int detect_vector(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("sse4.2");
}
#else
static uint32_t copy_crc(unsigned char *d, const unsigned char *s, size_t len, uint32_t crc, int stream)
{
    (void)d, (void)s, (void)len, (void)stream;
    return crc;                             /* never called: copy_crc32c raises first where hardware is 0 */
}

static int detect(void)
{
    return 0;
}

static int detect_vector(void)
{
    return 0;
}
#endif

/* ---- Python ---- */

/* A contiguous view of obj; 0, or -1 with the error set naming the argument. */
static int get_view(PyObject *obj, Py_buffer *view, const char *name, int writable)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must support the buffer protocol, got %.100s", name,
                         Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    const char *bad = NULL;
    if (!PyBuffer_IsContiguous(view, 'C'))
        bad = "is not C-contiguous (the copy never reorders bytes)";
    else if (writable && view->readonly)
        bad = "is read-only";
    if (bad) {
        PyErr_Format(PyExc_ValueError, "%s %s", name, bad);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int check_pair(const Py_buffer *d, const Py_buffer *s)
{
    if (d->len != s->len) {
        PyErr_Format(PyExc_ValueError, "copy_crc32c: dst is %zd bytes, src %zd: they must be the same length",
                     d->len, s->len);
        return -1;
    }
    uintptr_t a = (uintptr_t)d->buf, b = (uintptr_t)s->buf;
    if (d->len && a < b + (uintptr_t)s->len && b < a + (uintptr_t)d->len) {
        PyErr_SetString(PyExc_ValueError, "copy_crc32c: dst and src overlap");
        return -1;
    }
    return 0;
}

static PyObject *py_copy_crc32c(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"dst", "src", "crc", "stream", NULL};
    PyObject *dst_obj, *src_obj;
    unsigned long crc = 0;
    int stream = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|k$p:copy_crc32c", kwlist, &dst_obj, &src_obj, &crc, &stream))
        return NULL;
    if (!hardware) {
        PyErr_SetString(PyExc_RuntimeError, "copy_crc32c: this CPU has no CRC-32C instruction (HARDWARE is False)");
        return NULL;
    }
    if (crc > 0xffffffffUL) {
        PyErr_SetString(PyExc_OverflowError, "copy_crc32c: crc must be in 0..2**32-1");
        return NULL;
    }
    Py_buffer d, s;
    if (get_view(dst_obj, &d, "copy_crc32c: dst", 1) < 0)
        return NULL;
    if (get_view(src_obj, &s, "copy_crc32c: src", 0) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    uint32_t out = 0;
    int ok = check_pair(&d, &s) == 0;
    if (ok && d.len >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        out = copy_crc(d.buf, s.buf, (size_t)d.len, (uint32_t)crc, stream);
        Py_END_ALLOW_THREADS
    } else if (ok) {
        out = copy_crc(d.buf, s.buf, (size_t)d.len, (uint32_t)crc, stream);
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    return ok ? PyLong_FromUnsignedLong(out) : NULL;
}

/* The buffers of a sequence of slots, each C-contiguous and (for a save) writable; their count, or -1 with the error
 * set. views must hold len(seq) entries; on success the caller releases each. */
static Py_ssize_t get_slots(PyObject *seq, Py_buffer *views, Py_ssize_t n, int writable)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        char name[48];
        snprintf(name, sizeof(name), "copy_pages: slots[%zd]", i);
        if (get_view(item, &views[i], name, writable) < 0) {
            while (i--)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return n;
}

static PyObject *py_copy_pages(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"pages", "offsets", "slots", "slot_offset", "run_bytes", "crcs", "to_slots", "stream",
                             NULL};
    PyObject *pages_obj, *offsets_obj, *slots_obj, *crcs_obj = Py_None;
    Py_ssize_t slot_offset, run_bytes;
    int to_slots = -1, stream = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOnn|O$pp:copy_pages", kwlist, &pages_obj, &offsets_obj,
                                     &slots_obj, &slot_offset, &run_bytes, &crcs_obj, &to_slots, &stream))
        return NULL;
    if (to_slots < 0) {
        PyErr_SetString(PyExc_TypeError, "copy_pages: to_slots is required (True: pages -> slots, False: back)");
        return NULL;
    }
    int with_crc = crcs_obj != Py_None;
    if (with_crc && !hardware) {
        PyErr_SetString(PyExc_RuntimeError, "copy_pages: this CPU has no CRC-32C instruction (HARDWARE is False)");
        return NULL;
    }
    if (slot_offset < 0 || run_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_pages: slot_offset and run_bytes must be >= 0");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(slots_obj, "copy_pages: slots must be a sequence of buffers");
    if (!seq)
        return NULL;
    Py_ssize_t nslots = PySequence_Fast_GET_SIZE(seq);
    Py_buffer pages, offs, crcs = {0};
    Py_buffer *views = PyMem_Calloc((size_t)(nslots ? nslots : 1), sizeof(Py_buffer));
    int have_pages = 0, have_offs = 0, have_crcs = 0, have_slots = 0, ok = 0;
    if (!views) {
        PyErr_NoMemory();
        goto done;
    }
    if (get_view(pages_obj, &pages, "copy_pages: pages", !to_slots) < 0)
        goto done;
    have_pages = 1;
    if (get_view(offsets_obj, &offs, "copy_pages: offsets", 0) < 0)
        goto done;
    have_offs = 1;
    if (offs.itemsize != 8 || offs.len % 8) {
        PyErr_SetString(PyExc_ValueError, "copy_pages: offsets must be an int64 array");
        goto done;
    }
    if (with_crc) {
        if (get_view(crcs_obj, &crcs, "copy_pages: crcs", 1) < 0)
            goto done;
        have_crcs = 1;
        if (crcs.itemsize != 4 || crcs.len / 4 < nslots) {
            PyErr_Format(PyExc_ValueError, "copy_pages: crcs must be a uint32 array of at least %zd entries", nslots);
            goto done;
        }
    }
    Py_ssize_t nruns = offs.len / 8;
    if (nslots == 0 ? nruns != 0 : nruns % nslots != 0) {
        PyErr_Format(PyExc_ValueError, "copy_pages: %zd run offsets for %zd slots (a whole number of runs per slot)",
                     nruns, nslots);
        goto done;
    }
    Py_ssize_t per = nslots ? nruns / nslots : 0;
    const int64_t *off = offs.buf;
    for (Py_ssize_t r = 0; r < nruns; r++) {
        if (off[r] < 0 || off[r] > pages.len - run_bytes) {
            PyErr_Format(PyExc_ValueError, "copy_pages: run %zd at offset %lld + %zd bytes is outside the pages "
                         "(%zd bytes)", r, (long long)off[r], run_bytes, pages.len);
            goto done;
        }
    }
    if (get_slots(seq, views, nslots, to_slots) < 0)
        goto done;
    have_slots = 1;
    uintptr_t p0 = (uintptr_t)pages.buf, p1 = p0 + (uintptr_t)pages.len;
    for (Py_ssize_t i = 0; i < nslots; i++) {
        if (slot_offset + per * run_bytes > views[i].len) {
            PyErr_Format(PyExc_ValueError, "copy_pages: slots[%zd] is %zd bytes, the runs end at %zd", i,
                         views[i].len, slot_offset + per * run_bytes);
            goto done;
        }
        uintptr_t a = (uintptr_t)views[i].buf;
        if (views[i].len && pages.len && a < p1 && p0 < a + (uintptr_t)views[i].len) {
            PyErr_Format(PyExc_ValueError, "copy_pages: slots[%zd] overlaps the pages", i);
            goto done;
        }
    }
    uint32_t *crc = with_crc ? crcs.buf : NULL;
    size_t n = (size_t)run_bytes;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < nslots; i++) {
        unsigned char *slot = (unsigned char *)views[i].buf + slot_offset;
        for (Py_ssize_t k = 0; k < per; k++) {
            unsigned char *page = (unsigned char *)pages.buf + off[i * per + k];
            unsigned char *run = slot + k * run_bytes;
            unsigned char *d = to_slots ? run : page;
            const unsigned char *s = to_slots ? page : run;
            if (crc)
                crc[i] = copy_crc(d, s, n, crc[i], stream);
            else
                memcpy(d, s, n);
        }
    }
    Py_END_ALLOW_THREADS
    ok = 1;
done:
    if (have_slots)
        for (Py_ssize_t i = 0; i < nslots; i++)
            PyBuffer_Release(&views[i]);
    if (have_crcs)
        PyBuffer_Release(&crcs);
    if (have_offs)
        PyBuffer_Release(&offs);
    if (have_pages)
        PyBuffer_Release(&pages);
    PyMem_Free(views);
    Py_DECREF(seq);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_crc32c", (PyCFunction)(void (*)(void))py_copy_crc32c, METH_VARARGS | METH_KEYWORDS,
     "copy_crc32c(dst, src, crc=0) -> int\n\nCopy src into dst and return the CRC-32C of the bytes copied, in "
     "one pass (see the module's contract)."},
    {"copy_pages", (PyCFunction)(void (*)(void))py_copy_pages, METH_VARARGS | METH_KEYWORDS,
     "copy_pages(pages, offsets, slots, slot_offset, run_bytes, crcs=None, *, to_slots, stream=False)\n\nMove "
     "one layer's pages between an engine's KV storage and the blocks' slots, continuing each block's CRC-32C "
     "(see the module's contract)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kvcopy", "One pass that copies a buffer and computes its CRC-32C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kvcopy(void)
{
    hardware = detect();
    vector = hardware && detect_vector() && getenv("KVCOPY_NO_VECTOR") == NULL;
    zeros_table(zeros_long, LONG);
    zeros_table(zeros_short, SHORT);
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddObject(m, "HARDWARE", PyBool_FromLong(hardware)) < 0 ||
              PyModule_AddObject(m, "VECTOR", PyBool_FromLong(vector)) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
