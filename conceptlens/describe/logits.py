"""Each concept direction through the unembedding: its most promoted and most suppressed tokens.

    top = logit_tokens(directions, W_U, 10)   # promoted_ids / promoted_logit / suppressed_... (n, 10)

The product of every unit direction with the unembedding (n d V: 320 GFLOP for the 5,632 concepts
of a quick SmolLM2 run) is most of the describe finish. On a CPU with fast bfloat16 products
(AMX or AVX512-BF16) it is screened in bfloat16 and only each row's few candidates are computed in
float32: a rigorous bound on the screen's error (see `_bf16_slack`) certifies that no other token
can reach the p-th logit; a row it cannot certify is screened again in float32 with more
candidates, up to its whole row. The result is the top p of float32 logits, equal logits in
column order, whichever path ran.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

EXTRA = 22
"""Candidates per row and side beyond p that a screen passes on (p + 22 = 32 at p 10: SmolLM2's
random directions need a median of 21 and at most 43 with the bfloat16 bound), 4x more for the
rows it cannot certify."""
MEMBERS = 64  # tokens per group of the group-maxima search of a screen
U32 = 2.0 ** -24  # unit roundoff of float32
EPS_OUT = 2.0 ** -7 / (1 - 2.0 ** -7)  # |bf16(t) - t| <= EPS_OUT |bf16(t)| for a faithful rounding of t
SIGN = -32768  # int16 with only the sign bit: x ^ SIGN flips a bfloat16's sign


class Unembedding:
    """An unembedding `(V, d)` prepared for `logit_tokens` once per pass: float32 on the CPU, and on
    the bfloat16 screen's first use its bfloat16 copy and the norms of its bound (~4 passes over it).

        head = Unembedding(model.get_output_embeddings().weight)
        top = logit_tokens(directions, head, 10)
    """

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight.detach().float().cpu()
        self._bf16: tuple[Tensor, tuple[float, float, float]] | None = None

    def __len__(self) -> int:
        return len(self.weight)

    def bf16(self) -> tuple[Tensor, tuple[float, float, float]]:
        """bf16(W) and (N~, rho, N) of `_bf16_slack`."""
        if self._bf16 is None:
            self._bf16 = _bf16_copy(self.weight)
        return self._bf16


def logit_tokens(directions: Tensor, unembedding: Tensor | Unembedding, p: int, chunk: int = 512,
                 screen: bool | None = None) -> dict[str, Tensor]:
    """Each unit direction through the unembedding `(V, d)`: its p most promoted and suppressed token
    ids and their logits, equal logits in column order. `screen`: through the bfloat16 screen (None:
    where the CPU multiplies bfloat16 fast and the vocabulary is large)."""
    unit = torch.nn.functional.normalize(directions.float(), dim=1)
    head = unembedding if isinstance(unembedding, Unembedding) else Unembedding(unembedding)
    if screen is None:
        screen = unit.device.type == "cpu" and len(head) >= 8 * (p + EXTRA + 1) * MEMBERS and fast_bf16()
    parts = _screened(unit, head, p, chunk) if screen and p > 0 else _plain(unit, head.weight, p, chunk)
    names = ("promoted_ids", "promoted_logit", "suppressed_ids", "suppressed_logit")
    return {name: torch.cat([part[i] for part in parts]) for i, name in enumerate(names)}


def _plain(unit: Tensor, w: Tensor, p: int, chunk: int) -> list[tuple[Tensor, ...]]:
    """Every logit in float32, a block of rows at a time; per block (promoted ids, logits, suppressed ...)."""
    buffer = torch.empty(min(chunk, len(unit)), w.shape[0])  # one (chunk, V) buffer: no fresh 100 MB per chunk
    parts: list[tuple[Tensor, ...]] = []
    for rows in unit.split(chunk):
        logits = torch.matmul(rows, w.T, out=buffer[: len(rows)])  # (chunk, V)
        parts.append((*row_extremes(logits, p, True), *row_extremes(logits, p, False)))
    return parts


def _screened(unit: Tensor, head: Unembedding, p: int, chunk: int) -> list[tuple[Tensor, ...]]:
    """`_plain`'s results through a bfloat16 screen; the rows it cannot certify through a float32 one.
    Both sides at once: rows 0..r-1 of a block search S, rows r..2r-1 search -S (the suppressed side)."""
    w, (wb, norms) = head.weight, head.bf16()
    buffer = torch.empty(2 * min(chunk, len(unit)), len(w), dtype=torch.int16)  # bfloat16 bits of S and -S
    parts: list[tuple[Tensor, ...]] = []
    failed: list[Tensor] = []
    for start, rows in zip(range(0, len(unit), chunk), unit.split(chunk)):
        r, ub, keys = len(rows), rows.bfloat16(), buffer[: 2 * len(rows)]
        torch.matmul(ub, wb.T, out=keys[:r].view(torch.bfloat16))  # S (r, V)
        torch.bitwise_xor(keys[:r], SIGN, out=keys[r:])  # -S
        slack = _bf16_slack(rows, ub, norms).repeat(2)
        ids, values, ok = _escalated(rows.repeat(2, 1), w, lambda i, k: _screen_top(keys, i, k, EPS_OUT, slack),
                                     _signs(r), p, 16 * (p + EXTRA))
        zero = (rows.abs().amax(1) == 0).repeat(2)  # every logit 0: the first p tokens (else a whole-row search)
        ids[zero], values[zero], ok[zero] = torch.arange(p), 0.0, True
        parts.append((ids[:r], values[:r], ids[r:], values[r:]))
        failed.append(start + (~(ok[:r] & ok[r:])).nonzero().squeeze(1))
    redo = torch.cat(failed)  # a near tie around the p-th logit wider than the bound: float32 for those rows
    if len(redo):
        out = [torch.cat(t) for t in zip(*parts)]
        for ids in redo.split(chunk):
            for t, redone in zip(out, _float32_rows(unit[ids], w, p, norms)):
                t[ids] = redone
        parts = [tuple(out)]
    return parts


def _float32_rows(rows: Tensor, w: Tensor, p: int, norms: tuple[float, float, float]) -> list[Tensor]:
    """(promoted ids, logits, suppressed ids, logits) of a few rows, screened by their float64 logits
    (a block of tokens at a time: within 2 d 2^-53 ||u|| N of the exact ones whatever float32 matmul
    precision torch is set to; the candidates' float32 logits lie within gamma_d ||u|| N of them)."""
    logits = torch.cat([rows.double() @ block.double().T for block in w.split(4096)], 1)  # (r, V)
    scores = torch.cat([logits, -logits])  # (2r, V): both sides as largest values
    d, r = rows.shape[1], len(rows)
    bound = (_gamma(d) + 2 * d * 2.0 ** -53) * _inflate(rows.norm(dim=1).double(), d) * norms[2]
    slack = ((bound + _tiny(d, norms)) * (1 + 2.0 ** -20)).repeat(2)

    def top(todo: Tensor, k: int) -> tuple[Tensor, Tensor]:
        ids, values = row_extremes(scores[todo], k + 1, True)
        return ids[:, :k], values[:, k].double() + slack[todo]

    ids, values, _ = _escalated(rows.repeat(2, 1), w, top, _signs(r), p, len(w))
    return [ids[:r], values[:r], ids[r:], values[r:]]


def _signs(r: int) -> Tensor:
    """`(2r,)`: 1 for the promoted side's rows, -1 for the suppressed side's."""
    return torch.cat([torch.ones(r), -torch.ones(r)])


def _escalated(rows: Tensor, w: Tensor, top, sign: Tensor, p: int, k_last: int) -> tuple[Tensor, Tensor, Tensor]:
    """`_certified` with p + EXTRA candidates per row from `top(rows, k)` -> (candidate ids (t, k), the
    highest sign-adjusted logit any other token can have (t,)), then 4x more for the rows not
    certified, up to k_last (at V candidates, every token is one: certified)."""
    r, v = rows.shape[0], w.shape[0]
    ids, values, ok = torch.zeros(r, p, dtype=torch.long), torch.zeros(r, p), torch.zeros(r, dtype=torch.bool)
    todo, k = torch.arange(r), min(p + EXTRA, v)
    while len(todo):
        if k == v:
            cand, reach = torch.arange(v).expand(len(todo), v), torch.full((len(todo),), -torch.inf)
        else:
            cand, reach = top(todo, k)
        some = len(todo) < r
        got_ids, got_values, good = _certified(rows[todo] if some else rows, w, cand, reach.double(),
                                               sign[todo] if some else sign, p)
        if k == v:  # every token a candidate: the row's own top p, even of NaN or infinite logits
            good = torch.ones_like(good)
        done = todo[good]
        ids[done], values[done], ok[done] = got_ids[good], got_values[good], True
        todo = todo[~good]
        if k >= min(k_last, v):
            break
        k = min(4 * k, v)
    return ids, values, ok


def _certified(rows: Tensor, w: Tensor, cand: Tensor, reach: Tensor, sign: Tensor, p: int) -> tuple[Tensor, ...]:
    """The top p float32 logits (sign 1) or bottom p (-1) among each row's candidates `(r, k)` as
    (ids, logits) `(r, p)`, equal logits in column order, and whether they are those of the whole row
    `(r,)`: every other token's sign-adjusted logit is at most `reach`, below the p-th found."""
    cand = cand.sort(dim=1).values  # column order first: the stable sort below keeps it for equal logits
    exact = _dots(rows, w, cand)
    order = (exact * sign[:, None]).sort(dim=1, descending=True, stable=True).indices[:, :p]
    top_ids, top_values = cand.gather(1, order), exact.gather(1, order)
    return top_ids, top_values, reach < top_values[:, -1].double() * sign


def _screen_top(keys: Tensor, todo: Tensor, k: int, eps_out: float, slack: Tensor) -> tuple[Tensor, Tensor]:
    """`top` of `_escalated` for a bfloat16 screen held as int16 bits `(r, V)` (S or -S): the k largest
    values' ids, and the (k+1)-th value s moved by the screen's error bound (s + eps_out |s| + slack)."""
    some = keys if len(todo) == len(keys) else keys[todo]
    ids, top = _largest_bits(some, k + 1)
    wrong = top[:, k] < 0  # a negative (k+1)-th value: int16 order is not bfloat16 order there
    if wrong.any():
        ids[wrong], values = row_extremes(some[wrong].view(torch.bfloat16), k + 1, True)
        top[wrong] = values.view(torch.int16)
    out = top[:, k].view(torch.bfloat16).double()
    return ids[:, :k], out + eps_out * out.abs() + slack[todo]


def _largest_bits(bits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest int16 values of each row and their columns `(r, k)`, largest first, through groups
    of MEMBERS columns strided across the row (group g: columns g, g + G, g + 2G, ...): the k groups
    with the largest maxima hold the k largest values (see `row_extremes`). For bfloat16 bits the
    int16 order is the value order among non-negative values (an int16 max is 4x a bfloat16 one)."""
    r, v = bits.shape
    groups = v // MEMBERS
    if groups < 8 * k:
        top = bits.topk(k, dim=1)
        return top.indices, top.values
    maxima = bits[:, : groups * MEMBERS].view(r, MEMBERS, groups).amax(1)  # (r, G)
    chosen = maxima.topk(k, dim=1).indices
    pool = (chosen[..., None] + groups * torch.arange(MEMBERS)).view(r, k * MEMBERS)
    if groups * MEMBERS < v:  # the columns past the last whole group are always searched
        pool = torch.cat([pool, torch.arange(groups * MEMBERS, v).expand(r, -1)], 1)
    top = bits.gather(1, pool).topk(k, dim=1)
    return pool.gather(1, top.indices), top.values


def _dots(rows: Tensor, w: Tensor, cols: Tensor) -> Tensor:
    """The float32 logits `rows[i] . w[cols[i, j]]` `(r, k)`, each one dot product of its own
    (`torch.sparse.sampled_addmm` on CPU): a logit does not depend on the batch it is computed in,
    so equal unembedding rows give equal logits."""
    r, k = cols.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR tensors are a "beta" feature of torch
        pattern = torch.sparse_csr_tensor(torch.arange(0, r * k + 1, k), cols.reshape(-1), torch.zeros(r * k),
                                          size=(r, len(w)), check_invariants=False)
        return torch.sparse.sampled_addmm(pattern, rows, w.T, beta=0.0).values().view(r, k)


def _bf16_slack(rows: Tensor, ub: Tensor, norms: tuple[float, float, float]) -> Tensor:
    """Per row `(r,)`, how far a token's float32 logit E(v) can lie above its bfloat16 screen S(v),
    apart from the screen's output rounding (EPS_OUT |S(v)|).

    With u a unit row in float32, u~ = bf16(u), w_v a token's row, w~_v = bf16(w_v), R(v) = u . w_v:
    - the screen accumulates the exact products u~_i w~_vi (8-bit significands) in float32 in some
      order: T(v) within gamma_d sum_i |u~_i w~_vi| <= gamma_d ||u~|| N~ of u~ . w~_v
      (gamma_d = d 2^-24 / (1 - d 2^-24), Higham's bound for any order), then rounds T to bfloat16:
      S(v) = bf16(T(v)), |S - T| <= EPS_OUT |S|;
    - u~ . w~_v - R(v) = (u~ - u) . w~_v + u . (w~_v - w_v), at most ||u~ - u|| N~ + ||u|| rho;
    - the float32 logit E(v) (one dot product) lies within gamma_d ||u|| N of R(v);
    where N~ = max_v ||w~_v||, rho = max_v ||w~_v - w_v||, N = max_v ||w_v|| (`_bf16_copy`), plus a
    tiny absolute term for subnormals flushed to zero (`_tiny`). So E(v) <= S(v) + EPS_OUT |S(v)| +
    slack, and S + EPS_OUT |S| grows with S: a token screened at most s has E(v) <= s + EPS_OUT |s| +
    slack (on the suppressed side the same holds for -S and -E). Norms computed in float32 are
    raised by their own rounding bound (`_inflate`)."""
    tilde, rho, big = norms
    d = rows.shape[1]
    n_u = _inflate(rows.norm(dim=1).double(), d)
    r_u = _inflate((rows - ub.float()).norm(dim=1).double(), d)  # u - bf16(u) is exact in float32
    slack = r_u * tilde + n_u * rho + _gamma(d) * ((n_u + r_u) * tilde + n_u * big) + _tiny(d, norms)
    return slack * (1 + 2.0 ** -20)  # the float64 sums here and in `_screen_top` round too


def _bf16_copy(w: Tensor) -> tuple[Tensor, tuple[float, float, float]]:
    """bf16(w) and (N~, rho, N) of `_bf16_slack`, each raised by its rounding."""
    wb = w.bfloat16()
    back = wb.float()
    tilde = float(back.norm(dim=1).max())
    rho = float(back.sub_(w).norm(dim=1).max())  # bf16(w) - w is exact in float32
    big = float(w.norm(dim=1).max())
    d = w.shape[1]
    return wb, (_inflate(tilde, d), _inflate(rho, d), _inflate(big, d))


def _inflate(norm, d: int):
    """A float32 Euclidean norm of d terms, raised past its rounding error ((d + 3) 2^-24 relative)."""
    return norm * (1 + (d + 3) * U32)


def _gamma(d: int) -> float:
    """Higham's gamma_d: the relative error bound of a float32 sum of d products, in any order."""
    return d * U32 / (1 - d * U32)


def _tiny(d: int, norms: tuple[float, float, float]) -> float:
    """Subnormal inputs, products or sums flushed to zero (below 2^-126 each) in either dot product."""
    return 4 * d * 2.0 ** -126 * (1 + norms[0] + norms[2])


@functools.cache
def fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX or AVX512-BF16, Linux flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def row_extremes(scores: Tensor, p: int, largest: bool, block: int = 128) -> tuple[Tensor, Tensor]:
    """`scores.topk(p, dim=1, largest=largest)` as (indices, values), equal values listed by column,
    through blocks of `block` columns: the p blocks with the largest maxima hold the p largest values
    (a block holding one of them has a maximum at least the p-th value, and each block ranked above
    it holds another one), so one max per block and a top-k over p blocks replace a top-k over the
    whole row (3x faster at V 49k)."""
    r, v = scores.shape
    whole = v // block * block
    if whole < 8 * p * block:
        top = scores.topk(p, dim=1, largest=largest)
        return _by_column(top.indices, top.values, largest)
    blocks = scores[:, :whole].view(r, -1, block)
    extreme = blocks.amax(2) if largest else blocks.amin(2)  # (r, V / block)
    chosen = extreme.topk(p, dim=1, largest=largest).indices  # (r, p)
    pool = (chosen[..., None] * block + torch.arange(block, device=scores.device)).view(r, p * block)
    if whole < v:  # the columns past the last whole block are always searched
        pool = torch.cat([pool, torch.arange(whole, v, device=scores.device).expand(r, -1)], 1)
    top = scores.gather(1, pool).topk(p, dim=1, largest=largest)
    return _by_column(pool.gather(1, top.indices), top.values, largest)


def _by_column(indices: Tensor, values: Tensor, largest: bool) -> tuple[Tensor, Tensor]:
    """Top-k results with equal values put in column order (a top-k leaves their order open)."""
    first = indices.sort(dim=1).indices
    indices, values = indices.gather(1, first), values.gather(1, first)
    order = values.sort(dim=1, descending=largest, stable=True).indices
    return indices.gather(1, order), values.gather(1, order)
