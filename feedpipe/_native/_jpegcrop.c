/* feedpipe._native._jpegcrop: decode only a window of a JPEG (libjpeg-turbo's partial decoding),
 * and resize RGB pixels into the three planes of a CHW uint8 batch row. Three functions and the
 * test hooks below; the callers are feedpipe/transforms/_jpeg.py (decode_crop,
 * decode_crop_into), feedpipe/transforms/_resize.py (resize_into) and
 * feedpipe/diagnostics/_env.py (LIBJPEG_TURBO_VERSION_NUMBER).
 *
 * A random-resized crop keeps on average about half of the image. simplejpeg, OpenCV and Pillow
 * decode all of it; libjpeg-turbo (>= 1.5) can skip the rows above the window
 * (jpeg_skip_scanlines: entropy decoding only, no IDCT, upsampling or colour conversion), and
 * run the IDCT and colour conversion on the iMCU columns that overlap it only
 * (jpeg_crop_scanline). The rows below it are entropy-decoded only, and the file read to its
 * EOI marker, so that whether a file decodes never depends on the window. The window's pixels
 * are the ones a whole decode gives (the decoded columns reach past the window on each side:
 * see crop_region).
 *
 * The functions:
 *
 * - decode_crop(data, top, left, height, width, scale_num=8, fastdct=False) returns
 *   (pixels, row_width, x_offset): ``pixels`` is a bytearray of ``height`` rows of
 *   ``row_width`` RGB pixels; the window is columns ``x_offset:x_offset + width`` of it. The
 *   window is in the coordinates of the image scaled by scale_num/8 (libjpeg's DCT scaling,
 *   1..16).
 * - decode_crop_into(data, top, left, height, width, out, out_height, out_width, flip,
 *   scale_num=8) decodes the window as decode_crop does and resizes it into ``out`` (3 x
 *   out_height x out_width uint8), flipped left-right when asked; nothing is written into
 *   ``out`` unless the decode succeeds.
 * - resize_into(src, out, flip) resizes an H x W x 3 uint8 array into ``out`` the same way: an
 *   enlargement with OpenCV's INTER_LINEAR (within one grey level), a reduction on either axis
 *   with torch's antialiased bilinear (its bytes).
 * - Test hooks: _use_simd(level) caps the resize's vector code; _hold_next(),
 *   _wait_until_held(), _is_held() and _let_go() prove that a decode releases the GIL without
 *   timing anything: _hold_next() makes the next decode, once it has released the GIL, signal
 *   that it got there and wait until _let_go(). Unarmed, the hook costs one read of an int per
 *   call.
 *
 * The GIL is released while decoding and resizing. Errors raise ValueError naming the function
 * (``decode_crop(): libjpeg: <its message>``, the convention of feedpipe/_native/__init__.py),
 * MemoryError where a buffer cannot be had. As with simplejpeg's strict mode (its default), a
 * warning (corrupt or truncated data that libjpeg would paper over) is an error too. libjpeg reports fatal errors through a
 * callback that must not return; this module longjmps back out of it, which only C can do safely
 * (hence no ctypes).
 *
 * Optional (setup.py; it needs libjpeg-turbo's headers): where it did not build, simplejpeg
 * decodes whole images and OpenCV or torch resize them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <pthread.h>
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

static PyObject *hold_next(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused))
{
    if (hold_gate_taken)
        return PyErr_Format(PyExc_RuntimeError, "_hold_next(): a hold is armed already");
    PyThread_acquire_lock(hold_gate, WAIT_LOCK); /* free: returns at once */
    hold_gate_taken = 1;
    hold_armed = 1;
    Py_RETURN_NONE;
}

static PyObject *wait_until_held(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused))
{
    PyLockStatus status;
    Py_BEGIN_ALLOW_THREADS
    status = PyThread_acquire_lock_timed(hold_reached, HOLD_LIMIT_US, 0);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(status == PY_LOCK_ACQUIRED);
}

static PyObject *is_held(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused))
{
    return PyBool_FromLong(hold_waiting);
}

static PyObject *let_go(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused))
{
    hold_armed = 0;
    if (hold_gate_taken) {
        hold_gate_taken = 0;
        PyThread_release_lock(hold_gate);
    }
    Py_RETURN_NONE;
}


/* -- each thread's scratch memory --
 *
 * The decoded window and the resize's intermediate planes are a few hundred KiB an image: fresh
 * from malloc each time, they are mapped and faulted in anew (glibc hands blocks that large
 * back to the kernel when freed). Each thread keeps its blocks instead, up to SCRATCH_KEEP
 * bytes each (larger ones are freed after use); a thread's blocks are freed when it ends. */

#define SCRATCH_SLOTS 5
#define SCRATCH_KEEP ((size_t)16 << 20)

struct scratch {
    void *block[SCRATCH_SLOTS];
    size_t size[SCRATCH_SLOTS];
};

static pthread_key_t scratch_key;
static int scratch_key_made;

static void scratch_free(void *p)
{
    struct scratch *s = p;
    int i;
    for (i = 0; i < SCRATCH_SLOTS; i++)
        free(s->block[i]);
    free(s);
}

/* slot's block of at least size bytes for this thread, or NULL when out of memory */
static void *scratch_get(int slot, size_t size)
{
    struct scratch *s = scratch_key_made ? pthread_getspecific(scratch_key) : NULL;
    if (scratch_key_made && s == NULL) {
        s = calloc(1, sizeof *s);
        if (s != NULL && pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            s = NULL;
        }
    }
    if (s == NULL)
        return malloc(size);
    if (s->size[slot] < size) {
        free(s->block[slot]);
        s->block[slot] = malloc(size);
        s->size[slot] = s->block[slot] == NULL ? 0 : size;
    }
    return s->block[slot];
}

/* give back what scratch_get gave: kept unless too large (or not kept at all) */
static void scratch_put(int slot, void *block)
{
    struct scratch *s = scratch_key_made ? pthread_getspecific(scratch_key) : NULL;
    if (block == NULL)
        return;
    if (s == NULL || s->block[slot] != block) {
        free(block);
        return;
    }
    if (s->size[slot] > SCRATCH_KEEP) {
        free(block);
        s->block[slot] = NULL;
        s->size[slot] = 0;
    }
}

