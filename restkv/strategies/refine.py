"""Set-level refinement of a kept set, a strategy for any scorer (``refine_rounds``).

After the top-B of any scorer (and any per-head budgets or ranking strategy), each head swaps kept and
evicted prefix entries for ``refine_rounds`` rounds so that the window queries' mean layer attention-output
error falls: ReST-KV's objective (ICLR 2026, Def. 3.1; https://github.com/an-yongqi/rest-kv), measured
exactly (``output_error``), for the set as a whole instead of per entry. Every head keeps its count
(uniform, AdaKV, HeadKV; one set per query head with ``gqa_agg="none"``) and the window; every accepted
step lowers the measured error, so the refined set's is never above the scorer's set's. Candidates are the
entries a head holds (never padding). With merging (``merge``) the refined set is merged as any other: the
error lowered is the unmerged set's.

Shapes: ``b`` batch, ``Hq`` query heads, ``H`` the heads that keep a set (``g = Hq // H`` each), ``r``
observed queries, ``N`` keys, ``P`` the evictable prefix, ``d`` head dim, ``D`` hidden size.

Cost per layer and config, with R = ``refine_pool``: once O(b H g^2 P d^2) (``layer_terms``, shared by every
config of a layer in sweep mode); per round O(b H g^2 r P d) (the exact error of every single change, which
picks the pools) plus O(b H g^2 r R^2) (every swap of the pools) and log2(R) + 2 trial applications of
O(b Hq r R d + b r Hq d D); one ``output_change`` (O(b Hq r N d)) at the start and the end. No host read:
every round runs (a round that finds no improving swap changes nothing). With
``refine_candidates="boundary"`` the pools are the kept entries ranked lowest and the evicted ranked highest
by the ranking key (the top-B boundary), and only their terms are computed: no O(b H g^2 P d^2) or
O(b H g^2 r P d) term, per round O(b H g^2 r R d + b H g^2 R d^2) for the pools' terms.
``M_ac = W_O^a^T W_O^c`` (O(H g^2 D d^2), H g^2 d^2 float32 numbers) is computed once per layer weight and
kept with it (``restkv.eviction.observation``); ``o_proj`` is read as stored and converted to float32 for
one product at a time (D Hq d numbers held while it runs, never through the search). Memory: the window
attention, one such copy and blocks of per-entry terms of at most 1/16 of the layer's K+V each
(``output_error.TERMS_SHARE``), under 4x the layer's K+V at 8K (``tests/core/test_cost_refine.py``).
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import F, torch
from ..methods import REGISTRY
from ..scoring.observe import group_view
from ..scoring.output_error import (
    group_terms,
    layer_terms,
    output_change,
    single_errors_blocked,
    state_products,
    swap_errors_at,
)

POOL = 32
KNOBS = (
    Knob(
        "refine_rounds",
        0,
        "set-level refinement after the top-B: rounds of swaps of kept and evicted entries "
        "that lower the window queries' layer attention-output error (ReST-KV's objective); 0: off",
        rule=">= 0",
        stage="select",
    ),
    Knob(
        "refine_pool",
        POOL,
        "refinement: kept and evicted candidates per head and round (also the most swaps "
        "a head makes in one round)",
        rule=">= 1",
        stage="select",
    ),
    Knob(
        "refine_candidates",
        "effect",
        "refinement's candidate pools: effect (the entries whose change of side alone lowers the "
        "error most, exact over the whole prefix) or boundary (the kept entries ranked lowest and the "
        "evicted ranked highest: the top-B boundary; the error terms of those entries only)",
        choices=("effect", "boundary"),
        stage="select",
    ),
)


def check(values: dict) -> None:
    if not values.get("refine_rounds") and values.get("refine_pool", POOL) != POOL:
        raise ValueError("refine_pool is read only when refine_rounds > 0")
    if not values.get("refine_rounds") and values.get("refine_candidates", "effect") != "effect":
        raise ValueError("refine_candidates is read only when refine_rounds > 0")
    if values.get("refine_rounds"):
        if values.get("layer_budget") == "global" or REGISTRY[values["method"]].replays:
            raise ValueError(
                f"refine_rounds: set-level refinement works within a layer's budget; it is not "
                f"supported with {values['method']}'s selection across layers (layer_budget='global' "
                f"or passes after the prefill)"
            )


def refined(obs, cfg, key: "torch.Tensor", keep) -> "torch.Tensor":
    """The ranking key [b, H, P] whose top ``keep`` (an int, or [b, H]) is the refined set: 1 on it, else 0.

    ``key`` is the scorer's ranking [b, H, P] (-inf on padding and on entries a head does not hold); its top
    ``keep`` is the starting set. H is the KV heads, or the query heads with ``gqa_agg="none"``.
    """
    heads = key.shape[1]
    P = obs.prefix_len

    def per_head(x):  # [b, Hkv or 1, ...] -> [b, H, ...]
        return x if x.shape[1] in (1, heads) else x.repeat_interleave(heads // x.shape[1], 1)

    values = per_head(obs.values)
    boundary = cfg.refine_candidates == "boundary"
    terms = group_terms if boundary else layer_terms
    w_o = obs.o_proj  # as stored: each product converts it to float32 while it runs
    gram = None
    if obs.wo_gram is not None:  # M_ac, a constant of the layer's weight
        gram = obs.shared(f"wo_gram_{heads}", lambda: obs.wo_gram(heads))
    layer = obs.shared(f"refine_{terms.__name__}_{heads}", lambda: terms(values, w_o, P, gram))
    keep, _, _ = swap_search(
        obs.window_attention,
        values,
        top_set(key, keep),
        key,
        w_o,
        cfg.refine_rounds,
        cfg.refine_pool,
        cfg.refine_pool,
        pool_by="score" if boundary else "effect",
        layer=layer,
        allowed=per_head(obs.entry_valid[..., :P]),
        stop=False,
    )
    return keep.float()


def top_set(scores: "torch.Tensor", count) -> "torch.Tensor":
    """Scores [b, H, P] -> mask [b, H, P] of each head's ``count`` highest (an int, or [b, H] per head)."""
    if isinstance(count, int):
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(
            -1, scores.topk(count, dim=-1).indices, True
        )
    order = scores.argsort(-1, descending=True)
    P = scores.shape[-1]
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(P, device=order.device).expand_as(order)
    )
    return rank < count[..., None]


