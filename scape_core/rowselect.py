"""The ``k`` largest keys of every row, as ascending columns: the top-k selection's pick.

Which coordinates win is fixed by the keys alone: the ``k`` largest int32 keys of each row, ties at
the row's ``k``-th key taken lowest columns first, the columns returned in ascending order. That is
``torch.topk`` over keys made unique by their column (:func:`reference_columns`, the definition the
tests hold the CPU's paths to), so a mask is the same on every rank and path.

On the CPU a per-row radix select in C does it (:data:`SOURCE`): a histogram of the keys' top 11
bits finds the bucket of the ``k``-th key, two more over that bucket's keys find the key itself,
and one pass over the row writes the columns above it and the first ties, in column order. Four
passes over a row that stays in cache, against ``torch.topk``'s quickselect over (key, index)
pairs and a sort for the ascending order: ``docs/benchmarks.md`` has the costs. It is built at
the first use with the system's C compiler (:mod:`scape_core.native`). Where none works
:func:`reference_columns` picks the same columns, slower. On CUDA ``torch.topk`` (itself a radix select
there) picks over the int32 keys, half the bytes of unique ones: the same columns but where a row has
ties at its ``k``-th key, deterministic and the same on every rank.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
from typing import Callable, Optional

import torch
from torch import Tensor

from scape_core import native

SOURCE = r"""
/* int32 keys in unsigned order */
static inline uint32_t ord(int32_t x) { return (uint32_t)x ^ 0x80000000u; }

/* The bucket at or below `top` (the highest non-empty one) holding the need-th largest counted value; *need
   becomes the rank of that value inside its bucket. */
static int top_bucket(const uint32_t *hist, int top, int64_t *need) {
    int b = top;
    while (*need > (int64_t)hist[b]) { *need -= hist[b]; b--; }
    return b;
}

/* The columns of the k keys above t and the first `ties` equal to t, in column order (cols[i]: key i's column, or i
   where NULL); `equal`: how many keys equal t. Where every one of them is taken (the usual case) no branch and no
   chain through `ties`: a row's picks are unpredictable. */
static void take_columns(const int32_t *x, const int16_t *cols, int64_t n, int64_t k, uint32_t t, int64_t ties,
                         int64_t equal, int16_t *out) {
    int64_t c = 0;
    if (ties == equal) {
        for (int64_t i = 0; i < n && c < k; i++) { out[c] = cols ? cols[i] : (int16_t)i; c += ord(x[i]) >= t; }
        return;
    }
    for (int64_t i = 0; i < n && c < k; i++) {
        uint32_t u = ord(x[i]);
        int64_t tie = u == t, take = (u > t) | (tie & (ties > 0));
        ties -= tie & take;
        out[c] = cols ? cols[i] : (int16_t)i; c += take;
    }
}

static uint32_t select_row(const int32_t *x, int64_t n, int64_t k, int16_t *out, uint32_t *cand) {
    uint32_t hist[4][2048], sum[2048];
    int64_t need = k, m = 0, ties;
    int64_t j = 0;
    uint32_t top = 0;  /* the highest bucket counted: the scans for the k-th start there */
    if (n >= 2048) {  /* four histograms: no chain of increments on one bin */
        uint32_t t4[4] = {0, 0, 0, 0};
        memset(hist, 0, sizeof hist);
        for (; j + 4 <= n; j += 4) {
            for (int l = 0; l < 4; l++) {
                uint32_t b = ord(x[j + l]) >> 21;
                hist[l][b]++; t4[l] = b > t4[l] ? b : t4[l];
            }
        }
        for (; j < n; j++) { uint32_t b = ord(x[j]) >> 21; hist[0][b]++; t4[0] = b > t4[0] ? b : t4[0]; }
        for (int l = 0; l < 4; l++) top = t4[l] > top ? t4[l] : top;
        for (uint32_t b = 0; b <= top; b++) sum[b] = hist[0][b] + hist[1][b] + hist[2][b] + hist[3][b];
    } else {  /* a few keys (a bounded pick's): one histogram, a quarter of the clearing */
        memset(sum, 0, sizeof sum);
        for (; j < n; j++) { uint32_t b = ord(x[j]) >> 21; sum[b]++; top = b > top ? b : top; }
    }
    uint32_t high = (uint32_t)top_bucket(sum, (int)top, &need);
    for (j = 0; j < n; j++) { uint32_t u = ord(x[j]); cand[m] = u; m += (u >> 21) == high; }
    memset(sum, 0, sizeof sum);
    top = 0;
    for (int64_t i = 0; i < m; i++) { uint32_t b = (cand[i] >> 10) & 2047; sum[b]++; top = b > top ? b : top; }
    uint32_t prefix = (high << 21) | ((uint32_t)top_bucket(sum, (int)top, &need) << 10);
    int64_t m2 = 0;
    for (int64_t i = 0; i < m; i++) { uint32_t u = cand[i]; cand[m2] = u; m2 += (u >> 10) == (prefix >> 10); }
    memset(sum, 0, 1024 * sizeof(uint32_t));
    top = 0;
    for (int64_t i = 0; i < m2; i++) { uint32_t b = cand[i] & 1023; sum[b]++; top = b > top ? b : top; }
    uint32_t t = prefix | (uint32_t)top_bucket(sum, (int)top, &need);
    ties = need;  /* keys equal to t to take, lowest columns first */
    int64_t equal = 0;
    for (int64_t i = 0; i < m2; i++) equal += cand[i] == t;
    take_columns(x, NULL, n, k, t, ties, equal, out);
    return t;
}

