from heard import heard_as


def test_a_sentence_is_heard_with_one_word_misheard_or_dropped_but_not_two():
    assert heard_as("The weather is sunny today.", "the weather is sunny today")
    assert heard_as("The wother is sunny today.", "the weather is sunny today")
    assert heard_as("weather is sunny today", "the weather is sunny today")
    assert not heard_as("The wother is funny today.", "the weather is sunny today")
    assert not heard_as("today sunny is weather the", "the weather is sunny today")
    assert not heard_as("The weather is sunny today, and tomorrow it rains.", "the weather is sunny today")
    assert not heard_as("", "the weather is sunny today")
