import pytest

from audit.switches import switch


@pytest.mark.parametrize("value,expected", [("1", True), (" ON ", True), ("yes", True), ("true", True),
                                            ("0", False), ("Off", False), ("no", False), ("false", False)])
def test_a_switch_reads_the_words_for_on_and_off(value, expected):
    assert switch({"S": value}, "S", default=not expected) is expected


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(default):
    assert switch({}, "S", default=default) is default
    assert switch({"S": "  "}, "S", default=default) is default


def test_any_other_word_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match=r"^S='maybe': expected on or off \(1 or 0\)$"):
        switch({"S": "maybe"}, "S", default=True)