/* Scratch for one row's pick: the radix select's candidates; the hinted pick's keys, their columns and their
   positions picked; select_near's histogram (2048 bins and three more, zero between rows). */
typedef struct { uint32_t *cand, *near; int32_t *keys; int16_t *cols, *at; } Scratch;

#define HINT_MARGIN (1u << 20)  /* a key's bits less this: 0.88 to 0.94 times its value, for scores >= 0 */
#define NEAR_SHIFT 13  /* select_near's bins: 2^13 key values each, 2047 of them over two octaves above the bound */

/* The k largest of m keys all at or above `lo` (unsigned order), in column order (cols[i]: key i's column), where
   the k-th lies within 2047 bins of `lo` (a hint that held): one histogram of (key - lo) >> NEAR_SHIFT finds the
   k-th's bin, and the few keys in that bin are ranked exactly. The k columns into out; the k-th key returned, or 0
   where this does not apply (the k-th further above `lo`, or over 64 keys in its bin): select_row then. */
static uint32_t select_near(const int32_t *x, const int16_t *cols, int64_t m, int64_t k, uint32_t lo, int16_t *out,
                            Scratch *s) {
    uint32_t *sum = s->near, top = 0, low = 2047;
    for (int64_t i = 0; i < m; i++) {  /* keys beyond the bins: four counts, no chain of increments on one */
        uint32_t d = (ord(x[i]) - lo) >> NEAR_SHIFT, b = d < 2047 ? d : 2047 + (uint32_t)(i & 3);
        sum[b]++; top = b > top ? b : top; low = b < low ? b : low;
    }
    if (top > 2047) {
        sum[2047] += sum[2048] + sum[2049] + sum[2050];
        sum[2048] = sum[2049] = sum[2050] = 0;
        top = 2047;
    }
    int64_t below = 0;  /* keys in the bins under b: the k-th largest is in the first bin where they pass m - k */
    uint32_t b = low;
    while (below + (int64_t)sum[b] <= m - k) below += sum[b++];
    int64_t need = k - (m - below - (int64_t)sum[b]);  /* the k-th's rank from the top among its bin's keys */
    memset(sum + low, 0, (top - low + 1) * sizeof(uint32_t));
    if (b == 2047) return 0;
    uint32_t *bin = s->cand;
    int64_t nb = 0;
    for (int64_t i = 0; i < m; i++) { uint32_t u = ord(x[i]); bin[nb] = u; nb += (u - lo) >> NEAR_SHIFT == b; }
    if (nb > 64) return 0;
    for (int64_t i = 1; i < nb; i++) {  /* a few keys: sorted descending */
        uint32_t u = bin[i];
        int64_t j = i;
        for (; j > 0 && bin[j - 1] < u; j--) bin[j] = bin[j - 1];
        bin[j] = u;
    }
    uint32_t t = bin[need - 1];
    int64_t ties = need, equal = 0;  /* keys equal to t to take, lowest columns first; keys equal to t */
    for (int64_t i = 0; i < need; i++) ties -= bin[i] > t;
    for (int64_t i = 0; i < nb; i++) equal += bin[i] == t;
    take_columns(x, cols, m, k, t, ties, equal, out);
    return t;
}

