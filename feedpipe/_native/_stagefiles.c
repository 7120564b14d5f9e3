/* feedpipe._native._stagefiles: the per-file loop of one-pass staging, called by
 * feedpipe.convert._stage_dir (stage_dir, for feedpipe.convert._onepass).
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
 * Optional (setup.py): where it did not build, the Python loop stages every sample.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
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

static PyMethodDef methods[] = {
    {"stage", stage, METH_VARARGS,
     "stage(dirfd, out_fd, keys, first, exts, rels, extra, template, start, pos, guess, flags, "
     "starts, names, offsets, sizes, rows) -> (next, pos)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "feedpipe._native._stagefiles",
    "The per-file loop of one-pass staging (see the source).", -1, methods, NULL, NULL, NULL,
    NULL};

PyMODINIT_FUNC PyInit__stagefiles(void) { return PyModule_Create(&module); }