/* -- the resize into a batch row --
 *
 * resize_into and decode_crop_into resize an RGB window straight into the three planes of a
 * CHW uint8 row, flipped left-right on the way when asked. An enlargement (or a copy), the usual
 * case of a random-resized crop of a small image, is one pass where OpenCV takes three (resize
 * to HWC, flip, split into planes). Its filter is OpenCV's INTER_LINEAR for uint8 (half-pixel
 * centres, edge pixels repeated, 11-bit fixed-point weights, the vertical blend rounded as its
 * vector path does): within one grey level of cv2.resize (tests/test_jpegcrop.py). A reduction
 * on either axis takes torch's antialiased filter instead (the next section).
 *
 * The horizontal blend takes four outputs at a time: four consecutive outputs of an enlargement
 * read at most five consecutive source pixels, 15 bytes, so one 16-byte load and one byte shuffle
 * per channel gather their (left, right) pairs for one multiply-add (SSSE3, every x86-64 CPU
 * since 2006; two groups at once with AVX2; checked at run time, with a plain C loop elsewhere).
 * The vertical blend is SSE2 or AVX2. */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

#define COEF_BITS 11
#define COEF_SCALE (1 << COEF_BITS)

struct axis {
    int n;          /* outputs */
    int *src;       /* each output's left (upper) source index */
    int *next;      /* its right (lower) one: src + 1, or src at the last source pixel */
    short *w0, *w1; /* their weights */
    /* the horizontal axis, by groups of four outputs (n / 4 of them): the first source pixel
     * of the group's 16-byte load, the byte shuffle of each channel and the weight pairs */
    int *base;
    unsigned char *shuffle; /* 3 x 16 bytes a group */
    short *pairs;           /* 8 a group: w0, w1 of each output */
};

static void axis_free(struct axis *a)
{
    free(a->src);
    free(a->next);
    free(a->w0);
    free(a->w1);
    free(a->base);
    free(a->shuffle);
    free(a->pairs);
}

/* out_len outputs over src_len sources, in reverse order when flip; the groups when groups. */
static int axis_make(struct axis *a, int src_len, int out_len, int flip, int groups)
{
    double scale = (double)src_len / out_len;
    int d, g;
    memset(a, 0, sizeof *a);
    a->n = out_len;
    a->src = malloc(sizeof(int) * (size_t)out_len);
    a->next = malloc(sizeof(int) * (size_t)out_len);
    a->w0 = malloc(sizeof(short) * (size_t)out_len);
    a->w1 = malloc(sizeof(short) * (size_t)out_len);
    if (a->src == NULL || a->next == NULL || a->w0 == NULL || a->w1 == NULL)
        return -1;
    for (d = 0; d < out_len; d++) {
        int at = flip ? out_len - 1 - d : d;
        float f = (float)((at + 0.5) * scale - 0.5);
        int s = (int)floorf(f);
        f -= (float)s;
        if (s < 0) {
            s = 0;
            f = 0.f;
        }
        if (s >= src_len - 1) {
            s = src_len - 1;
            f = 0.f;
        }
        a->src[d] = s;
        a->next[d] = s + 1 < src_len ? s + 1 : s;
        a->w0[d] = (short)lrintf((1.f - f) * COEF_SCALE);
        a->w1[d] = (short)lrintf(f * COEF_SCALE);
    }
    if (!groups || out_len < 4)
        return 0;
    a->base = malloc(sizeof(int) * (size_t)(out_len / 4));
    a->shuffle = malloc(48 * (size_t)(out_len / 4));
    a->pairs = malloc(sizeof(short) * 8 * (size_t)(out_len / 4));
    if (a->base == NULL || a->shuffle == NULL || a->pairs == NULL)
        return -1;
    for (g = 0; g < out_len / 4; g++) {
        int k, c, lo = a->src[4 * g];
        for (k = 1; k < 4; k++)
            if (a->src[4 * g + k] < lo)
                lo = a->src[4 * g + k];
        a->base[g] = lo;
        for (k = 0; k < 4; k++) {
            int o = 4 * g + k;
            a->pairs[8 * g + 2 * k] = a->w0[o];
            a->pairs[8 * g + 2 * k + 1] = a->w1[o];
            for (c = 0; c < 3; c++) {
                unsigned char *m = a->shuffle + 48 * (size_t)g + 16 * c + 4 * k;
                /* an enlargement's four outputs span <= 3 source steps: indices <= 14 */
                m[0] = (unsigned char)(3 * (a->src[o] - lo) + c);
                m[1] = 0x80; /* zero: the high byte of a 16-bit lane */
                m[2] = (unsigned char)(3 * (a->next[o] - lo) + c);
                m[3] = 0x80;
            }
        }
    }
    return 0;
}

/* outputs [from, to) of one source row blended across, the plain C way */
static void blend_row_c(const unsigned char *row, const struct axis *x, int from, int to,
                        short *p0, short *p1, short *p2)
{
    int d;
    for (d = from; d < to; d++) {
        const unsigned char *a = row + 3 * x->src[d], *b = row + 3 * x->next[d];
        int w0 = x->w0[d], w1 = x->w1[d];
        p0[d] = (short)((a[0] * w0 + b[0] * w1) >> 4);
        p1[d] = (short)((a[1] * w0 + b[1] * w1) >> 4);
        p2[d] = (short)((a[2] * w0 + b[2] * w1) >> 4);
    }
}

#if HAVE_X86
/* The groups of four outputs whose 16-byte load stays inside the row; the others (the last
 * source pixels: at the start of the row when flipping) the plain way. */
