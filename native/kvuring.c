/*
 * kvstore._kvuring — io_uring for the SSD tier, written against the kernel ABI (no liburing).
 *
 * CONTRACT
 *   Ring(depth) -> Ring             io_uring_setup with `depth` SQ entries (1..4096; the CQ has twice as many) and
 *     the SQ/CQ rings mmapped. OSError(errno) when the kernel refuses: ENOSYS (no io_uring), EPERM
 *     (kernel.io_uring_disabled, seccomp), ENOMEM (RLIMIT_MEMLOCK on kernels before 5.12), or ENOSYS too for a
 *     kernel older than 5.5 (no IORING_FEAT_NODROP) — the caller falls back to threads and logs the reason.
 *   A Ring has `depth` slots. Each op takes one from its prep until its completion is reaped; `space` says how
 *   many are free, and a prep with none free raises RuntimeError (a programming error: check `space`).
 *     readv(fd, bufs, offset, tag, *, link=False, fixed_file=False)   IORING_OP_READV into `bufs` (a list or
 *     writev(fd, bufs, offset, tag, *, link=False, fixed_file=False)  tuple of 1..1024 contiguous buffers; writable
 *                                                                     for reads) at `offset` (>= 0)
 *     read_fixed(fd, index, start, length, offset, tag, ...)      IORING_OP_READ_FIXED / WRITE_FIXED on bytes
 *     write_fixed(fd, index, start, length, offset, tag, ...)     [start, start+length) of registered buffer `index`
 *     fsync(fd, tag, *, datasync=False, link=False, fixed_file=False)
 *     cancel(target_tag, tag)     IORING_OP_ASYNC_CANCEL of the op in flight with `target_tag` (its result:
 *                                 -ECANCELED); the cancel's own result is 0, -ENOENT or -EALREADY.
 *   `tag` is the caller's name for the op (an int, 0..2^64-1), handed back with its result. link=True sets
 *   IOSQE_IO_LINK: the next op prepped starts only after this one completes in full (a failed or short read or
 *   write cancels it: -ECANCELED) — a write then its fsync. fixed_file=True: `fd` is an index into
 *   register_files.
 *     submit() -> int            hands the prepped ops to the kernel; how many it took.
 *     wait(min_complete=1) -> list[tuple[int, int]]
 *                                submits what is prepped, then returns every completion there is as (tag, result),
 *                                waiting with the GIL released until at least min(min_complete, in flight) are
 *                                there. result: bytes moved (a short read is its byte count), 0 for fsync, or
 *                                -errno: one op's failure is its result, never an exception. A signal during the
 *                                wait returns the completions already reaped, if any (the handler runs next), else
 *                                raises the handler's exception (the ops stay in flight, their buffers held).
 *     register_buffers(bufs) / unregister_buffers(), register_files(fds) / unregister_files()
 *     close()                    cancels what is in flight, waits for it, frees the ring. Idempotent.
 *     fd, depth, inflight, space, closed: read-only attributes.
 *
 * MEMORY SAFETY. The kernel reads and writes a caller's buffer by address until the op's completion is reaped.
 * Each op holds a Py_buffer on every buffer it names (PyObject_GetBuffer, PyBUF_WRITABLE for reads) from its prep
 * until its CQE is reaped in wait(), and releases them exactly then: meanwhile an mmap cannot be closed
 * (BufferError) nor a bytearray resized. Registered buffers are held the same way until unregister_buffers()
 * (refused while a fixed op is in flight) or close(). A ring is never freed with ops in flight: close() and the
 * deallocator first submit anything prepped, cancel every op in flight (IORING_OP_ASYNC_CANCEL), then wait (GIL
 * released, signals ignored) until every completion is in. An op already under way on a disk cannot be cancelled
 * (-EALREADY) and is waited for. A ring inherited by a forked child is freed there without waiting: the kernel
 * does the parent's I/O into the parent's memory, never the child's copy.
 *
 * THE GIL. Every io_uring_enter runs with the GIL released (a submit of O_DIRECT I/O may block in the block layer,
 * a wait blocks until the disk answers). EINTR: pending Python signal handlers run (an exception they raise —
 * KeyboardInterrupt — comes out of wait(), the ops stay in flight and their buffers held), else the call is
 * retried; EAGAIN (no kernel memory for now) is retried after a yield; EBUSY (completions must be reaped first)
 * makes wait() reap before it submits more.
 *
 * THREADS. A Ring belongs to the thread that made it: a method called from any other thread (or process) raises
 * RuntimeError, so the rings, the slots and the Py_buffers are never touched by two threads at once, and a ring is
 * never closed under a thread waiting in it. The SSD tier keeps one Ring per worker thread (thread-local).
 *
 * CQ OVERFLOW. At most `depth` slots are in flight and close()'s cancels add at most `depth` more, against a CQ of
 * 2 x SQ entries: the CQ cannot overflow by construction. Should the kernel ever report it (IORING_SQ_CQ_OVERFLOW),
 * IORING_FEAT_NODROP (required) keeps the completions, and the next io_uring_enter(GETEVENTS) flushes them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/io_uring.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_DEPTH 4096
#define MAX_IOV 1024                  /* Linux UIO_MAXIOV */
#define CLOSE_CANCEL_UD UINT64_MAX    /* user_data of close()'s own cancels: their completions are ignored */
#define NO_SLOT_UD (UINT64_MAX - 1)   /* cancel target that names no op: the kernel answers -ENOENT */
#define EAGAIN_TRIES 1000

