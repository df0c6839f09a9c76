"""Find the largest haystack that fits a token budget."""


def largest_fitting(fits, guess=1, minimum=1, maximum=None):
    """Largest integer ``n`` in ``[minimum, maximum]`` with ``fits(n)`` true.

    Gallops from ``guess`` then bisects, so a guess close to the answer (the
    previous sample's size) costs few calls. ``fits`` should be monotone
    (true, then false); where it is not, the result still satisfies ``fits``.

    Parameters
    ----------
    fits : callable
        ``fits(n) -> bool``.
    guess : int
        Starting point.
    minimum, maximum : int, optional
        Bounds of the search; ``maximum=None`` means unbounded.

    Returns
    -------
    int

    Raises
    ------
    ValueError
        If ``fits(minimum)`` is false.
    """
    memo = {}

    def ok(n):
        if n not in memo:
            memo[n] = fits(n)
        return memo[n]

    top = float("inf") if maximum is None else maximum
    n = min(max(guess, minimum), top)
    step = max(1, n // 32)
    if ok(n):
        lo = n
        hi = None
        while hi is None and lo < top:
            nxt = min(lo + step, top)
            if ok(nxt):
                lo, step = nxt, step * 2
            else:
                hi = nxt
        if hi is None:
            return lo
    else:
        hi = n
        lo = None
        while lo is None:
            prv = max(hi - step, minimum)
            if ok(prv):
                lo = prv
            elif prv == minimum:
                raise ValueError(f"even the smallest size ({minimum}) does not fit")
            else:
                hi, step = prv, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
