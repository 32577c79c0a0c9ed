import pytest

from app.voice.text import SentenceSplitter, loop_end, speakable, without_trailing_loop, words


def stream(splitter: SentenceSplitter, text: str, step: int = 3) -> list[str]:
    pieces = []
    for index in range(0, len(text), step):
        pieces += splitter.push(text[index : index + step])
    rest = splitter.flush()
    return pieces + ([rest] if rest else [])


def test_sentences_are_released_as_soon_as_they_end():
    splitter = SentenceSplitter()
    assert splitter.push("Paris is the capital of France.") == []  # no following space yet: may be "France.5"
    assert splitter.push(" It is") == ["Paris is the capital of France."]
    assert splitter.flush() == "It is"


def test_abbreviations_numbers_and_short_fragments_do_not_split():
    text = "Dr. Smith moved there in 1999. It has 2.1 million people! Really? Yes, it is true."
    assert stream(SentenceSplitter(), text) == [
        "Dr. Smith moved there in 1999.",
        "It has 2.1 million people!",
        "Really? Yes, it is true.",
    ]


def test_newlines_end_a_piece():
    assert stream(SentenceSplitter(), "First line here\nSecond line here") == ["First line here", "Second line here"]


def test_first_clause_released_early_when_enabled():
    splitter = SentenceSplitter(first_clause_chars=20, first_piece_words=6)
    text = "Well, the capital of France, as you may know, is Paris. It is big, old and lovely."
    assert stream(splitter, text) == [
        "Well, the capital of France,",
        "as you may know,",  # the second piece ends at a clause break too (it has 3 words)
        "is Paris. It is big, old and lovely.",  # (a piece shorter than min_chars goes on)
    ]


def test_speakable_strips_markdown():
    assert speakable("**Paris** is the `capital` of [France](http://x).") == "Paris is the capital of ."


def test_words_ignore_case_and_punctuation():
    assert words("What is the capital of France?") == ["what", "is", "the", "capital", "of", "france"]


def test_long_first_sentence_without_commas_is_cut_before_a_joining_word():
    splitter = SentenceSplitter(first_clause_chars=16, first_piece_words=6)
    text = "The fun fact about dogs is that they are very loyal companions. Dogs love walks and treats."
    assert stream(splitter, text) == [
        "The fun fact about dogs is",
        "that they are very loyal companions.",
        "Dogs love walks and treats.",  # only the first piece is cut early
    ]
    # with the default cap of 3 a joining word ends it from the third word on
    assert stream(SentenceSplitter(first_clause_chars=16), text)[:2] == [
        "The fun fact",
        "about dogs is that they are",  # the second piece: at most twice the first's cap
    ]


def test_first_piece_is_capped_at_three_words_when_nothing_joins():
    words_only = "one two three four five six seven eight."
    assert stream(SentenceSplitter(first_clause_chars=16), words_only) == [
        "one two three",
        "four five six seven eight.",
    ]
    # a first sentence one word past the cap, whose third word leads to the fourth, is said whole
    assert stream(SentenceSplitter(first_clause_chars=16), "Paris is in France. It is big.")[0] == "Paris is in France."


@pytest.mark.parametrize(
    ("text", "first"),
    [
        ("Today is a day of celebration.", "Today is a day"),
        ("The capital of France is Paris.", "The capital of France"),
        ("I think your idea is great.", "I think your idea"),
        ("The weather today is sunny.", "The weather today"),  # nothing leads: the cap
    ],
)
def test_a_piece_cut_at_its_cap_does_not_end_on_an_article_or_a_preposition(text, first):
    """ "Today is a" was said with a falling end, as if finished: the cap takes the word it leads to."""
    assert stream(SentenceSplitter(first_clause_chars=16), text)[0] == first


def test_the_first_piece_s_word_cap_is_a_setting():
    words_only = "one two three four five six seven eight nine ten eleven twelve."
    assert stream(SentenceSplitter(first_clause_chars=16, first_piece_words=6), words_only) == [
        "one two three four five six",
        "seven eight nine ten eleven twelve.",
    ]
    # with a cap of 4 a joining word ends the piece from the third word on, with 6 from the fourth
    text = "The best way to cook dinner tonight is with friends."
    assert stream(SentenceSplitter(first_clause_chars=16), text)[0] == "The best way"
    assert (
        stream(SentenceSplitter(first_clause_chars=16, first_piece_words=6), text)[0] == "The best way to cook dinner"
    )


