/* feedpipe._native._stagefiles: the conversion's two per-item loops in C. ``stage``, the per-file
 * loop of one-pass staging, is called by feedpipe.convert._stage_dir (stage_dir, for
 * feedpipe.convert._onepass); ``image_sizes``, each image's size read from its header at shard
 * time, by feedpipe.format._image_sizes.
 *
 * stage(dirfd, out_fd, keys, first, exts, rels, extra, template, start, pos, guess, flags,
 *       starts, names, offsets, sizes, rows) -> (next, pos)
 *
 * Stages samples ``start``, ``start + 1``, ... of a directory, in key order: per member ``m`` of
 * sample ``i`` (``first[i] <= m < first[i + 1]``), the file ``rels[m]`` (a str relative to the
 * directory ``dirfd``; ``None``: the bytes ``extra``, a ``cls`` field) is opened with ``flags``,
 * read in one read of ``guess`` bytes and closed, and its tar member (the ustar header packed
 * from the 512-byte ``template`` with the name ``key.ext`` and the size, the data, the padding to
 * a block) is appended to the staging file ``out_fd`` in large writes. Per sample staged it
 * appends to ``starts`` the sample's start, to ``names``, ``offsets`` and ``sizes`` its members'
 * names, data offsets and sizes, and to ``rows`` the listing's row ``(key, [(ext, rel, size),
 * ...])`` (its files only).
 * ``pos`` is where the next member starts in the staging file.
 *
 * The Python loop does the same per file, and takes over for a sample with anything unusual, so
 * that its behaviour stays exactly the Python path's: a name over 100 bytes, a file that cannot be
 * opened or read, an empty one, one that fills the read (perhaps larger, or not a regular file),
 * a path that is not UTF-8. It then stops before that sample, having written every sample before
 * it, and returns its index as ``next`` (``len(keys)`` once all are staged) and the position
 * reached. Python per file costs more than the system calls on a tree of small files
 * (benchmarks/bench_convert.py --profile).
 *
 * image_sizes(buffer, members, offsets, sizes) -> (pairs, fallback)
 *
 * Each sample's image ``(width, height)`` read from its header in the mapped shard ``buffer``,
 * for feedpipe.format._image_sizes (index_sizes, the sizes recorded at shard time): sample ``i``'s
 * image is the member ``members[i]`` (-1: none) whose data is ``offsets[m]``, ``sizes[m]`` bytes
 * (cut at the buffer's end, as a memoryview slice is). ``pairs`` is ``bytes`` of native int32
 * ``(width, height)`` pairs, ``(-1, -1)`` where the sample has no image or its size was not read
 * here; ``fallback`` lists the samples whose header the Python parsers would not read (or would
 * read as a value an int32 does not hold), which Python then reads itself (``header_size``, and
 * Pillow), so that the recorded sizes and the count of unread headers stay the Python path's.
 * JPEG's start-of-frame, PNG's IHDR, WebP's VP8/VP8L/VP8X, GIF and BMP are parsed byte for byte
 * as ``header_size`` parses them. A loop of Python per image costs more than the parse itself
 * (benchmarks/bench_versions.py --counter instructions, the convert phase).
 *
 * Optional (setup.py): where it did not build, the Python loop stages every sample and Python
 * reads every header.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define BLOCK 512
#define FLUSH_AT (1 << 20) /* bytes gathered before one write to the staging file */

typedef struct {
    char *buf;
    size_t len, cap;
    int fd;
} Out;

static int reserve(Out *o, size_t more)
{
    if (o->len + more <= o->cap)
        return 0;
    size_t cap = o->cap ? o->cap : FLUSH_AT;
    while (cap < o->len + more)
        cap *= 2;
    char *b = PyMem_Realloc(o->buf, cap);
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->buf = b;
    o->cap = cap;
    return 0;
}

static int flush(Out *o)
{
    size_t done = 0;
    while (done < o->len) {
        ssize_t n = write(o->fd, o->buf + done, o->len - done);
        if (n < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0)
                    return -1;
                continue;
            }
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        done += (size_t)n;
    }
    o->len = 0;
    return 0;
}

/* the member's data, read into ``dst`` (room for ``guess`` bytes): its size, or -1 where the
 * Python loop must take the sample over (no Python error set) */
