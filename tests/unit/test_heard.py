from heard import heard_as


def test_a_sentence_is_heard_with_one_word_misheard_or_dropped_but_not_two():
    assert heard_as("The weather is sunny today.", "the weather is sunny today")
    assert heard_as("The wother is sunny today.", "the weather is sunny today")
    assert heard_as("weather is sunny today", "the weather is sunny today")
    assert not heard_as("The wother is funny today.", "the weather is sunny today")
    assert not heard_as("today sunny is weather the", "the weather is sunny today")
    assert not heard_as("The weather is sunny today, and tomorrow it rains.", "the weather is sunny today")
    assert not heard_as("", "the weather is sunny today")


def test_a_contraction_is_heard_as_the_words_it_stands_for():
    assert heard_as("The Weather's Sunny Today", "the weather is sunny today")  # as CI heard it once
    assert heard_as("I can't hear you.", "I can not hear you")
    assert heard_as("We'll see.", "we will see")
    assert not heard_as("The weather's funny tonight", "the weather is sunny today")