def test_first_piece_is_cut_before_a_preposition():
    text = "The most popular dog breed in the world is the Labrador."
    assert stream(SentenceSplitter(first_clause_chars=16, first_piece_words=6), text) == [
        "The most popular dog breed",
        "in the world is the Labrador.",
    ]


def test_words_in_any_script():
    assert words("Wie spät ist es? It's naïve, señor.") == ["wie", "spät", "ist", "es", "it's", "naïve", "señor"]
    assert words("你好世界。") == ["你好世界"]


def test_cjk_sentences_end_without_a_space():
    splitter = SentenceSplitter()
    assert splitter.push("你好。今天天气很好！我们去") == ["你好。今天天气很好！"]
    assert splitter.flush() == "我们去"
    first = SentenceSplitter(first_clause_chars=16)
    assert first.push("今天天气很好，我们去公园散步吧") == ["今天天气很好，"]


def test_a_run_on_later_sentence_is_cut_so_the_listener_is_not_left_in_silence():
    run_on = "is that the answer is that the answer is that the answer is that the answer is that the answer"
    pieces = stream(SentenceSplitter(first_clause_chars=16, first_piece_words=6), "The most popular answer " + run_on)
    assert pieces[0] == "The most popular answer is"
    assert all(len(piece.split()) <= 20 for piece in pieces)
    assert len(pieces) >= 3 and " ".join(pieces) == "The most popular answer " + run_on


def test_later_sentences_of_ordinary_length_are_spoken_whole():
    text = "Paris is lovely. It is very old. In spring, the parks are full of people walking their dogs. Go in May."
    assert stream(SentenceSplitter(first_clause_chars=16), text) == [
        "Paris is lovely.",
        "It is very old.",
        "In spring, the parks are full of people walking their dogs.",
        "Go in May.",
    ]


def test_the_second_piece_is_at_most_twice_the_first_piece_s_cap():
    """It is written and spoken while the first piece plays, about a second of audio."""
    text = "Today is a day of celebration, a day of new beginnings, and a day of hope. It is big."
    assert stream(SentenceSplitter(first_clause_chars=16), text) == [
        "Today is a day",
        "of celebration, a day of new",  # twice the cap of 3 (its clause break came at 2 words, under 3)
        "beginnings, and a day of hope.",
        "It is big.",
    ]
    # without a clause break: before a joining word after the first piece's cap, else at twice it
    text = "The best book to read is a classic novel called The Nightingale by Emily Bronte. Yes."
    assert stream(SentenceSplitter(first_clause_chars=16), text)[:3] == [
        "The best book",
        "to read is a classic novel",
        "called The Nightingale by Emily Bronte.",
    ]
    long = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen."
    pieces = stream(SentenceSplitter(first_clause_chars=16, first_piece_words=6), long)
    assert pieces == ["one two three four five six", " ".join(long.split()[6:])]  # 6 + up to 12 words
    # a whole short sentence is not cut, and with first_clause_chars=0 nothing is
    assert stream(SentenceSplitter(first_clause_chars=16), "Yes, it is true. Paris is the capital of France.") == [
        "Yes, it is true.",
        "Paris is the capital of France.",
    ]
    assert stream(SentenceSplitter(), text)[1] == "Yes."


def test_the_word_cap_cuts_as_soon_as_the_next_word_begins():
    """The LLM streams words with their leading space: " seven" begins the seventh word, so the six before are whole."""
    splitter = SentenceSplitter(first_clause_chars=16, first_piece_words=6)
    released = [splitter.push(token) for token in ["one", " two", " three", " four", " five", " six", " sev"]]
    assert released[:-1] == [[]] * 6
    assert released[-1] == ["one two three four five six"]
    # a joining word must be whole before it ends the piece: " for" may become " format"
    splitter = SentenceSplitter(first_clause_chars=16, first_piece_words=6)
    assert [splitter.push(token) for token in ["The", " best", " way", " to", " cook", " for"]][-1] == []
    assert splitter.push(" dinner") == ["The best way to cook"]