static Py_ssize_t read_member(int dirfd, const char *rel, int flags, char *dst, Py_ssize_t guess)
{
    int fd;
    do
        fd = openat(dirfd, rel, flags);
    while (fd < 0 && errno == EINTR);
    if (fd < 0)
        return -1;
    ssize_t n;
    do
        n = read(fd, dst, (size_t)guess);
    while (n < 0 && errno == EINTR);
    close(fd);
    if (n <= 0 || n >= guess)
        return -1;
    return (Py_ssize_t)n;
}

static PyObject *stage(PyObject *Py_UNUSED(self), PyObject *args)
{
    int dirfd, out_fd, flags;
    PyObject *keys, *first, *exts, *rels, *starts, *names, *offsets, *sizes, *rows;
    Py_buffer extra, tmpl;
    Py_ssize_t start, guess;
    long long pos;
    if (!PyArg_ParseTuple(args, "iiO!O!O!O!y*y*nLniO!O!O!O!O!", &dirfd, &out_fd, &PyList_Type,
                          &keys, &PyList_Type, &first, &PyList_Type, &exts, &PyList_Type, &rels,
                          &extra, &tmpl, &start, &pos, &guess, &flags, &PyList_Type, &starts,
                          &PyList_Type, &names, &PyList_Type, &offsets, &PyList_Type, &sizes,
                          &PyList_Type, &rows))
        return NULL;
    PyObject *result = NULL;
    Out o = {NULL, 0, 0, out_fd};
    Py_ssize_t *got = NULL; /* per member of the sample: its size, its header in the buffer */
    Py_ssize_t got_cap = 0;
    Py_ssize_t nkeys = PyList_GET_SIZE(keys), nmembers = PyList_GET_SIZE(exts);
    if (tmpl.len != BLOCK || guess < 1 || extra.len >= guess || start < 0
        || PyList_GET_SIZE(first) != nkeys + 1 || PyList_GET_SIZE(exts) != nmembers
        || PyList_GET_SIZE(rels) != nmembers) {
        PyErr_SetString(PyExc_ValueError, "stage(): inconsistent arguments");
        goto done;
    }
    long tmpl_sum = 0;
    for (Py_ssize_t k = 0; k < BLOCK; k++)
        tmpl_sum += ((const unsigned char *)tmpl.buf)[k];
    Py_ssize_t i = start;
    for (; i < nkeys; i++) {
        Py_ssize_t m0 = PyLong_AsSsize_t(PyList_GET_ITEM(first, i));
        Py_ssize_t m1 = PyLong_AsSsize_t(PyList_GET_ITEM(first, i + 1));
        if ((m0 == -1 || m1 == -1) && PyErr_Occurred())
            goto done;
        if (m0 < 0 || m1 < m0 || m1 > nmembers) {
            PyErr_SetString(PyExc_ValueError, "stage(): first is out of range");
            goto done;
        }
        if (m1 - m0 > got_cap) {
            Py_ssize_t *g = PyMem_Realloc(got, (size_t)(m1 - m0) * 2 * sizeof(Py_ssize_t));
            if (g == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            got = g;
            got_cap = m1 - m0;
        }
        size_t mark = o.len; /* where the sample starts in the buffer: undone from here */
        int unusual = 0;
        Py_ssize_t klen;
        const char *key = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(keys, i), &klen);
        if (key == NULL) {
            PyErr_Clear();
            unusual = 1;
        }
        for (Py_ssize_t m = m0; m < m1 && !unusual; m++) {
            Py_ssize_t elen;
            const char *ext = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(exts, m), &elen);
            if (ext == NULL) {
                PyErr_Clear();
                unusual = 1;
                break;
            }
            Py_ssize_t nlen = klen + 1 + elen;
            PyObject *rel_o = PyList_GET_ITEM(rels, m);
            if (nlen > 100) {
                unusual = 1;
                break;
            }
            if (reserve(&o, BLOCK + (size_t)guess + BLOCK) < 0)
                goto done;
            char *h = o.buf + o.len, *data = h + BLOCK;
            Py_ssize_t size;
            if (rel_o == Py_None) {
                memcpy(data, extra.buf, (size_t)extra.len);
                size = extra.len;
            } else {
                const char *rel = PyUnicode_Check(rel_o) ? PyUnicode_AsUTF8(rel_o) : NULL;
                if (rel == NULL) { /* (not UTF-8: the Python loop encodes it as os.open does) */
                    PyErr_Clear();
                    unusual = 1;
                    break;
                }
                size = read_member(dirfd, rel, flags, data, guess);
                if (size < 0) {
                    unusual = 1;
                    break;
                }
            }
            memcpy(h, tmpl.buf, BLOCK);
            memcpy(h, key, (size_t)klen);
            h[klen] = '.';
            memcpy(h + klen + 1, ext, (size_t)elen);
            char field[16];
            snprintf(field, sizeof field, "%011llo", (unsigned long long)size);
            memcpy(h + 124, field, 12); /* eleven digits and the NUL */
            long sum = tmpl_sum;
            for (Py_ssize_t k = 0; k < nlen; k++)
                sum += (unsigned char)h[k];
            for (int k = 0; k < 12; k++)
                sum += (unsigned char)h[124 + k];
            /* at most 624 bytes of 255 each: six octal digits (the mask says so to gcc) */
            snprintf(field, sizeof field, "%06o", (unsigned)(sum & 0777777));
            memcpy(h + 148, field, 7); /* six digits and the NUL, then the template's space */
            size_t tail = (size_t)(-size & (BLOCK - 1));
            memset(data + size, 0, tail);
            got[2 * (m - m0)] = size;
            got[2 * (m - m0) + 1] = (Py_ssize_t)o.len;
            o.len += BLOCK + (size_t)size + tail;
        }
        if (unusual) {
            o.len = mark;
            break;
        }
        /* the sample is staged: its records */
        PyObject *row_files = PyList_New(0);
        if (row_files == NULL)
            goto done;
        PyObject *v = PyLong_FromLongLong(pos);
        int bad = v == NULL || PyList_Append(starts, v) < 0;
        Py_XDECREF(v);
        for (Py_ssize_t m = m0; m < m1 && !bad; m++) {
            Py_ssize_t size = got[2 * (m - m0)];
            const char *h = o.buf + got[2 * (m - m0) + 1];
            PyObject *name = PyUnicode_DecodeUTF8(h, (Py_ssize_t)strnlen(h, 100), NULL);
            PyObject *off = PyLong_FromLongLong(pos + BLOCK);
            PyObject *sz = PyLong_FromSsize_t(size);
            bad = name == NULL || off == NULL || sz == NULL || PyList_Append(names, name) < 0
                  || PyList_Append(offsets, off) < 0 || PyList_Append(sizes, sz) < 0;
            Py_XDECREF(name);
            PyObject *rel_o = PyList_GET_ITEM(rels, m);
            if (!bad && rel_o != Py_None) {
                PyObject *t = PyTuple_Pack(3, PyList_GET_ITEM(exts, m), rel_o, sz);
                bad = t == NULL || PyList_Append(row_files, t) < 0;
                Py_XDECREF(t);
            }
            Py_XDECREF(off);
            Py_XDECREF(sz);
            pos += BLOCK + size + (-size & (BLOCK - 1));
        }
        if (!bad) {
            PyObject *row = PyTuple_Pack(2, PyList_GET_ITEM(keys, i), row_files);
            bad = row == NULL || PyList_Append(rows, row) < 0;
            Py_XDECREF(row);
        }
        Py_DECREF(row_files);
        if (bad)
            goto done;
        if (o.len >= FLUSH_AT && flush(&o) < 0)
            goto done;
        /* a Ctrl-C of a run without a pool (stage_dir in the main process) stops it here, not
         * after the whole directory */
        if ((i & 1023) == 1023 && PyErr_CheckSignals() < 0)
            goto done;
    }
    if (flush(&o) < 0)
        goto done;
    result = Py_BuildValue("(nL)", i, pos);