__attribute__((target("ssse3"))) static void blend_row_ssse3_from(const unsigned char *row,
                                                                  const struct axis *x,
                                                                  int src_w, int g, short *p0,
                                                                  short *p1, short *p2)
{
    int groups = x->n / 4;
    short *planes[3] = {p0, p1, p2};
    for (; g < groups; g++) {
        __m128i px, w;
        int c;
        if (3 * x->base[g] + 16 > 3 * src_w) {
            blend_row_c(row, x, 4 * g, 4 * g + 4, p0, p1, p2);
            continue;
        }
        px = _mm_loadu_si128((const __m128i *)(row + 3 * x->base[g]));
        w = _mm_loadu_si128((const __m128i *)(x->pairs + 8 * g));
        for (c = 0; c < 3; c++) {
            __m128i m = _mm_loadu_si128((const __m128i *)(x->shuffle + 48 * (size_t)g + 16 * c));
            __m128i v = _mm_srai_epi32(_mm_madd_epi16(_mm_shuffle_epi8(px, m), w), 4);
            _mm_storel_epi64((__m128i *)(planes[c] + 4 * g), _mm_packs_epi32(v, v));
        }
    }
    blend_row_c(row, x, 4 * groups, x->n, p0, p1, p2);
}
#endif

#if HAVE_X86
/* As blend_row_ssse3, two groups (eight outputs) at a time in the two lanes of an AVX2
 * register: byte shuffles stay within a lane, so each lane takes its group's own load. */
__attribute__((target("avx2"))) static void blend_row_avx2(const unsigned char *row,
                                                           const struct axis *x, int src_w,
                                                           short *p0, short *p1, short *p2)
{
    int g = 0, groups = x->n / 4;
    short *planes[3] = {p0, p1, p2};
    for (; g + 1 < groups; g += 2) {
        __m256i px, w;
        int c;
        if (3 * x->base[g + 1] + 16 > 3 * src_w || 3 * x->base[g] + 16 > 3 * src_w)
            break; /* the rest (the row's end; its start too when flipping) below */
        px = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(row + 3 * x->base[g]))),
            _mm_loadu_si128((const __m128i *)(row + 3 * x->base[g + 1])), 1);
        w = _mm256_loadu_si256((const __m256i *)(x->pairs + 8 * g));
        for (c = 0; c < 3; c++) {
            __m256i m = _mm256_setr_m128i(
                _mm_loadu_si128((const __m128i *)(x->shuffle + 48 * (size_t)g + 16 * c)),
                _mm_loadu_si128((const __m128i *)(x->shuffle + 48 * (size_t)(g + 1) + 16 * c)));
            __m256i v = _mm256_srai_epi32(_mm256_madd_epi16(_mm256_shuffle_epi8(px, m), w), 4);
            __m256i p = _mm256_packs_epi32(v, v); /* lane-wise: group g low, g + 1 high */
            _mm_storel_epi64((__m128i *)(planes[c] + 4 * g), _mm256_castsi256_si128(p));
            _mm_storel_epi64((__m128i *)(planes[c] + 4 * g + 4),
                             _mm256_extracti128_si256(p, 1));
        }
    }
    blend_row_ssse3_from(row, x, src_w, g, p0, p1, p2);
}
#endif

/* One source row blended across into three planes of x->n values (pixel * 2048 >> 4, as
 * OpenCV's vertical pass takes them), in output order (reversed already when flipping). */
static void blend_row(const unsigned char *row, const struct axis *x, int src_w, int simd,
                      short *planes)
{
    short *p0 = planes, *p1 = planes + x->n, *p2 = planes + 2 * x->n;
#if HAVE_X86
    if (simd == 2 && x->base != NULL) {
        blend_row_avx2(row, x, src_w, p0, p1, p2);
        return;
    }
    if (simd && x->base != NULL) {
        blend_row_ssse3_from(row, x, src_w, 0, p0, p1, p2);
        return;
    }
#endif
    blend_row_c(row, x, 0, x->n, p0, p1, p2);
}

#if HAVE_X86
/* blend_down's first outputs, 32 at a time */
__attribute__((target("avx2"))) static int blend_down_avx2(const short *a, const short *b,
                                                           short wa, short wb, int n,
                                                           unsigned char *out)
{
    __m256i va = _mm256_set1_epi16(wa), vb = _mm256_set1_epi16(wb), two = _mm256_set1_epi16(2);
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i lo = _mm256_add_epi16(
            _mm256_mulhi_epi16(_mm256_loadu_si256((const __m256i *)(a + i)), va),
            _mm256_mulhi_epi16(_mm256_loadu_si256((const __m256i *)(b + i)), vb));
        __m256i hi = _mm256_add_epi16(
            _mm256_mulhi_epi16(_mm256_loadu_si256((const __m256i *)(a + i + 16)), va),
            _mm256_mulhi_epi16(_mm256_loadu_si256((const __m256i *)(b + i + 16)), vb));
        lo = _mm256_srai_epi16(_mm256_add_epi16(lo, two), 2);
        hi = _mm256_srai_epi16(_mm256_add_epi16(hi, two), 2);
        /* packus works lane by lane: put the 32 bytes back in order */
        _mm256_storeu_si256((__m256i *)(out + i),
                            _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xd8));
    }
    return i;
}
#endif

/* (a * wa >> 16) + (b * wb >> 16), + 2, >> 2, saturated: OpenCV's vector rounding. */
static void blend_down(const short *a, const short *b, short wa, short wb, int n,
                       unsigned char *out, int simd)
{
    int i = 0;
#if HAVE_X86
    if (simd == 2)
        i = blend_down_avx2(a, b, wa, wb, n, out);
    if (simd) {
        __m128i va = _mm_set1_epi16(wa), vb = _mm_set1_epi16(wb), two = _mm_set1_epi16(2);
        for (; i + 16 <= n; i += 16) {
            __m128i lo = _mm_add_epi16(
                _mm_mulhi_epi16(_mm_loadu_si128((const __m128i *)(a + i)), va),
                _mm_mulhi_epi16(_mm_loadu_si128((const __m128i *)(b + i)), vb));
            __m128i hi = _mm_add_epi16(
                _mm_mulhi_epi16(_mm_loadu_si128((const __m128i *)(a + i + 8)), va),
                _mm_mulhi_epi16(_mm_loadu_si128((const __m128i *)(b + i + 8)), vb));
            lo = _mm_srai_epi16(_mm_add_epi16(lo, two), 2);
            hi = _mm_srai_epi16(_mm_add_epi16(hi, two), 2);
            _mm_storeu_si128((__m128i *)(out + i), _mm_packus_epi16(lo, hi));
        }
    }
#endif
    for (; i < n; i++) {
        int v = (((int)a[i] * wa) >> 16) + (((int)b[i] * wb) >> 16);
        v = (v + 2) >> 2;
        out[i] = (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v);
    }
}