/* ------------------------------------------------------------------------------------------------ syscalls */

static int sys_setup(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

static int sys_register(int fd, unsigned opcode, const void *arg, unsigned nr_args)
{
    return (int)syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
}

/* OSError(err, what) (the errno's subclass: PermissionError for EPERM, ...); returns NULL. */
static PyObject *os_error(int err, const char *what)
{
    PyObject *v = Py_BuildValue("(is)", err, what ? what : strerror(err));
    if (v) {
        PyErr_SetObject(PyExc_OSError, v);
        Py_DECREF(v);
    }
    return NULL;
}

/* ------------------------------------------------------------------------------------------------ the object */

typedef struct {
    uint64_t tag;
    Py_buffer *views;                 /* held from prep until the CQE is reaped */
    struct iovec *iov;
    int nviews;
    int busy;
    int fixed_buf;                    /* uses a registered buffer: unregister must wait */
} Slot;

typedef struct {
    PyObject_HEAD
    int fd;                           /* -1 once closed */
    unsigned depth;
    pid_t pid;
    unsigned long owner;              /* PyThread_get_thread_ident() of the creating thread */
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_entries, *sq_flags, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_map_len, cq_map_len, sqes_len;
    Slot *slots;
    unsigned *free_slots, nfree;
    unsigned queued;                  /* SQEs written, not yet taken by the kernel */
    unsigned fixed_inflight;
    unsigned close_cancels;           /* close()'s cancels whose completions are not in yet */
    Py_buffer *reg;                   /* registered buffers, held until unregistered */
    Py_ssize_t nreg;
    int files_registered;
    int leaked;                       /* io_uring_enter failed while draining: buffers are kept for good */
} Ring;

static PyTypeObject RingType;

/* ------------------------------------------------------------------------------------------------ rings */

static int map_rings(Ring *r, const struct io_uring_params *p)
{
    r->sq_map_len = p->sq_off.array + p->sq_entries * sizeof(unsigned);
    r->cq_map_len = p->cq_off.cqes + p->cq_entries * sizeof(struct io_uring_cqe);
    if (p->features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_map_len > r->sq_map_len)
            r->sq_map_len = r->cq_map_len;
    }
    r->sq_map = mmap(NULL, r->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) {
        r->sq_map = NULL;
        return -1;
    }
    if (p->features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_map = r->sq_map;
    } else {
        r->cq_map = mmap(NULL, r->cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                         IORING_OFF_CQ_RING);
        if (r->cq_map == MAP_FAILED) {
            r->cq_map = NULL;
            return -1;
        }
    }
    r->sqes_len = p->sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) {
        r->sqes = NULL;
        return -1;
    }
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p->sq_off.head);
    r->sq_tail = (unsigned *)(sq + p->sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p->sq_off.ring_mask);
    r->sq_entries = (unsigned *)(sq + p->sq_off.ring_entries);
    r->sq_flags = (unsigned *)(sq + p->sq_off.flags);
    r->sq_array = (unsigned *)(sq + p->sq_off.array);
    r->cq_head = (unsigned *)(cq + p->cq_off.head);
    r->cq_tail = (unsigned *)(cq + p->cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p->cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p->cq_off.cqes);
    return 0;
}