done:
    PyMem_Free(got);
    PyMem_Free(o.buf);
    PyBuffer_Release(&extra);
    PyBuffer_Release(&tmpl);
    return result;
}

/* -- image sizes -- */

#define NO_SIZE 0
#define SIZE 1
#define FALLBACK 2 /* the Python parsers return None, or a value over int32: Python reads it */

static unsigned be16(const unsigned char *p) { return (unsigned)p[0] << 8 | p[1]; }
static unsigned le16(const unsigned char *p) { return (unsigned)p[1] << 8 | p[0]; }
static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[3] << 24 | (uint32_t)p[2] << 16 | (uint32_t)p[1] << 8 | p[0];
}
static uint32_t le24(const unsigned char *p)
{
    return (uint32_t)p[2] << 16 | (uint32_t)p[1] << 8 | p[0];
}

static int is_sof(unsigned m)
{
    return m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
}

/* _image_sizes._jpeg */
static int jpeg_size(const unsigned char *b, Py_ssize_t n, int32_t *w, int32_t *h)
{
    Py_ssize_t i = 2;
    while (i + 9 < n) {
        if (b[i] != 0xFF)
            return FALLBACK;
        unsigned m = b[i + 1];
        if (m == 0xFF) {
            i += 1;
            continue;
        }
        if (m == 0x01 || m == 0xD8 || (m >= 0xD0 && m <= 0xD7)) {
            i += 2;
            continue;
        }
        if (is_sof(m)) {
            *h = (int32_t)be16(b + i + 5);
            *w = (int32_t)be16(b + i + 7);
            return *w && *h ? SIZE : FALLBACK;
        }
        i += 2 + (Py_ssize_t)be16(b + i + 2);
    }
    return FALLBACK;
}

