/* feedpipe._native._packrows: the copy of feedpipe.Packed's token pieces out of the shards' maps.
 *
 * gather(out, maps, which, start, count, itemsize) copies piece i, ``count[i]`` tokens of
 * ``itemsize`` bytes from byte ``start[i]`` of ``maps[which[i]]`` (the shards' maps), after the
 * pieces before it in ``out``, and returns the tokens copied. A group of batches holds hundreds
 * of pieces (documents in the epoch's shuffled order); numpy copies them only through one view
 * object per piece and a concatenate that checks each, which costs more than the bytes moved
 * (benchmarks/bench_packed.py). Every piece is checked against its map and the whole against
 * ``out`` before a byte moves (ValueError); the GIL is released while copying. While it copies
 * a piece it asks the CPU for the start of one a few pieces ahead (their addresses are random).
 *
 * fill(out, tokens, counts) writes a batch's ids, positions and labels in one pass (below).
 *
 * Optional (setup.py): where it did not build, feedpipe.Packed copies and fills with numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define AHEAD 4 /* pieces asked for ahead of the one being copied */

static int get_i64(PyObject *obj, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format;
    size_t flen = f == NULL ? 0 : strlen(f);
    if (view->itemsize != 8 || flen == 0 || (f[flen - 1] != 'q' && f[flen - 1] != 'l')
        || strchr(f, '>') != NULL || strchr(f, '!') != NULL) {
        PyErr_Format(PyExc_TypeError, "gather(): %s must be a contiguous int64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *gather(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *out_o, *maps, *which_o, *start_o, *count_o;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "OO!OOOn", &out_o, &PyTuple_Type, &maps, &which_o, &start_o,
                          &count_o, &itemsize))
        return NULL;
    if (itemsize < 1 || itemsize > 8) {
        PyErr_SetString(PyExc_ValueError, "gather(): itemsize must be 1 to 8 bytes");
        return NULL;
    }
    Py_ssize_t nmaps = PyTuple_GET_SIZE(maps);
    Py_buffer out, which, start, count;
    Py_buffer *views = PyMem_Calloc(nmaps ? nmaps : 1, sizeof(Py_buffer));
    if (views == NULL)
        return PyErr_NoMemory();
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    int have_out = 0, have_w = 0, have_s = 0, have_c = 0;
    if (PyObject_GetBuffer(out_o, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_out = 1;
    if (get_i64(which_o, &which, "which") < 0)
        goto done;
    have_w = 1;
    if (get_i64(start_o, &start, "start") < 0)
        goto done;
    have_s = 1;
    if (get_i64(count_o, &count, "count") < 0)
        goto done;
    have_c = 1;
    for (; got < nmaps; got++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(maps, got), &views[got], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
    Py_ssize_t n = which.len / 8;
    if (start.len / 8 != n || count.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "gather(): which, start and count differ in length");
        goto done;
    }
    const int64_t *w = which.buf, *st = start.buf, *k = count.buf;
    /* every piece checked before any byte moves */
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (w[i] < 0 || w[i] >= nmaps || st[i] < 0 || st[i] > views[w[i]].len || k[i] < 0
            || k[i] > (views[w[i]].len - st[i]) / itemsize) {
            PyErr_Format(PyExc_ValueError,
                         "gather(): piece %zd (map %lld, byte %lld, %lld tokens) is outside its "
                         "map", i, (long long)w[i], (long long)st[i], (long long)k[i]);
            goto done;
        }
        total += (Py_ssize_t)k[i] * itemsize; /* at most a map's size: no overflow */
        if (total > out.len) {
            PyErr_SetString(PyExc_ValueError, "gather(): the pieces do not fit in out");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    char *dst = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) { /* a hint: it never faults */
            const char *p = (const char *)views[w[i + AHEAD]].buf + st[i + AHEAD];
            __builtin_prefetch(p);
            if (k[i + AHEAD] * itemsize > 64)
                __builtin_prefetch(p + 64);
        }
        size_t bytes = (size_t)k[i] * (size_t)itemsize;
        memcpy(dst, (const char *)views[w[i]].buf + st[i], bytes);
        dst += bytes;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(total / itemsize);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    if (have_c)
        PyBuffer_Release(&count);
    if (have_s)
        PyBuffer_Release(&start);
    if (have_w)
        PyBuffer_Release(&which);
    if (have_out)
        PyBuffer_Release(&out);
    return result;
}

#define FILL_LOOP(T)                                                                        \
    do {                                                                                    \
        const T *tk = (const T *)tok.buf;                                                   \
        Py_ssize_t at = 0;                                                                  \
        for (Py_ssize_t j = 0; j < np_; j++) {                                              \
            for (int64_t t = 0; t < cnt[j]; t++, at++) {                                    \
                int64_t v = (int64_t)tk[at];                                                \
                ids[at] = v;                                                                \
                lab[at] = v;                                                                \
                pos[at] = t;                                                                \
            }                                                                               \
        }                                                                                   \
    } while (0)

/* fill(out, tokens, counts): a batch's rows with no padding in them. ``out`` is int64
 * [3, n] (ids, positions, labels), ``tokens`` the batch's n tokens (int16/32/64 or
 * uint16/32), ``counts`` its pieces' lengths (int64, summing to n): ids and labels are the
 * tokens, a position counts from 0 at each piece. One pass over memory, where numpy makes three
 * and a temporary (in a worker's shared buffer, which is not in the cache, each pass fetches
 * the lines it overwrites). */
static PyObject *fill(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *out_o, *tok_o, *count_o;
    if (!PyArg_ParseTuple(args, "OOO", &out_o, &tok_o, &count_o))
        return NULL;
    Py_buffer out, tok, count;
    if (PyObject_GetBuffer(out_o, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(tok_o, &tok, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (get_i64(count_o, &count, "counts") < 0) {
        PyBuffer_Release(&tok);
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = NULL;
    const int64_t *cnt = count.buf;
    Py_ssize_t np_ = count.len / 8, n = out.len / 24, total = 0;
    char kind = tok.format == NULL ? 'B' : tok.format[strlen(tok.format) - 1];
    for (Py_ssize_t j = 0; j < np_; j++) {
        if (cnt[j] < 0 || cnt[j] > n - total) {
            total = -1;
            break;
        }
        total += cnt[j];
    }
    if (out.len % 24 || total != n || tok.itemsize * n != tok.len) {
        PyErr_SetString(PyExc_ValueError, "fill(): out must be int64 [3, n], tokens n long and "
                                          "counts summing to n");
        goto done;
    }
    int64_t *ids = out.buf, *pos = ids + n, *lab = ids + 2 * n;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    if (tok.itemsize == 4 && (kind == 'i' || kind == 'l'))
        FILL_LOOP(int32_t);
    else if (tok.itemsize == 4 && (kind == 'I' || kind == 'L'))
        FILL_LOOP(uint32_t);
    else if (tok.itemsize == 8 && (kind == 'q' || kind == 'l'))
        FILL_LOOP(int64_t);
    else if (tok.itemsize == 2 && kind == 'h')
        FILL_LOOP(int16_t);
    else if (tok.itemsize == 2 && kind == 'H')
        FILL_LOOP(uint16_t);
    else
        ok = 0;
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "fill(): tokens of format %s are not handled", tok.format);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&count);
    PyBuffer_Release(&tok);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, "gather(out, maps, which, start, count, itemsize) -> tokens copied"},
    {"fill", fill, METH_VARARGS, "fill(out, tokens, counts) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "feedpipe._native._packrows", "The copy of feedpipe.Packed's token pieces (see the source).",
    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__packrows(void) { return PyModule_Create(&module); }