static int simd_allowed = 2; /* the test hook _use_simd lowers it */

/* 2: AVX2 and SSSE3, 1: SSSE3 only, 0: plain C (checked once at run time, capped by the hook) */
static int simd_level(void)
{
#if HAVE_X86
    static int known = -1;
    if (known < 0)
        known = __builtin_cpu_supports("avx2") ? 2 : __builtin_cpu_supports("ssse3") ? 1 : 0;
    return known < simd_allowed ? known : simd_allowed;
#else
    return 0;
#endif
}

/* Resize the src_h x src_w RGB pixels at src (rows stride bytes apart, pixels 3 bytes apart)
 * into the planes of out (3 x out_h x out_w), flipped when flip. src_h <= out_h and
 * src_w <= out_w. 0, or -1 when out of memory. Runs without the GIL. */
static int resize_planes(const unsigned char *src, size_t stride, int src_h, int src_w,
                         unsigned char *out, int out_h, int out_w, int flip)
{
    struct axis x, y;
    short *rows = NULL;
    int cached[2] = {-1, -1}, d, rc = -1, simd = simd_level();
    size_t plane = (size_t)out_h * out_w;

    memset(&y, 0, sizeof y);
    if (axis_make(&x, src_w, out_w, flip, simd) < 0 || axis_make(&y, src_h, out_h, 0, 0) < 0)
        goto done;
    rows = malloc(sizeof(short) * 2 * 3 * (size_t)out_w);
    if (rows == NULL)
        goto done;
    for (d = 0; d < out_h; d++) {
        int s0 = y.src[d], s1 = y.next[d], k, c;
        short *r0, *r1;
        /* the two slots hold the two source rows this output row blends; each source row is
         * blended across once, as the output rows walk down */
        for (k = 0; k < 2; k++) {
            int want = k == 0 ? s0 : s1;
            if (cached[0] != want && cached[1] != want) {
                int slot = cached[0] == s0 || cached[0] == s1 ? 1 : 0;
                blend_row(src + (size_t)want * stride, &x, src_w, simd,
                          rows + (size_t)slot * 3 * out_w);
                cached[slot] = want;
            }
        }
        r0 = rows + (size_t)(cached[0] == s0 ? 0 : 1) * 3 * out_w;
        r1 = rows + (size_t)(cached[0] == s1 ? 0 : 1) * 3 * out_w;
        for (c = 0; c < 3; c++)
            blend_down(r0 + (size_t)c * out_w, r1 + (size_t)c * out_w, y.w0[d], y.w1[d], out_w,
                       out + c * plane + (size_t)d * out_w, simd);
    }
    rc = 0;
done:
    axis_free(&x);
    axis_free(&y);
    free(rows);
    return rc;
}

/* -- any other resize: torch's antialiased bilinear --
 *
 * A reduction on either axis takes the filter of torch.nn.functional.interpolate(mode="bilinear",
 * antialias=True) on uint8 (torchvision's and DALI's class of random-resized crop filter): per
 * axis, a triangle widened by the reduction factor, the weights normalised in double precision
 * then scaled to int16 at the largest precision their maximum allows, each pass rounded to
 * uint8. Torch filters across first and then down; here down first (across the interleaved
 * rows: contiguous, vectorised), then the result is transposed so that filtering across is a
 * filter down its rows too, and each channel's result is transposed back into its plane. The
 * intermediate rounding is the only difference: within one grey level of torch
 * (tests/test_jpegcrop.py). A flip takes the mirrored taps, as torch's resize of the flipped
 * source. */

struct taps {
    int n, precision;   /* outputs, weight bits */
    int *start, *count; /* each output's first source index and its number of taps */
    short *w;           /* n x kmax weights */
    int kmax;
};

static void taps_free(struct taps *t)
{
    free(t->start);
    free(t->count);
    free(t->w);
}

static int taps_make(struct taps *t, int src_len, int out_len, int flip)
{
    double scale = (double)src_len / out_len;
    double support = scale >= 1.0 ? scale : 1.0, invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    double *wf, w_max = 0.0;
    int i, j, k = 0;

    memset(t, 0, sizeof *t);
    t->n = out_len;
    t->start = malloc(sizeof(int) * (size_t)out_len);
    t->count = malloc(sizeof(int) * (size_t)out_len);
    if (t->start == NULL || t->count == NULL)
        return -1;
    for (i = 0; i < out_len; i++) {
        double center = scale * (i + 0.5);
        long lo = (long)(center - support + 0.5), hi = (long)(center + support + 0.5);
        if (lo < 0)
            lo = 0;
        if (hi > src_len)
            hi = src_len;
        t->start[i] = (int)lo;
        t->count[i] = (int)(hi - lo);
        if (t->count[i] > k)
            k = t->count[i];
    }
    t->kmax = k;
    wf = calloc((size_t)out_len * k + 1, sizeof(double));
    t->w = calloc((size_t)out_len * k + 1, sizeof(short));
    if (wf == NULL || t->w == NULL) {
        free(wf);
        return -1;
    }
    for (i = 0; i < out_len; i++) {
        double center = scale * (i + 0.5), total = 0.0, *row = wf + (size_t)i * k;
        for (j = 0; j < t->count[i]; j++) {
            double x = (j + t->start[i] - center + 0.5) * invscale;
            double v = x < 0 ? -x : x;
            row[j] = v < 1.0 ? 1.0 - v : 0.0;
            total += row[j];
        }
        for (j = 0; j < t->count[i]; j++) {
            if (total != 0.0)
                row[j] /= total;
            if (row[j] > w_max)
                w_max = row[j];
        }
    }
    for (t->precision = 0; t->precision < 22; t->precision++)
        if ((int)(0.5 + w_max * (1 << (t->precision + 1))) >= (1 << 15))
            break;
    for (i = 0; i < out_len; i++) {
        int c = t->count[i];
        for (j = 0; j < c; j++) {
            double v = wf[(size_t)i * k + (flip ? c - 1 - j : j)] * (1 << t->precision);
            t->w[(size_t)i * k + j] = (short)(v < 0 ? v - 0.5 : v + 0.5);
        }
        if (flip)
            t->start[i] = src_len - t->start[i] - c;
    }
    free(wf);
    return 0;
}