static void unmap_rings(Ring *r)
{
    if (r->sqes)
        munmap(r->sqes, r->sqes_len);
    if (r->cq_map && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_map_len);
    if (r->sq_map)
        munmap(r->sq_map, r->sq_map_len);
    r->sqes = NULL;
    r->sq_map = r->cq_map = NULL;
}

/* Runs io_uring_enter with the GIL released (the caller holds it); retries EAGAIN a while. Returns the syscall's
 * result or -errno. EINTR is returned to the caller, which decides whether signals matter. */
static int enter(Ring *r, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    int ret, err = 0;
    for (int tries = 0; tries < EAGAIN_TRIES; tries++) {
        Py_BEGIN_ALLOW_THREADS
        ret = sys_enter(r->fd, to_submit, min_complete, flags);
        err = errno;
        if (ret < 0 && err == EAGAIN)
            sched_yield();
        Py_END_ALLOW_THREADS
        if (ret >= 0)
            return ret;
        if (err != EAGAIN)
            return -err;
    }
    return -EAGAIN;
}

/* ------------------------------------------------------------------------------------------------ slots */

static void slot_release(Ring *r, unsigned i)
{
    Slot *s = &r->slots[i];
    for (int k = 0; k < s->nviews; k++)
        PyBuffer_Release(&s->views[k]);
    PyMem_Free(s->views);
    PyMem_Free(s->iov);
    s->views = NULL;
    s->iov = NULL;
    s->nviews = 0;
    if (s->fixed_buf)
        r->fixed_inflight--;
    s->fixed_buf = 0;
    s->busy = 0;
    r->free_slots[r->nfree++] = i;
}

static int check_usable(Ring *r)
{
    if (r->fd < 0) {
        PyErr_SetString(PyExc_ValueError, "I/O on a closed Ring");
        return -1;
    }
    if (r->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "this Ring belongs to the parent process (forked): make a new one");
        return -1;
    }
    if (r->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "a Ring is used only by the thread that made it");
        return -1;
    }
    return 0;
}

/* A free slot for a new op, or -1 with RuntimeError set. */
static int slot_take(Ring *r, uint64_t tag)
{
    if (!r->nfree) {
        PyErr_Format(PyExc_RuntimeError, "all %u entries of the Ring are in flight: wait() for one first",
                     r->depth);
        return -1;
    }
    unsigned i = r->free_slots[--r->nfree];
    Slot *s = &r->slots[i];
    s->busy = 1;
    s->tag = tag;
    return (int)i;
}

/* The next SQE, zeroed, with user_data set; the tail is published at once (the kernel reads it only in enter). */
static struct io_uring_sqe *sqe_push(Ring *r, uint64_t user_data)
{
    unsigned tail = *r->sq_tail;
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    if (tail - head >= *r->sq_entries)
        return NULL;                  /* never with the slot limit; checked all the same */
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    memset(sqe, 0, sizeof(*sqe));
    sqe->user_data = user_data;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    r->queued++;
    return sqe;
}