/* _image_sizes._webp */
static int webp_size(const unsigned char *b, Py_ssize_t n, int32_t *w, int32_t *h)
{
    if (n >= 16 && memcmp(b + 12, "VP8 ", 4) == 0 && n >= 30) {
        *w = (int32_t)(le16(b + 26) & 0x3FFF);
        *h = (int32_t)(le16(b + 28) & 0x3FFF);
        return SIZE;
    }
    if (n >= 16 && memcmp(b + 12, "VP8L", 4) == 0 && n >= 25) {
        uint32_t v = le32(b + 21);
        *w = (int32_t)(v & 0x3FFF) + 1;
        *h = (int32_t)((v >> 14) & 0x3FFF) + 1;
        return SIZE;
    }
    if (n >= 16 && memcmp(b + 12, "VP8X", 4) == 0 && n >= 30) {
        *w = (int32_t)le24(b + 24) + 1;
        *h = (int32_t)le24(b + 27) + 1;
        return SIZE;
    }
    return FALLBACK;
}

/* _image_sizes.header_size without Pillow: SIZE with (*w, *h), or FALLBACK */
static int header_size(const unsigned char *b, Py_ssize_t n, int32_t *w, int32_t *h)
{
    if (n >= 2 && b[0] == 0xFF && b[1] == 0xD8)
        return jpeg_size(b, n, w, h);
    if (n >= 24 && memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0) {
        uint32_t pw = be32(b + 16), ph = be32(b + 20);
        if (pw > INT32_MAX || ph > INT32_MAX) /* (an OverflowError in Python's array) */
            return FALLBACK;
        *w = (int32_t)pw;
        *h = (int32_t)ph;
        return SIZE;
    }
    if (n >= 12 && memcmp(b, "RIFF", 4) == 0 && memcmp(b + 8, "WEBP", 4) == 0)
        return webp_size(b, n, w, h);
    if (n >= 6 && (memcmp(b, "GIF87a", 6) == 0 || memcmp(b, "GIF89a", 6) == 0)) {
        if (n < 10) /* (struct.error in Python) */
            return FALLBACK;
        *w = (int32_t)le16(b + 6);
        *h = (int32_t)le16(b + 8);
        return SIZE;
    }
    if (n >= 26 && b[0] == 'B' && b[1] == 'M') {
        int32_t bw = (int32_t)le32(b + 18), bh = (int32_t)le32(b + 22);
        if (bh == INT32_MIN) /* (abs() over int32: an OverflowError in Python's array) */
            return FALLBACK;
        *w = bw;
        *h = bh < 0 ? -bh : bh;
        return SIZE;
    }
    return FALLBACK;
}