/* out row i = the taps of output i over rows of in (in_stride bytes apart), cols bytes each,
 * rounded to uint8 */
static void filter_rows_c(const unsigned char *in, size_t in_stride, const struct taps *t,
                          int from, int cols, unsigned char *out, size_t out_stride)
{
    int i, j, x, round = t->precision > 0 ? 1 << (t->precision - 1) : 0;
    for (i = 0; i < t->n; i++) {
        const short *w = t->w + (size_t)i * t->kmax;
        const unsigned char *first = in + (size_t)t->start[i] * in_stride;
        unsigned char *o = out + (size_t)i * out_stride;
        for (x = from; x < cols; x++) {
            int a = round, v;
            for (j = 0; j < t->count[i]; j++)
                a += first[(size_t)j * in_stride + x] * w[j];
            v = a >> t->precision;
            o[x] = (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v);
        }
    }
}

#if HAVE_X86
/* filter_rows_c's first columns, 16 at a time: two taps per multiply-add (the two rows' values
 * side by side as 16-bit pairs), the sums in registers across the taps. Returns the columns
 * done. */
__attribute__((target("avx2"))) static int filter_rows_avx2(const unsigned char *in,
                                                            size_t in_stride,
                                                            const struct taps *t, int cols,
                                                            unsigned char *out,
                                                            size_t out_stride)
{
    int i, j, x = 0, round = t->precision > 0 ? 1 << (t->precision - 1) : 0;
    __m256i start = _mm256_set1_epi32(round), zero = _mm256_setzero_si256();
    __m128i shift = _mm_cvtsi32_si128(t->precision);
    for (i = 0; i < t->n; i++) {
        const short *w = t->w + (size_t)i * t->kmax;
        const unsigned char *first = in + (size_t)t->start[i] * in_stride;
        unsigned char *o = out + (size_t)i * out_stride;
        int count = t->count[i];
        for (x = 0; x + 16 <= cols; x += 16) {
            __m256i lo = start, hi = start, packed;
            for (j = 0; j < count; j += 2) {
                __m256i a = _mm256_cvtepu8_epi16(
                    _mm_loadu_si128((const __m128i *)(first + (size_t)j * in_stride + x)));
                __m256i b = j + 1 < count
                                ? _mm256_cvtepu8_epi16(_mm_loadu_si128(
                                      (const __m128i *)(first + (size_t)(j + 1) * in_stride
                                                        + x)))
                                : zero;
                __m256i pair = _mm256_set1_epi32(
                    (int)((unsigned short)w[j]
                          | ((unsigned int)(unsigned short)(j + 1 < count ? w[j + 1] : 0)
                             << 16)));
                lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), pair));
                hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), pair));
            }
            lo = _mm256_sra_epi32(lo, shift);
            hi = _mm256_sra_epi32(hi, shift);
            packed = _mm256_packs_epi32(lo, hi); /* per lane: columns in order again */
            packed = _mm256_packus_epi16(packed, packed);
            packed = _mm256_permute4x64_epi64(packed, 0x08); /* the two lanes' low halves */
            _mm_storeu_si128((__m128i *)(o + x), _mm256_castsi256_si128(packed));
        }
    }
    return cols - cols % 16;
}
#endif

static void filter_rows(const unsigned char *in, size_t in_stride, const struct taps *t,
                        int cols, unsigned char *out, size_t out_stride, int simd)
{
    int done = 0;
#if HAVE_X86
    if (simd == 2)
        done = filter_rows_avx2(in, in_stride, t, cols, out, out_stride);
#endif
    (void)simd;
    filter_rows_c(in, in_stride, t, done, cols, out, out_stride);
}

/* out[c][r] = in[r][c] for rows x cols bytes: 16 x 16 blocks with SSE2 unpacks, the edges
 * plainly */
static void transpose(const unsigned char *in, size_t in_stride, int rows, int cols,
                      unsigned char *out, size_t out_stride, int simd)
{
    int r0 = 0, c0, r, c;
#if HAVE_X86
    if (simd) {
        for (; r0 + 16 <= rows; r0 += 16) {
            for (c0 = 0; c0 + 16 <= cols; c0 += 16) {
                __m128i a[16], b[16];
                int k;
                for (k = 0; k < 16; k++)
                    a[k] = _mm_loadu_si128(
                        (const __m128i *)(in + (size_t)(r0 + k) * in_stride + c0));
                /* four rounds of interleaving: bytes, words, dwords, qwords */
                for (k = 0; k < 8; k++) {
                    b[2 * k] = _mm_unpacklo_epi8(a[k], a[k + 8]);
                    b[2 * k + 1] = _mm_unpackhi_epi8(a[k], a[k + 8]);
                }
                for (k = 0; k < 8; k++) {
                    a[2 * k] = _mm_unpacklo_epi8(b[k], b[k + 8]);
                    a[2 * k + 1] = _mm_unpackhi_epi8(b[k], b[k + 8]);
                }
                for (k = 0; k < 8; k++) {
                    b[2 * k] = _mm_unpacklo_epi8(a[k], a[k + 8]);
                    b[2 * k + 1] = _mm_unpackhi_epi8(a[k], a[k + 8]);
                }
                for (k = 0; k < 8; k++) {
                    a[2 * k] = _mm_unpacklo_epi8(b[k], b[k + 8]);
                    a[2 * k + 1] = _mm_unpackhi_epi8(b[k], b[k + 8]);
                }
                for (k = 0; k < 16; k++)
                    _mm_storeu_si128((__m128i *)(out + (size_t)(c0 + k) * out_stride + r0),
                                     a[k]);
            }
            for (r = r0; r < r0 + 16; r++) /* the columns past the last whole block */
                for (c = c0; c < cols; c++)
                    out[(size_t)c * out_stride + r] = in[(size_t)r * in_stride + c];
        }
    }
#endif
    (void)simd;
    for (r = r0; r < rows; r++)
        for (c = 0; c < cols; c++)
            out[(size_t)c * out_stride + r] = in[(size_t)r * in_stride + c];
}