static int take_views(Slot *s, PyObject *bufs, int writable)
{
    if (!PyList_Check(bufs) && !PyTuple_Check(bufs)) {
        PyErr_SetString(PyExc_TypeError, "bufs must be a list or tuple of buffers");
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(bufs);
    if (n < 1 || n > MAX_IOV) {
        PyErr_Format(PyExc_ValueError, "bufs must hold 1 to %d buffers, not %zd", MAX_IOV, n);
        return -1;
    }
    s->views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    s->iov = PyMem_Calloc((size_t)n, sizeof(struct iovec));
    if (!s->views || !s->iov) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(bufs);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyObject_GetBuffer(items[k], &s->views[k], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
            return -1;
        s->nviews = (int)k + 1;
        s->iov[k].iov_base = s->views[k].buf;
        s->iov[k].iov_len = (size_t)s->views[k].len;
    }
    return 0;
}

static unsigned sqe_flags(int link, int fixed_file)
{
    return (link ? IOSQE_IO_LINK : 0) | (fixed_file ? IOSQE_FIXED_FILE : 0);
}

/* ------------------------------------------------------------------------------------------------ ops */

/* The submission entry of op slot i, or NULL with RuntimeError set and the slot released (its views with it). */
static struct io_uring_sqe *sqe_for(Ring *r, int i)
{
    struct io_uring_sqe *sqe = sqe_push(r, (uint64_t)i);
    if (!sqe) {
        slot_release(r, (unsigned)i);
        PyErr_SetString(PyExc_RuntimeError, "the submission queue is full");
    }
    return sqe;
}

static PyObject *prep_vec(Ring *r, PyObject *args, PyObject *kw, int op)
{
    static char *kwlist[] = {"fd", "bufs", "offset", "tag", "link", "fixed_file", NULL};
    int fd, link = 0, fixed_file = 0;
    PyObject *bufs;
    long long offset;
    unsigned long long tag;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOLK|$pp", kwlist, &fd, &bufs, &offset, &tag, &link,
                                     &fixed_file))
        return NULL;
    if (check_usable(r) < 0)
        return NULL;
    if (offset < 0)                   /* io_uring reads -1 as "the file position": never pass it through */
        return PyErr_Format(PyExc_ValueError, "offset must be >= 0, not %lld", offset);
    int i = slot_take(r, tag);
    if (i < 0)
        return NULL;
    Slot *s = &r->slots[i];
    if (take_views(s, bufs, op == IORING_OP_READV) < 0) {
        slot_release(r, (unsigned)i);
        return NULL;
    }
    struct io_uring_sqe *sqe = sqe_for(r, i);
    if (!sqe)
        return NULL;
    sqe->opcode = (uint8_t)op;
    sqe->flags = (uint8_t)sqe_flags(link, fixed_file);
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)s->iov;
    sqe->len = (uint32_t)s->nviews;
    sqe->off = (uint64_t)offset;
    Py_RETURN_NONE;
}

static PyObject *ring_readv(Ring *r, PyObject *args, PyObject *kw) { return prep_vec(r, args, kw, IORING_OP_READV); }
static PyObject *ring_writev(Ring *r, PyObject *args, PyObject *kw) { return prep_vec(r, args, kw, IORING_OP_WRITEV); }

static PyObject *prep_fixed(Ring *r, PyObject *args, PyObject *kw, int op)
{
    static char *kwlist[] = {"fd", "index", "start", "length", "offset", "tag", "link", "fixed_file", NULL};
    int fd, link = 0, fixed_file = 0;
    Py_ssize_t index, start, length;
    long long offset;
    unsigned long long tag;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "innnLK|$pp", kwlist, &fd, &index, &start, &length, &offset, &tag,
                                     &link, &fixed_file))
        return NULL;
    if (check_usable(r) < 0)
        return NULL;
    if (index < 0 || index >= r->nreg)
        return PyErr_Format(PyExc_IndexError, "registered buffer %zd of %zd", index, r->nreg);
    Py_buffer *b = &r->reg[index];
    if (start < 0 || length < 0 || length > UINT32_MAX || start > b->len - length)
        return PyErr_Format(PyExc_ValueError, "[%zd, +%zd) is outside registered buffer %zd (%zd bytes)", start,
                            length, index, b->len);
    if (offset < 0)
        return PyErr_Format(PyExc_ValueError, "offset must be >= 0, not %lld", offset);
    int i = slot_take(r, tag);
    if (i < 0)
        return NULL;
    struct io_uring_sqe *sqe = sqe_for(r, i);
    if (!sqe)
        return NULL;
    r->slots[i].fixed_buf = 1;
    r->fixed_inflight++;
    sqe->opcode = (uint8_t)op;
    sqe->flags = (uint8_t)sqe_flags(link, fixed_file);
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)((char *)b->buf + start);
    sqe->len = (uint32_t)length;
    sqe->off = (uint64_t)offset;
    sqe->buf_index = (uint16_t)index;
    Py_RETURN_NONE;
}

static PyObject *ring_read_fixed(Ring *r, PyObject *a, PyObject *k) { return prep_fixed(r, a, k, IORING_OP_READ_FIXED); }
static PyObject *ring_write_fixed(Ring *r, PyObject *a, PyObject *k) { return prep_fixed(r, a, k, IORING_OP_WRITE_FIXED); }

