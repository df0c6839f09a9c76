"""The eviction step: each layer's plan, the prefill step (observe, score, budget, select, cache layer),
selections deferred until every layer's prefill, and eviction while decoding."""