/* Any resize of the src_h x src_w RGB pixels at src (rows stride bytes apart) into the planes
 * of out (3 x out_h x out_w), flipped when flip, with torch's antialiased bilinear (see above).
 * 0, or -1 when out of memory. Runs without the GIL. */
static int resize_planes_aa(const unsigned char *src, size_t stride, int src_h, int src_w,
                            unsigned char *out, int out_h, int out_w, int flip)
{
    struct taps x, y;
    unsigned char *src_t = NULL, *across_t = NULL, *across = NULL;
    int c, rc = -1, simd = simd_level();
    int wide = 3 * src_w;
    size_t plane = (size_t)out_h * out_w, tplane = (size_t)src_h * out_w;

    memset(&x, 0, sizeof x);
    memset(&y, 0, sizeof y);
    src_t = scratch_get(1, (size_t)wide * src_h); /* the source transposed: 3 x src_w rows */
    across_t = scratch_get(2, 3 * tplane);        /* filtered across: 3 x out_w rows of src_h */
    across = scratch_get(3, 3 * tplane);          /* that transposed: 3 x src_h rows of out_w */
    if (src_t == NULL || across_t == NULL || across == NULL
        || taps_make(&y, src_h, out_h, 0) < 0 || taps_make(&x, src_w, out_w, flip) < 0)
        goto done;
    transpose(src, stride, src_h, wide, src_t, (size_t)src_h, simd);
    for (c = 0; c < 3; c++) {
        /* channel c's columns are every third row of src_t */
        filter_rows(src_t + (size_t)c * src_h, 3 * (size_t)src_h, &x, src_h,
                    across_t + c * tplane, (size_t)src_h, simd);
        transpose(across_t + c * tplane, (size_t)src_h, out_w, src_h, across + c * tplane,
                  (size_t)out_w, simd);
        filter_rows(across + c * tplane, (size_t)out_w, &y, out_w, out + c * plane,
                    (size_t)out_w, simd);
    }
    rc = 0;
done:
    taps_free(&x);
    taps_free(&y);
    scratch_put(1, src_t);
    scratch_put(2, across_t);
    scratch_put(3, across);
    return rc;
}

/* An enlargement (or a copy) the fast way, anything else as torch does. */
static int resize_any(const unsigned char *src, size_t stride, int src_h, int src_w,
                      unsigned char *out, int out_h, int out_w, int flip)
{
    if (src_h <= out_h && src_w <= out_w)
        return resize_planes(src, stride, src_h, src_w, out, out_h, out_w, flip);
    return resize_planes_aa(src, stride, src_h, src_w, out, out_h, out_w, flip);
}

/* A window to decode, and where its pixels go. */
struct window {
    const char *fn; /* the Python function called, which errors name (see ERR) */
    const unsigned char *data;
    unsigned long len;
    unsigned int top, left, height, width;
    int scale_num, fastdct;
    /* decode_crop: the pixels go to a new bytearray (bytes), returned with row_width and the
     * window's offset in it. decode_crop_into: to a scratch buffer, then resized into ``out``
     * (3 x out_h x out_w), flipped when flip, before the GIL is taken back. */
    PyObject *bytes;
    unsigned char *out;
    int out_h, out_w, flip;
    JDIMENSION xoff, row_width;
};

/* The columns to decode for the window's columns [*xoff, *xoff + *width): on return the region
 * jpeg_crop_scanline is asked for, whose pixels in the window are a whole decode's.
 *
 * - One column more on the left and two more on the right than asked (where the image has
 *   them): at the edges of a cropped region the smooth ("fancy") chroma upsampling of 4:2:x
 *   images has no neighbour to interpolate from, and the region's first column and its last one
 *   or two differ from a whole decode's (by up to 9 levels seen).
 * - Its left edge on an iMCU boundary (jpeg_crop_scanline moves it there anyway), and further
 *   left by whole iMCUs while the region would leave a component less than two samples wide
 *   where the whole image has two or more (else right, up to the image's edge): libjpeg-turbo
 *   then swaps in the plain (box) upsampler for the whole region, and every pixel of it differs
 *   from a whole decode's, vertically too. That is a window at the right edge whose last iMCU is
 *   two columns wide: a 4:2:0 image 16k + 2 wide at 8/8 (18-57 levels seen), and the same at
 *   scales above 8/8 (below it libjpeg-turbo upsamples the chroma in its IDCT instead);
 *   tests/test_jpegcrop.py. */
static void crop_region(j_decompress_ptr cinfo, JDIMENSION *xoff, JDIMENSION *width)
{
#if JPEG_LIB_VERSION >= 70
    int min_size = cinfo->min_DCT_h_scaled_size;
#define COMP_SIZE(c) ((c)->DCT_h_scaled_size)
#else
    int min_size = cinfo->min_DCT_scaled_size;
#define COMP_SIZE(c) ((c)->DCT_scaled_size)
#endif
    JDIMENSION full = cinfo->output_width, left = *xoff, end = *xoff + *width, align;
    int ci, ok = 0;

    left = left > 0 ? left - 1 : 0;
    end = end + 2 <= full ? end + 2 : full;
    if (cinfo->comps_in_scan == 1 && cinfo->num_components == 1)
        align = (JDIMENSION)min_size; /* as jpeg_crop_scanline: one component, no upsampling */
    else
        align = (JDIMENSION)(min_size * cinfo->max_h_samp_factor);
    left -= left % align;
    while (!ok && end - left < full) {
        ok = 1;
        /* each component's width in the region, as jpeg_crop_scanline works it out */
        for (ci = 0; ci < cinfo->num_components && ok; ci++) {
            jpeg_component_info *c = &cinfo->comp_info[ci];
            unsigned long num = (unsigned long)(end - left) * (unsigned long)(c->h_samp_factor
                                                                             * COMP_SIZE(c));
            unsigned long den = (unsigned long)(cinfo->max_h_samp_factor * min_size);
            if ((num + den - 1) / den < 2 && c->downsampled_width >= 2)
                ok = 0;
        }
        if (!ok) {
            if (left >= align)
                left -= align;
            else
                end = end + align <= full ? end + align : full;
        }
    }
#undef COMP_SIZE
    *xoff = left;
    *width = end - left;
}

