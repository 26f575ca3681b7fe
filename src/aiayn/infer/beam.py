"""Beam search (§6.1) with n-best lists: B sentences at once, each with up to `beam`
hypotheses, one decoder step per token on cached keys and values (decode.py's helpers, shared
with greedy search and sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aiayn.infer.decode import (
    Hypothesis,
    ban_pad_and_bos,
    eval_mode,
    greedy_search,
    length_penalty,
    log_probs,
    max_lengths,
    min_lengths,
    new_state,
    no_early_eos,
)
from aiayn.model import DecoderState, Seq2SeqTransformer


def beam_search(
    model: Seq2SeqTransformer,
    src: torch.Tensor,
    *,
    beam: int = 4,
    alpha: float = 0.6,
    max_len_b: int = 50,
    min_len: int = 0,
    bos_id: int,
    eos_id: int,
    pad_id: int,
) -> list[list[int]]:
    """The best hypothesis of each sentence by beam_search_n_best (see there)."""
    special = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    lengths = dict(max_len_b=max_len_b, min_len=min_len)
    if beam == 1:
        return greedy_search(model, src, **lengths, **special)
    hyps = beam_search_n_best(model, src, beam=beam, alpha=alpha, **lengths, **special)
    return [h[0].ids for h in hyps]


def beam_search_n_best(
    model: Seq2SeqTransformer,
    src: torch.Tensor,
    *,
    beam: int = 4,
    alpha: float = 0.6,
    max_len_b: int = 50,
    min_len: int = 0,
    n_best: int = 1,
    bos_id: int,
    eos_id: int,
    pad_id: int,
) -> list[list[Hypothesis]]:
    """Beam search over B sentences at once (up to B * beam decoder rows), §6.1, eos not
    before min_len tokens (but for an empty source, and at the length limit, where eos is
    forced).

    Hypotheses are ranked by log P(Y | X) / lp(Y). A hypothesis that ends in eos is finished.
    A sentence stops when no live hypothesis can still beat its n_best-th finished one (a live
    score can at best be divided by lp at the length limit, since log-probabilities only add
    negative terms), or at its length limit, where eos is forced. Stopping once `beam`
    hypotheses have finished (fairseq's rule) is not enough: a confident model puts improbable
    eos continuations of its weaker beams among the top candidates, and the search would end
    before the best hypothesis finishes. beam=1 is greedy search.

    The first step decodes one row per sentence (bos), later ones `beam` rows per sentence,
    consecutive (row b * beam + k is hypothesis k of sentence b); they share the sentence's
    cross-attention keys and values. A sentence that stops leaves the batch.

    Returns each sentence's n_best (<= beam) finished hypotheses, best first: the search keeps
    `beam` of them, so a longer list would need a wider beam (decode.n_best's check).
    """
    if not 1 <= n_best <= beam:
        raise ValueError(f"n_best {n_best} must be 1..beam ({beam}): widen the beam")
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(src.size(0))]
    with eval_mode(model):
        beams = _start_beams(model, src, max_len_b, min_len, pad_id, bos_id)
        for step in range(int(beams.limits.max()) + 1):
            logits = model.decode(beams.last, beams.memory, beams.src_mask, beams.state)[:, -1]
            at_limit = step >= beams.limits  # (n,)
            logp = log_probs(model, logits)  # (n * W, V)
            logp = _step_logp(logp, step, beams, at_limit, min_len, pad_id, bos_id, eos_id)
            # 2K candidates: even if K of them end in eos, K live ones remain.
            vals, origin, tok = _top_candidates(beams.scores, logp, 2 * beam)
            _finish(finished, beams, vals, origin, tok, step, alpha, eos_id, n_best)
            if not _advance(beams, vals, origin, tok, at_limit, alpha, eos_id):
                break
    return [[Hypothesis(*h) for h in hyps[:n_best]] for hyps in finished]


@dataclass
class _Beams:
    """What beam search carries from one step to the next for the B' sentences still searched,
    W hypotheses each (W = 1 at the first step, then the beam): row b * W + k of the
    (B' * W, ...) tensors is hypothesis k of sentence b."""

    live: list[int]  # the sentence (in src) of each of the (B', ...) rows
    memory: torch.Tensor  # (B', S, D) encoder output
    src_mask: torch.Tensor  # (B', 1, 1, S)
    limits: torch.Tensor  # (B',) most output tokens
    minimums: torch.Tensor  # (B',) fewest output tokens before eos
    state: DecoderState
    last: torch.Tensor  # (B' * W, 1) each hypothesis's newest token
    history: torch.Tensor  # (B' * W, t) tokens of each hypothesis
    scores: torch.Tensor  # (B', W) log P so far
    # (B',) score of each sentence's n_best-th finished hypothesis (its best with n_best 1;
    # -inf while fewer have finished), float64 like the Python floats that rank them
    best: torch.Tensor

    def select(self, keep: torch.Tensor) -> None:
        """Only the sentences of rows `keep` (B'',) go on: the others have stopped. Their
        hypotheses (last, history, scores) are the caller's to select."""
        self.live = [self.live[i] for i in keep.tolist()]
        self.limits, self.minimums = self.limits[keep], self.minimums[keep]
        self.best = self.best[keep]
        self.memory, self.src_mask = self.memory[keep], self.src_mask[keep]
        self.state.select_sources(keep)


def _start_beams(
    model, src: torch.Tensor, max_len_b: int, min_len: int, pad_id: int, bos_id: int
) -> _Beams:
    """The search before its first step: one hypothesis (bos) per sentence of src (B, S)."""
    memory, src_mask = model.encode(src)  # (B, S, D), (B, 1, 1, S)
    return _Beams(
        live=list(range(src.size(0))),
        memory=memory,
        src_mask=src_mask,
        limits=max_lengths(model, src, pad_id, max_len_b),
        minimums=min_lengths(src, pad_id, min_len),
        state=new_state(model),
        last=src.new_full((src.size(0), 1), bos_id),
        history=src.new_zeros((src.size(0), 0)),
        scores=torch.zeros(src.size(0), 1, device=src.device),
        best=torch.full((src.size(0),), float("-inf"), dtype=torch.float64, device=src.device),
    )


def _top_candidates(scores: torch.Tensor, logp: torch.Tensor, k: int):
    """The k best continuations of each sentence's W hypotheses (scores (n, W) log P so far,
    logp (n * W, V) the step's): (n, k) their log P, the hypothesis each extends (0..W-1) and
    the token it appends."""
    n, W = scores.shape
    V = logp.size(-1)
    cand = (scores.view(-1, 1) + logp).view(n, W * V)  # (n, W * V)
    vals, idx = cand.topk(k, dim=1)  # (n, k)
    return vals, idx // V, idx % V


def _advance(beams: _Beams, vals, origin, tok, at_limit, alpha: float, eos_id: int) -> bool:
    """The next step's hypotheses: the K best of the 2K candidates (vals, origin, tok: (n, 2K))
    that do not end in eos, in a stable order by score. A sentence stops at its limit, or
    when no live hypothesis can still beat its n_best-th finished one, and leaves the batch.
    False where every sentence has stopped."""
    n, K, W = vals.size(0), vals.size(1) // 2, beams.scores.size(1)
    rank = torch.arange(2 * K, device=vals.device).expand(n, -1)
    order = torch.where(tok == eos_id, rank + 2 * K, rank).argsort(dim=1)[:, :K]
    scores = vals.gather(1, order)  # (n, K)
    best_live = scores[:, 0] / length_penalty(beams.limits + 1, alpha)  # (n,) upper bound
    done = at_limit | (torch.isfinite(beams.best) & (beams.best >= best_live))  # (n,)
    rows = origin.gather(1, order) + W * torch.arange(n, device=vals.device)[:, None]
    last = tok.gather(1, order)  # (n, K)
    if bool(done.any()):  # the sentences that stop leave the batch
        keep = (~done).nonzero()[:, 0]  # (n',)
        if keep.numel() == 0:
            return False
        beams.select(keep)
        rows, last, scores = rows[keep], last[keep], scores[keep]
    rows = rows.view(-1)  # (n' * K,) parent row of each new hypothesis
    beams.scores, beams.last = scores, last.view(-1, 1)  # (n', K), (n' * K, 1)
    beams.history = torch.cat([beams.history[rows], beams.last], dim=1)  # (n' * K, t + 1)
    beams.state.reorder(rows)
    return True


def _step_logp(logp, step, beams: _Beams, at_limit, min_len, pad_id, bos_id, eos_id):
    """A beam step's log-probabilities (n * W, V) of its W rows per sentence: pad and bos
    banned, eos held back before min_len tokens, and only eos where a sentence is at its
    length limit."""
    W = beams.scores.size(1)
    logp = ban_pad_and_bos(logp, pad_id, bos_id, eos_id)
    if step < min_len:
        logp = no_early_eos(logp, step, beams.minimums.repeat_interleave(W), eos_id)
    if bool(at_limit.any()):
        rows_at_limit = at_limit.repeat_interleave(W)  # (n * W,)
        logp[rows_at_limit] = _only_eos(logp[rows_at_limit], eos_id)
    return logp


def _only_eos(logp: torch.Tensor, eos_id: int) -> torch.Tensor:
    """At the length limit a hypothesis can only end: every token but eos is impossible."""
    forced = torch.full_like(logp, float("-inf"))
    forced[:, eos_id] = logp[:, eos_id]
    return forced


def _finish(finished, beams: _Beams, vals, origin, tok, step, alpha, eos_id, n_best) -> None:
    """Record the hypotheses ending in eos among the top K candidates, keeping each sentence's
    K best in finished[beams.live[b]] and the score of its n_best-th in beams.best[b] once it
    has that many."""
    K = vals.size(1) // 2
    ends = (tok[:, :K] == eos_id) & torch.isfinite(vals[:, :K])  # (n, K)
    if not bool(ends.any()):
        return
    W = beams.scores.size(1)  # hypotheses per sentence
    lp = length_penalty(step + 1, alpha)  # step + 1 tokens, eos included
    for b, j in ends.nonzero().tolist():
        ids = beams.history[b * W + int(origin[b, j])].tolist()
        hyps = finished[beams.live[b]]
        hyps.append((float(vals[b, j]) / lp, ids))
        hyps.sort(key=lambda hyp: hyp[0], reverse=True)
        del hyps[K:]
        if len(hyps) >= n_best:
            beams.best[b] = hyps[n_best - 1][0]