def _marked(keep, idx, use):
    """Mask like ``keep`` of the entries ``idx`` [b, H, m] where ``use`` (an index may repeat where not used)."""
    return (
        torch.zeros(keep.shape, dtype=torch.int32, device=keep.device).scatter_add_(
            -1, idx, use.int()
        )
        > 0
    )


def _disjoint_best(gain, m: int) -> tuple:
    """Per head, up to ``m`` swaps of the largest gain sharing no entry: (i, j [b, H, m], gain [b, H, m])."""
    gain = gain.clone()
    rows = []
    cols = []
    gains = []
    n_add = gain.shape[-1]
    for _ in range(min(m, *gain.shape[-2:])):
        best, flat = gain.flatten(-2).max(-1)
        i = flat // n_add
        j = flat % n_add
        rows.append(i), cols.append(j), gains.append(best)
        gain.masked_fill_(F.one_hot(i, gain.shape[-2]).bool()[..., None], float("-inf"))
        gain.masked_fill_(F.one_hot(j, n_add).bool()[..., None, :], float("-inf"))
    return torch.stack(rows, -1), torch.stack(cols, -1), torch.stack(gains, -1)


def _swapped(attention, values, o_proj_weight, state, removed, added, use):
    """The state (delta, o^S, z) after evicting ``removed`` and keeping ``added`` ([b, H, m] prefix indices,
    where ``use``), from the changed entries only: ``u - u' = ((s_out - m_out u) - (s_in - m_in u)) / z'``
    with m the attention mass and s the attention-weighted values of each side."""
    delta, o_kept, z = state
    b, hq, r, _ = attention.shape
    hkv = values.shape[1]
    d = values.shape[-1]
    u = group_view(o_kept, hkv)
    z_old = group_view(z, hkv)

    def side(idx):
        a = group_view(attention, hkv).gather(
            -1, idx[:, :, None, None].expand(-1, -1, hq // hkv, r, -1)
        )
        a = a * use[:, :, None, None]
        v = values.gather(2, idx[..., None].expand(-1, -1, -1, d)).float()
        mass = a.sum(-1, keepdim=True)
        return mass, torch.einsum("bkgqm,bkmd->bkgqd", a, v) - mass * u

    (m_out, s_out), (m_in, s_in) = side(removed), side(added)
    z_new = z_old - m_out[..., 0] + m_in[..., 0]
    change = ((s_out - s_in) / z_new[..., None]).flatten(1, 2)  # u - u' [b, Hq, r, d]
    delta = delta + change.transpose(1, 2).reshape(b, r, -1) @ o_proj_weight.float().T
    return delta, o_kept - change, z_new.flatten(1, 2)


def swap_search(
    attention,
    values,
    keep,
    scores,
    o_proj_weight,
    rounds: int = 64,
    pool: int = 32,
    batch: int = 32,
    pool_by: str = "effect",
    layer: tuple | None = None,
    allowed=None,
    stop: bool = True,
) -> tuple:
    """Lower the mean layer-output error of the observed queries by swapping kept and evicted entries.

    Each round takes per head a pool of ``pool`` kept and ``pool`` evicted entries, computes every single
    swap's exact error (``swap_errors``), picks per head up to ``m`` improving swaps that share no entry and
    applies them together in every head; the result is kept only if the measured error falls, else with
    m/2, m/4, ... swaps per head, then the best single swap of the best head. ``m`` (per sample) starts at
    ``batch`` and is twice the last accepted count after. It runs ``rounds`` rounds; with ``stop`` it ends
    early when no swap of the pools improves (one host read per round). Every head keeps its count; every
    accepted step lowers the measured error (measured from the changed entries; the returned error is
    measured afresh).

    Pools (``pool_by``): ``effect``, the entries whose side change alone lowers the error most or raises it
    least (``single_errors``, exact); ``score``, the kept entries of lowest ``scores`` and evicted of highest.

    Parameters
    ----------
    attention, values, o_proj_weight : as ``output_error.output_change``
    keep : [b, H, P] bool, the starting set (heads may keep different counts)
    scores : [b, H, P] ranking the candidate pools with ``pool_by="score"``
    layer : ``layer_terms(values, o_proj_weight, P)``, computed when not given (it serves every budget)
    allowed : [b, 1 or H, P] bool, the entries that may be kept (None: all)

    Returns
    -------
    (keep [b, H, P], error per query [b, r], swaps applied [b])
    """
    if pool_by not in ("effect", "score"):
        raise ValueError(f"pool_by must be effect or score, got {pool_by!r}")
    b, hkv, P = keep.shape
    n = min(pool, P)
    if rounds and layer is None:
        layer = layer_terms(values, o_proj_weight, P)
    delta, o_kept, z = output_change(attention, values, keep, o_proj_weight)
    swaps = torch.zeros(b, dtype=torch.long, device=keep.device)
    m = torch.full((b,), batch, dtype=torch.long, device=keep.device)
    ladder = sorted({max(1, batch >> s) for s in range(batch.bit_length())}, reverse=True)
    for _ in range(rounds):
        error = delta.norm(dim=-1).mean(-1)  # [b]
        state = (delta, o_kept, z)
        products = state_products(layer, *state)  # shared by the pools and the swaps
        rank = (
            single_errors_blocked(attention, layer, state, keep, products)
            if pool_by == "effect"
            else None
        )
        addable = ~keep if allowed is None else ~keep & allowed
        out_rank, in_rank = (scores, -scores) if rank is None else (rank, rank)  # lowest first
        removals = out_rank.masked_fill(~keep, float("inf")).topk(n, largest=False).indices
        additions = in_rank.masked_fill(~addable, float("inf")).topk(n, largest=False).indices
        eligible = (
            keep.gather(-1, removals)[..., :, None] & addable.gather(-1, additions)[..., None, :]
        )
        gain = error[:, None, None, None] - swap_errors_at(
            attention, layer, state, removals, additions, products
        )
        i, j, best = _disjoint_best(gain.masked_fill(~eligible, float("-inf")), batch)
        ok = best > 1e-6 * error[:, None, None]
        if stop and not bool(ok.any()):
            break
        head = F.one_hot(best[..., 0].argmax(-1), hkv).bool()[
            ..., None
        ]  # the best single swap's head
        trials = [(k, ok[..., :k] & (k <= m)[:, None, None]) for k in ladder] + [
            (1, ok[..., :1] & head)
        ]
        accepted = torch.zeros(b, dtype=torch.bool, device=keep.device)
        for k, use in trials:
            removed = removals.gather(-1, i[..., :k])
            added = additions.gather(-1, j[..., :k])
            trial = _swapped(
                attention, values, o_proj_weight, (delta, o_kept, z), removed, added, use
            )
            take = ~accepted & (trial[0].norm(dim=-1).mean(-1) < error)
            out = keep & ~_marked(keep, removed, use)
            out |= _marked(keep, added, use)
            keep = torch.where(take[:, None, None], out, keep)
            delta, o_kept, z = (
                torch.where(take.view(-1, *[1] * (x.dim() - 1)), t, x)
                for t, x in zip(trial, (delta, o_kept, z))
            )
            swaps += take * use.sum((1, 2))
            m = torch.where(take, min(batch, 2 * k), m)
            accepted |= take
        if stop and not bool(accepted.any()):
            break
    if rounds:  # the changes were applied one by one: the returned error is measured afresh
        delta = output_change(attention, values, keep, o_proj_weight)[0]
    return keep, delta.norm(dim=-1), swaps


def applies(cfg) -> bool:
    return bool(cfg.get("refine_rounds"))


def rank(obs, cfg, scores: "torch.Tensor", key: "torch.Tensor", keep) -> "torch.Tensor":
    """The selection hook: a key [b, H, P] whose top ``keep`` is the top of ``key`` refined as a set."""
    return refined(obs, cfg, key, keep)
