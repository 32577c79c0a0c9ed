"""What `parley bench quality` says: four everyday conversations, and the questions it also asks alone.

Each conversation mixes, in 20 typed turns: a greeting and small talk, 10 questions with
checkable answers, two follow-ups that only make sense after the question before them, two
things the user tells about themselves and asks back four or five turns later, one long request
that is cancelled as soon as its reply is heard, and a goodbye. Answers are aliases matched as
whole words, case-insensitive, numbers as digits or words (``app.bench.quality.mentions``); no
answer of one question is the answer of another in the same conversation, so a reply that gives
an earlier answer can be told apart (tests/bench/test_bench_quality.py checks it).

Every fact the user tells is asked back while it is still in the prompt's history window at
the default ``max_history_messages`` (16 messages: turns 9-12 see turns 5 on, 13-16 see 9 on),
so a miss is the model forgetting, not the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["fact", "follow_up", "tell", "recall", "chat", "closing", "interrupt"]
QUESTIONS: tuple[Kind, ...] = ("fact", "follow_up")  # questions about the world
SCORED: tuple[Kind, ...] = (*QUESTIONS, "recall")  # the kinds with an answer to check


@dataclass(frozen=True)
class Ask:
    """One typed user turn, and what its reply is checked for."""

    text: str
    kind: Kind
    answers: tuple[str, ...] = ()  # any one of them is right
    in_full: str | None = None  # a follow-up as a question of its own (asked alone)


def fact(text: str, *answers: str) -> Ask:
    return Ask(text, "fact", answers)


def follow_up(text: str, in_full: str, *answers: str) -> Ask:
    return Ask(text, "follow_up", answers, in_full)


def tell(text: str) -> Ask:
    return Ask(text, "tell")


def recall(text: str, *answers: str) -> Ask:
    return Ask(text, "recall", answers)


def chat(text: str) -> Ask:
    return Ask(text, "chat")


def closing(text: str) -> Ask:
    """A thanks or goodbye: a reply of a word or two is fine."""
    return Ask(text, "closing")


def interrupt(text: str) -> Ask:
    """A request for a long reply, cancelled once its first audio arrives."""
    return Ask(text, "interrupt")


CONVERSATIONS: tuple[tuple[Ask, ...], ...] = (
    (
        chat("Hi! How are you today?"),
        tell("My name is Maya."),
        fact("What is the capital of France?", "paris"),
        fact("What is the capital of Italy?", "rome"),
        follow_up("And what about Spain?", "What is the capital of Spain?", "madrid"),
        recall("What is my name?", "maya"),
        fact("How many days are in a week?", "7"),
        chat("Can you tell me a joke?"),
        fact("What do bees make?", "honey"),
        tell("I live in Lisbon."),
        fact("How many legs does a spider have?", "8"),
        follow_up("And an ant?", "How many legs does an ant have?", "6"),
        fact("What colour is a banana?", "yellow"),
        recall("Which city do I live in?", "lisbon"),
        fact("What is the opposite of hot?", "cold"),
        fact("What sound does a cat make?", "meow", "miaow", "mew", "purr"),
        interrupt("Tell me a long story about a dragon who learns to bake bread."),
        fact("What planet do we live on?", "earth"),
        fact("What is two plus two?", "4"),
        closing("Thanks, goodbye!"),
    ),
    (
        chat("Good morning! What a lovely day it is."),
        tell("My favourite colour is purple."),
        fact("What is the capital of Japan?", "tokyo"),
        follow_up("And Germany?", "What is the capital of Germany?", "berlin"),
        fact("What colour is grass?", "green"),
        recall("What is my favourite colour?", "purple"),
        fact("How many months are in a year?", "12"),
        closing("Thanks!"),
        tell("I have a dog called Biscuit."),
        fact("What sound does a cow make?", "moo", "mooing"),
        follow_up("And a duck?", "What sound does a duck make?", "quack", "quacking"),
        fact("What is the largest planet in our solar system?", "jupiter"),
        fact("What is the opposite of up?", "down"),
        recall("What is my dog's name?", "biscuit"),
        fact("What is three plus five?", "8"),
        fact("What do hens lay?", "egg"),
        interrupt("Describe in detail how a car engine works, step by step."),
        fact("What is frozen water called?", "ice"),
        fact("Which animal is known as the king of the jungle?", "lion"),
        closing("Goodbye!"),
    ),
    (
        chat("Hello there, how is your day going?"),
        tell("I work as a nurse."),
        fact("What is the capital of Egypt?", "cairo"),
        fact("What colour is the sky on a clear day?", "blue"),
        follow_up("And snow?", "What colour is snow?", "white"),
        recall("What do I do for a living?", "nurse", "nursing"),
        fact("How many hours are in a day?", "24"),
        chat("I'm a bit tired today."),
        fact("What is the opposite of fast?", "slow"),
        tell("My favourite food is pizza."),
        fact("What is a baby cat called?", "kitten", "kitty"),
        follow_up("And a baby dog?", "What is a baby dog called?", "puppy", "puppies", "pup"),
        fact("Which planet is known as the red planet?", "mars"),
        recall("What is my favourite food?", "pizza"),
        fact("What is ten minus three?", "7"),
        fact("What is the fastest land animal?", "cheetah"),
        interrupt("Explain everything you know about the history of the Roman Empire."),
        fact("At what temperature in Celsius does water boil?", "100"),
        fact("What do caterpillars turn into?", "butterfly", "butterflies", "moth"),
        closing("Thank you, bye!"),
    ),
    (
        chat("Hey, nice to meet you!"),
        tell("My sister is called Hannah."),
        fact("What is the capital of Canada?", "ottawa"),
        fact("How many seasons are there in a year?", "4"),
        fact("What is the opposite of big?", "small", "little", "tiny"),
        follow_up("And happy?", "What is the opposite of happy?", "sad", "unhappy"),
        recall("What is my sister's name?", "hannah"),
        chat("What should I cook for dinner tonight?"),
        tell("I play the violin."),
        fact("How many minutes are in an hour?", "60"),
        fact("What is the capital of Greece?", "athens"),
        follow_up("And Russia?", "What is the capital of Russia?", "moscow"),
        fact("What gas do people need to breathe?", "oxygen"),
        recall("Which instrument do I play?", "violin"),
        fact("What sound does a dog make?", "bark", "woof"),
        fact("What do cows give us to drink?", "milk"),
        interrupt("Tell me about all the planets in the solar system, one by one, in detail."),
        fact("What is the tallest animal in the world?", "giraffe"),
        fact("What is five times five?", "25"),
        closing("Thanks for the chat, goodbye!"),
    ),
)


def alone_questions(conversations: tuple[tuple[Ask, ...], ...] = CONVERSATIONS) -> list[Ask]:
    """The facts of ``conversations``, and their follow-ups as questions in full: each to ask with no history."""
    asks = [ask for conversation in conversations for ask in conversation]
    in_full = [Ask(ask.in_full, "follow_up", ask.answers) for ask in asks if ask.kind == "follow_up" and ask.in_full]
    return [ask for ask in asks if ask.kind == "fact"] + in_full
