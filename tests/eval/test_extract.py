from __future__ import annotations

import pytest

from m3serve.eval.extract import flexible_extract, is_correct, normalize, reference_answer, strict_extract

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def test_reference_answer() -> None:
    assert reference_answer(GSM8K_ANSWER) == "72"
    assert reference_answer("so\n#### 1,234") == "1234"
    assert reference_answer("#### -5") == "-5"
    with pytest.raises(ValueError, match="answer: expected a '#### N'"):
        reference_answer("no marker 12")


def test_strict_takes_first_marker_and_normalises() -> None:
    assert strict_extract("a\n#### 1,000.\nmore #### 7") == "1000"
    assert strict_extract("#### -3") == "-3"
    assert strict_extract("#### $5") is None          # "$" is outside the strict pattern (as in lm-eval)
    assert strict_extract("the answer is 12") is None
    assert strict_extract("####12") is None           # the pattern needs the space


def test_flexible_falls_back_to_last_number() -> None:
    assert flexible_extract("3 + 4 = 7\nso the answer is 7.") == "7"
    assert flexible_extract("costs $1,250 in total") == "1250"
    assert flexible_extract("#### 9 then 11") == "9"   # strict wins when present
    assert flexible_extract("no digits") is None


def test_normalize() -> None:
    assert normalize(" $1,234. ") == "1234"
    assert normalize("reasoning #### 42") == "42"


def test_is_correct() -> None:
    assert is_correct("7 + 5 = 12\n#### 12", "12")
    assert not is_correct("7 + 5 = 12", "12")
    assert is_correct("7 + 5 = 12", "12", mode="flexible")
    assert not is_correct("#### 13", "12", mode="flexible")
    with pytest.raises(ValueError, match="mode"):
        is_correct("#### 1", "1", mode="loose")
