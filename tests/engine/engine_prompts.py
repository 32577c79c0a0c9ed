"""Fixed prompts for the engine tests (a module of its own so test files can import it)."""

STORY = (
    "The lighthouse keeper had lived on the island for thirty years. Every evening he climbed the "
    "hundred and twelve steps, polished the great lens, and lit the lamp that warned the fishing boats "
    "away from the rocks. One winter night a storm cut the telegraph line, and a small boat with a "
    "broken mast drifted toward the reef. He rowed out alone through the waves, threw a rope to the "
    "two frightened children on board, and pulled them back to the shore before dawn."
)

TEXT_PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little robot who",
    "def fibonacci(n):",
    "List three colors:",
    "Water boils at",
    STORY + " The next morning,",
    "Q: What is 12 plus 30?\nA:",
    "My favourite food is pizza because",
    STORY + "\n\nSummary of the story in one sentence:",
    "The quick brown fox",
]

CHAT_QUESTIONS = [
    "What is the tallest mountain in the world?",
    "Give me a tip for sleeping better.",
    "How many legs does a spider have?",
]