def first_loop_end(text: str, step: int = 2) -> str | None:
    """Stream ``text`` a few characters at a time, as the LLM does; the text kept at the first loop found."""
    for index in range(step, len(text) + step, step):
        end = loop_end(text[:index])
        if end is not None:
            return text[:end]
    return None


def test_a_loop_inside_a_piece_is_found_as_it_is_written_and_only_its_first_time_is_kept():
    # loops the bundled LLM fell into in `parley bench voice` (one piece each: no sentence end)
    assert first_loop_end("You want to have a big ol' ol' ol' ol' ol' ol' party") == "You want to have a big ol'"
    assert (
        first_loop_end("The I.Pauli, and the I.Pauli, and the I.Pauli, and the I.Pauli, and")
        == "The I.Pauli, and the I.Pauli,"  # at a comma rather than after "and"
    )


def test_repetition_people_use_is_not_a_loop():
    for text in (
        "No, no, no, that is not it. Very, very, very good.",
        "Row, row, row your boat, gently down the stream.",
        "The address is 0.0.0.0 and the mask is 255.255.255.0 today.",
        "It was a long, long way. Step by step, day by day, we got there.",
        "Paris is the capital of France. It is known for the Eiffel Tower.",
    ):
        assert first_loop_end(text) is None, text


def test_a_word_still_being_written_does_not_complete_a_loop():
    assert loop_end("ol' ol' ol' ol") is None  # "ol" may become "olive"
    assert loop_end("ol' ol' ol' ol' ") is not None


def test_forget_last_drops_only_what_is_not_released():
    splitter = SentenceSplitter()
    assert splitter.push("Paris is lovely in spring. It has ol' ol'") == ["Paris is lovely in spring."]
    splitter.forget_last(len(" ol'"))
    assert splitter.flush() == "It has ol'"
    splitter.forget_last(100)
    assert splitter.flush() is None


def test_a_transcript_that_ends_in_whisper_s_runaway_keeps_its_first_time():
    # what Whisper tiny.en wrote for a noisy "Yes.", "Got it." and "Why is the sky blue?"
    assert without_trailing_loop("Yes. Yes. Yes. Yes. Yes.") == "Yes."
    assert without_trailing_loop("Got it. Got it. Got it. Got") == "Got it."
    assert without_trailing_loop("Why is the sky blue? Why is the sky blue? Why") == "Why is the sky blue?"
    assert without_trailing_loop("Yeah Yeah Yeah Yeah Yeah Yeah") == "Yeah"
    assert without_trailing_loop("Tell me about dogs. Dogs. Dogs. Dogs. Dogs.") == "Tell me about dogs."
    assert without_trailing_loop("The I.Pauli, and the I.Pauli, and the I.Pauli,") == "The I.Pauli,"


def test_a_transcript_keeps_what_people_repeat_and_what_follows_a_restart():
    for text in (
        "No, no, no.",
        "Hello? Hello?",
        "Bye bye.",
        "I think that I think that we should go.",  # a restart: the loop does not run to the end
        "My number is 1 2 1 2 1 2.",
        "What is the capital of France?",
        "",
    ):
        assert without_trailing_loop(text) == text, text


def test_a_runaway_the_token_cap_ended_in_its_second_time_ends_at_the_first():
    # a one-user benchmark turn: a 1.5 s question, decoded over ~2 s of audio (pre-roll and pad)
    heard = "What is the capital look, France? What is the capital look,"
    assert without_trailing_loop(heard, audio_s=2.0) == "What is the capital look, France?"
    assert without_trailing_loop("Why is the sky blue? Why is the", audio_s=1.6) == "Why is the sky blue?"
    # no audio length, or as many words as a person says in that time: the words stay (a restart)
    assert without_trailing_loop(heard) == heard
    assert without_trailing_loop("I want to go. I want to", audio_s=2.5) == "I want to go. I want to"
    # a cut-off start of the same sentence, nothing else
    for text in ("Why is the sky blue? Why", "I want to go. I want to see Paris.", "No. No", "Hello? Hello?"):
        assert without_trailing_loop(text, audio_s=0.5) == text, text
