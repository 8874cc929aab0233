"""Batched sampling: penalties, temperature, top-k / top-p / min-p, draws, logprobs.

The engine calls this once per step on logits ``[rows, vocab]``, one row per
token position to sample. A request may own several consecutive rows (the
nodes of a draft tree being verified), so every parameter is given per row.

Semantics, in order (the same for ``processed_probs`` and ``sample``):

1. penalties on the raw logits (``apply_penalties``): repetition (HF/CTRL:
   divide positive, multiply negative logits of tokens seen in prompt+output),
   then frequency/presence (OpenAI: ``- freq * count - presence * (count > 0)``
   over generated tokens);
2. greedy rows (temperature 0, or top_k == 1) take ``argmax`` of the penalized
   logits; their distribution is the one-hot of that token;
3. ``p = softmax(logits / temperature)``;
4. top-k keeps tokens with ``p >= p_(k)`` (the k-th largest; ties kept);
5. top-p, on the top-k set renormalized, keeps the shortest prefix of the
   sorted tokens whose mass reaches top_p (a token is kept when the mass
   strictly before it is < top_p), extended to ties of the last kept value;
6. min-p keeps tokens with ``p >= min_p * max(p)``;
7. renormalize. Disabled settings (top_k=-1/vocab, top_p=1, min_p=0) leave a
   row bit-for-bit unchanged.

Draws use the inverse CDF in float64 with two uniforms per row, from the row's
own generator (seeded request) or the global RNG, so a seeded row's tokens
depend only on its seed and its logits, never on the other rows in the batch.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specserve.core import SamplingParams

if TYPE_CHECKING:
    from specserve.core import Request

# On CPU, top-p without top-k first ranks this many candidates, then more, and
# sorts the whole vocabulary only when a nucleus is wider still.
TOP_P_CANDIDATE_WIDTHS = (256, 4096)
# Tokens per block of the two-level inverse-CDF draw.
DRAW_BLOCK = 256
# Largest uniform used: keeps ``u * total`` strictly below ``total`` in float64.
_MAX_UNIFORM = 1.0 - 2.0**-52


# ---------------------------------------------------------------- penalties


@dataclass
class PenaltyState:
    """The distinct (row, token) pairs of the penalized rows' histories.

    Sparse: applying it touches only these entries, not ``rows * vocab``.
    Prompt tokens are stored only for rows with a repetition penalty.
    """

    flat_indices: Tensor   # [num_entries] int64, row * vocab_size + token, distinct
    output_counts: Tensor  # [num_entries] float32, times generated (0: prompt only)
    frequency: Tensor      # [num_entries] float32, the entry's row frequency_penalty
    presence: Tensor       # [num_entries] float32
    repetition: Tensor     # [num_entries] float32
    vocab_size: int

    @classmethod
    def from_histories(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int] | Tensor],
        output_ids: Sequence[Sequence[int] | Tensor],
        device: torch.device | str,
        vocab_size: int,
    ) -> PenaltyState | None:
        """Build from per-row histories; None when no row uses penalties.

        ``output_ids[i]`` is everything generated before row ``i``'s position
        (for a draft-tree row: the request's output plus its draft ancestors).
        """
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not rows:
            return None
        keys, generated = _history_keys(params, rows, prompt_ids, output_ids, vocab_size)
        flat_indices, entry_of_key = torch.unique(keys, return_inverse=True)  # [num_entries]
        output_counts = torch.zeros(flat_indices.shape[0]).index_add_(0, entry_of_key, generated)
        entry_rows = flat_indices // vocab_size  # [num_entries]

        def per_entry(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32)[entry_rows].to(device)

        return cls(
            flat_indices=flat_indices.to(device),
            output_counts=output_counts.to(device),
            frequency=per_entry([p.frequency_penalty for p in params]),
            presence=per_entry([p.presence_penalty for p in params]),
            repetition=per_entry([p.repetition_penalty for p in params]),
            vocab_size=vocab_size,
        )


def _history_keys(
    params: Sequence[SamplingParams],
    rows: list[int],
    prompt_ids: Sequence[Sequence[int] | Tensor],
    output_ids: Sequence[Sequence[int] | Tensor],
    vocab_size: int,
) -> tuple[Tensor, Tensor]:
    """``row * vocab + token`` for every history token ``[n]`` (CPU), and 1.0 where generated."""
    keys, generated = [], []
    for row in rows:
        histories = [(output_ids[row], 1.0)]
        if params[row].repetition_penalty != 1.0:
            histories.append((prompt_ids[row], 0.0))
        for ids, is_generated in histories:
            tokens = torch.as_tensor(ids, dtype=torch.int64).cpu().reshape(-1)  # [len]
            if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
                raise ValueError(f"row {row}: token id out of range [0, {vocab_size})")
            keys.append(tokens + row * vocab_size)
            generated.append(torch.full(tokens.shape, is_generated))
    return torch.cat(keys), torch.cat(generated)


def apply_penalties(logits: Tensor, penalties: PenaltyState | None) -> Tensor:
    """Penalized float32 logits ``[rows, vocab]``; the input is never modified."""
    logits = logits.float()
    if penalties is None:
        return logits
    if logits.shape[1] != penalties.vocab_size:
        raise ValueError(f"logits vocab {logits.shape[1]} != penalty vocab {penalties.vocab_size}")
    flat_logits = logits.reshape(-1)  # [rows * vocab]
    values = flat_logits.index_select(0, penalties.flat_indices)  # [num_entries]
    repetition = penalties.repetition
    values = torch.where(values > 0, values / repetition, values * repetition)
    counts = penalties.output_counts
    values = values - penalties.frequency * counts - penalties.presence * (counts > 0).float()
    return flat_logits.index_put((penalties.flat_indices,), values).view_as(logits)


# ---------------------------------------------------------------- batch


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for one step, on the logits' device.

    The fields after ``penalties`` are a host-side plan that ``from_params``
    derives from the parameters, so a step never reads parameters back from
    the device. Their defaults are the safe, slower choices for batches built
    by hand.
    """

    temperatures: Tensor       # [rows] float32, 0 for greedy rows
    top_ps: Tensor             # [rows] float32, 1 when disabled
    top_ks: Tensor             # [rows] int64, vocab_size when disabled
    min_ps: Tensor             # [rows] float32, 0 when disabled
    is_all_greedy: bool
    need_top_p_k_min_p: bool   # False: no sampled row sets top-k/top-p/min-p
    generators: list[torch.Generator | None]  # per row, on the logits' device; None: global RNG
    penalties: PenaltyState | None = None
    has_greedy_rows: bool = True
    has_min_p: bool = True
    max_top_k: int | None = None         # largest top_k < vocab (0: none); None: rank all
    has_top_p: bool = True               # some sampled row has top_p < 1
    has_open_top_p: bool = True          # ... and no top_k, so its nucleus has no known bound
    filtered_rows: Tensor | None = None  # [rows] bool, rows the filters may change; None: all

    @property
    def num_rows(self) -> int:
        return self.temperatures.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device | str,
        vocab_size: int,
        *,
        generators: Sequence[torch.Generator | None] | None = None,
        penalties: PenaltyState | None = None,
    ) -> SamplingBatch:
        """One row per entry of ``params`` (repeat a request's params for each of its rows)."""
        generators = list(generators) if generators is not None else [None] * len(params)
        if len(generators) != len(params):
            raise ValueError(f"{len(generators)} generators for {len(params)} rows")
        rows = [_RowParams.normalize(p, vocab_size) for p in params]
        filtered = [r.is_filtered(vocab_size) for r in rows]
        return cls(
            temperatures=_tensor([r.temperature for r in rows], torch.float32, device),
            top_ps=_tensor([r.top_p for r in rows], torch.float32, device),
            top_ks=_tensor([r.top_k for r in rows], torch.int64, device),
            min_ps=_tensor([r.min_p for r in rows], torch.float32, device),
            is_all_greedy=all(r.is_greedy for r in rows),
            need_top_p_k_min_p=any(filtered),
            generators=generators,
            penalties=penalties,
            has_greedy_rows=any(r.is_greedy for r in rows),
            has_min_p=any(r.min_p > 0.0 for r in rows),
            max_top_k=max((r.top_k for r in rows if r.top_k < vocab_size), default=0),
            has_top_p=any(r.top_p < 1.0 for r in rows),
            has_open_top_p=any(r.top_p < 1.0 and r.top_k == vocab_size for r in rows),
            filtered_rows=None if all(filtered) else _tensor(filtered, torch.bool, device),
        )

    @classmethod
    def from_requests(
        cls,
        requests: Sequence[Request],
        device: torch.device | str,
        vocab_size: int,
        rows_per_request: Sequence[int] | None = None,
        draft_ids_per_row: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """Rows for each request in order, ``rows_per_request[i]`` of them (default 1).

        Seeded requests draw from ``request.generator``. ``draft_ids_per_row[r]``:
        draft tokens between the request's output and row ``r`` (its tree
        ancestors), which penalties count as generated; default none.
        """
        counts = list(rows_per_request) if rows_per_request is not None else [1] * len(requests)
        owners = [req for req, n in zip(requests, counts, strict=True) for _ in range(n)]
        params = [req.sampling for req in owners]
        penalties = None
        if any(p.has_penalties for p in params):
            drafts = draft_ids_per_row if draft_ids_per_row is not None else [()] * len(owners)
            penalties = PenaltyState.from_histories(
                params,
                [req.input_ids for req in owners],
                [list(req.output_ids) + list(d) for req, d in zip(owners, drafts, strict=True)],
                device,
                vocab_size,
            )
        return cls.from_params(
            params, device, vocab_size,
            generators=[req.generator for req in owners], penalties=penalties,
        )


@dataclass
class _RowParams:
    """One row's parameters with the disabled and greedy cases made neutral."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    is_greedy: bool

    @classmethod
    def normalize(cls, params: SamplingParams, vocab_size: int) -> _RowParams:
        if params.is_greedy:
            return cls(0.0, 1.0, vocab_size, 0.0, True)
        top_k = vocab_size if params.top_k < 1 else min(params.top_k, vocab_size)
        return cls(params.temperature, min(params.top_p, 1.0), top_k, params.min_p, False)

    def is_filtered(self, vocab_size: int) -> bool:
        return self.top_k < vocab_size or self.top_p < 1.0 or self.min_p > 0.0


def _tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


# ---------------------------------------------------------------- distribution


def processed_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Final target distribution ``[rows, vocab]`` float32, the one ``sample`` draws from."""
    return _probs_from_penalized(apply_penalties(logits, batch.penalties), batch)


def _probs_from_penalized(penalized: Tensor, batch: SamplingBatch) -> Tensor:
    if batch.is_all_greedy:
        return _one_hot_argmax(penalized)
    temperatures = torch.where(batch.temperatures > 0, batch.temperatures, 1.0)  # [rows]
    probs = torch.softmax(penalized / temperatures.unsqueeze(1), dim=-1)  # [rows, vocab]
    if batch.need_top_p_k_min_p:
        probs = _filter_probs(probs, batch)
    if batch.has_greedy_rows:
        is_greedy = (batch.temperatures == 0).unsqueeze(1)  # [rows, 1]
        probs = torch.where(is_greedy, _one_hot_argmax(penalized), probs)
    return probs


def _one_hot_argmax(logits: Tensor) -> Tensor:
    """``[rows, vocab]`` float32 with a 1 at each row's argmax."""
    one_hot = torch.zeros_like(logits, dtype=torch.float32)
    return one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _filter_probs(probs: Tensor, batch: SamplingBatch) -> Tensor:
    """Zero, in place, the tokens top-k/top-p/min-p drop; renormalize the rows they touch."""
    threshold = probs.new_zeros(probs.shape[0], 1)  # [rows, 1]
    if batch.has_min_p:
        threshold = batch.min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    if batch.max_top_k != 0 or batch.has_top_p:
        threshold = torch.maximum(threshold, _top_k_top_p_threshold(probs, batch))
    probs.masked_fill_(probs < threshold, 0.0)
    totals = probs.sum(dim=-1, keepdim=True)  # [rows, 1]
    if batch.filtered_rows is not None:  # x / 1.0 keeps unfiltered rows bit for bit
        totals = torch.where(batch.filtered_rows.unsqueeze(1), totals, 1.0)
    return probs.div_(totals)


def _top_k_top_p_threshold(probs: Tensor, batch: SamplingBatch) -> Tensor:
    """Smallest probability top-k then top-p keep, per row ``[rows, 1]`` (0: keep all).

    Ranks only the largest candidates when that is provably enough, widening
    (at last to a full sort) while some open nucleus reaches past them.
    """
    vocab_size = probs.shape[1]
    for width in _candidate_widths(batch, vocab_size, probs.is_cpu):
        if width < vocab_size:
            ranked = probs.topk(width, dim=-1).values  # [rows, width], descending
        else:
            ranked = probs.sort(dim=-1, descending=True).values  # [rows, vocab]
        threshold, overflow = _threshold_from_ranked(probs, ranked, batch)
        if width == vocab_size or not bool(overflow.any()):  # host read: free on CPU
            return threshold
    raise AssertionError("unreachable: the last width ranks the whole vocabulary")


def _candidate_widths(batch: SamplingBatch, vocab_size: int, is_cpu: bool) -> list[int]:
    """Increasing candidate counts to try; the last one always suffices."""
    if batch.max_top_k is None:
        return [vocab_size]
    if not batch.has_open_top_p:
        return [batch.max_top_k]
    if not is_cpu:
        return [vocab_size]  # checking whether candidates suffice would sync the device
    widths = {min(vocab_size, max(batch.max_top_k, w)) for w in TOP_P_CANDIDATE_WIDTHS}
    return sorted(widths | {vocab_size})


def _threshold_from_ranked(
    probs: Tensor, ranked: Tensor, batch: SamplingBatch
) -> tuple[Tensor, Tensor]:
    """Thresholds from the ``width`` largest probabilities of each row, descending.

    Returns ``(threshold [rows, 1], overflow [rows])``; ``overflow`` marks open
    top-p rows whose nucleus may reach past the candidates (their threshold is
    then wrong and the caller must rank more).
    """
    vocab_size, width = probs.shape[1], ranked.shape[1]
    top_ks = batch.top_ks.unsqueeze(1)  # [rows, 1]
    kth_value = ranked.gather(1, top_ks.clamp(max=width) - 1)  # [rows, 1]
    top_k_threshold = torch.where(top_ks >= vocab_size, 0.0, kth_value)  # [rows, 1]
    if not batch.has_top_p:
        return top_k_threshold, torch.zeros_like(top_ks.squeeze(1), dtype=torch.bool)
    top_ps = batch.top_ps.unsqueeze(1)  # [rows, 1]
    nucleus_mass = top_ps * _top_k_mass(probs, top_k_threshold, batch)  # [rows, 1]
    ranked_top_k = torch.where(ranked >= top_k_threshold, ranked, 0.0)  # [rows, width]
    cumulative = ranked_top_k.cumsum(dim=-1)  # [rows, width]
    num_kept = 1 + (cumulative[:, :-1] < nucleus_mass).sum(dim=-1, keepdim=True)  # [rows, 1]
    top_p_threshold = torch.where(top_ps >= 1.0, 0.0, ranked.gather(1, num_kept - 1))
    is_open = (top_ps < 1.0) & (top_ks >= vocab_size)  # [rows, 1]
    overflow = (is_open & (cumulative[:, -1:] < nucleus_mass)).squeeze(1)  # [rows]
    return torch.maximum(top_k_threshold, top_p_threshold), overflow


def _top_k_mass(probs: Tensor, top_k_threshold: Tensor, batch: SamplingBatch) -> Tensor:
    """Mass of each row's top-k set ``[rows, 1]``, ties at the k-th value included."""
    if batch.max_top_k == 0:
        return probs.sum(dim=-1, keepdim=True)
    return torch.where(probs >= top_k_threshold, probs, 0.0).sum(dim=-1, keepdim=True)


# ---------------------------------------------------------------- sampling


def argmax_rows(values: Tensor) -> Tensor:
    """``values.argmax(dim=-1)`` of a 2-D tensor, ``[rows]`` int64: the first maximum of each
    row, a NaN counting as the largest. On CPU through numpy, whose argmax is ~10x faster than
    torch's reduction over vocabulary-wide rows."""
    if values.device.type != "cpu" or values.dim() != 2 or values.requires_grad:
        return values.argmax(dim=-1)
    array = (values if values.dtype == torch.float32 else values.float()).numpy()
    return torch.from_numpy(array.argmax(axis=-1).astype("int64", copy=False))


def is_plain_greedy(requests: Iterable[Request]) -> bool:
    """Every request greedy without penalties: its token is its logits' argmax (``sample`` gives
    the same), so no ``SamplingBatch`` is needed (building one costs ~40 us a decode step)."""
    return all(req.sampling.is_greedy and not req.sampling.has_penalties for req in requests)


def sample_requests(logits: Tensor, vocab_size: int, requests: Sequence[Request],
                    rows_per_request: Sequence[int] | None = None,
                    draft_ids_per_row: Sequence[Sequence[int]] | None = None) -> Tensor:
    """``sample`` over ``SamplingBatch.from_requests`` of these arguments; plain-greedy requests
    (``is_plain_greedy``) take the logits' argmax without building the batch: the same tokens."""
    if is_plain_greedy(requests):
        return argmax_rows(logits)
    return sample(logits, SamplingBatch.from_requests(requests, logits.device, vocab_size, rows_per_request,
                                                      draft_ids_per_row))


def sample(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Next tokens ``[rows]`` int64: greedy rows argmax, others a draw from ``processed_probs``."""
    penalized = apply_penalties(logits, batch.penalties)  # [rows, vocab]
    if batch.is_all_greedy:
        return argmax_rows(penalized)
    probs = _probs_from_penalized(penalized, batch)  # greedy rows are one-hot
    return _draw(probs, _uniforms(batch.generators, probs.device))


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> Tensor:
    """Two float64 uniforms in [0, 1) per row ``[rows, 2]``; seeded rows from their generator."""
    uniforms = torch.rand(len(generators), 2, dtype=torch.float64, device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row] = torch.rand(2, dtype=torch.float64, device=device, generator=generator)
    return uniforms.clamp_(max=_MAX_UNIFORM)


def _draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Token ``i`` of each row with probability ``probs[i] / sum`` ``[rows]`` int64.

    Inverse CDF in two levels: a block of ``DRAW_BLOCK`` tokens by its mass,
    then a token inside it; exact up to float32 block sums, and cheaper than
    a float64 CDF over the whole vocabulary.
    """
    num_rows, vocab_size = probs.shape
    num_blocks = -(-vocab_size // DRAW_BLOCK)
    if num_blocks * DRAW_BLOCK != vocab_size:
        probs = torch.nn.functional.pad(probs, (0, num_blocks * DRAW_BLOCK - vocab_size))
    blocks = probs.reshape(num_rows, num_blocks, DRAW_BLOCK)  # [rows, blocks, block]
    block_ids = _inverse_cdf(blocks.sum(dim=-1), uniforms[:, :1])  # [rows]
    row_ids = torch.arange(num_rows, device=probs.device)
    offsets = _inverse_cdf(blocks[row_ids, block_ids], uniforms[:, 1:])  # [rows]
    return block_ids * DRAW_BLOCK + offsets


def _inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """Index ``i`` with probability ``weights[i] / sum`` per row ``[rows]``.

    ``weights`` [rows, n] >= 0, ``uniforms`` [rows, 1] in [0, 1). A zero
    weight adds no width to the float64 CDF, so it is never drawn.
    """
    cdf = weights.double().cumsum(dim=-1)  # [rows, n]
    target = uniforms * cdf[:, -1:]  # [rows, 1], strictly below the total
    index = torch.searchsorted(cdf, target, right=True)  # first index with cdf > target
    return index.squeeze(1).clamp_(max=weights.shape[1] - 1)


# ---------------------------------------------------------------- logprobs


def compute_logprobs(
    logits: Tensor, token_ids: Tensor, top_n: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Raw (pre-penalty, pre-temperature) logprobs, as OpenAI reports them.

    Returns the chosen tokens' logprobs ``[rows]``, the top-n token ids
    ``[rows, top_n]`` int64 and their logprobs ``[rows, top_n]``.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)  # [rows]
    if top_n <= 0:
        empty = logprobs.new_empty(logprobs.shape[0], 0)
        return chosen, empty.long(), empty
    top_logprobs, top_ids = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1)
    return chosen, top_ids, top_logprobs