/* select_row, faster where `*hint` is a bound at or below the row's k-th key: the keys >= it gathered with their
   columns in one pass and selected among those alone (select_near, else select_row). Exact whatever the hint: when
   fewer than k keys are >= it, the whole row is selected. `*hint` becomes this row's k-th key less HINT_MARGIN (0: no
   hint), the next pick's bound: a row's k-th score moves little from one step to the next. */
static void hinted_row(const int32_t *x, int64_t n, int64_t k, int16_t *out, Scratch *s, uint32_t *hint) {
    uint32_t lo = *hint, t;
    int64_t m = 0;
    if (lo) {
        for (int64_t j = 0; j < n; j++) {
            int32_t v = x[j];
            s->keys[m] = v; s->cols[m] = (int16_t)j; m += ord(v) >= lo;
        }
    }
    if (lo && m >= k) {  /* the k largest are all gathered, ties at the k-th included (they are >= lo too) */
        t = select_near(s->keys, s->cols, m, k, lo, out, s);
        if (!t) {
            t = select_row(s->keys, m, k, s->at, s->cand);
            for (int64_t i = 0; i < k; i++) out[i] = s->cols[s->at[i]];
        }
    } else {
        t = select_row(x, n, k, out, s->cand);
    }
    *hint = t > HINT_MARGIN ? t - HINT_MARGIN : 0;
}

static int scratch(Scratch *s, int64_t n) {
    s->cand = (uint32_t *)malloc((size_t)n * sizeof(uint32_t));
    s->near = (uint32_t *)calloc(2048 + 3, sizeof(uint32_t));
    s->keys = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    s->cols = (int16_t *)malloc((size_t)n * sizeof(int16_t));
    s->at = (int16_t *)malloc((size_t)n * sizeof(int16_t));
    return s->cand && s->near && s->keys && s->cols && s->at;
}

static void release(Scratch *s) { free(s->cand); free(s->near); free(s->keys); free(s->cols); free(s->at); }

/* Row r takes its k best among its n columns, but a shorter row (short[p] == row0 + r, ascending) takes its
   counts[p] best among its first lens[p], ascending; the other slots hold column n - 1 (its padding). */
typedef struct { const int32_t *rows, *lens, *counts; int64_t n, next; } Short;

static void pick_row(const int32_t *x, Short *sh, int64_t row, int64_t n, int64_t k, int16_t *out, Scratch *s,
                     uint32_t *hint) {
    int64_t len = n, count = k;
    while (sh->next < sh->n && sh->rows[sh->next] < row) sh->next++;
    if (sh->next < sh->n && sh->rows[sh->next] == row) { len = sh->lens[sh->next]; count = sh->counts[sh->next]; }
    if (count > len) count = len;
    if (count > 0 && hint) hinted_row(x, len, count, out, s, hint);
    else if (count > 0) select_row(x, len, count, out, s->cand);
    for (int64_t i = count < 0 ? 0 : count; i < k; i++) out[i] = (int16_t)(n - 1);
}

/* rows x n int32 keys (row stride `stride` values) -> rows x k int16 columns; 0 on success */
int scape_topk_rows(const int32_t *keys, int64_t rows, int64_t n, int64_t stride, int64_t k, int64_t row0,
                    const int32_t *short_rows, const int32_t *lens, const int32_t *counts, int64_t n_short,
                    int16_t *out) {
    if (k < 1 || k > n || n > 32768) return 1;
    Scratch s;
    if (!scratch(&s, n)) { release(&s); return 2; }
    Short sh = {short_rows, lens, counts, n_short, 0};
    for (int64_t r = 0; r < rows; r++) pick_row(keys + r * stride, &sh, row0 + r, n, k, out + r * k, &s, NULL);
    release(&s);
    return 0;
}

/* The age score's pick without a stored score: row by row, the keys of |(w - t1) * late| (late: OVERDUE
   where w < before and a limit is set, else m; |m| without windows), the excluded columns moved below
   every free key, then pick_row. The fp32 arithmetic of scape_core.masks.age_momentum_score. `hint`: one bound
   per row (hinted_row), or NULL. */
