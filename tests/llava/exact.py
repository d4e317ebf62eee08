"""The one bound every LLaVA parity suite holds a packed (or pack=False) run to against LLaVA's own batched run:
token_mult_prob_error (exp of the mean |dlogp| over every token with a loss, 1.0 = identical) within fp32 rounding
on the CPU, and the worst relative error over every parameter gradient (TP shards gathered), all of them compared."""

EXACT = 1.000001  # token_mult_prob_error: exp(mean |dlogp|), 1.0 = identical (fp32 on CPU)
GRAD = 1e-5


def assert_equals_batched(run: dict, params: int, *, min_tokens: int = 10) -> None:
    """`run` (a worker's result for one case) matches the batched run: at least `min_tokens` tokens compared,
    every one of the model's `params` parameters' gradients checked, none missing."""
    assert 1.0 <= run["token_mult_prob_error"] <= EXACT and run["tokens_compared"] >= min_tokens, run
    assert run["max_rel_grad_err"] < GRAD, run
    assert run["params_missing"] == [] and run["params_checked"] == params, run