/* list[i] as a Py_ssize_t; -1 with an error set where it is not an int */
static int list_index(PyObject *list, Py_ssize_t i, Py_ssize_t *out)
{
    *out = PyLong_AsSsize_t(PyList_GET_ITEM(list, i));
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *image_sizes(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer buf;
    PyObject *members, *offsets, *sizes;
    if (!PyArg_ParseTuple(args, "y*O!O!O!:image_sizes", &buf, &PyList_Type, &members,
                          &PyList_Type, &offsets, &PyList_Type, &sizes))
        return NULL;
    PyObject *result = NULL, *pairs = NULL, *fallback = NULL;
    Py_ssize_t n = PyList_GET_SIZE(members), nm = PyList_GET_SIZE(offsets);
    Py_ssize_t *span = NULL; /* per sample: where its image starts and ends, -1 for none */
    unsigned char *state = NULL;
    if (PyList_GET_SIZE(sizes) != nm) {
        PyErr_Format(PyExc_ValueError, "image_sizes(): offsets and sizes must be as long, not "
                     "%zd and %zd", nm, PyList_GET_SIZE(sizes));
        goto done;
    }
    span = PyMem_Malloc(n ? (size_t)n * 2 * sizeof(Py_ssize_t) : 1);
    state = PyMem_Malloc(n ? (size_t)n : 1);
    pairs = PyBytes_FromStringAndSize(NULL, n * 2 * (Py_ssize_t)sizeof(int32_t));
    if (span == NULL || state == NULL || pairs == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t m, off, size;
        if (list_index(members, i, &m) < 0)
            goto done;
        if (m == -1) {
            span[2 * i] = -1;
            continue;
        }
        if (m < 0 || m >= nm) {
            PyErr_Format(PyExc_ValueError, "image_sizes(): members[%zd] must be -1 or in "
                         "0..%zd, not %zd", i, nm - 1, m);
            goto done;
        }
        if (list_index(offsets, m, &off) < 0 || list_index(sizes, m, &size) < 0)
            goto done;
        if (off < 0 || size < 0) {
            PyErr_Format(PyExc_ValueError, "image_sizes(): member %zd's offset and size must "
                         "not be negative, not %zd and %zd", m, off, size);
            goto done;
        }
        /* a memoryview slice's bounds: cut at the end of the buffer */
        Py_ssize_t a = off < buf.len ? off : buf.len;
        Py_ssize_t b = size < buf.len - a ? a + size : buf.len;
        span[2 * i] = a;
        span[2 * i + 1] = b;
    }
    int32_t *out = (int32_t *)PyBytes_AS_STRING(pairs);
    const unsigned char *base = buf.buf;
    Py_ssize_t nfallback = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t w = -1, h = -1;
        state[i] = NO_SIZE;
        if (span[2 * i] >= 0) {
            state[i] = (unsigned char)header_size(base + span[2 * i],
                                                  span[2 * i + 1] - span[2 * i], &w, &h);
            if (state[i] != SIZE) {
                w = h = -1;
                nfallback++;
            }
        }
        out[2 * i] = w;
        out[2 * i + 1] = h;
    }
    Py_END_ALLOW_THREADS
    fallback = PyList_New(nfallback);
    if (fallback == NULL)
        goto done;
    for (Py_ssize_t i = 0, k = 0; i < n; i++) {
        if (state[i] != FALLBACK)
            continue;
        PyObject *v = PyLong_FromSsize_t(i);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(fallback, k++, v);
    }
    result = PyTuple_Pack(2, pairs, fallback);
done:
    Py_XDECREF(pairs);
    Py_XDECREF(fallback);
    PyMem_Free(span);
    PyMem_Free(state);
    PyBuffer_Release(&buf);
    return result;
}

static PyMethodDef methods[] = {
    {"image_sizes", image_sizes, METH_VARARGS,
     "image_sizes(buffer, members, offsets, sizes) -> (pairs, fallback)"},
    {"stage", stage, METH_VARARGS,
     "stage(dirfd, out_fd, keys, first, exts, rels, extra, template, start, pos, guess, flags, "
     "starts, names, offsets, sizes, rows) -> (next, pos)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "feedpipe._native._stagefiles",
    "The per-file loop of one-pass staging, and the image sizes recorded at shard time (see the "
    "source).", -1, methods, NULL, NULL, NULL,
    NULL};

PyMODINIT_FUNC PyInit__stagefiles(void) { return PyModule_Create(&module); }