int scape_age_topk_rows(const float *m, const float *w, int64_t rows, int64_t n, int64_t k, float t1,
                        int has_limit, float before, float overdue, const int16_t *excluded, int64_t k_ex,
                        int64_t row0, const int32_t *short_rows, const int32_t *lens, const int32_t *counts,
                        int64_t n_short, uint32_t *hint, int16_t *out) {
    if (k < 1 || k > n || n > 32768) return 1;
    Scratch s;
    int32_t *keys = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    if (!scratch(&s, n) || !keys) { release(&s); free(keys); return 2; }
    Short sh = {short_rows, lens, counts, n_short, 0};
    for (int64_t r = 0; r < rows; r++) {
        const float *mr = m + r * n;
        float *score = (float *)keys;  /* the row's scores, read as int32 keys below (-fno-strict-aliasing) */
        if (w) {
            const float *wr = w + r * n;
            if (has_limit) {
                for (int64_t j = 0; j < n; j++) {  /* both read first: a select, so the loop vectorizes */
                    float mj = mr[j], wj = wr[j];
                    score[j] = fabsf((wj - t1) * (wj < before ? overdue : mj));
                }
            } else {
                for (int64_t j = 0; j < n; j++) score[j] = fabsf((wr[j] - t1) * mr[j]);
            }
        } else {
            for (int64_t j = 0; j < n; j++) score[j] = fabsf(mr[j]);
        }
        if (excluded) {
            for (int64_t i = 0; i < k_ex; i++) {
                int64_t c = excluded[r * k_ex + i];
                int32_t e = keys[c] | (int32_t)0x80000000u;
                keys[c] = e < -2147483647 ? -2147483647 : e;
            }
        }
        pick_row(keys, &sh, row0 + r, n, k, out + r * k, &s, hint ? hint + r : NULL);
    }
    release(&s); free(keys);
    return 0;
}
"""

_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (pid, pool)
_hints: dict[tuple[int, ...], Tensor] = {}  # _hint's bounds, by block of the momentum and k
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
native.register(SOURCE, {
    "scape_topk_rows": (ctypes.c_int, [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR]),
    "scape_age_topk_rows": (ctypes.c_int, [_PTR, _PTR, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int,
                                           ctypes.c_float, ctypes.c_float, _PTR, _I64, _I64, _PTR, _PTR, _PTR,
                                           _I64, _PTR, _PTR]),
})


def unique_keys(keys: Tensor) -> Tensor:
    """int32 ``keys`` as int64 keys in the same order, made unique by the column: among equal keys the
    lower column ranks first.

    Example:
        >>> unique_keys(torch.tensor([[2, 2]], dtype=torch.int32)).tolist()   # 2 * 65536 + 65535, ... + 65534
        [[196607, 196606]]
    """
    cols = torch.arange(keys.shape[-1], device=keys.device)
    return keys.long().mul_(1 << 16).add_(0xFFFF - cols)


Short = tuple[Tensor, Tensor, Tensor]  # a block's shorter rows: their rows (ascending), lengths and counts, int32


def reference_columns(keys: Tensor, k: int, short: Short | None = None, unique: bool = True) -> Tensor:
    """The columns of each row's ``k`` largest int32 ``keys``, ties lowest columns first, ascending
    (``(rows, k)`` int16): ``torch.topk`` over :func:`unique_keys`, sorted. ``short``: rows that take
    their ``count`` best among their first ``length`` columns, the other slots holding the last column
    (a parameter's shorter last row: its picks, then its padding). ``unique=False``: ``torch.topk`` over
    the int32 keys themselves, its own choice among ties at the ``k``-th key (what CUDA runs: a radix
    select over half the bytes).

    Example:
        >>> reference_columns(torch.tensor([[5, 1, 5, 7, 5]], dtype=torch.int32), 3).tolist()
        [[0, 2, 3]]
        >>> one = torch.tensor([0], dtype=torch.int32)
        >>> reference_columns(torch.tensor([[5, 1, 5, 7, 5]], dtype=torch.int32), 3, (one, one + 3, one + 2)).tolist()
        [[0, 2, 4]]
    """
    ranked = unique_keys(keys) if unique else keys
    cols = ranked.topk(k, dim=1, sorted=False).indices.sort(dim=1).values.to(torch.int16)
    if short is None or not short[0].numel():
        return cols
    rows, lengths, counts = (t.to(keys.device).long() for t in short)
    n = keys.shape[1]
    beyond = torch.arange(n, device=keys.device) >= lengths[:, None]
    lowest = torch.iinfo(ranked.dtype).min
    best = ranked.index_select(0, rows).masked_fill_(beyond, lowest).topk(k, dim=1).indices
    slots = torch.arange(k, device=keys.device) >= counts[:, None]
    return cols.index_copy_(0, rows, best.masked_fill_(slots, n - 1).sort(dim=1).values.to(torch.int16))


def top_columns(keys: Tensor, k: int, short: Short | None = None) -> Tensor:
    """:func:`reference_columns`, fast: on the CPU the C radix select (rows split over torch's threads;
    without a C compiler the reference, the same columns); elsewhere ``torch.topk`` over the int32 keys,
    whose choice among ties at a row's ``k``-th key is its own. ``keys``: ``(rows, n)`` int32, rows contiguous.

    Example:
        >>> keys = torch.tensor([[3, 9, 9, 1], [0, 0, 0, 0]], dtype=torch.int32)
        >>> top_columns(keys, 2).tolist()
        [[1, 2], [0, 1]]
    """
    n = keys.shape[1]
    if keys.device.type != "cpu":
        return reference_columns(keys, k, short, unique=False)
    if keys.dtype != torch.int32 or keys.stride(1) != 1 or not _c_picks(n, k, short):
        return reference_columns(keys, k, short)
    return torch.ops.scape.top_columns(keys, k, *(short or (None, None, None)))


def fused_age_columns(m: Tensor, windows: Tensor | None, target: int, max_window: int | None, overdue: float,
                      excluded: Tensor | None, k: int, short: Short | None = None) -> Tensor | None:
    """The columns :func:`top_columns` takes from the age score of ``m`` and ``windows``
    (:func:`~scape_core.masks.age_momentum_score`, an overdue coordinate's ``|m|`` read as ``overdue``; ``|m|``
    without windows), the ``(rows, k_ex)`` int16 ``excluded`` columns moved last
    (:func:`~scape_core.masks.excluded_key`), computed row by row in C with no stored score: the same columns
    from the same fp32 arithmetic. ``None`` where the C pick is not used (not the CPU, no compiler, not
    contiguous fp32): the caller scores and selects.

    Example:
        >>> m, w = torch.tensor([[1.0, -2.0, 0.5]]), torch.tensor([[3.0, 1.0, 0.0]])   # scores 1, 6, 2
        >>> fused_age_columns(m, w, target=5, max_window=None, overdue=2.0 ** 100, excluded=None, k=2).tolist()
        [[1, 2]]
    """
    n = m.shape[1]
    tensors = [t for t in (m, windows, excluded) if t is not None]
    if (m.device.type != "cpu" or m.dtype != torch.float32 or (windows is not None and windows.dtype != m.dtype)
            or (excluded is not None and excluded.dtype != torch.int16) or not all(t.is_contiguous() for t in tensors)
            or not _c_picks(n, k, short)):
        return None
    limit = max_window is not None and windows is not None
    return torch.ops.scape.age_columns(m, windows, float(target - 1), limit, float(target - max_window) if limit
                                       else 0.0, float(overdue), excluded, k, *(short or (None, None, None)),
                                       _hint(m, k))


def _hint(m: Tensor, k: int) -> Tensor:
    """Per row of ``m`` (a block of the momentum, which stays in place from step to step), a bound at or below
    its last pick's ``k``-th key: the C pick gathers the keys above it and selects among those alone (exact
    whatever the bound: a row with fewer keys above it is selected whole)."""
    key = (m.data_ptr(), *m.shape, k)
    found = _hints.get(key)
    if found is None:
        if len(_hints) > 4096:  # buffers made anew (a resume, another model): their blocks' hints go
            _hints.clear()
        found = _hints[key] = torch.zeros(m.shape[0], dtype=torch.int32)
    return found


def _c_picks(n: int, k: int, short: Short | None) -> bool:
    """Whether the C pick takes ``k`` of rows of ``n`` with these shorter rows: ``0 < k <= n <= 32768`` (int16
    columns), ``short`` absent or three contiguous int32 CPU tensors of one length, and the pick built."""
    fits = short is None or all(t.dtype == torch.int32 and t.is_contiguous() and t.device.type == "cpu"
                                and t.shape == short[0].shape for t in short)
    return 0 < k <= n <= 32768 and fits and native.library() is not None


# The C picks as torch operators (CPU only): a dispatch mode (benchmarks/traffic_bench.py, op_count.py) sees each
# call as one operator that reads its tensor arguments and writes its columns.
@torch.library.custom_op("scape::top_columns", mutates_args=(), device_types="cpu")
def _top_columns_op(keys: Tensor, k: int, short_rows: Optional[Tensor], lengths: Optional[Tensor],
                    counts: Optional[Tensor]) -> Tensor:
    rows, n = keys.shape
    out = torch.empty(rows, k, dtype=torch.int16)
    library, n_short = native.library(), 0 if short_rows is None else short_rows.numel()
    return _by_rows(out, lambda lo, hi: library.scape_topk_rows(
        _at(keys, lo), hi - lo, n, keys.stride(0), k, lo, _at(short_rows, 0), _at(lengths, 0), _at(counts, 0),
        n_short, _at(out, lo)))


@torch.library.custom_op("scape::age_columns", mutates_args=("hint",), device_types="cpu")
def _age_columns_op(m: Tensor, windows: Optional[Tensor], t1: float, limit: bool, before: float, overdue: float,
                    excluded: Optional[Tensor], k: int, short_rows: Optional[Tensor], lengths: Optional[Tensor],
                    counts: Optional[Tensor], hint: Optional[Tensor]) -> Tensor:
    rows, n = m.shape
    out = torch.empty(rows, k, dtype=torch.int16)
    k_ex = 0 if excluded is None else excluded.shape[1]
    library, n_short = native.library(), 0 if short_rows is None else short_rows.numel()
    return _by_rows(out, lambda lo, hi: library.scape_age_topk_rows(
        _at(m, lo), _at(windows, lo), hi - lo, n, k, t1, int(limit), before, overdue, _at(excluded, lo), k_ex,
        lo, _at(short_rows, 0), _at(lengths, 0), _at(counts, 0), n_short, _at(hint, lo), _at(out, lo)))


@_top_columns_op.register_fake
def _(keys: Tensor, k: int, short_rows: Optional[Tensor], lengths: Optional[Tensor],
      counts: Optional[Tensor]) -> Tensor:
    return keys.new_empty(keys.shape[0], k, dtype=torch.int16)


@_age_columns_op.register_fake
def _(m: Tensor, windows: Optional[Tensor], t1: float, limit: bool, before: float, overdue: float,
      excluded: Optional[Tensor], k: int, short_rows: Optional[Tensor], lengths: Optional[Tensor],
      counts: Optional[Tensor], hint: Optional[Tensor]) -> Tensor:
    return m.new_empty(m.shape[0], k, dtype=torch.int16)


def _at(t: Tensor | None, row: int) -> ctypes.c_void_p | None:
    """The address of row ``row`` of a row-major ``t`` (element ``row`` of a 1-D one); ``None`` for none."""
    return None if t is None else ctypes.c_void_p(t.data_ptr() + row * t.stride(0) * t.element_size())


def _by_rows(out: Tensor, run: Callable[[int, int], int]) -> Tensor:
    """``run(lo, hi)`` over ``out``'s rows, split over torch's threads (ctypes releases the GIL); ``out``."""
    rows = out.shape[0]
    threads = min(torch.get_num_threads(), max(1, rows // 64))
    size = -(-rows // threads)
    parts = [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]
    codes = [run(*parts[0])] if len(parts) == 1 else list(_threads().map(lambda p: run(*p), parts))
    if any(codes):
        raise RuntimeError(f"SCAPE's C top-k failed (code {max(codes)}) on {rows} rows")
    return out


def _threads() -> concurrent.futures.ThreadPoolExecutor:
    """The pool the rows are split over, one per process (a forked child makes its own: its parent's
    threads do not exist there)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                                                    thread_name_prefix="scape-topk"))
    return _pool[1]
