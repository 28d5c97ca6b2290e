"""``ctxc bake``: one reusable patch per context, fitted or distilled over sampled queries."""