/* Decode w's window; 0, or -1 with a Python error set. Called and returns with the GIL. */
static int decode_window_rows(struct window *w)
{
    struct jpeg_decompress_struct cinfo;
    struct crop_error err;
    /* changed after setjmp and read by its error branch: volatile */
    PyThreadState *volatile released = NULL;
    unsigned char *volatile scratch = NULL, *volatile spare = NULL;
    unsigned char *pixels;
    unsigned int top = w->top, left = w->left, height = w->height, width = w->width;
    JDIMENSION xoff, row_width;
    size_t stride;

    if (w->scale_num < 1 || w->scale_num > 16) {
        PyErr_Format(PyExc_ValueError, "%s(): scale_num must be in 1..16, not %d", w->fn,
                     w->scale_num);
        return -1;
    }
    if (height == 0 || width == 0) {
        PyErr_Format(PyExc_ValueError, "%s(): an empty window (%u x %u)", w->fn, height, width);
        return -1;
    }
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = crop_error_exit;
    err.pub.emit_message = crop_emit_message;
    err.message[0] = '\0';
    if (setjmp(err.jump)) {
        if (released != NULL)
            PyEval_RestoreThread(released);
        if (err.message[0] == '\0') /* not libjpeg's: out of memory in the resize */
            PyErr_NoMemory();
        else
            PyErr_Format(PyExc_ValueError, "%s(): libjpeg: %s", w->fn, err.message);
        goto fail;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, w->data, w->len);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = (unsigned int)w->scale_num;
    cinfo.scale_denom = 8;
    cinfo.dct_method = w->fastdct ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_components != 3) {
        PyErr_Format(PyExc_ValueError, "%s(): libjpeg gave %d components, not 3 (RGB)", w->fn,
                     cinfo.output_components);
        goto fail;
    }
    if ((unsigned long)top + height > cinfo.output_height
        || (unsigned long)left + width > cinfo.output_width) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): window %u+%u x %u+%u is outside the %u x %u decoded image", w->fn,
                     top, height, left, width, (unsigned int)cinfo.output_height,
                     (unsigned int)cinfo.output_width);
        goto fail;
    }
    xoff = left;
    row_width = width;
    crop_region(&cinfo, &xoff, &row_width);
    if (row_width < cinfo.output_width)
        jpeg_crop_scanline(&cinfo, &xoff, &row_width);
    stride = (size_t)row_width * 3;
    if (w->out == NULL) {
        w->bytes = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(stride * height));
        if (w->bytes == NULL)
            goto fail;
        pixels = (unsigned char *)PyByteArray_AS_STRING(w->bytes);
    } else {
        scratch = scratch_get(0, stride * height);
        if (scratch == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        pixels = scratch;
    }

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
    /* The rows below the window: entropy-decoded only (jpeg_skip_scanlines), but the last one,
     * and the markers up to EOI read, so that truncated or corrupt data anywhere in the file is
     * an error whatever the window, as it is for a whole decode (tests/test_jpegcrop.py). */
    if (cinfo.output_scanline + 1 < cinfo.output_height)
        jpeg_skip_scanlines(&cinfo, cinfo.output_height - 1 - cinfo.output_scanline);
    if (cinfo.output_scanline < cinfo.output_height) {
        JSAMPROW last;
        spare = scratch_get(4, stride);
        if (spare == NULL)
            longjmp(err.jump, 1); /* message left empty: out of memory */
        last = spare;
        while (cinfo.output_scanline < cinfo.output_height)
            if (jpeg_read_scanlines(&cinfo, &last, 1) == 0) {
                strcpy(err.message, "no scanline could be read");
                longjmp(err.jump, 1);
            }
    }
    jpeg_finish_decompress(&cinfo);
    if (w->out != NULL && resize_any(pixels + (size_t)(left - xoff) * 3, stride, (int)height,
                                        (int)width, w->out, w->out_h, w->out_w, w->flip) < 0)
        longjmp(err.jump, 1); /* message left empty: out of memory */
    jpeg_destroy_decompress(&cinfo);
    PyEval_RestoreThread(released);
    released = NULL;
    scratch_put(0, scratch);
    scratch_put(4, spare);
    w->xoff = xoff;
    w->row_width = row_width;
    return 0;

fail: /* with the GIL and a Python error set: what the decode holds is let go */
    jpeg_destroy_decompress(&cinfo);
    scratch_put(0, scratch);
    scratch_put(4, spare);
    Py_CLEAR(w->bytes);
    return -1;
}

static PyObject *use_simd(PyObject *Py_UNUSED(self), PyObject *arg)
{
    int was = simd_level(), level = (int)PyLong_AsLong(arg);
    if (level == -1 && PyErr_Occurred())
        return NULL;
    simd_allowed = level < 0 ? 0 : level > 2 ? 2 : level;
    return PyLong_FromLong(was);
}

static PyObject *decode_crop(PyObject *Py_UNUSED(self), PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"data", "top", "left", "height", "width", "scale_num", "fastdct",
                               NULL};
    Py_buffer view;
    struct window w;
    int rc;

    memset(&w, 0, sizeof w);
    w.fn = "decode_crop";
    w.scale_num = 8;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*IIII|ip:decode_crop", keywords, &view,
                                     &w.top, &w.left, &w.height, &w.width, &w.scale_num,
                                     &w.fastdct))
        return NULL;
    w.data = (const unsigned char *)view.buf;
    w.len = (unsigned long)view.len;
    rc = decode_window_rows(&w);
    PyBuffer_Release(&view);
    if (rc < 0)
        return NULL;
    return Py_BuildValue("(NII)", w.bytes, (unsigned int)w.row_width,
                         (unsigned int)(w.left - w.xoff));
}

