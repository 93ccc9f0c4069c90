"""A working-set term's bytes and its printed formula come from the same factors."""

from featherweight.memory.terms import Factor, Term, number


def test_a_terms_bytes_and_formula_come_from_its_factors():
    layer = Term.of(Factor("one layer's linear weights", 218103808), Factor("itemsize", 2))
    weights = layer.times(1.05)
    assert weights.bytes == round(1.05 * (218103808 * 2))  # the count times the exact size
    assert weights.formula == (
        "1.05 x one layer's linear weights x itemsize = 1.05 x 218103808 x 2"
    )
    both = Term.sum(weights, Term.of(number(4), Factor("B", 2)))
    assert both.bytes == weights.bytes + 8
    assert both.formula.endswith("= 1.05 x 218103808 x 2 + 4 x 2")


def test_a_term_that_does_not_apply_has_no_bytes_and_no_products():
    term = Term.of(Factor("B", 2), Factor("S", 64)).when(False)
    assert term.bytes == 0 and term.products == () and term.times(3.0).bytes == 0
    assert Term.sum(term, Term.of(Factor("D", 8))).formula == "D = 8"