static PyObject *ring_fsync(Ring *r, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"fd", "tag", "datasync", "link", "fixed_file", NULL};
    int fd, datasync = 0, link = 0, fixed_file = 0;
    unsigned long long tag;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iK|$ppp", kwlist, &fd, &tag, &datasync, &link, &fixed_file))
        return NULL;
    if (check_usable(r) < 0)
        return NULL;
    int i = slot_take(r, tag);
    if (i < 0)
        return NULL;
    struct io_uring_sqe *sqe = sqe_for(r, i);
    if (!sqe)
        return NULL;
    sqe->opcode = IORING_OP_FSYNC;
    sqe->flags = (uint8_t)sqe_flags(link, fixed_file);
    sqe->fd = fd;
    sqe->fsync_flags = datasync ? IORING_FSYNC_DATASYNC : 0;
    Py_RETURN_NONE;
}

/* user_data of the op in flight named `tag` (NO_SLOT_UD if none: the kernel then answers -ENOENT). */
static uint64_t slot_of(Ring *r, uint64_t tag, int except)
{
    for (unsigned i = 0; i < r->depth; i++)
        if (r->slots[i].busy && r->slots[i].tag == tag && (int)i != except)
            return i;
    return NO_SLOT_UD;
}

static PyObject *ring_cancel(Ring *r, PyObject *args)
{
    unsigned long long target, tag;
    if (!PyArg_ParseTuple(args, "KK", &target, &tag))
        return NULL;
    if (check_usable(r) < 0)
        return NULL;
    int i = slot_take(r, tag);
    if (i < 0)
        return NULL;
    struct io_uring_sqe *sqe = sqe_for(r, i);
    if (!sqe)
        return NULL;
    sqe->opcode = IORING_OP_ASYNC_CANCEL;
    sqe->fd = -1;
    sqe->addr = slot_of(r, target, i);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------------ submit, reap */

/* Hands queued SQEs to the kernel. Returns how many it took (0 on EBUSY: reap first), or -errno. With
 * `signals`, EINTR runs Python's signal handlers (-EINTR returned with their exception set). */
static int submit_queued(Ring *r, int signals)
{
    int total = 0;
    while (r->queued) {
        int n = enter(r, r->queued, 0, 0);
        if (n == -EINTR) {
            if (signals && PyErr_CheckSignals() < 0)
                return -EINTR;
            continue;
        }
        if (n == -EBUSY)
            return total;
        if (n < 0)
            return n;
        if (n == 0)
            return total;
        r->queued -= (unsigned)n;
        total += n;
    }
    return total;
}

static unsigned inflight(Ring *r)
{
    return r->depth - r->nfree + r->close_cancels;
}

/* Moves every CQE there is into `out` (a list, may be NULL to drop them), releasing each op's buffers. */
static int reap_ready(Ring *r, PyObject *out)
{
    unsigned head = *r->cq_head;
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    int got = 0;
    for (; head != tail; head++) {
        struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
        uint64_t ud = c->user_data;
        int res = c->res;
        if (ud == CLOSE_CANCEL_UD) {
            r->close_cancels--;
            continue;
        }
        if (ud >= r->depth || !r->slots[ud].busy)
            continue;                 /* not ours (never expected): nothing to release */
        uint64_t tag = r->slots[ud].tag;
        slot_release(r, (unsigned)ud);
        got++;
        if (out) {
            PyObject *t = Py_BuildValue("(Ki)", (unsigned long long)tag, res);
            if (!t || PyList_Append(out, t) < 0) {
                Py_XDECREF(t);
                __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
                return -1;
            }
            Py_DECREF(t);
        }
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    return got;
}

static PyObject *ring_submit(Ring *r, PyObject *Py_UNUSED(ignored))
{
    if (check_usable(r) < 0)
        return NULL;
    int n = submit_queued(r, 1);
    if (n == -EINTR)
        return NULL;
    if (n < 0)
        return os_error(-n, "io_uring_enter (submit)");
    return PyLong_FromLong(n);
}

/* Blocks (GIL released) until a completion is there: 0; 1 if a signal came while the caller `has` completions
 * to hand back (they are returned, and the interpreter runs the handler right after); -1 with an exception set. */
static int wait_one(Ring *r, Py_ssize_t has)
{
    for (;;) {
        int n = enter(r, r->queued, 1, IORING_ENTER_GETEVENTS);
        if (n >= 0) {
            r->queued -= (unsigned)n < r->queued ? (unsigned)n : r->queued;
            return 0;
        }
        if (n == -EINTR) {
            if (has)
                return 1;
            if (PyErr_CheckSignals() < 0)
                return -1;
            continue;
        }
        if (n == -EBUSY && r->queued) {       /* completions to reap first: wait without submitting */
            n = enter(r, 0, 1, IORING_ENTER_GETEVENTS);
            if (n >= 0)
                return 0;
            if (n == -EINTR)
                continue;
        }
        os_error(-n, "io_uring_enter (wait)");
        return -1;
    }
}

static PyObject *ring_wait(Ring *r, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"min_complete", NULL};
    int want = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|i", kwlist, &want))
        return NULL;
    if (check_usable(r) < 0)
        return NULL;
    if (submit_queued(r, 1) == -EINTR)
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    for (;;) {
        int got = reap_ready(r, out);
        if (got < 0)
            goto fail;
        Py_ssize_t have = PyList_GET_SIZE(out);
        if (have >= want || r->depth == r->nfree)
            return out;
        int w = wait_one(r, have);
        if (w < 0)
            goto fail;
        if (w > 0)
            return out;
    }
fail:
    Py_DECREF(out);                   /* empty after a signal (never drops a completion); after a MemoryError
                                       * the ones reaped are lost to the caller, their buffers released */
    return NULL;
}

/* ------------------------------------------------------------------------------------------------ close */

/* Cancels every op in flight and waits for all of them, signals ignored. No Python exception is left set. */
static void drain(Ring *r)
{
    PyObject *exc_t, *exc_v, *exc_tb;
    PyErr_Fetch(&exc_t, &exc_v, &exc_tb);
    submit_queued(r, 0);
    for (unsigned i = 0; i < r->depth; i++) {
        if (!r->slots[i].busy)
            continue;
        struct io_uring_sqe *sqe = sqe_push(r, CLOSE_CANCEL_UD);
        if (!sqe)
            break;                    /* cannot happen (SQ entries >= slots); the wait below still covers it */
        sqe->opcode = IORING_OP_ASYNC_CANCEL;
        sqe->fd = -1;
        sqe->addr = i;
        r->close_cancels++;
    }
    while (inflight(r) || r->queued) {
        if (reap_ready(r, NULL) < 0)
            PyErr_Clear();
        if (!inflight(r) && !r->queued)
            break;
        int n = enter(r, r->queued, 1, IORING_ENTER_GETEVENTS);
        if (n >= 0)
            r->queued -= (unsigned)n < r->queued ? (unsigned)n : r->queued;
        else if (n != -EINTR && n != -EBUSY)
            break;                    /* the ring is unusable: buffers are kept (leaked), never freed early */
    }
    PyErr_Restore(exc_t, exc_v, exc_tb);
}

static void unregister_all(Ring *r)
{
    for (Py_ssize_t k = 0; k < r->nreg; k++)
        PyBuffer_Release(&r->reg[k]);
    PyMem_Free(r->reg);
    r->reg = NULL;
    r->nreg = 0;
}

static void ring_free(Ring *r)
{
    if (r->fd >= 0 && r->slots && r->sqes && r->pid == getpid()) {
        drain(r);
        r->leaked = inflight(r) > 0;   /* only if io_uring_enter itself failed: keep what the kernel may touch */
    }                                  /* (a forked child frees at once: the parent's I/O never lands here) */
    if (!r->leaked && r->slots) {
        for (unsigned i = 0; i < r->depth; i++)
            if (r->slots[i].busy)
                slot_release(r, i);
        unregister_all(r);
        PyMem_Free(r->slots);
        PyMem_Free(r->free_slots);
        r->slots = NULL;
        r->free_slots = NULL;
        r->nfree = 0;
    }
    if (r->fd >= 0) {
        unmap_rings(r);
        close(r->fd);
        r->fd = -1;
    }
}

static PyObject *ring_close(Ring *r, PyObject *Py_UNUSED(ignored))
{
    if (r->fd < 0)
        Py_RETURN_NONE;
    if (check_usable(r) < 0)
        return NULL;
    ring_free(r);
    Py_RETURN_NONE;
}

static void ring_dealloc(Ring *r)
{
    ring_free(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* ------------------------------------------------------------------------------------------------ register */

static PyObject *ring_register_buffers(Ring *r, PyObject *bufs)
{
    if (check_usable(r) < 0)
        return NULL;
    if (r->nreg)
        return PyErr_Format(PyExc_RuntimeError, "buffers are registered already: unregister_buffers() first");
    PyObject *seq = PySequence_Fast(bufs, "bufs must be a sequence of buffers");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = n ? PyMem_Calloc((size_t)n, sizeof(Py_buffer)) : NULL;
    struct iovec *iov = n ? PyMem_Calloc((size_t)n, sizeof(struct iovec)) : NULL;
    Py_ssize_t held = 0;
    if (n < 1 || n > 16384 || !views || !iov) {
        if (n >= 1 && n <= 16384)
            PyErr_NoMemory();
        else
            PyErr_Format(PyExc_ValueError, "register 1 to 16384 buffers, not %zd", n);
        goto fail;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, held), &views[held], PyBUF_WRITABLE) < 0)
            goto fail;
        iov[held].iov_base = views[held].buf;
        iov[held].iov_len = (size_t)views[held].len;
    }
    int ret;
    Py_BEGIN_ALLOW_THREADS
    ret = sys_register(r->fd, IORING_REGISTER_BUFFERS, iov, (unsigned)n);
    Py_END_ALLOW_THREADS
    if (ret < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    PyMem_Free(iov);
    Py_DECREF(seq);
    r->reg = views;
    r->nreg = n;
    Py_RETURN_NONE;
fail:
    for (Py_ssize_t k = 0; k < held; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyMem_Free(iov);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *ring_unregister_buffers(Ring *r, PyObject *Py_UNUSED(ignored))
{
    if (check_usable(r) < 0)
        return NULL;
    if (r->fixed_inflight)
        return PyErr_Format(PyExc_RuntimeError, "%u fixed-buffer ops are in flight: wait() for them first",
                            r->fixed_inflight);
    if (!r->nreg)
        Py_RETURN_NONE;
    if (sys_register(r->fd, IORING_UNREGISTER_BUFFERS, NULL, 0) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    unregister_all(r);
    Py_RETURN_NONE;
}

static PyObject *ring_register_files(Ring *r, PyObject *fds)
{
    if (check_usable(r) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(fds, "fds must be a sequence of ints");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int *arr = (n >= 1 && n <= 32768) ? PyMem_Calloc((size_t)n, sizeof(int)) : NULL;
    if (!arr) {
        Py_DECREF(seq);
        return (n >= 1 && n <= 32768) ? PyErr_NoMemory()
                                      : PyErr_Format(PyExc_ValueError, "register 1 to 32768 files, not %zd", n);
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, k));
        if (v < -1 || v > INT32_MAX) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "not a file descriptor: %ld", v);
        }
        arr[k] = (int)v;
        if (PyErr_Occurred()) {
            PyMem_Free(arr);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    int ret = sys_register(r->fd, IORING_REGISTER_FILES, arr, (unsigned)n);
    PyMem_Free(arr);
    if (ret < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    r->files_registered = 1;
    Py_RETURN_NONE;
}

static PyObject *ring_unregister_files(Ring *r, PyObject *Py_UNUSED(ignored))
{
    if (check_usable(r) < 0)
        return NULL;
    if (r->files_registered && sys_register(r->fd, IORING_UNREGISTER_FILES, NULL, 0) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    r->files_registered = 0;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------------ type */

static int ring_init_slots(Ring *r)
{
    r->slots = PyMem_Calloc(r->depth, sizeof(Slot));
    r->free_slots = PyMem_Calloc(r->depth, sizeof(unsigned));
    if (!r->slots || !r->free_slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (unsigned i = 0; i < r->depth; i++)
        r->free_slots[i] = r->depth - 1 - i;
    r->nfree = r->depth;
    return 0;
}

static PyObject *ring_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"depth", NULL};
    int depth;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i", kwlist, &depth))
        return NULL;
    if (depth < 1 || depth > MAX_DEPTH)
        return PyErr_Format(PyExc_ValueError, "depth must be 1 to %d, not %d", MAX_DEPTH, depth);
    Ring *r = (Ring *)type->tp_alloc(type, 0);
    if (!r)
        return NULL;
    r->fd = -1;                       /* until set up, the deallocator frees only memory */
    r->depth = (unsigned)depth;
    r->pid = getpid();
    r->owner = PyThread_get_thread_ident();
    if (ring_init_slots(r) < 0)
        goto fail;
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    r->fd = sys_setup((unsigned)depth, &p);
    if (r->fd < 0) {
        char msg[128];
        int err = errno;
        snprintf(msg, sizeof(msg), "io_uring_setup: %s", strerror(err));
        r->fd = -1;
        os_error(err, msg);
        goto fail;
    }
    if (!(p.features & IORING_FEAT_NODROP)) {
        os_error(ENOSYS, "io_uring without IORING_FEAT_NODROP (a kernel before 5.5)");
        goto fail;
    }
    if (map_rings(r, &p) < 0) {
        os_error(errno, "mmap of the io_uring rings");
        goto fail;
    }
    return (PyObject *)r;
fail:
    Py_DECREF(r);                     /* ring_free: unmaps what was mapped, closes the fd */
    return NULL;
}

static PyObject *get_fd(Ring *r, void *c) { return PyLong_FromLong(r->fd); }
static PyObject *get_depth(Ring *r, void *c) { return PyLong_FromUnsignedLong(r->depth); }
static PyObject *get_inflight(Ring *r, void *c) { return PyLong_FromUnsignedLong(r->fd < 0 ? 0 : r->depth - r->nfree); }
static PyObject *get_space(Ring *r, void *c) { return PyLong_FromUnsignedLong(r->fd < 0 ? 0 : r->nfree); }
static PyObject *get_closed(Ring *r, void *c) { return PyBool_FromLong(r->fd < 0); }

static PyGetSetDef ring_getset[] = {
    {"fd", (getter)get_fd, NULL, "the ring's file descriptor (-1 once closed)", NULL},
    {"depth", (getter)get_depth, NULL, "slots: the most ops in flight at once", NULL},
    {"inflight", (getter)get_inflight, NULL, "ops prepped or submitted whose completion is not reaped yet", NULL},
    {"space", (getter)get_space, NULL, "free slots: how many ops may be prepped now", NULL},
    {"closed", (getter)get_closed, NULL, "whether close() ran", NULL},
    {NULL},
};

#define KW (METH_VARARGS | METH_KEYWORDS)
static PyMethodDef ring_methods[] = {
    {"readv", (PyCFunction)(void (*)(void))ring_readv, KW, "readv(fd, bufs, offset, tag, *, link, fixed_file)"},
    {"writev", (PyCFunction)(void (*)(void))ring_writev, KW, "writev(fd, bufs, offset, tag, *, link, fixed_file)"},
    {"read_fixed", (PyCFunction)(void (*)(void))ring_read_fixed, KW,
     "read_fixed(fd, index, start, length, offset, tag, *, link, fixed_file)"},
    {"write_fixed", (PyCFunction)(void (*)(void))ring_write_fixed, KW,
     "write_fixed(fd, index, start, length, offset, tag, *, link, fixed_file)"},
    {"fsync", (PyCFunction)(void (*)(void))ring_fsync, KW, "fsync(fd, tag, *, datasync, link, fixed_file)"},
    {"cancel", (PyCFunction)ring_cancel, METH_VARARGS, "cancel(target_tag, tag)"},
    {"submit", (PyCFunction)ring_submit, METH_NOARGS, "submit() -> ops taken by the kernel"},
    {"wait", (PyCFunction)(void (*)(void))ring_wait, KW, "wait(min_complete=1) -> [(tag, result), ...]"},
    {"register_buffers", (PyCFunction)ring_register_buffers, METH_O, "register_buffers(bufs)"},
    {"unregister_buffers", (PyCFunction)ring_unregister_buffers, METH_NOARGS, "unregister_buffers()"},
    {"register_files", (PyCFunction)ring_register_files, METH_O, "register_files(fds)"},
    {"unregister_files", (PyCFunction)ring_unregister_files, METH_NOARGS, "unregister_files()"},
    {"close", (PyCFunction)ring_close, METH_NOARGS, "cancel and wait for what is in flight, then free the ring"},
    {NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore._kvuring.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An io_uring owned by the thread that made it (see native/kvuring.c).",
    .tp_new = ring_new,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_getset = ring_getset,
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_kvuring", "io_uring over the raw kernel ABI (see native/kvuring.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__kvuring(void)
{
    if (PyType_Ready(&RingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m)
        return NULL;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_IOV", MAX_IOV) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
