"""`parley bench turn-end`: how well the end-of-turn signals tell a finished utterance from one paused mid-clause.

The labelled set is ``UTTERANCES``: questions, commands and statements, each said whole (complete)
and cut where the user might pause mid-clause (``|``: "Set a timer for | ten minutes."). Both are
spoken by the bundled voice (the cut one is the whole sentence's audio cut at that word boundary,
so the words before it keep the intonation of a sentence going on), with the audio the tracker
gives its models at a pause. Each is then judged as the server judges it:

* the words' cue (``turns.looks_unfinished``) on Whisper's transcript;
* the audio signal: Smart Turn's P(complete);
* the text signal: the LLM's P(the user's words end there) (``LocalScheduling.end_of_turn_probability``);
* the endpoint: how long ``turns.Endpointer`` waits, with today's rule (words and audio) and with
  both signals combined (``turns.combined_probability``).

It reports the accuracy of each signal alone and combined (complete judged complete, paused
judged not), and of the endpoint: a complete utterance must end after a short silence, a paused
one must wait the mid-clause silence. ``--fit`` also fits the combination's weights on the set.
The pauses of ``parley bench voice --set pauses`` (a breath at a comma, where the words before it often
make a sentence) are judged too, as kind ``comma``, apart from the mid-clause ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from app.audio import ASR_SAMPLE_RATE
from app.bench.samples import synthesize_speech, trim_to_speech, with_pause
from app.bench.voice import PAUSED_QUESTIONS
from app.stages.base import scheduling_of
from app.voice.listening import endpointer
from app.voice.text import without_trailing_loop, words
from app.voice.turns import Endpointer, SignalWeights, combined_probability, looks_unfinished
from app.voice.utterance import PREROLL_MS, TAIL_PAD_MS
from engine.weights import cache_dir

# (kind, the utterance with its mid-clause pause point marked "|")
UTTERANCES: tuple[tuple[str, str], ...] = (
    ("question", "What is the capital of | France?"),
    ("question", "How far is it from | London to Paris?"),
    ("question", "Can you tell | me a joke about cats?"),
    ("question", "Why do cats | purr when they are happy?"),
    ("question", "What time does the | museum open on Sundays?"),
    ("question", "How many days are | in a leap year?"),
    ("question", "Who wrote | the novel Pride and Prejudice?"),
    ("question", "Where can I find a good | coffee shop near here?"),
    ("question", "Could you explain how | rainbows are formed?"),
    ("question", "What is the weather going | to be like tomorrow?"),
    ("question", "Is it going to rain in | Berlin this weekend?"),
    ("question", "How do I make | a cup of green tea?"),
    ("question", "Do you know any good | books about space?"),
    ("question", "What's the best way to | learn a new language?"),
    ("question", "How long should I boil | an egg?"),
    ("question", "Which planet is | the largest in our solar system?"),
    ("question", "When did the Second World | War end?"),
    ("question", "How tall is the | Eiffel Tower?"),
    ("question", "What should I cook for | dinner tonight?"),
    ("question", "Can you recommend a | good book for a long flight?"),
    ("question", "Are there any vegetarian | restaurants in this area?"),
    ("question", "Why is the | sky blue?"),
    ("command", "Set a timer for | ten minutes."),
    ("command", "Please say hello to | my sister Anna."),
    ("command", "Remind me to | call my mother tomorrow."),
    ("command", "Turn off the | lights in the living room."),
    ("command", "Play some relaxing | music for me."),
    ("command", "Tell me a story about | a brave little mouse."),
    ("command", "Give me a | recipe for banana bread."),
    ("command", "Read me the latest | news headlines."),
    ("command", "Show me | pictures of the northern lights."),
    ("command", "Wake me up at | seven tomorrow morning."),
    ("command", "Please translate | good morning into Spanish."),
    ("command", "Call my | brother on his mobile phone."),
    ("command", "Send a message to | Sarah saying I am running late."),
    ("command", "Explain how | a rainbow is formed."),
    ("command", "Describe the | solar system in simple words."),
    ("command", "Please spell | the word necessary."),
    ("command", "Write a short | poem about the ocean."),
    ("command", "Count backwards from | ten to one."),
    ("command", "Summarize the plot of | Romeo and Juliet."),
    ("command", "Suggest a name for | my new puppy."),
    ("command", "Turn up the | volume a little."),
    ("command", "Please repeat what | you just said."),
    ("command", "Find me a | cheap flight to Rome."),
    ("command", "Convert | fifty dollars into euros."),
    ("command", "Make a list of | things to pack for camping."),
    ("command", "Let me know when | it starts raining."),
    ("command", "Book a table for | four people tonight."),
    ("statement", "I would like to hear | a song by the Beatles."),
    ("statement", "I want to learn | how to play the guitar."),
    ("statement", "I need a recipe for | chocolate chip cookies."),
    ("statement", "I am looking for | a good Italian restaurant."),
    ("statement", "My brother lives in | Canada with his family."),
    ("statement", "I am planning a trip to | Japan next spring."),
    ("statement", "I had a really | long day at work today."),
    ("statement", "I think I left my | keys in the car."),
    ("statement", "I'd like to know more about | the history of Rome."),
    ("statement", "My sister's birthday is on | the twelfth of May."),
    ("statement", "I can't decide what | to wear tonight."),
    ("statement", "I'm feeling a bit | tired this evening."),
    ("statement", "We are going to the | beach this weekend."),
    ("statement", "I just finished reading a | great book."),
    ("statement", "It would be nice to | visit Paris someday."),
    ("statement", "I wonder what | the weather will be like."),
    ("statement", "I'm trying to | cook dinner for six people."),
    ("statement", "I would love to hear | a joke right now."),
    ("statement", "The meeting has been moved to | Thursday afternoon."),
    ("statement", "I forgot to | buy bread on the way home."),
    ("statement", "I'd like you to | tell me something interesting."),
    ("statement", "Our train leaves at | half past eight."),
    ("statement", "I need some ideas for | a birthday present."),
    ("statement", "I'm not sure whether | to take the bus or walk."),
)


def split_marked(marked: str) -> tuple[str, str]:
    """The whole utterance and the words said before its pause point."""
    before, after = marked.split("|")
    return f"{before.strip()} {after.strip()}", before.strip()


@dataclass
class Sample:
    """One utterance as the tracker hands it to its models at a pause."""

    kind: str  # question | command | statement
    complete: bool  # said whole (else paused at its mid-clause point)
    said: str  # the words said
    rate: float  # Piper length scale
    audio: np.ndarray  # pre-roll, speech, the tail's pad of silence (noise under it all)


@dataclass
class Judged:
    """A sample's transcript and what each signal made of it."""

    kind: str
    complete: bool
    said: str
    rate: float
    transcript: str
    unfinished_words: bool  # turns.looks_unfinished on the transcript
    audio_p: float | None
    text_p: float | None


