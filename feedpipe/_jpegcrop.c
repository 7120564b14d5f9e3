/* feedpipe._jpegcrop: decode only a window of a JPEG, with libjpeg-turbo's partial decoding.
 *
 * A random-resized crop keeps on average about half of the image. simplejpeg, OpenCV and Pillow
 * decode all of it; libjpeg-turbo (>= 1.5) can skip the rows above the window
 * (jpeg_skip_scanlines: entropy decoding only, no IDCT, upsampling or colour conversion), stop
 * after its last row, and run the IDCT and colour conversion on the iMCU columns that overlap it
 * only (jpeg_crop_scanline). The pixels are the ones a full decode gives for that window (the
 * decoded columns reach past the window on each side: see the comment in decode_crop).
 *
 * One function, decode_crop(data, top, left, height, width, scale_num=8, fastdct=False), returns
 * (pixels, row_width, x_offset): ``pixels`` is a bytearray of ``height`` rows of ``row_width``
 * RGB pixels; the window is columns ``x_offset:x_offset + width`` of it (jpeg_crop_scanline widens
 * the decoded columns to iMCU boundaries). The window is in the coordinates of the image scaled
 * by scale_num/8 (libjpeg's DCT scaling). The GIL is released while decoding.
 *
 * A test hook proves the release without timing anything (tests/test_jpegcrop.py):
 * _hold_next() makes the next decode_crop, once it has released the GIL, signal that it got there
 * and wait until _let_go(); _wait_until_held() blocks until a decode waits there, and _is_held()
 * says whether one does now. A thread that runs Python code while a decode is held proves that
 * the decode does not hold the GIL. Unarmed, the hook costs one read of an int per call.
 *
 * Errors raise ValueError with libjpeg's message. As with simplejpeg's strict mode (its default),
 * a warning (corrupt or truncated data that libjpeg would paper over) is an error too.
 * libjpeg reports fatal errors through a callback that must not return; this module longjmps back
 * out of it, which only C can do safely (hence no ctypes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>
#include <pythread.h>

struct crop_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void crop_error_exit(j_common_ptr cinfo)
{
    struct crop_error *err = (struct crop_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void crop_emit_message(j_common_ptr cinfo, int level)
{
    if (level < 0) { /* a warning: corrupt data; strict, as simplejpeg is by default */
        struct crop_error *err = (struct crop_error *)cinfo->err;
        (*cinfo->err->format_message)(cinfo, err->message);
        longjmp(err->jump, 1);
    }
    /* trace messages (level >= 0): ignored */
}

#define ROWS_AT_ONCE 16

/* -- the test hook (see the top of the file) -- */
#define HOLD_LIMIT_US 60000000LL /* a held decode fails after this, rather than hang a test */
static PyThread_type_lock hold_gate;    /* taken by _hold_next, given back by _let_go */
static PyThread_type_lock hold_reached; /* given by a decode that waits at the hold */
static volatile int hold_armed, hold_waiting, hold_gate_taken;

/* Called without the GIL by a decode that found the hook armed: 0 if not let go in time. */
static int wait_while_held(void)
{
    int ok;
    hold_armed = 0;
    hold_waiting = 1;
    PyThread_release_lock(hold_reached);
    ok = PyThread_acquire_lock_timed(hold_gate, HOLD_LIMIT_US, 0) == PY_LOCK_ACQUIRED;
    if (ok)
        PyThread_release_lock(hold_gate);
    hold_waiting = 0;
    return ok;
}

static PyObject *hold_next(PyObject *self, PyObject *unused)
{
    if (hold_gate_taken)
        return PyErr_Format(PyExc_RuntimeError, "a hold is armed already");
    PyThread_acquire_lock(hold_gate, WAIT_LOCK); /* free: returns at once */
    hold_gate_taken = 1;
    hold_armed = 1;
    Py_RETURN_NONE;
}

static PyObject *wait_until_held(PyObject *self, PyObject *unused)
{
    PyLockStatus status;
    Py_BEGIN_ALLOW_THREADS
    status = PyThread_acquire_lock_timed(hold_reached, HOLD_LIMIT_US, 0);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(status == PY_LOCK_ACQUIRED);
}

static PyObject *is_held(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(hold_waiting);
}

static PyObject *let_go(PyObject *self, PyObject *unused)
{
    hold_armed = 0;
    if (hold_gate_taken) {
        hold_gate_taken = 0;
        PyThread_release_lock(hold_gate);
    }
    Py_RETURN_NONE;
}