/* out: a writable C-contiguous uint8 buffer of exactly 3 x out_h x out_w bytes for a window of
 * height x width; a ValueError naming the function fn and what is wrong. */
static int check_out(const char *fn, Py_buffer *out, int out_h, int out_w, Py_ssize_t height,
                     Py_ssize_t width)
{
    if (out_h <= 0 || out_w <= 0 || out->len != (Py_ssize_t)3 * out_h * out_w) {
        PyErr_Format(PyExc_ValueError, "%s(): out must hold 3 x %d x %d bytes, not %zd", fn,
                     out_h, out_w, out->len);
        return -1;
    }
    if (height <= 0 || width <= 0) {
        PyErr_Format(PyExc_ValueError, "%s(): an empty window (%zd x %zd)", fn, height, width);
        return -1;
    }
    return 0;
}

static PyObject *decode_crop_into(PyObject *Py_UNUSED(self), PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"data", "top", "left", "height", "width", "out", "out_height",
                               "out_width", "flip", "scale_num", NULL};
    Py_buffer view, out;
    struct window w;
    int rc;

    memset(&w, 0, sizeof w);
    w.fn = "decode_crop_into";
    w.scale_num = 8;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*IIIIw*iip|i:decode_crop_into", keywords,
                                     &view, &w.top, &w.left, &w.height, &w.width, &out, &w.out_h,
                                     &w.out_w, &w.flip, &w.scale_num))
        return NULL;
    rc = check_out(w.fn, &out, w.out_h, w.out_w, w.height, w.width);
    if (rc == 0) {
        w.data = (const unsigned char *)view.buf;
        w.len = (unsigned long)view.len;
        w.out = (unsigned char *)out.buf;
        rc = decode_window_rows(&w);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&view);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *resize_into(PyObject *Py_UNUSED(self), PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"src", "out", "flip", NULL};
    PyObject *src_obj, *out_obj;
    Py_buffer src, out;
    int flip = 0, rc, out_h, out_w;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOp:resize_into", keywords, &src_obj,
                                     &out_obj, &flip))
        return NULL;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_CONTIG) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    rc = -1;
    if (src.ndim != 3 || src.shape[2] != 3 || src.itemsize != 1 || src.strides[2] != 1
        || src.strides[1] != 3 || src.strides[0] < 3 * src.shape[1]
        || (src.format != NULL && strcmp(src.format, "B") != 0))
        PyErr_SetString(PyExc_ValueError,
                        "resize_into(): src must be an H x W x 3 uint8 array of packed pixels, "
                        "rows in order");
    else if (out.ndim != 3 || out.shape[0] != 3 || out.itemsize != 1)
        PyErr_SetString(PyExc_ValueError,
                        "resize_into(): out must be a C-contiguous 3 x H x W uint8 array");
    else {
        out_h = (int)out.shape[1];
        out_w = (int)out.shape[2];
        rc = check_out("resize_into", &out, out_h, out_w, src.shape[0], src.shape[1]);
    }
    if (rc == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = resize_any((const unsigned char *)src.buf, (size_t)src.strides[0],
                           (int)src.shape[0], (int)src.shape[1], (unsigned char *)out.buf, out_h,
                           out_w, flip);
        Py_END_ALLOW_THREADS
        if (rc < 0)
            PyErr_NoMemory();
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_crop", (PyCFunction)(void (*)(void))decode_crop, METH_VARARGS | METH_KEYWORDS,
     "decode_crop(data, top, left, height, width, scale_num=8, fastdct=False)\n--\n\n"
     "Decode rows top:top+height, columns left:left+width of a JPEG (in the image scaled by\n"
     "scale_num/8) to RGB. Returns (pixels, row_width, x_offset): a bytearray of height rows of\n"
     "row_width RGB pixels, the window being columns x_offset:x_offset+width."},
    {"decode_crop_into", (PyCFunction)(void (*)(void))decode_crop_into,
     METH_VARARGS | METH_KEYWORDS,
     "decode_crop_into(data, top, left, height, width, out, out_height, out_width, flip,\n"
     "                 scale_num=8)\n--\n\n"
     "Decode a window as decode_crop does and resize it into the three planes of out, a\n"
     "writable C-contiguous buffer of 3 x out_height x out_width uint8, flipped left-right when\n"
     "flip: an enlargement with OpenCV's INTER_LINEAR pixels (within one level), a reduction on\n"
     "either axis with torch's antialiased bilinear (its pixels). Nothing is written into out\n"
     "unless the decode succeeds."},
    {"resize_into", (PyCFunction)(void (*)(void))resize_into, METH_VARARGS | METH_KEYWORDS,
     "resize_into(src, out, flip)\n--\n\n"
     "Resize src (an H x W x 3 uint8 array of packed pixels, rows any stride apart) into out\n"
     "(a C-contiguous 3 x H' x W' uint8 array) as decode_crop_into does."},
    {"_use_simd", use_simd, METH_O,
     "Test hook: _use_simd(level) caps the resize's vector code: 2 AVX2 (the default, where the\n"
     "CPU has it), 1 SSSE3, 0 plain C loops only. Returns the level that ran before."},
    {"_hold_next", hold_next, METH_NOARGS,
     "Test hook: the next decode_crop waits, without the GIL, until _let_go()."},
    {"_wait_until_held", wait_until_held, METH_NOARGS,
     "Test hook: block until a decode waits at the hold; False if none came in 60 s."},
    {"_is_held", is_held, METH_NOARGS, "Test hook: whether a decode waits at the hold now."},
    {"_let_go", let_go, METH_NOARGS, "Test hook: let a held decode go on (and disarm)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "feedpipe._native._jpegcrop",
    "Window-only JPEG decoding with libjpeg-turbo, and the resize into a batch row (see the "
    "source).",
    -1, methods, NULL, NULL, NULL, NULL,
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
    if (!scratch_key_made && pthread_key_create(&scratch_key, scratch_free) == 0)
        scratch_key_made = 1;
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
