import pytest

from kvlab.core.budgets import Budget, BudgetError, exact_bytes, parse_budgets


def test_parse_fraction_and_tokens():
    assert Budget.parse("0.25").fraction == 0.25
    assert Budget.parse("512t").tokens == 512
    assert [b.label for b in parse_budgets("0.5, 0.25,128t")] == ["0.5", "0.25", "128t"]
    assert Budget.parse("1").is_full


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.1", "abc", "0t", "12x", ""])
def test_bad_budgets_say_what_is_allowed(bad):
    with pytest.raises(BudgetError, match="allowed"):
        Budget.parse(bad)


def test_token_budget_as_fraction():
    assert Budget.parse("100t").fraction_of(400) == 0.25
    assert Budget.parse("1000t").fraction_of(400) == 1.0


def test_exact_bytes_formula(lm):
    info = lm.info
    assert (info.n_layers, info.n_kv_heads, info.head_dim) == (30, 3, 64)
    # layers x KV heads x tokens x head_dim x 2 (K and V) x 2 bytes: the 16-bit cache dtype
    assert info.cache_dtype == "float16" and info.dtype == "float32"
    assert exact_bytes(info, 100) == 30 * 3 * 100 * 64 * 2 * 2
    assert exact_bytes(info.with_cache_dtype("float32"), 100) == 30 * 3 * 100 * 64 * 2 * 4
    assert exact_bytes(info.with_cache_dtype("bfloat16"), 100) == exact_bytes(info, 100)