static PyObject *decode_crop(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"data", "top", "left", "height", "width", "scale_num", "fastdct",
                               NULL};
    Py_buffer view;
    unsigned int top, left, height, width;
    int scale_num = 8, fastdct = 0;
    struct jpeg_decompress_struct cinfo;
    struct crop_error err;
    /* changed after setjmp and read by its error branch: volatile */
    PyObject *volatile out = NULL;
    PyThreadState *volatile released = NULL;
    JDIMENSION xoff, row_width;
    unsigned char *pixels;
    size_t stride;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*IIII|ip:decode_crop", keywords, &view, &top,
                                     &left, &height, &width, &scale_num, &fastdct))
        return NULL;
    if (scale_num < 1 || scale_num > 16) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "scale_num must be in 1..16, not %d", scale_num);
    }
    if (height == 0 || width == 0) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "an empty window (%u x %u)", height, width);
    }

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = crop_error_exit;
    err.pub.emit_message = crop_emit_message;
    err.message[0] = '\0';
    if (setjmp(err.jump)) {
        if (released != NULL)
            PyEval_RestoreThread(released);
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&view);
        Py_XDECREF(out);
        return PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, (const unsigned char *)view.buf, (unsigned long)view.len);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = (unsigned int)scale_num;
    cinfo.scale_denom = 8;
    cinfo.dct_method = fastdct ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_components != 3 || (unsigned long)top + height > cinfo.output_height
        || (unsigned long)left + width > cinfo.output_width) {
        unsigned int oh = cinfo.output_height, ow = cinfo.output_width;
        int comps = cinfo.output_components;
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&view);
        if (comps != 3)
            return PyErr_Format(PyExc_ValueError, "libjpeg gave %d components, not 3 (RGB)",
                                comps);
        return PyErr_Format(PyExc_ValueError,
                            "window %u+%u x %u+%u is outside the %u x %u decoded image", top,
                            height, left, width, oh, ow);
    }
    /* Decode one column more on the left and two more on the right than asked (where the image
     * has them): at the edges of a cropped region, the smooth ("fancy") chroma upsampling of
     * 4:2:x images has no neighbour to interpolate from, and the region's first column and its
     * last one or two (a region one chroma sample wide) differ from a whole decode's, by up to 9
     * levels seen (tests/test_jpegcrop.py). */
    xoff = left > 0 ? left - 1 : 0;
    row_width = (left + width + 2 <= cinfo.output_width ? left + width + 2 : cinfo.output_width)
                - xoff;
    if (row_width < cinfo.output_width)
        jpeg_crop_scanline(&cinfo, &xoff, &row_width);
    stride = (size_t)row_width * 3;
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(stride * height));
    if (out == NULL) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&view);
        return NULL;
    }
    pixels = (unsigned char *)PyByteArray_AS_STRING(out);

    released = PyEval_SaveThread();
    if (hold_armed && !wait_while_held()) {
        strcpy(err.message, "a held decode was not let go (test hook)");
        longjmp(err.jump, 1);
    }
    if (top > 0)
        jpeg_skip_scanlines(&cinfo, top);
    while (cinfo.output_scanline < top + height) {
        JSAMPROW rows[ROWS_AT_ONCE];
        unsigned int first = cinfo.output_scanline - top, n = top + height - cinfo.output_scanline;
        unsigned int i;
        if (n > ROWS_AT_ONCE)
            n = ROWS_AT_ONCE;
        for (i = 0; i < n; i++)
            rows[i] = pixels + (size_t)(first + i) * stride;
        if (jpeg_read_scanlines(&cinfo, rows, n) == 0) { /* no progress: never loop forever */
            strcpy(err.message, "no scanline could be read");
            longjmp(err.jump, 1);
        }
    }
    /* the rows below the window are never decoded: abort rather than finish */
    jpeg_abort_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    PyEval_RestoreThread(released);
    released = NULL;
    PyBuffer_Release(&view);
    return Py_BuildValue("(NII)", (PyObject *)out, (unsigned int)row_width,
                         (unsigned int)(left - xoff));
}

static PyMethodDef methods[] = {
    {"decode_crop", (PyCFunction)(void (*)(void))decode_crop, METH_VARARGS | METH_KEYWORDS,
     "decode_crop(data, top, left, height, width, scale_num=8, fastdct=False)\n--\n\n"
     "Decode rows top:top+height, columns left:left+width of a JPEG (in the image scaled by\n"
     "scale_num/8) to RGB. Returns (pixels, row_width, x_offset): a bytearray of height rows of\n"
     "row_width RGB pixels, the window being columns x_offset:x_offset+width."},
    {"_hold_next", hold_next, METH_NOARGS,
     "Test hook: the next decode_crop waits, without the GIL, until _let_go()."},
    {"_wait_until_held", wait_until_held, METH_NOARGS,
     "Test hook: block until a decode waits at the hold; False if none came in 60 s."},
    {"_is_held", is_held, METH_NOARGS, "Test hook: whether a decode waits at the hold now."},
    {"_let_go", let_go, METH_NOARGS, "Test hook: let a held decode go on (and disarm)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegcrop",
    "Partial (window-only) JPEG decoding with libjpeg-turbo; see feedpipe.image_ops.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__jpegcrop(void)
{
    PyObject *m;
    if (hold_gate == NULL) {
        hold_gate = PyThread_allocate_lock();
        hold_reached = PyThread_allocate_lock();
        if (hold_gate == NULL || hold_reached == NULL)
            return PyErr_NoMemory();
        PyThread_acquire_lock(hold_reached, WAIT_LOCK); /* unsignalled until a decode waits */
    }
    m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER",
#ifdef LIBJPEG_TURBO_VERSION_NUMBER
                                             LIBJPEG_TURBO_VERSION_NUMBER
#else
                                             0
#endif
                                             ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