def pause_point(speech: np.ndarray, before: str, asr) -> int | None:
    """The sample where the words ``before`` end in ``speech`` (the whole utterance), or None when it is not found.

    Whisper's word timestamps place the boundary roughly (tiny.en's run late). Around it, every 20 ms,
    the audio is cut and transcribed; of the cuts after which Whisper hears as many words as ``before``,
    ending with its last word, the quietest is the pause point (between words, not inside a stop
    consonant). A cut a little late is heard as a stray syllable of the next word ("What time does
    the mute?"), which no user says.
    """
    segments, _ = asr.whisper.transcribe(speech, word_timestamps=True, beam_size=1, language="en")
    heard = [word for segment in segments for word in segment.words]
    expected = words(before)
    if len(heard) <= len(expected):
        return None
    step = ASR_SAMPLE_RATE // 50
    lo = max(step, int((heard[len(expected) - 1].start - 0.2) * ASR_SAMPLE_RATE))
    hi = min(len(speech) - step, int((heard[len(expected)].start + 0.15) * ASR_SAMPLE_RATE))
    pad = np.zeros(TAIL_PAD_MS * ASR_SAMPLE_RATE // 1000, np.float32)
    fits = []
    for cut in range(lo, hi, step):
        result = asr.transcribe(np.concatenate([speech[:cut], pad]))
        said = words(result.text) if result is not None else []
        if len(said) == len(expected) and said[-1:] == expected[-1:]:
            fits.append((float(np.mean(speech[cut - step // 2 : cut + step // 2] ** 2)), cut))
    return min(fits)[1] if fits else None


def pause_points(asr, rates: list[float]) -> dict[str, int | None]:
    """``pause_point`` of each utterance at its rate, cached on disk beside the synthesized speech."""
    path = cache_dir() / "speech" / "pause-points.json"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    found = {}
    for index, (_, marked) in enumerate(UTTERANCES):
        rate = rates[index % len(rates)]
        key = f"{marked}|{rate:g}"
        if key not in cached:
            whole, before = split_marked(marked)
            cached[key] = pause_point(trim_to_speech(synthesize_speech(whole, length_scale=rate)), before, asr)
        found[key] = cached[key]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cached, indent=1))
    return found


def build_samples(asr, rates: list[float], snr_db: float | None, seed: int = 0) -> tuple[list[Sample], list[str]]:
    """Each utterance complete and paused, at the rates in turn; and the utterances whose pause was not found."""
    rng = np.random.default_rng(seed)
    lead = np.zeros(PREROLL_MS * ASR_SAMPLE_RATE // 1000, np.float32)
    pad = np.zeros(TAIL_PAD_MS * ASR_SAMPLE_RATE // 1000, np.float32)
    points = pause_points(asr, rates)
    samples, skipped, pairs = [], [], []
    for index, (kind, marked) in enumerate(UTTERANCES):
        rate = rates[index % len(rates)]
        cut = points[f"{marked}|{rate:g}"]
        if cut is None:
            skipped.append(marked)
            continue
        whole, before = split_marked(marked)
        speech = trim_to_speech(synthesize_speech(whole, length_scale=rate))
        pairs.append((kind, whole, before, rate, speech, cut))
    for index, whole in enumerate(PAUSED_QUESTIONS):  # `bench voice --set pauses`: a breath at a comma
        rate = rates[index % len(rates)]
        speech = trim_to_speech(synthesize_speech(whole, length_scale=rate))
        _, cut = with_pause(speech, 0.0)
        pairs.append(("comma", whole, whole.split(",")[0], rate, speech, cut))
    for kind, whole, before, rate, speech, cut in pairs:
        for complete, said, spoken in ((True, whole, speech), (False, before, speech[:cut])):
            audio = np.concatenate([lead, spoken, pad])
            if snr_db is not None:
                loud = spoken[np.abs(spoken) > 0.01]
                noise_rms = float(np.sqrt(np.mean(loud**2))) / 10 ** (snr_db / 20)
                audio = audio + rng.normal(0, noise_rms, len(audio)).astype(np.float32)
            samples.append(Sample(kind, complete, said, rate, audio.astype(np.float32)))
    return samples, skipped


async def judge(samples: list[Sample], asr, turn_model, llm, system_prompt: str) -> list[Judged]:
    """Transcribe each sample and ask both signals about it, one at a time (as at a pause)."""
    scheduling = scheduling_of(llm)  # None: an LLM elsewhere, no text signal
    conversation = [{"role": "system", "content": system_prompt}]
    judged = []
    for sample in samples:
        result = asr.transcribe(sample.audio)
        transcript = without_trailing_loop(result.text, len(sample.audio) / ASR_SAMPLE_RATE) if result else ""
        audio_p = turn_model.complete_probability(sample.audio) if turn_model is not None else None
        text_p = None
        if scheduling is not None and transcript.strip():
            text_p = await scheduling.end_of_turn_probability(conversation, transcript)
        unfinished = looks_unfinished(transcript, "en")
        judged.append(
            Judged(sample.kind, sample.complete, sample.said, sample.rate, transcript, unfinished, audio_p, text_p)
        )
    return judged


# ---------------------------------------------------------------- scores
def features(record: Judged, weights: SignalWeights) -> list[float]:
    """What ``turns.combined_probability`` weighs: 1, logit(audio P), log10(text P) (each as it clips them)."""
    audio = min(max(record.audio_p if record.audio_p is not None else 0.5, 1e-3), 1 - 1e-3)
    text = max(record.text_p if record.text_p is not None else 1.0, weights.text_floor)
    return [1.0, math.log(audio / (1 - audio)), math.log10(text)]


def fit_weights(records: list[Judged], floor: float = SignalWeights().text_floor, l2: float = 0.01) -> SignalWeights:
    """The logistic regression of complete on ``features`` (Newton's method, a little L2 for separable sets)."""
    x = np.array([features(r, SignalWeights(text_floor=floor)) for r in records])
    y = np.array([1.0 if r.complete else 0.0 for r in records])
    w = np.zeros(x.shape[1])
    for _ in range(50):
        p = 1 / (1 + np.exp(-x @ w))
        hessian = (x.T * (p * (1 - p))) @ x + l2 * np.eye(len(w))
        w -= np.linalg.solve(hessian, x.T @ (p - y) + l2 * w)
    return SignalWeights(
        bias=round(float(w[0]), 2), audio=round(float(w[1]), 2), text=round(float(w[2]), 2), text_floor=floor
    )


def held_out_accuracy(records: list[Judged], rule: Endpointer, folds: int = 5, seed: int = 0) -> float:
    """The combination's accuracy on utterances it was not fitted on: ``folds``-fold cross-validation, grouped so
    an utterance (whole and paused, at every noise level) is never in both the fitting and the judged part."""
    groups = [records[i].said for i in range(0, len(records) - 1, 2) for _ in (0, 1)]  # (whole, paused) pairs
    names = sorted(set(groups))
    np.random.default_rng(seed).shuffle(names)
    fold_of = {name: index % folds for index, name in enumerate(names)}
    right = 0
    for fold in range(folds):
        fitting = [r for r, g in zip(records, groups, strict=True) if fold_of[g] != fold]
        judged = [r for r, g in zip(records, groups, strict=True) if fold_of[g] == fold]
        weights = fit_weights(fitting)
        right += sum(
            ((combined_probability(r.audio_p, r.text_p, weights) or 0.0) >= rule.complete_threshold) == r.complete
            for r in judged
        )
    return right / len(records)


def _counts(records: list[Judged], says_complete) -> dict:
    """Complete ones judged complete and paused ones judged not, of how many."""
    complete = [r for r in records if r.complete]
    paused = [r for r in records if not r.complete]
    right = sum(bool(says_complete(r)) for r in complete) + sum(not says_complete(r) for r in paused)
    return {
        "complete_ok": sum(bool(says_complete(r)) for r in complete),
        "complete": len(complete),
        "paused_ok": sum(not says_complete(r) for r in paused),
        "paused": len(paused),
        "accuracy": right / len(records) if records else None,
    }


def score(records: list[Judged], endpointer: Endpointer) -> dict:
    """Accuracy of each signal alone and combined, at the endpoint's complete threshold (the text's alone: the
    text P at which the combination without the sound reaches it), and of the endpoint with and without the
    LLM's signal (a complete utterance ends after less than the mid-clause silence, a paused one waits it)."""
    w, threshold = endpointer.weights, endpointer.complete_threshold
    text_threshold = 10 ** ((math.log(threshold / (1 - threshold)) - w.bias) / w.text)

    def combined(r: Judged) -> float | None:
        return combined_probability(r.audio_p, r.text_p, w)

    def ends_soon(with_text: bool):
        def rule(r: Judged) -> bool:
            text_p = r.text_p if with_text else None
            waits = endpointer.required_silence_ms(r.transcript, r.audio_p, "en", text_p)
            return waits < endpointer.unfinished_silence_ms

        return rule

    def table(subset: list[Judged]) -> dict:
        return {
            "audio": _counts(subset, lambda r: (r.audio_p or 0.0) >= threshold),
            "text": _counts(subset, lambda r: (r.text_p or 0.0) >= text_threshold),
            "combined": _counts(subset, lambda r: (combined(r) or 0.0) >= threshold),
            "endpoint_today": _counts(subset, ends_soon(with_text=False)),
            "endpoint_combined": _counts(subset, ends_soon(with_text=True)),
        }

    kinds = sorted({r.kind for r in records})
    return {
        "threshold": threshold,
        "text_threshold": text_threshold,
        "weights": asdict(w),
        "all": table(records),
        "mid_clause": table([r for r in records if r.kind != "comma"]),
        "by_kind": {kind: table([r for r in records if r.kind == kind]) for kind in kinds},
    }


def print_report(summary: dict) -> None:
    def cell(counts: dict) -> str:
        return f"{counts['complete_ok']:>3}/{counts['complete']:<3} {counts['paused_ok']:>3}/{counts['paused']:<3} {counts['accuracy']:6.1%}"

    print(
        f"\n{summary['samples']} samples ({summary['utterances']} utterances said whole and paused; "
        f"noise {summary['snr_db']}, rates {summary['rates']}); weights {summary['weights']}"
    )
    print(
        f"thresholds: P(complete) >= {summary['threshold']:g} (audio, combined), "
        f"text P >= {summary['text_threshold']:.3g} (text alone)"
    )
    columns = ["audio", "text", "combined", "endpoint_today", "endpoint_combined"]
    print(f"{'set':<12}" + "".join(f"{name:>26}" for name in columns))
    print(f"{'':<12}" + "".join(f"{'complete   paused  right':>26}" for _ in columns))
    rows = [("all", summary["all"]), ("mid-clause", summary["mid_clause"]), *summary["by_kind"].items()]
    for name, table in rows:
        print(f"{name:<12}" + "".join(f"{cell(table[column]):>26}" for column in columns))
    if summary.get("fitted"):
        print(
            f"fitted on this set: {summary['fitted']['weights']}, combined accuracy {summary['fitted']['accuracy']:.1%}"
            f" ({summary['fitted']['held_out_accuracy']:.1%} on utterances left out of the fit, 5-fold)"
        )
    if summary["skipped"]:
        print(f"left out (their pause point was not found): {summary['skipped']}")


# ---------------------------------------------------------------- command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parley bench turn-end", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", default="0.9,1,1.15", help="speaking rates (Piper length scales), one per utterance in turn"
    )
    parser.add_argument("--snr-db", default="none,20", help="background noise levels, each a full pass ('none': clean)")
    parser.add_argument("--fit", action="store_true", help="also fit the combination's weights on the set")
    parser.add_argument("--json", dest="json_path", help="write the summary and every judged sample here")
    args = parser.parse_args(argv)
    try:
        rates = [float(rate) for rate in args.rates.split(",")]
        noises = [None if level.strip() == "none" else float(level) for level in args.snr_db.split(",")]
    except ValueError:
        parser.error("--rates and --snr-db take comma-separated numbers ('none' for no noise)")

    from app.config import load_settings
    from app.stages.asr import Transcriber
    from app.stages.registry import make_llm, make_turn_detector, one_blas_thread

    settings = load_settings()
    one_blas_thread()
    print("loading Whisper, Smart Turn and the LLM ...", flush=True)
    asr = Transcriber(settings.asr_model, compute_type=settings.asr_compute_type, window_s=settings.asr_window_s)
    turn_model = make_turn_detector(settings)
    llm = make_llm(settings)
    try:
        records, skipped = [], []
        for snr_db in noises:
            print(
                f"building and judging the set (noise: {snr_db if snr_db is not None else 'none'} dB) ...", flush=True
            )
            samples, skipped = build_samples(asr, rates, snr_db)
            records += asyncio.run(judge(samples, asr, turn_model, llm, settings.system_prompt))
    finally:
        llm.close()
    rule = endpointer(settings)
    summary = {
        "samples": len(records),
        "utterances": len(records) // 2 // len(noises),
        "skipped": skipped,
        "snr_db": args.snr_db,
        "rates": rates,
        **score(records, rule),
    }
    if args.fit:
        fitted = fit_weights(records)
        fitted_score = score(records, replace(rule, weights=fitted))["all"]["combined"]
        summary["fitted"] = {
            "weights": asdict(fitted),
            "accuracy": fitted_score["accuracy"],
            "held_out_accuracy": held_out_accuracy(records, rule),
        }
    print_report(summary)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({**summary, "records": [asdict(r) for r in records]}, indent=1))
    return 0
