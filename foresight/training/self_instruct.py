"""Chat training requests, written offline: the kinds of thing people ask an assistant, over topic seeds.

Three sources, all seeded (the item list of a run is fixed, then saved beside the labels):
  written    the target writes the request itself from a kind + topic (self-instruct), sampled at T=1
  template   a request built from a template over a topic, names and random numbers (arithmetic, word
             problems, short tasks the small target writes badly)
  passage    the target writes a short passage about a topic; a template asks to summarise, rewrite or
             extract from it
A quarter of the conversations get a follow-up turn ("Can you make it shorter?"), answered in turn, so
the drafter also sees second answers. Every request is checked against the evaluation sets (13-gram rule
and whole short chat requests, as for the code corpus) before anything is answered.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

# kind -> what the target is asked to write (None: built from templates only)
WRITTEN_KINDS = {
    "explanation": "a question asking for a clear explanation of something about {topic}",
    "advice": "a request for practical advice about {topic}",
    "stories_letters": "a request to write a short story, poem, letter or email about {topic}",
    "role_play": "a role-play request in which the user asks the assistant to act as a character or expert "
                 "connected with {topic}",
    "puzzles_reasoning": "a riddle, logic puzzle or reasoning question about {topic}",
    "code": "a request to write a small program or function (Python, JavaScript, SQL or shell) to do with {topic}",
    "science": "a science question about {topic}",
    "history_culture": "a question about the history or culture of {topic}",
    "opinion": "a question asking the assistant to compare options or weigh pros and cons about {topic}",
    "how_to": "a question asking how to do something step by step, about {topic}",
}
# The target continues a numbered list of user messages as plain text (no chat template): asked in a chat
# turn to write a request, a 135M instruct model mostly answers one instead (measured: 16 of 24 outputs
# read as an assistant's reply); continuing a list, most outputs read as a user's message.
WRITER_LIST = "A list of messages that users sent to an AI assistant.\n\n{examples}\n{next}. ({what}) "
# Few-shot examples for the writer (a 135M target asked without examples mostly answers instead of asking).
WRITER_EXAMPLES = (
    "How long should I boil an egg if I want the yolk a little soft?",
    "Write a short poem about the first snow of the winter.",
    "Can you explain what a credit score is and why it matters?",
    "My roommate never washes the dishes. How can I bring it up without starting a fight?",
    "Pretend you are a pirate captain and describe your ship to a new sailor.",
    "I have a list of names in Python. How do I sort them by length?",
    "Why do leaves change colour in the autumn?",
    "Write an email to my landlord asking when the heating will be fixed.",
    "What were the main causes of the fall of the Roman Empire?",
    "Is it better to rent or to buy a car if I only drive on weekends?",
    "Three friends share a pizza cut into 12 slices. If each eats the same amount, how many slices does each get?",
    "Give me a step-by-step plan to learn to play the guitar in three months.",
    "What is the difference between a virus and a bacterium?",
    "Write a SQL query that counts the orders per customer.",
    "Tell me a bedtime story about a brave little turtle.",
    "Which is heavier, a kilogram of feathers or a kilogram of stones? Explain.",
)
WRITER_SHOTS = 4
PASSAGE_INSTRUCTION = "Write a short paragraph of four or five sentences about {topic}."

TOPICS = (
    "volcanoes", "coral reefs", "the moon", "black holes", "photosynthesis", "the human heart", "sleep",
    "vaccines", "electric cars", "solar panels", "wind energy", "recycling", "rainforests", "deserts",
    "earthquakes", "hurricanes", "glaciers", "bees", "octopuses", "wolves", "dinosaurs", "birds migrating",
    "the immune system", "DNA", "bacteria", "the periodic table", "magnets", "light and colour", "sound waves",
    "gravity", "the water cycle", "plate tectonics", "the ancient Egyptians", "the Roman Empire",
    "the Silk Road", "the printing press", "the Industrial Revolution", "the Vikings", "the Renaissance",
    "the Maya", "ancient Greece", "the Ming dynasty", "the first airplanes", "the telephone", "the internet",
    "jazz music", "classical music", "hip hop", "street art", "photography", "poetry", "chess", "football",
    "basketball", "running a marathon", "yoga", "swimming", "cycling", "hiking", "camping", "gardening",
    "houseplants", "cooking pasta", "baking bread", "vegetarian meals", "coffee", "tea", "chocolate",
    "spices", "healthy breakfasts", "saving money", "budgeting", "credit cards", "student loans",
    "starting a small business", "job interviews", "writing a resume", "working from home", "time management",
    "public speaking", "learning a language", "studying for exams", "online courses", "choosing a university",
    "moving to a new city", "renting an apartment", "buying a used car", "travel in Japan", "travel in Italy",
    "a trip to Mexico", "packing for a trip", "airports", "trains", "road trips", "birthday parties",
    "weddings", "friendship", "family dinners", "raising a puppy", "cats", "keeping fish", "parenting toddlers",
    "teenagers and phones", "social media", "video games", "smartphones", "passwords and online safety",
    "spreadsheets", "databases", "web pages", "sorting a list", "text files", "dates and times",
    "prime numbers", "fractions", "percentages", "geometry", "probability", "statistics", "maps",
    "the weather", "climate change", "the ocean", "rivers", "mountains", "forests", "farming", "cities",
    "public transport", "architecture", "bridges", "museums", "libraries", "newspapers", "movies",
    "television", "novels", "fairy tales", "mythology", "dragons", "robots", "space travel", "Mars",
    "astronauts", "the stock market", "inflation", "taxes", "insurance", "elections", "volunteering",
    "a neighbourhood cleanup", "a school science fair", "a lost wallet", "a rainy weekend", "a first day at work",
    "a difficult coworker", "a surprise gift", "an old lighthouse", "a small bakery", "a detective",
    "a talking cat", "a haunted house", "a pirate ship", "a knight", "a wizard", "a time traveller",
    "headaches", "drinking water", "stretching", "posture", "stress", "meditation", "vitamins", "first aid",
)

TEMPLATES = {
    "explanation": ["Explain {topic} in simple terms.", "What should a beginner know about {topic}?",
                    "Can you explain {topic} to a ten-year-old?", "Give me a short overview of {topic}."],
    "advice": ["Give me three tips about {topic}.", "I'm new to {topic}. Where should I start?",
               "What are common mistakes people make with {topic}?"],
    "stories_letters": ["Write a short story about {topic}.", "Write a four-line poem about {topic}.",
                        "Write a friendly email to {name} about {topic}.", "Write a limerick about {topic}.",
                        "Write a thank-you note to {name} that mentions {topic}."],
    "role_play": ["Pretend you are a tour guide and tell me about {topic}.",
                  "You are a teacher. Introduce today's lesson on {topic}.",
                  "Act as a friendly shopkeeper and greet me. I'm looking for something related to {topic}."],
    "rewriting": ["Rewrite this more formally:\n\n{passage}", "Make this text shorter:\n\n{passage}",
                  "Rewrite this so a child can understand it:\n\n{passage}",
                  "Fix any grammar mistakes in this text:\n\n{passage}"],
    "summaries": ["Summarize this in one sentence:\n\n{passage}", "Give me the main points of this text:\n\n{passage}",
                  "TL;DR:\n\n{passage}", "Summarize the following paragraph in two sentences.\n\n{passage}"],
    "extraction": ["List every number mentioned in this text:\n\n{passage}",
                   "What are the key facts in this paragraph? Answer as a bulleted list.\n\n{passage}",
                   "Extract the names of places and things from this text as a JSON list:\n\n{passage}",
                   "Write three quiz questions about this text:\n\n{passage}"],
    "arithmetic": ["What is {a} + {b}?", "What is {a} times {c}?", "What is {b} minus {c}?",
                   "What is {p}% of {a}?", "Is {a} a prime number?", "What is {a} divided by {c}?",
                   "{name} has {a} {things} and buys {c} more. How many does {name} have now?",
                   "{name} has {a} {things} and gives {c} to a friend. How many are left?",
                   "A {item} costs {c} dollars. How much do {n} of them cost?",
                   "A car travels {a} miles in {n} hours. What is its average speed?",
                   "There are {n} boxes with {c} {things} in each. How many {things} are there in total?",
                   "{name} reads {c} pages a day. How many days to finish a book of {a} pages?"],
}
PASSAGE_KINDS = ("rewriting", "summaries", "extraction")
NAMES = ("Anna", "Ben", "Carlos", "Dana", "Emeka", "Fatima", "George", "Hana", "Ivan", "Julia", "Kofi", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf")
THINGS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "cards", "stamps", "shells", "coins")
ITEMS = ("notebook", "ticket", "sandwich", "lamp", "shirt", "plant", "mug", "toy car")
FOLLOW_UPS = ("Can you make that shorter?", "Thanks! Can you give me an example?", "Why is that?",
              "Can you explain that more simply?", "Can you put that in a list?", "What else should I know?",
              "That's great. Can you add a bit more detail?", "Can you say it in a more friendly tone?",
              "Are you sure? Please check your answer.", "Now give me a one-sentence version.")
FOLLOW_UP_SHARE = 0.25


@dataclass(slots=True)
class ChatRequest:
    messages: list[dict]  # user turns so far, the last one unanswered
    kind: str
    source: str  # written | template | passage
    follow_up: str | None = None  # a second user turn, asked after the first answer


def plan(n: int, seed: int) -> list[dict]:
    """The seeded plan of `n` requests: per item its kind, source, topic and fill-ins (no model needed)."""
    rng = random.Random(seed)
    kinds = list(WRITTEN_KINDS) + list(TEMPLATES)
    items = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind in PASSAGE_KINDS:
            source = "passage"
        elif kind in WRITTEN_KINDS and (kind not in TEMPLATES or rng.random() < 0.6):
            source = "written"
        else:
            source = "template"
        fill = dict(topic=rng.choice(TOPICS), name=rng.choice(NAMES), things=rng.choice(THINGS),
                    item=rng.choice(ITEMS), a=rng.randint(12, 999), b=rng.randint(2, 500), c=rng.randint(2, 40),
                    n=rng.randint(2, 12), p=rng.choice((5, 10, 15, 20, 25, 30, 40, 50, 75)))
        follow = rng.choice(FOLLOW_UPS) if rng.random() < FOLLOW_UP_SHARE else None
        items.append(dict(kind=kind, source=source, fill=fill, template=rng.choice(TEMPLATES.get(kind, [""])),
                          follow_up=follow, shots=rng.sample(range(len(WRITER_EXAMPLES)), WRITER_SHOTS)))
    rng.shuffle(items)
    return items


def writer_messages(item: dict) -> str | list[dict] | None:
    """What the target continues to write this item's request (plain text), or is asked in a chat turn to
    write its passage (messages); None for a template."""
    topic = item["fill"]["topic"]
    if item["source"] == "written":
        what = WRITTEN_KINDS[item["kind"]].format(topic=topic)
        examples = "\n".join(f"{k + 1}. {WRITER_EXAMPLES[i]}" for k, i in enumerate(item["shots"]))
        return WRITER_LIST.format(examples=examples, next=len(item["shots"]) + 1, what=what)
    if item["source"] == "passage":
        return [{"role": "user", "content": PASSAGE_INSTRUCTION.format(topic=topic)}]
    return None


_PREFIX = re.compile(r"^\s*(?:[-*]\s+|\d+[.)]\s+|[A-Z][.):]\s+)*(?:\*\*)?(?:(?:new )?(?:request|question|user|prompt|task|message)\s*[:\-]\s*)?(?:\*\*)?",
                     re.IGNORECASE)
# The writer answering instead of asking: such output is not a user's message.
_ASSISTANT_VOICE = re.compile(r"^(?:sure|certainly|of course|here(?:'s| is| are)|hello|hi\b|i'd be|i would be|"
                              r"as an ai|great question|absolutely)", re.IGNORECASE)


def clean_written(text: str, passage: bool = False) -> str | None:
    """A usable request (or passage) from the target's raw output, or None."""
    text = text.strip()
    if not passage:
        text = _PREFIX.sub("", text.split("\n")[0]).strip().strip('"“”').strip()
    lo, hi = (120, 1200) if passage else (12, 300)
    if not lo <= len(text) <= hi or "\ufffd" in text:
        return None
    if not passage and (_ASSISTANT_VOICE.match(text) or text[-1] not in ".?!" or len(text.split()) < 4):
        return None
    return text


def request_from(item: dict, written: str | None) -> ChatRequest | None:
    """The user request of a planned item, given the target's text for it (None for templates)."""
    fill = item["fill"]
    if item["source"] == "written":
        content = written
    elif item["source"] == "passage":
        content = item["template"].format(passage=written) if written else None
    else:
        content = item["template"].format(**fill)
    if not content:
        return None
    return ChatRequest([{"role": "user", "content": content}], item["kind"], item["source"], item["follow_up"])


def to_record(r: ChatRequest) -> dict:
    return {"messages": r.messages, "kind": r.kind, "source": r.source, "follow_up": r.follow_up}


def from_record(d: dict) -> ChatRequest:
    return ChatRequest(d["messages"], d["kind"], d["source"], d.get("follow_up"))


__all__ = ["ChatRequest", "plan", "writer_messages", "clean_written", "request_from", "to_record", "from_record",
           "FOLLOW_UPS", "TOPICS", "TEMPLATES", "WRITTEN_KINDS"]
