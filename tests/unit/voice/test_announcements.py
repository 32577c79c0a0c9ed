"""A skill's news in a conversation: shown at once, said only once the user is neither speaking nor listening."""

from __future__ import annotations

import asyncio

from app import protocol
from app.voice.announcements import MAX_WAITING, Announcements


class Scene:
    def __init__(self, max_wait_s: float = 5.0) -> None:
        self.sent: list = []
        self.said: list[str] = []
        self.busy = False
        self.announcements = Announcements(self.send, self.say, lambda: self.busy, poll_s=0.01, max_wait_s=max_wait_s)

    async def send(self, message) -> None:
        self.sent.append(message)

    async def say(self, words: str) -> None:
        self.said.append(words)


async def settle(seconds: float = 0.05) -> None:
    await asyncio.sleep(seconds)


async def test_news_is_shown_at_once_and_said_when_the_user_is_free():
    scene = Scene()
    scene.busy = True  # a reply is playing
    scene.announcements.announce("timer", "Your tea timer is done.")
    await settle()
    assert scene.sent == [protocol.Notice(code="timer", message="Your tea timer is done.")]
    assert scene.said == []  # not over the reply
    scene.busy = False
    await settle()
    assert scene.said == ["Your tea timer is done."]


async def test_news_is_said_in_order_and_a_flood_is_bounded():
    scene = Scene()
    scene.busy = True
    for n in range(MAX_WAITING + 5):
        scene.announcements.announce("reminder", f"Reminder {n}.")
    scene.busy = False
    await settle(0.2)
    assert scene.said == [f"Reminder {n}." for n in range(MAX_WAITING)]


async def test_news_the_user_was_too_busy_to_hear_is_shown_not_said_and_close_ends_it_all():
    scene = Scene(max_wait_s=0.05)
    scene.busy = True
    scene.announcements.announce("timer", "Your eggs timer is done.")
    await settle(0.15)
    assert scene.said == [] and len(scene.sent) == 1
    scene.busy = False
    await scene.announcements.close()
    scene.announcements.announce("timer", "After the end.")
    await settle()
    assert scene.said == [] and len(scene.sent) == 1
